"""The packed attention kernel (workers/backends/host_kernels.c, attend_full_bf16) against the per-sequence
torch operators it replaces (packed_pieces.attend_each_sequence), alternated in one process, on one thread
in bfloat16 as a default worker runs on a small CPU host:

    python -m encoderd.bench.attention [--lengths 16,32,...] [--forward minilm|base] [--compare-ref REF]

Per layer: one layer's attention over a batch of --tokens tokens of equal-length sequences, q, k and v
strided views of one fused QKV output as the BERT layer leaves them, at MiniLM's head shape (12 x 32)
and bge-base's (12 x 64); the fastest of --rounds calls of each, in CPU time, and their ratio.

--forward: the whole packed forward of the worker's backend over the bench corpus (as bench.breakdown
runs it), with and without the kernel, passes alternated; corpus tokens per CPU second of each and the ratio.

--compare-ref: also the kernel of git REF's host_kernels.c (main, a commit before a change), built here
with the same flags and taking its turn in both measurements: "vs_ref" is REF's time over this checkout's.
Ratios, not absolute times, are the result on a shared host.
"""

from __future__ import annotations

import argparse
import functools
import json
import subprocess
import sys
import tempfile
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
    """Each call's fastest of `rounds`, the calls taking turns, so a neighbour's load falls on all of them;
    every other round in reverse order, so that none always follows the same one (whose freed memory or
    evicted cache the next call meets)."""
    for call in calls.values():
        call()  # first calls allocate
    seconds: dict[str, list[float]] = {name: [] for name in calls}
    for round_ in range(rounds):
        for name, call in list(calls.items())[:: 1 if round_ % 2 == 0 else -1]:
            seconds[name].append(cpu_seconds(call))
    return {name: min(s) for name, s in seconds.items()}


def ref_kernels(ref: str):
    """host_kernels.c as it is at git REF, built here with this checkout's compiler and flags."""
    from ..workers.backends import host_kernels

    source = host_kernels.SOURCE
    relative = source.relative_to(Path(__file__).resolve().parents[1])
    text = subprocess.run(
        ["git", "-C", str(source.parent), "show", f"{ref}:{relative}"], check=True, capture_output=True, text=True
    ).stdout
    compiler = host_kernels.find_compiler()
    assert compiler is not None  # main() returns before this when nothing could be built
    with tempfile.TemporaryDirectory(prefix="encoderd-ref-kernels-") as folder:
        path = Path(folder) / "host_kernels.c"
        path.write_text(text)
        return host_kernels._build(compiler, source=path)


def serving(built, call):
    """`call` with `built` (REF's kernels) serving wherever host_kernels would serve its own."""
    from ..workers.backends import host_kernels

    def run(*args, **kwargs):
        with mock.patch.object(host_kernels, "kernels", return_value=built):
            return call(*args, **kwargs)

    return run


def per_layer(lengths: list[int], tokens: int, rounds: int, ref=None) -> list[dict]:
    from ..workers.backends import host_kernels, packed_pieces

    rows = []
    for name, (heads, dim) in SHAPES.items():
        for length in lengths:
            q, k, v, batch = layer_inputs(length, tokens, heads, dim)
            calls = {
                "kernel": functools.partial(host_kernels.attend_full, q, k, v, batch, None),
                "operators": functools.partial(packed_pieces.attend_each_sequence, q, k, v, batch),
            }
            if ref is not None:  # both through the same patching, so that its cost falls on both
                own = serving(host_kernels.kernels(), host_kernels.attend_full)
                calls["kernel"] = functools.partial(own, q, k, v, batch, None)
                calls["ref"] = functools.partial(serving(ref, host_kernels.attend_full), q, k, v, batch, None)
            best = alternated(calls, rounds)
            row = {
                "shape": name,
                "length": length,
                "tokens": q.shape[0],
                "kernel_ms": round(best["kernel"] * 1e3, 3),
                "operators_ms": round(best["operators"] * 1e3, 3),
                "speedup": round(best["operators"] / best["kernel"], 2),
                "kernel_gflops": round(4 * q.shape[0] * length * heads * dim / best["kernel"] / 1e9, 1),
            }
            if ref is not None:
                row |= {"ref_ms": round(best["ref"] * 1e3, 3), "vs_ref": round(best["ref"] / best["kernel"], 3)}
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


def forward(models: str, corpus_size: int, batch_tokens: int, rounds: int, cache_dir: Path, ref=None) -> dict:
    """The whole forward with and without the kernel (attend_full answering None: the operators serve),
    and with REF's kernels (all of them: add + LayerNorm's too) where given."""
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

    calls = {"kernel": run_all, "operators": without_kernel}
    if ref is not None:
        calls |= {"kernel": serving(host_kernels.kernels(), run_all), "ref": serving(ref, run_all)}
    best = alternated(calls, rounds)
    result = {
        "model": models,
        "tokens": tokens,
        "batches": len(work),
        "tokens_per_cpu_s": {name: round(tokens / s) for name, s in best.items()},
        "speedup": round(best["operators"] / best["kernel"], 3),
    }
    if ref is not None:
        result["vs_ref"] = round(best["ref"] / best["kernel"], 3)
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m encoderd.bench.attention", description=__doc__.split("\n\n")[0])
    p.add_argument("--lengths", default="16,32,64,128,256,512", help="sequence lengths, comma-separated")
    p.add_argument("--tokens", type=int, default=8192, help="tokens per layer batch (the scheduler's budget)")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--forward", choices=("minilm", "base"), help="also time the whole forward over the corpus")
    p.add_argument("--corpus-size", type=int, default=256)
    p.add_argument("--cache-dir", type=Path, default=Path.home() / ".cache" / "encoderd-bench")
    p.add_argument("--compare-ref", help="also time the kernels of this git ref's host_kernels.c (e.g. main)")
    p.add_argument("--json", type=Path, help="also write the result here")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    from ..workers.backends import host_kernels

    built = host_kernels.kernels()
    if built is None:
        print("the kernels could not be built here (see the log): nothing to compare", file=sys.stderr)
        return 1
    products = built.attention_tiles or built.attention_products  # head sizes of a multiple of 32 by tiles
    print(f"attention products: {products}", flush=True)
    result: dict = {"products": products}
    ref = ref_kernels(args.compare_ref) if args.compare_ref else None
    if args.compare_ref:
        result["ref"] = args.compare_ref
    if args.lengths:
        lengths = [int(n) for n in args.lengths.split(",")]
        result["per_layer"] = per_layer(lengths, args.tokens, args.rounds, ref)
    if args.forward:
        result["forward"] = forward(args.forward, args.corpus_size, 8192, args.rounds, args.cache_dir, ref)
        print(json.dumps(result["forward"]), flush=True)
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
