"""Prometheus metrics of the frontend (exposed by --metrics-port).

Naming follows the Prometheus conventions: an `encoderd_` prefix, base units
(`_seconds`), counters exported with `_total`. Label sets stay bounded: the
`model` label only ever holds a served model's name (see `model_resolver.metrics_label`), `rpc`
and `code` come from fixed sets.

Latency is split the way an operator debugs it:
  encoderd_request_duration_seconds  the whole call in the frontend (total);
  encoderd_queue_wait_seconds        per input, from queueing to its batch leaving;
  encoderd_batch_duration_seconds    per batch, the worker round trip (compute).
"""

from __future__ import annotations

import functools

from prometheus_client import REGISTRY, Counter, Gauge, Histogram
from prometheus_client.exposition import choose_encoder

_LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)
_SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
_TOKEN_BUCKETS = (16, 64, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536)

# ---------------------------------------------------------------- requests
REQUESTS = Counter(
    "encoderd_requests", "Finished RPCs, by status code (errors are code != OK)", ["model", "rpc", "code"]
)
REQUEST_SECONDS = Histogram(
    "encoderd_request_duration_seconds",
    "RPC latency, end to end in the frontend",
    ["model", "rpc"],
    buckets=_LATENCY_BUCKETS,
)
IN_FLIGHT = Gauge("encoderd_requests_in_flight", "RPCs accepted and not yet answered, by RPC", ["rpc"])
AUTH_FAILURES = Counter(
    "encoderd_auth_failures",
    "Calls refused for a missing or wrong API key, by route (the gRPC method; REST routes arrive as theirs)",
    ["route"],
)
REJECTED = Counter("encoderd_rejected_requests", "Requests refused before queueing", ["model", "reason"])

# --------------------------------------------------------------- scheduler
QUEUED_INPUTS = Counter(
    "encoderd_queued_inputs", "Inputs accepted into a model's queue, by priority", ["model", "priority"]
)
QUEUE_DEPTH = Gauge("encoderd_queue_depth", "Inputs waiting for a batch", ["model"])
QUEUE_WAIT = Histogram(
    "encoderd_queue_wait_seconds",
    "Time an input waited in the queue for its batch",
    ["model"],
    buckets=_LATENCY_BUCKETS,
)
DROPPED = Counter(
    "encoderd_dropped_inputs", "Queued inputs dropped before compute (request cancelled or failed)", ["model"]
)
BATCHES = Counter("encoderd_batches", "Batches computed by workers (forward passes)", ["model"])
BATCH_SIZE = Histogram("encoderd_batch_size", "Inputs per batch", ["model"], buckets=_SIZE_BUCKETS)
BATCH_TOKENS = Histogram(
    "encoderd_batch_tokens", "Tokens computed per batch, padding included", ["model"], buckets=_TOKEN_BUCKETS
)
BATCH_SECONDS = Histogram(
    "encoderd_batch_duration_seconds",
    "Batch round trip to the worker (compute)",
    ["model", "replica"],
    buckets=_LATENCY_BUCKETS,
)
REAL_TOKENS = Counter("encoderd_real_tokens", "Tokens of the inputs", ["model"])
TOKENIZED_TEXTS = Counter(
    "encoderd_tokenized_texts",
    "Texts the frontend tokenized (inputs, documents, queries), refused ones included",
    ["model"],
)
COMPUTED_TOKENS = Counter("encoderd_computed_tokens", "Tokens computed, padding included", ["model"])

CACHE = Counter(
    "encoderd_cache_lookups",
    "Result cache and in-flight dedup lookups by outcome (hit, miss, inflight_hit)",
    ["model", "outcome"],
)
STREAM_INPUTS_IN_FLIGHT = Gauge("encoderd_stream_inputs_in_flight", "EmbedStream inputs inside the server")

# ----------------------------------------------------------------- workers
# `replica` is a worker's label, e.g. "reranker@cuda:1"; bounded by --replicas x devices.
WORKER_RESTARTS = Counter("encoderd_worker_restarts", "Worker processes restarted after dying", ["model", "replica"])
WORKER_UP = Gauge("encoderd_worker_up", "1 while this worker of the model is ready", ["model", "replica"])
MODEL_LOAD_SECONDS = Gauge(
    "encoderd_model_load_seconds",
    "Seconds from spawning the model's workers at start-up until all were loaded and warm",
    ["model"],
)
# The start-up fidelity self-check (workers/fidelity.py): one series per figure of the model's kind.
MODEL_FIDELITY = Gauge(
    "encoderd_model_fidelity",
    "Start-up fidelity self-check against float32 of the same weights "
    "(metric: min_cosine, max_prob_diff, max_logit_diff, kendall_tau, top1_agreement)",
    ["model", "metric"],
)
MODEL_FIDELITY_BOUND = Gauge(
    "encoderd_model_fidelity_bound",
    "The dtype's floor for that figure (max_prob_diff, max_logit_diff: their ceiling)",
    ["model", "metric"],
)


@functools.cache
def series(metric, *labels: str):
    """metric.labels(*labels), looked up once per label set. prometheus_client checks the labels
    and takes a lock on every labels() call, ~14 times per short query on the hot path; a child
    lives as long as its metric (none is ever removed here), so holding it counts the same samples.
    Bounded as the label sets are (see the module docstring)."""
    return metric.labels(*labels)


def observe_fidelity(model: str, figures) -> None:
    for figure in figures:
        MODEL_FIDELITY.labels(model, figure.metric).set(figure.value)
        MODEL_FIDELITY_BOUND.labels(model, figure.metric).set(figure.bound)


def observe_batch(model: str, replica: str, batch, padded: bool, seconds: float) -> None:
    lengths = [item.length for item in batch]
    real = sum(lengths)
    computed = len(batch) * max(lengths) if padded else real
    series(BATCHES, model).inc()
    series(BATCH_SIZE, model).observe(len(batch))
    series(BATCH_TOKENS, model).observe(computed)
    series(BATCH_SECONDS, model, replica).observe(seconds)
    series(REAL_TOKENS, model).inc(real)
    series(COMPUTED_TOKENS, model).inc(computed)


def exposition(accept: str) -> tuple[str, bytes]:
    """(content type, body) of a scrape: the format its Accept header asks for (OpenMetrics or
    Prometheus text), negotiated as --metrics-port's server does, so REST /metrics answers the same."""
    encode, content_type = choose_encoder(accept)
    return content_type, encode(REGISTRY)
