"""Prometheus metrics of the frontend (exposed by --metrics-port)."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

_LATENCY_BUCKETS = (.001, .0025, .005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 30)

REQUESTS = Counter("encoderd_requests", "Finished requests", ["model", "rpc", "code"])
REQUEST_SECONDS = Histogram("encoderd_request_duration_seconds", "Request latency, end to end in the frontend",
                            ["model", "rpc"], buckets=_LATENCY_BUCKETS)
REJECTED = Counter("encoderd_rejected_inputs", "Requests refused before queueing", ["model", "reason"])
QUEUE_DEPTH = Gauge("encoderd_queue_depth", "Inputs waiting for a batch", ["model"])
BATCHES = Counter("encoderd_batches", "Batches computed by workers (forward passes)", ["model"])
BATCH_SIZE = Histogram("encoderd_batch_size", "Inputs per batch", ["model"],
                       buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256))
BATCH_SECONDS = Histogram("encoderd_batch_duration_seconds", "Batch round trip to the worker", ["model"],
                          buckets=_LATENCY_BUCKETS)
REAL_TOKENS = Counter("encoderd_real_tokens", "Tokens of the inputs", ["model"])
COMPUTED_TOKENS = Counter("encoderd_computed_tokens", "Tokens computed, padding included", ["model"])
WORKER_RESTARTS = Counter("encoderd_worker_restarts", "Worker processes restarted after dying", ["model"])
WORKER_UP = Gauge("encoderd_worker_up", "1 while the model's worker is ready", ["model"])


def observe_batch(model: str, batch, padded: bool, seconds: float) -> None:
    lengths = [item.length for item in batch]
    real = sum(lengths)
    BATCHES.labels(model).inc()
    BATCH_SIZE.labels(model).observe(len(batch))
    BATCH_SECONDS.labels(model).observe(seconds)
    REAL_TOKENS.labels(model).inc(real)
    COMPUTED_TOKENS.labels(model).inc(len(batch) * max(lengths) if padded else real)
