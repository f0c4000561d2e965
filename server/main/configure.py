"""The parsed command line, its ENCODERD_* variables and the models file, made into one checked
ServerConfig: the served models (the bundled one when none is named) and each one's own settings,
a NAME= flag over the models file over a bare flag; a conflict is refused in one line.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from typing import Any, cast

from ...gateway.envoy import ListenerLimits
from ...workers.contract.model_files import DEFAULT_MODEL_NAME, default_model_path
from ...workers.contract.model_spec import ModelLoadError
from ..base.config import ModelConfig, ServerConfig
from ..base.tls import TlsFiles
from ..models.models_file import ModelsFile, ModelsFileError, load_models_file
from .flag_env import NAMEABLE_FLAGS, PER_MODEL_FLAGS, env_list, env_per_model
from .flag_values import parse_env_models, parse_prompt


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
            models, flag, field, getattr(args, field) or env_per_model(flag, parse_value), models_file
        )
    for flag, field in NAMEABLE_FLAGS.items():
        dest = flag.lstrip("-").replace("-", "_")
        named = getattr(args, dest + "_per_model") or getattr(args, dest + "env_per_model")
        models = apply_per_model(models, flag, field, named, models_file)
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
        api_keys=tuple(args.api_key or env_list("ENCODERD_API_KEY")),
        bulk_api_keys=tuple(args.bulk_api_key or env_list("ENCODERD_BULK_API_KEY")),
        api_key_file=args.api_key_file,
        open_health=args.open_health,
        cache_size=args.cache_size,
        media_max_bytes=int(args.media_max_mb * 1024 * 1024),
        media_fetch_timeout=args.media_fetch_timeout,
        media_urls=args.media_urls,
        # Prompts keep their spaces ("query: "): split only, never strip.
        prompts=tuple(args.prompt or [parse_prompt(p) for p in os.environ.get("ENCODERD_PROMPT", "").split(";") if p]),
        max_batch_size=args.batch_size,
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
        cors_allow_origins=tuple(args.cors_allow_origin or env_list("ENCODERD_CORS_ALLOW_ORIGIN")),
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


def _models_file(path: str | None) -> ModelsFile | None:
    try:
        return load_models_file(path) if path else None
    except ModelsFileError as exc:
        raise SystemExit(f"encoderd: {exc}") from None
