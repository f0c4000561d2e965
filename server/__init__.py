"""encoderd frontend, in layers: each package imports only those below it
(tests/unit/test_layers_units.py keeps it so):

    main/        the composition root: the CLI (`encoderd`: cli.py, its flags, their ENCODERD_*
                 variables, the checked configuration), the gRPC app that builds and runs
                 everything (app.py), the in-process API (inprocess.py).
    api/         the API surface: encoderd.v1 gRPC (service.py, streaming.py), the Compat service
                 Envoy transcodes to REST (compat.py, with tei.py and cohere_embed.py over the
                 shared rest.py), auth, safe deserialization (handlers.py), responses
                 (messages.py, token_states.py), OpenAPI and reflection.
    models/      models and inputs: the registry of served models (registry.py; one model:
                 served.py), model resolution and options, request options parsed once
                 (request_options.py), tokenization and media decoding, the one compute path
                 (compute.py) with its dedup / cache (result_cache.py), post-processing.
    scheduling/  queues and workers: per-model scheduler and batching policy, worker and zygote
                 clients, the child-process supervisor, CPU / device placement.
    base/        what every layer uses: configuration, errors -> status (errors.py), metrics,
                 tracing, TLS files, systemd notification, start-up checks.

Models run in worker processes: for text models the frontend never imports torch
(media models import their image / audio processors from transformers).
"""
