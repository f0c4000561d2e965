"""Logging for the frontend and the workers: text for people, JSON lines for log pipelines.

A request id rides in a contextvar: the gRPC layer sets it per call (from the
client's `x-request-id` metadata, else a fresh one), so every record logged
while serving that call carries it, however deep the call stack. Workers mix
many requests in one batch and log without one.

Only the standard library here: the worker processes import this too.
"""

from __future__ import annotations

import contextvars
import json
import logging
import os
import sys
import time
import uuid

FORMATS = ("text", "json")
REQUEST_ID_KEY = "x-request-id"  # gRPC metadata key (lower case, as gRPC requires)
_MAX_REQUEST_ID = 128  # a client's id is echoed back and logged: keep it small and printable

request_id: contextvars.ContextVar[str] = contextvars.ContextVar("encoderd_request_id", default="")


def bind_request_id(metadata) -> str:
    """Take the caller's x-request-id (if sane) or make one, and set it for this call's context."""
    value = ""
    for key, item in metadata or ():
        if key == REQUEST_ID_KEY and isinstance(item, str):
            value = item
            break
    if not value or len(value) > _MAX_REQUEST_ID or not value.isprintable():
        value = uuid.uuid4().hex
    request_id.set(value)
    return value


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time (UTC, RFC 3339), level, logger, message, and context."""

    def __init__(self, static: dict | None = None):
        super().__init__()
        self.static = static or {}

    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "time": _rfc3339(record.created),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        rid = request_id.get()
        if rid:
            entry["request_id"] = rid
        entry.update(self.static)
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry, ensure_ascii=False, default=str)


class TextFormatter(logging.Formatter):
    def __init__(self, prefix: str = ""):
        super().__init__(f"%(asctime)s %(levelname)s {prefix}%(name)s: %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        text = super().format(record)
        rid = request_id.get()
        return f"{text} [request_id={rid}]" if rid else text


def _rfc3339(created: float) -> str:
    seconds = int(created)
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(seconds)) + f".{int((created - seconds) * 1000):03d}Z"


def configure_logging(level: str, fmt: str = "text", *, worker: str = "") -> None:
    """Replace the root handlers with one stderr handler in the chosen format."""
    if fmt not in FORMATS:
        raise ValueError(f"unknown log format {fmt!r}; choose one of {', '.join(FORMATS)}")
    handler = logging.StreamHandler(sys.stderr)
    if fmt == "json" or not sys.stderr.isatty():
        # Progress bars (model downloads and loading) redraw with carriage returns: on a terminal that is
        # progress, in a file or a journal a line without a timestamp (or one breaking the one-object-a-line
        # stream). There the frontend's "still loading" lines say it. Set before any Hugging Face library
        # is imported; workers inherit it.
        os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    if fmt == "json":
        static: dict[str, int | str] = {"pid": os.getpid()}
        if worker:
            static["worker"] = worker
        handler.setFormatter(JsonFormatter(static))
    else:
        handler.setFormatter(TextFormatter(f"[worker {worker}] " if worker else ""))
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.upper())
    logging.captureWarnings(True)  # library warnings become records too, in the same format
