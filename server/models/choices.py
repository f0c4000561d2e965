"""The one start-up line per model that says which layout, engine and dtype it runs and why.

The decisions themselves live in workers/contract/cpu_cores.py (layout), hardware.py (CPU dtype) and in the worker (the
engine, and the fidelity fallback of an automatic dtype); this only explains them."""

from __future__ import annotations

from ...workers.contract import cpu_cores, hardware
from ..base.config import ServerConfig
from ..scheduling.placement import Placement, cpu_layout, usable_cores


def explain(name: str, cfg: ServerConfig, placements: list[Placement], engine: str, dtype: str) -> str:
    parts = [f"{name}: engine {engine}" + (" (--engine auto)" if cfg.engine == "auto" else "")]
    parts.append(_dtype_reason(cfg, placements, engine, dtype))
    cpu_workers = [p for p in placements if p.device == "cpu"]
    if cpu_workers:
        layout = cpu_layout(cfg.replicas, cfg.cpu_threads)
        threads = cpu_workers[0].threads or len(usable_cores())
        budget = cpu_cores.cpu_budget()
        parts.append(f"{len(cpu_workers)} CPU worker(s) x {threads} thread(s) ({budget.describe()}; {layout.why})")
    gpus = sorted({p.device for p in placements if p.device != "cpu"})
    if gpus:
        parts.append(f"{len(placements) - len(cpu_workers)} worker(s) on {', '.join(gpus)}")
    return "; ".join(parts)


def _dtype_reason(cfg: ServerConfig, placements: list[Placement], engine: str, dtype: str) -> str:
    if cfg.dtype != "auto":
        note = hardware.explicit_dtype_note(engine, dtype) if _cpu_only(placements) else None
        return f"dtype {dtype} (--dtype {cfg.dtype}" + (f"; {note})" if note else ")")
    if not _cpu_only(placements):
        return f"dtype {dtype} (--dtype auto: float16 on CUDA)"
    wanted, why = hardware.choose_cpu_dtype(engine)
    if wanted != dtype:
        return (
            f"dtype {dtype} (--dtype auto chose {wanted}: {why}; it failed the fidelity self-check, "
            f"so {dtype} (worker log has the figures))"
        )
    return f"dtype {dtype} (--dtype auto: {why})"


def _cpu_only(placements: list[Placement]) -> bool:
    return all(p.device == "cpu" for p in placements)
