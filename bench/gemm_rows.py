"""What rounding a packed batch's row count costs and saves: oneDNN JIT-compiles a GEMM primitive for each
row count (M) it meets and keeps a few dozen (workers/memory.py), so batches of ever new token counts pay
for a new primitive on each linear. This runs MiniLM's six layers' four linears (bench.small_linear.layer_linears,
bfloat16, one thread, the worker's primitive-cache bounds) over a seeded stream of batch token counts,
rounded up by each policy in turn (the filler rows computed too), and prints CPU microseconds per real
token and the ratio:

    python -m encoderd.bench.gemm_rows [--tokens 1000-8192] [--batches 40] [--rounds 5]

"fixed" rounds to packed_encoder.GEMM_ROWS_MULTIPLE (8) whatever the batch; "grown" is what the packed
forward does (packed_encoder.gemm_rows_multiple). Each round draws new token counts, as live traffic
does; ratios, not absolute times, are the result on a shared host.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from collections.abc import Callable

import torch

from ..workers import memory
from ..workers.backends import packed_encoder
from .attention import cpu_seconds
from .small_linear import SHAPES, by_onednn, layer_linears

POLICIES: dict[str, Callable[[int], int]] = {
    "fixed": lambda tokens: packed_encoder.GEMM_ROWS_MULTIPLE,
    "grown": packed_encoder.gemm_rows_multiple,
}


def rounded(tokens: int, multiple: int) -> int:
    return -(-tokens // multiple) * multiple


def token_counts(low: int, high: int, count: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randint(low, high) for _ in range(count)]


def run_policy(layers, multiple_of: Callable[[int], int], counts: list[int]) -> float:
    """CPU seconds for the layers' linears over every batch, each at its rounded row count."""
    hidden = layers[0][0][0].in_features
    inputs = {k: torch.randn(rounded(max(counts), 128), k).bfloat16() for k in (hidden, 4 * hidden)}

    def call() -> None:
        for tokens in counts:
            m = rounded(tokens, multiple_of(tokens))
            for layer in layers:
                for linear, activation in layer:
                    by_onednn(linear, inputs[linear.in_features][:m], activation)

    return cpu_seconds(call)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m encoderd.bench.gemm_rows", description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", default="1000-8192", help="batch token counts drawn from LOW-HIGH")
    p.add_argument("--batches", type=int, default=40, help="batches per policy per round")
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args(argv)
    memory.bound_kernel_caches()  # as a worker runs: oneDNN keeps this many primitives
    torch.set_num_threads(1)
    low, high = (int(n) for n in args.tokens.split("-"))
    hidden, intermediate, count = SHAPES["minilm"]
    layers = [layer_linears(hidden, intermediate, seed) for seed in range(count)]
    per_token: dict[str, list[float]] = {name: [] for name in POLICIES}
    for round_ in range(args.rounds):
        for name, multiple_of in list(POLICIES.items())[:: 1 if round_ % 2 == 0 else -1]:
            counts = token_counts(low, high, args.batches, seed=round_ * 2 + (name == "grown"))
            per_token[name].append(run_policy(layers, multiple_of, counts) / sum(counts) * 1e6)
    best = {name: min(values) for name, values in per_token.items()}
    result = {f"{name}_us_per_token": round(value, 3) for name, value in best.items()}
    result["fixed_over_grown"] = round(best["fixed"] / best["grown"], 3)
    print(json.dumps({"tokens": args.tokens, "batches": args.batches, "rounds": args.rounds, **result}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
