"""Per-model settings, one table for every way to give them: a models file's keys
(server/models/models_file.py) and the `--FLAG [NAME=]VALUE` flags (server/main/flags.py) go through the same
value parsers, so both build the same ModelConfig and refuse a bad value with the same words."""

from __future__ import annotations

import argparse
import re
from collections.abc import Callable
from dataclasses import dataclass

from ...workers.contract import config as worker_config
from ...workers.contract.model_spec import ModelKind, Pooling

# "auto" resolves in the worker (workers.backends.resolve_engine / resolve_options), which reports what runs.
ENGINES = ("auto", *worker_config.ENGINES)
DTYPES = ("auto", *worker_config.DTYPES)
KINDS = tuple(kind.value for kind in ModelKind)

_DEVICE = re.compile(r"cpu|cuda(:\d+)?")


def choice(names: tuple[str, ...], what: str) -> Callable[[str], str]:
    def parse(value: str) -> str:
        if value not in names:
            raise argparse.ArgumentTypeError(f"unknown {what} {value!r}: choose one of {', '.join(names)}")
        return value

    return parse


def pooling_mode(value: str) -> str:
    try:
        return Pooling(value).value
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"unknown pooling {value!r}: choose one of {', '.join(p.value for p in Pooling)}"
        ) from None


def positive_int(value: str) -> int:
    if not value.isdigit() or int(value) < 1:
        raise argparse.ArgumentTypeError(f"{value!r} is not a positive whole number (1 or more)")
    return int(value)


def whole_number(value: str) -> int:
    if not value.isdigit():
        raise argparse.ArgumentTypeError(f"{value!r} is not a whole number (0 or more)")
    return int(value)


def text(value: str) -> str:
    if not value:
        raise argparse.ArgumentTypeError("it is empty")
    return value


def boolean(value: str) -> bool:
    if value.lower() not in ("true", "false"):
        raise argparse.ArgumentTypeError(f"{value!r} is not true or false")
    return value.lower() == "true"


def device_list(value: str) -> str:
    """`cpu`, `cuda`, `cuda:N`, or a comma-separated list of them (checked here, expanded at start)."""
    devices = [d.strip() for d in value.split(",")]
    for device in devices:
        if not _DEVICE.fullmatch(device):
            raise argparse.ArgumentTypeError(
                f"unknown device {device!r}: use cpu, cuda or cuda:N, or a comma-separated list of them"
            )
    return ",".join(devices)


@dataclass(frozen=True)
class ModelOption:
    field: str  # the ModelConfig field it sets
    parse: Callable[[str], object]  # text -> value; argparse.ArgumentTypeError when bad
    file_type: type = str  # the value type a models file gives (int: a TOML/YAML integer)


# Keyed by the flag's name: `--max-length m=128` is `max-length = 128` in a model's table. The models
# file takes every key; PER_MODEL_FLAGS in server/main/flag_env.py lists the ones with a `[NAME=]VALUE` flag.
MODEL_OPTIONS: dict[str, ModelOption] = {
    "kind": ModelOption("kind", choice(KINDS, "kind")),
    "device": ModelOption("device", device_list),
    "revision": ModelOption("revision", text),
    "pooling": ModelOption("pooling", pooling_mode),
    "max-length": ModelOption("max_length", positive_int, int),
    "engine": ModelOption("engine", choice(ENGINES, "engine")),
    "dtype": ModelOption("dtype", choice(DTYPES, "dtype")),
    "replicas": ModelOption("replicas", positive_int, int),
    "cpu-threads": ModelOption("cpu_threads", whole_number, int),
    "batch-size": ModelOption("max_batch_size", positive_int, int),
    "max-batch-tokens": ModelOption("max_batch_tokens", positive_int, int),
    "trust-remote-code": ModelOption("trust_remote_code", boolean, bool),
    "allow-low-fidelity": ModelOption("allow_low_fidelity", boolean, bool),
}


# ------------------------------------------------- the `[NAME=]VALUE` flags (server/main/flag_env.py)
def parse_per_model(flag: str, parse_value: Callable[[str], object]) -> Callable[[str], tuple[str | None, object]]:
    """The argparse type of a per-model flag: `[NAME=]VALUE` -> (NAME or None for every model, value)."""

    def parse(text: str) -> tuple[str | None, object]:
        given, sep, value = text.partition("=")
        name: str | None = given
        if not sep:
            name, value = None, text
        if (sep and not name) or not value:
            raise argparse.ArgumentTypeError(f"bad {flag} {text!r}: use [NAME=]VALUE")
        try:
            return name, parse_value(value)
        except argparse.ArgumentTypeError as exc:
            raise argparse.ArgumentTypeError(f"bad {flag} {text!r}: {exc}") from None

    return parse


class NameableValue(argparse.Action):
    """A bare value sets args.DEST; NAME=VALUE is appended to args.DEST_per_model. (Parsed here, not
    by `type`, which argparse would also apply to a string default.)"""

    def __init__(self, *args, parse: Callable[[str], tuple[str | None, object]], **kwargs):
        super().__init__(*args, **kwargs)
        self.parse = parse

    def __call__(self, parser, namespace, values, option_string=None):
        try:
            name, value = self.parse(values)
        except argparse.ArgumentTypeError as exc:
            raise argparse.ArgumentError(self, str(exc)) from None
        if name is None:
            setattr(namespace, self.dest, value)
        else:
            setattr(
                namespace,
                self.dest + "_per_model",
                [*(getattr(namespace, self.dest + "_per_model") or []), (name, value)],
            )


# Nameable number flags whose bare 0 leaves the value to the host (server/main/flags.py: the help says so for each).
ZERO_MEANS_CHOSEN = ("--replicas", "--cpu-threads", "--batch-size")


def nameable_value(flag: str, type, choices) -> Callable[[str], tuple[str | None, object]]:
    named = parse_per_model(flag, MODEL_OPTIONS[flag.lstrip("-")].parse)

    # A bare number is the server-wide value, where 0 means "chosen for this host"; never negative.
    bare = (whole_number if flag in ZERO_MEANS_CHOSEN else positive_int) if type is int else type

    def parse(text: str) -> tuple[str | None, object]:
        if "=" in text:
            return named(text)
        try:
            value = bare(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"bad {flag} {text!r}") from None
        if choices and value not in choices:
            raise argparse.ArgumentTypeError(f"bad {flag} {text!r}: choose one of {', '.join(choices)}")
        return None, value

    return parse
