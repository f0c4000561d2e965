"""How a `serve` flag is declared. Every one also reads an ENCODERD_* variable (for systemd
EnvironmentFile=) as its default, which the flag given on the command line overrides; a switch is
also set by its variable at 1. Some server-wide flags also take one model's own value as
NAME=VALUE (NAMEABLE_FLAGS); the per-model flags (PER_MODEL_FLAGS) take [NAME=]VALUE only.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable

from ..models.model_options import (
    NameableValue,
    nameable_value,
    parse_per_model,
    pooling_mode,
    positive_int,
)


def env_name(flag: str) -> str:
    return "ENCODERD_" + flag.lstrip("-").replace("-", "_").upper()


def env_flag(name: str) -> bool:
    return os.environ.get(name, "").lower() in ("1", "true", "yes", "on")


def env_list(name: str, sep: str = ",") -> list[str]:
    """A repeatable flag's ENCODERD_* variable: items split on `sep`, blanks dropped."""
    return [item.strip() for item in os.environ.get(name, "").split(sep) if item.strip()]


def add_flag(parser: argparse.ArgumentParser, flag: str, help: str, default=None, type=str, **kwargs) -> None:
    if flag in NAMEABLE_FLAGS:
        _add_nameable(parser, flag, help, default, type, **kwargs)
        return
    env = env_name(flag)
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
    env = env_name(flag)
    parse = nameable_value(flag, type, choices)
    try:
        env_values = [parse(item) for item in env_list(env)]
    except argparse.ArgumentTypeError as exc:
        raise SystemExit(f"encoderd: {env}: {exc}") from None
    dest = flag.lstrip("-").replace("-", "_")
    default = next((v for name, v in reversed(env_values) if name is None), default)
    # The command line's NAME= values replace the environment's, as for every flag.
    parser.set_defaults(**{dest + "_per_model": None, dest + "env_per_model": [v for v in env_values if v[0]]})
    values = "{" + ",".join(choices) + "}" if choices else dest.upper()
    parser.add_argument(
        flag,
        action=NameableValue,
        parse=parse,
        default=default,
        metavar=f"[NAME=]{values}",
        help=f"{help}; NAME=VALUE sets one model's own (repeatable) [env {env}, comma-separated; default: %(default)s]",
    )


def add_switch(parser: argparse.ArgumentParser, flag: str, help: str, dest: str | None = None) -> None:
    """An on/off flag that its ENCODERD_* variable set to 1 also gives. With `dest`, a `--no-X`
    switch that turns `dest` off."""
    env = env_name(flag)
    given = env_flag(env)
    if dest:
        parser.add_argument(flag, dest=dest, action="store_false", default=not given, help=f"{help} [env {env}=1]")
    else:
        parser.add_argument(flag, action="store_true", default=given, help=f"{help} [env {env}=1]")


# Per-model flags: `--FLAG [NAME=]VALUE`, repeatable. NAME is a served name (as --model gives it);
# a bare VALUE applies to every model. ModelConfig field (= argparse dest) -> (flag, value parser).
PER_MODEL_FLAGS: dict[str, tuple[str, Callable[[str], object]]] = {
    "revision": ("--revision", str),
    "pooling": ("--pooling", pooling_mode),
    "max_length": ("--max-length", positive_int),
}


def env_per_model(flag: str, parse_value: Callable[[str], object]) -> list[tuple[str | None, object]]:
    env = env_name(flag)
    try:
        return [parse_per_model(flag, parse_value)(item) for item in env_list(env)]
    except argparse.ArgumentTypeError as exc:
        raise SystemExit(f"encoderd: {env}: {exc}") from None
