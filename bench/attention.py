"""The packed attention kernel (workers/backends/host_kernels.c, attend_full_bf16) against the per-sequence
torch operators it replaces (packed_pieces.attend_each_sequence), alternated in one process, on one thread
in bfloat16 as a default worker runs on a small CPU host:

    python -m encoderd.bench.attention [--lengths 16,32,...] [--forward minilm|base]

Per layer: one layer's attention over a batch of --tokens tokens of equal-length sequences, q, k and v
strided views of one fused QKV output as the BERT layer leaves them, at MiniLM's head shape (12 x 32)
and bge-base's (12 x 64); the fastest of --rounds calls of each, in CPU time, and their ratio.

--forward: the whole packed forward of the worker's backend over the bench corpus (as bench.breakdown
runs it), with and without the kernel, passes alternated; corpus tokens per CPU second of each and the ratio.
Ratios, not absolute times, are the result on a shared host.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import time
from pathlib import Path
from unittest import mock

import torch

SHAPES = {"minilm": (12, 32), "bge-base": (12, 64)}  # (heads, head size)


def layer_inputs(length: int, tokens: int, heads: int, dim: int):
    """q, k, v as views of one (tokens, 3, heads, dim) projection, and the PackedBatch of its sequences."""
    from ..workers.backends import packed_pieces

    count = max(1, tokens // length)
    generator = torch.Generator().manual_seed(length)
    fused = torch.randn(count * length, 3, heads, dim, generator=generator).bfloat16()
    cu_seqlens = torch.arange(0, count * length + 1, length, dtype=torch.int32)
    batch = packed_pieces.PackedBatch.of(torch.zeros(count * length, dtype=torch.long), cu_seqlens)
    return (*fused.unbind(1), batch)


def cpu_seconds(call) -> float:
    """The CPU time of one call (one thread: a neighbour's load on a shared host stretches it less than
    the wall time)."""
    started = time.process_time()
    call()
    return time.process_time() - started


def alternated(calls: dict, rounds: int) -> dict[str, float]:
    """Each call's fastest of `rounds`, the calls taking turns, so a neighbour's load falls on all of them."""
    for call in calls.values():
        call()  # first calls allocate
    seconds: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(rounds):
        for name, call in calls.items():
            seconds[name].append(cpu_seconds(call))
    return {name: min(s) for name, s in seconds.items()}


def per_layer(lengths: list[int], tokens: int, rounds: int) -> list[dict]:
    from ..workers.backends import host_kernels, packed_pieces

    rows = []
    for name, (heads, dim) in SHAPES.items():
        for length in lengths:
            q, k, v, batch = layer_inputs(length, tokens, heads, dim)
            calls = {
                "kernel": functools.partial(host_kernels.attend_full, q, k, v, batch, None),
                "operators": functools.partial(packed_pieces.attend_each_sequence, q, k, v, batch),
            }
            best = alternated(calls, rounds)
            rows.append(
                {
                    "shape": name,
                    "length": length,
                    "tokens": q.shape[0],
                    "kernel_ms": round(best["kernel"] * 1e3, 3),
                    "operators_ms": round(best["operators"] * 1e3, 3),
                    "speedup": round(best["operators"] / best["kernel"], 2),
                    "kernel_gflops": round(4 * q.shape[0] * length * heads * dim / best["kernel"] / 1e9, 1),
                }
            )
            print(json.dumps(rows[-1]), flush=True)
    return rows


def forward(models: str, corpus_size: int, batch_tokens: int, rounds: int, cache_dir: Path) -> dict:
    """The whole forward with and without the kernel (attend_full answering None: the operators serve)."""
    from ..workers.backends import host_kernels
    from ..workers.contract.model_files import default_model_path
    from .breakdown import batches, load_backend
    from .models import build_base_embedder

    model_dir = build_base_embedder(cache_dir) if models == "base" else default_model_path()
    backend = load_backend(model_dir, "bfloat16", 1)
    work = batches(model_dir, corpus_size, batch_tokens, seed=0)
    tokens = int(sum(len(b.input_ids) for b in work))

    def run_all():
        for b in work:
            backend.forward(b)

    def without_kernel():
        with mock.patch.object(host_kernels, "attend_full", return_value=None):
            run_all()

    best = alternated({"kernel": run_all, "operators": without_kernel}, rounds)
    return {
        "model": models,
        "tokens": tokens,
        "batches": len(work),
        "tokens_per_cpu_s": {name: round(tokens / s) for name, s in best.items()},
        "speedup": round(best["operators"] / best["kernel"], 3),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m encoderd.bench.attention", description=__doc__.split("\n\n")[0])
    p.add_argument("--lengths", default="16,32,64,128,256,512", help="sequence lengths, comma-separated")
    p.add_argument("--tokens", type=int, default=8192, help="tokens per layer batch (the scheduler's budget)")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--forward", choices=("minilm", "base"), help="also time the whole forward over the corpus")
    p.add_argument("--corpus-size", type=int, default=256)
    p.add_argument("--cache-dir", type=Path, default=Path.home() / ".cache" / "encoderd-bench")
    p.add_argument("--json", type=Path, help="also write the result here")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    from ..workers.backends import host_kernels

    built = host_kernels.kernels()
    if built is None:
        print("the kernels could not be built here (see the log): nothing to compare", file=sys.stderr)
        return 1
    print(f"attention products: {built.attention_products}", flush=True)
    result: dict = {"products": built.attention_products}
    if args.lengths:
        result["per_layer"] = per_layer([int(n) for n in args.lengths.split(",")], args.tokens, args.rounds)
    if args.forward:
        result["forward"] = forward(args.forward, args.corpus_size, 8192, args.rounds, args.cache_dir)
        print(json.dumps(result["forward"]), flush=True)
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
