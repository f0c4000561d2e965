"""What the computation costs, and what this machine could do at best.

FLOP estimate for a BERT-like encoder, per input of n real tokens:
    FLOPs(n) = n * (2 * P + 4 * L * H * n)
where P = L * (4 H^2 + 2 H I) are the matmul weights of the L layers (Q, K, V, O
projections and the two feed-forward matrices; embeddings are lookups, biases and norms
are negligible) and 4 L H n per token is attention (QK^T and AV, 2 FLOPs per
multiply-add). Utilisation = useful FLOPs/s (real tokens only, padding excluded) divided
by a matmul peak measured here, now, with torch at the worker's thread count and dtype.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np


@dataclass(frozen=True)
class FlopModel:
    layers: int
    hidden: int
    intermediate: int

    @classmethod
    def from_dir(cls, model_dir: str) -> FlopModel:
        cfg = json.loads((Path(model_dir) / "config.json").read_text())
        hidden = int(cfg["hidden_size"])
        return cls(int(cfg["num_hidden_layers"]), hidden, int(cfg.get("intermediate_size", 4 * hidden)))

    @property
    def matmul_params(self) -> int:
        return self.layers * (4 * self.hidden**2 + 2 * self.hidden * self.intermediate)

    def flops(self, real_lengths: np.ndarray) -> float:
        n = real_lengths.astype(np.float64)
        return float((n * (2 * self.matmul_params + 4 * self.layers * self.hidden * n)).sum())


def matmul_peak(threads: int, sizes, seconds: float = 0.4) -> dict:
    """Best sustained GFLOP/s of torch.mm for fp32 and bf16 at a few shapes (square and the model's own)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    result: dict[str, int | float | dict[str, float]] = {"threads": threads}
    try:
        for name, dtype in (("float32", torch.float32), ("bfloat16", torch.bfloat16)):
            per_shape = {}
            for m, k, n in sizes:
                a, b = torch.randn(m, k).to(dtype), torch.randn(k, n).to(dtype)
                per_shape[f"{m}x{k}x{n}"] = round(_best_gflops(torch, a, b, seconds), 1)
            result[name] = max(per_shape.values())
            result[name + "_shapes"] = per_shape
    finally:
        torch.set_num_threads(before)
    result["float16"] = result["bfloat16"]  # no fp16 matmul units on most CPUs: bf16 is the better guess
    return result


def _best_gflops(torch, a, b, seconds: float) -> float:
    flop = 2.0 * a.shape[0] * a.shape[1] * b.shape[1]
    torch.mm(a, b)  # first call allocates and picks kernels
    best, spent = float("inf"), 0.0
    for _ in range(50):  # bounded; usually stops on `seconds`
        t0 = time.perf_counter()
        torch.mm(a, b)
        dt = time.perf_counter() - t0
        best, spent = min(best, dt), spent + dt
        if spent > seconds:
            break
    return flop / best / 1e9
