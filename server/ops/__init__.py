"""Operations: the CLI, configuration, the gRPC app, TLS, tracing, metrics, systemd, start-up checks."""
