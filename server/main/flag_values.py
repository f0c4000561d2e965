"""The values of the `serve` flags, parsed and range-checked as argparse types: --model's
[NAME=]SOURCE[:KIND][@DEVICES] (and ENCODERD_MODEL's list of them), --prompt, seconds, ports, the
workers' nice value and stall timeout; and a device's default batch size. (The model options shared
with the models file are server/models/model_options.py's.)
"""

from __future__ import annotations

import argparse
import re

from ...workers.contract.protocol import HEARTBEAT_INTERVAL
from ..base.config import ModelConfig
from ..models.model_options import (
    KINDS,
    device_list,
    whole_number,
)


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


def parse_prompt(value: str) -> tuple[str, str]:
    name, sep, text = value.partition("=")
    if not sep or not name:
        raise argparse.ArgumentTypeError(f"bad --prompt {value!r}: use NAME=TEXT")
    return name, text


def non_negative_float(value: str) -> float:
    """Seconds, MiB and the like: 0 or more (whole numbers: model_options' positive_int, whole_number)."""
    try:
        number = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is not a number") from None
    if not number >= 0:  # nan too
        raise argparse.ArgumentTypeError(f"must be 0 or more, not {value}")
    return number


def port_number(value: str) -> int:
    port = whole_number(value)
    if port > 65535:
        raise argparse.ArgumentTypeError(f"a port is 0 to 65535, not {value}")
    return port


def worker_nice(value: str) -> int:
    nice = int(value)
    if not 0 <= nice <= 19:  # a worker may lower its own priority, never raise it above the frontend's
        raise argparse.ArgumentTypeError("must be 0 to 19")
    return nice


def stall_timeout(value: str) -> float:
    seconds = float(value)
    if seconds != 0 and not seconds >= 2 * HEARTBEAT_INTERVAL:  # nan too; one late beat must not kill a healthy worker
        raise argparse.ArgumentTypeError(f"must be 0 (off) or at least {2 * HEARTBEAT_INTERVAL:g} seconds")
    return seconds
