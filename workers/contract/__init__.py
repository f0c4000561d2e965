"""The contract between the frontend (server/) and the workers: the only part of `workers/` the
frontend imports.

It lives inside `workers/` because it describes what a worker is and takes: the frontend builds a
WorkerConfig, speaks the worker's wire protocol and reads the model the same way the worker does,
and the top-level folders are fixed (protos/ holds the public API, not this process-internal wire).
Nothing here imports torch, an engine or the rest of `workers/` (launch.py defers the worker's entry
point to the child process), so the frontend starts without them; nothing imports `server/`.

  protocol.py       the ZeroMQ wire: batches, results, control messages
  ipc.py            the frontend's private socket directory: ipc:// endpoints, its gRPC and Envoy admin sockets
  errors.py         the error codes a failed batch carries back (the frontend maps them to gRPC status)
  config.py         WorkerConfig, BackendOptions, the cache directory
  launch.py         the spawned worker's entry point, by reference
  zygote_wire.py    the zygote's socket protocol (workers/zygote.py forks CPU workers)
  model_spec.py     what a model is (kind, pooling, modules): the types both sides pass around
  spec_reader.py    a model directory read into its ModelSpec (config.json), by both sides
  st_pipeline.py    an embedding model's sentence-transformers modules (modules.json: pooling, Dense)
  st_config.py      sentence-transformers' other settings files, each served or refused
  model_files.py    where a model's files are (directory, hub, bundled copy); reading its JSON
  bundled_model.py  where the default model's files are
  tokenizer.py      a model's tokenizer as sentence-transformers reads it
  hardware.py       this host's CPU and the engine x dtype it serves accurately
  cpu_cores.py      the cores this process may use and the workers x threads laid over them
  logs.py           logging set-up (text or JSON lines) and the request id
  corpus.py         the synthetic ingestion workload both the benchmark and the pacing calibration use

tests/unit/test_layers_units.py holds every import in the tree to these rules.
"""
