"""What every layer of the frontend stands on, importing none of them: the configuration
(config.py), the error taxonomy and its gRPC status (errors.py), metrics, tracing, TLS files,
systemd notification and the start-up port checks."""
