"""Inference engines behind one small interface (see base.Backend)."""

from __future__ import annotations

from .base import Backend, BackendOptions


def create_backend(engine: str, spec, options: BackendOptions) -> Backend:
    """Import only the engine asked for: each pulls in a heavy library."""
    if engine == "torch":
        from .torch_backend import TorchBackend

        return TorchBackend(spec, options)
    raise ValueError(f"unknown engine {engine!r}")


__all__ = ["Backend", "BackendOptions", "create_backend"]
