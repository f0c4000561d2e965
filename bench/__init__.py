"""`encoderd bench` (or `python -m encoderd.bench`): the serving benchmark of issue #5.

It is a benchmark, not a test: it reports numbers and asserts nothing about them.

What it runs, each mode on every target side by side (same corpus, same client code,
one target after the other so they share the machine's conditions):
  bulk    C clients, each sending B inputs per request back to back, until the corpus has
          been embedded once (timed from the first request to the last answer; or a fixed
          time window): inputs/s, real tokens/s, request latency, padding ratio, FLOP
          utilisation, CPU use per process (worker busy fraction). encoderd's gRPC clients
          ask for bulk priority, as an ingestion job should (--bulk-priority interactive:
          the default priority of a unary call). --stream adds the same work through one
          gRPC EmbedStream (the ingestion path).
  single  one short query at a time, N sequential calls: p50/p95/p99.
  rerank  a query + 50 passages per call, sequential: p50/p95.
  recovery  (only when asked: --modes recovery) cold start to the first embedding, and kill -9 of
          a worker to serving again, each server started afresh: recovery.py.
  memory  (only when asked) worker memory over a --soak-seconds bulk soak: flat or not (device.py).
  oom     (only when asked) a batch too big for the GPU halves and loses no input (device.py).

--device cuda runs it all on a GPU: encoderd serves there, the matmul peak is measured there and
sentence-transformers runs there in float16 (device.py).

Targets: encoderd over gRPC (always) and REST (--rest, through its Envoy gateway), an
Infinity server in its own virtualenv (--infinity, REST), and sentence-transformers in
this process (length-sorted encode; the compute floor without any server).

How tokens, FLOPs and CPU use are counted: corpus.py, flops.py and processes.py. The run
itself reads top to bottom in runner.py. More benchmarks live here:
`python -m encoderd.bench.rest` (REST through Envoy vs direct gRPC),
`python -m encoderd.bench.mixed` (live queries while bulk ingestion runs),
`python -m encoderd.bench.soak` (memory over 10 minutes of mixed traffic),
`python -m encoderd.bench.flood` (how fast a refusal arrives under a flood) and
`python -m encoderd.bench.bigcall` (sequential 2,048-input calls, where their time goes).
"""
