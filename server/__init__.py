"""encoderd frontend, grouped by concern in the order a request meets them:

    api/         the API surface: encoderd.v1 gRPC (service.py, streaming.py), the Compat service
                 Envoy transcodes to REST (compat.py, with tei.py and cohere_embed.py), the in-process
                 API (inprocess.py); options parsed once (request_options.py), errors -> status
                 (errors.py), auth, safe deserialization (handlers.py), responses (messages.py,
                 postprocess.py, token_states.py), OpenAPI and reflection.
    models/      models and inputs: the registry of served models (registry.py), model resolution and
                 options, tokenization and media decoding, the one compute path (compute.py) with
                 its dedup / cache (result_cache.py).
    scheduling/  queues and workers: per-model scheduler and batching policy, worker and zygote
                 clients, the child-process supervisor, CPU / device placement.
    ops/         operations: the CLI (`encoderd`), configuration, the gRPC app, TLS, tracing,
                 metrics, systemd notification, start-up checks.

Models run in worker processes: for text models the frontend never imports torch
(media models import their image / audio processors from transformers).
"""
