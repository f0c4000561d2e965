"""`encoderd` command line. Every `serve` flag also reads an ENCODERD_* variable
(for systemd EnvironmentFile=); a flag given on the command line wins."""

from __future__ import annotations

import argparse
import logging
import os
import sys

from ..workers.model_spec import DEFAULT_MODEL_NAME, default_model_path
from .config import ModelConfig, ServerConfig

ENGINES = ("torch",)
DTYPES = ("float32", "float16", "bfloat16")
KINDS = ("embedding", "reranker", "classifier")


def _env_name(flag: str) -> str:
    return "ENCODERD_" + flag.lstrip("-").replace("-", "_").upper()


def _add(parser: argparse.ArgumentParser, flag: str, help: str, default=None, type=str, **kwargs) -> None:
    env = _env_name(flag)
    if env in os.environ:
        default = type(os.environ[env])
    parser.add_argument(flag, default=default, type=type, help=f"{help} [env {env}; default: %(default)s]", **kwargs)


def parse_model(value: str) -> ModelConfig:
    """`[NAME=]PATH_OR_HUB_ID[:KIND]`: NAME defaults to the path or hub id itself."""
    kind = None
    for k in KINDS:
        if value.endswith(":" + k):
            value, kind = value[: -len(k) - 1], k
    name, sep, source = value.partition("=")
    if not sep:
        name, source = value.rstrip("/"), value
    if not name or not source:
        raise argparse.ArgumentTypeError(f"bad --model {value!r}: use [NAME=]PATH_OR_HUB_ID")
    return ModelConfig(name=name, source=source, kind=kind)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="encoderd", description="Serving engine for encoder models.")
    commands = parser.add_subparsers(dest="command", required=True)
    serve = commands.add_parser("serve", help="serve models over gRPC",
                                description="Serve encoder models over gRPC, each in its own worker process.")
    env_models = os.environ.get("ENCODERD_MODEL", "")
    serve.add_argument("--model", action="append", type=parse_model,
                       default=[parse_model(m) for m in env_models.split(",") if m.strip()] or None,
                       help="[NAME=]PATH_OR_HUB_ID[:KIND], repeatable; KIND forces embedding|reranker|classifier "
                            f"[env ENCODERD_MODEL, comma-separated; default: the bundled {DEFAULT_MODEL_NAME}]")
    _add(serve, "--engine", "inference engine for every model", "torch", choices=ENGINES)
    _add(serve, "--device", "device for the workers: cpu, cuda, cuda:N", "cpu")
    _add(serve, "--dtype", "compute precision", "float32", choices=DTYPES)
    _add(serve, "--cpu-threads", "intra-op threads per CPU worker (0 = the cores this process may use)", 0, int)
    _add(serve, "--batch-size", "most inputs in one batch", 64, int)
    _add(serve, "--max-batch-tokens", "most tokens in one batch (padding counted for padded engines)", 8192, int)
    _add(serve, "--batch-delay-ms", "how long a batch may wait to fill while the worker is busy", 5.0, float)
    _add(serve, "--max-queued-inputs", "inputs queued per model before new work gets RESOURCE_EXHAUSTED", 16384, int)
    _add(serve, "--max-inputs-per-request", "most inputs (or documents) in one request", 2048, int)
    _add(serve, "--host", "address to listen on", "127.0.0.1")
    _add(serve, "--grpc-port", "gRPC port (0 = any free port)", 50051, int)
    _add(serve, "--metrics-port", "Prometheus metrics port (0 = off)", 0, int)
    _add(serve, "--drain-timeout", "seconds to finish in-flight work on SIGTERM", 30.0, float)
    _add(serve, "--log-level", "DEBUG, INFO, WARNING or ERROR", "INFO")
    return parser


def config_from_args(args: argparse.Namespace) -> ServerConfig:
    models = args.model or [ModelConfig(DEFAULT_MODEL_NAME, default_model_path())]
    names = [m.name for m in models]
    if len(set(names)) != len(names):
        raise SystemExit(f"encoderd: two --model flags serve the same name: {names}")
    return ServerConfig(
        models=tuple(models), engine=args.engine, device=args.device, dtype=args.dtype, cpu_threads=args.cpu_threads,
        max_batch_size=args.batch_size, max_batch_tokens=args.max_batch_tokens, batch_delay_ms=args.batch_delay_ms,
        max_queued_inputs=args.max_queued_inputs, max_inputs_per_request=args.max_inputs_per_request,
        host=args.host, grpc_port=args.grpc_port, metrics_port=args.metrics_port,
        drain_timeout=args.drain_timeout, log_level=args.log_level.upper())


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "serve":
        config = config_from_args(args)
        logging.basicConfig(level=config.log_level, stream=sys.stderr,
                            format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        from .app import serve

        serve(config)
    return 0


if __name__ == "__main__":
    sys.exit(main())
