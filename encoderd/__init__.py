"""encoderd: a serving engine for encoder models.

`import encoderd` gives the in-process API (server/main/inprocess.py): `encoderd.AsyncEngine` serves
models from this Python process over the same worker processes as `encoderd serve`. The rest of
the distribution lives in subpackages mapped from the repository's top-level folders
(pyproject.toml [tool.setuptools]): encoderd.server, encoderd.workers, encoderd.clients, ...
This file is imported before any of them, so it imports nothing heavy itself.
"""

from pkgutil import extend_path

# encoderd-client (packaging/client) installs encoderd.clients / encoderd.v1 without this file: let
# `encoderd` span every sys.path entry that holds part of it, as the namespace package it was.
__path__ = extend_path(__path__, __name__)

_IN_PROCESS = ("AsyncEngine", "Ranked", "Tokens", "server_config")


def __getattr__(name: str):
    if name in _IN_PROCESS:
        from .server.main import inprocess

        return getattr(inprocess, name)
    raise AttributeError(f"module 'encoderd' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *_IN_PROCESS])


__all__ = list(_IN_PROCESS)
