"""The int8 linears' host kernel (workers/backends/host_kernels.c, int8_linear_rows: the VNNI GEMM with its
epilogue), alternated in one process on one thread as a default int8 worker runs:

    python -m encoderd.bench.int8_linear [--rows 512] [--forward] [--compare-ref REF] [--int-mm]

Per layer: MiniLM's four int8 linears (fused QKV, attention output, FFN up-projection with its GELU, FFN
down-projection) on --rows bfloat16 rows (int8_linear.ROWS_PER_PASS tokens, what one call gets), the
input quantized once; the fastest of --rounds CPU times of --repeats calls, as integer GOPS.

--forward: MiniLM's whole int8 forward (the worker's backend, --dtype int8) over the bench corpus, as
bench.breakdown runs it; corpus tokens per CPU second.

--compare-ref: the kernels of git REF's host_kernels.c (main, a commit before a change), built here with
the same flags, take their turn beside this checkout's in both measurements, through the same patching:
"vs_ref" is REF's time over this checkout's. Ratios, not absolute rates, are the result on a shared host.
On an AMX host, `--compare-ref main` (before the AMX blocks) times the VNNI tiles beside the AMX ones.

--int-mm: also the path int8_linear.Int8Linear takes where the kernel does not serve (torch._int_mm, then
host_kernels.rescale_rows), in both measurements, as "int_mm" ("int_mm_gops"; "vs_int_mm": its time over
the kernel's).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from unittest import mock

import torch

from .attention import alternated, ref_kernels, serving

# (in, out, activation) of MiniLM's (all-MiniLM-L6-v2) int8 linears
LAYERS = {
    "qkv": (384, 1152, "none"),
    "attention out": (384, 384, "none"),
    "up + gelu": (384, 1536, "gelu"),
    "down": (1536, 384, "none"),
}


def layer_call(built, k: int, n: int, activation: str, rows: int, repeats: int):
    """`repeats` int8_linear calls of one k -> n layer on `rows` bfloat16 rows through `built`'s kernels."""
    from ..workers.backends import host_kernels

    generator = torch.Generator().manual_seed(k + n)
    weight = torch.randint(-127, 128, (n, k), generator=generator, dtype=torch.int8)
    weight_scale, bias = torch.rand(n, generator=generator) * 1e-2, torch.randn(n, generator=generator)
    x = torch.randn(rows, k, generator=generator).bfloat16()
    out = torch.empty(rows, n, dtype=torch.bfloat16)

    with mock.patch.object(host_kernels, "kernels", return_value=built):  # packed by the build that reads it
        packed = host_kernels.pack_int8(weight, weight_scale, bias)
        quantized, token_scale = host_kernels.quantize_rows(x, None, to_unsigned=True)
    assert packed is not None  # main() checks that the build has the GEMM
    token_scale *= 0.1  # outputs within a few units of 0, as an FFN's are: GELU's tail included

    def calls():
        for _ in range(repeats):
            host_kernels.int8_linear(quantized, token_scale, packed, activation, out)

    return serving(built, calls)


def int_mm_call(k: int, n: int, activation: str, rows: int, repeats: int):
    """`repeats` torch._int_mm + rescale_rows calls of layer_call's layer (Int8Linear's other path)."""
    from ..workers.backends import host_kernels

    generator = torch.Generator().manual_seed(k + n)
    weight_t = torch.randint(-127, 128, (n, k), generator=generator, dtype=torch.int8).t()
    weight_scale, bias = torch.rand(n, generator=generator) * 1e-2, torch.randn(n, generator=generator)
    quantized, token_scale = host_kernels.quantize_rows(torch.randn(rows, k, generator=generator).bfloat16(), None)
    token_scale *= 0.1
    out = torch.empty(rows, n, dtype=torch.bfloat16)

    def calls():
        for _ in range(repeats):
            products = torch._int_mm(quantized, weight_t)
            host_kernels.rescale_rows(products, token_scale, weight_scale, bias, activation, out)

    return serving(host_kernels.kernels(), calls)


def per_layer(rows: int, repeats: int, rounds: int, ref=None, int_mm: bool = False) -> list[dict]:
    from ..workers.backends import host_kernels

    results = []
    for name, (k, n, activation) in LAYERS.items():
        calls = {"kernel": layer_call(host_kernels.kernels(), k, n, activation, rows, repeats)}
        if ref is not None:
            calls["ref"] = layer_call(ref, k, n, activation, rows, repeats)
        if int_mm:
            calls["int_mm"] = int_mm_call(k, n, activation, rows, repeats)
        best = alternated(calls, rounds)
        operations = 2 * rows * k * n * repeats
        row = {"layer": name, "k": k, "n": n, "gops": round(operations / best["kernel"] / 1e9)}
        if ref is not None:
            row |= {"ref_gops": round(operations / best["ref"] / 1e9), "vs_ref": round(best["ref"] / best["kernel"], 3)}
        if int_mm:
            row |= {"int_mm_gops": round(operations / best["int_mm"] / 1e9)}
            row |= {"vs_int_mm": round(best["int_mm"] / best["kernel"], 3)}
        results.append(row)
        print(json.dumps(row), flush=True)
    return results


def forward(corpus_size: int, rounds: int, ref=None, int_mm: bool = False) -> dict:
    from ..workers.backends import host_kernels
    from ..workers.contract.model_files import default_model_path
    from .breakdown import batches, load_backend

    model_dir = default_model_path()
    backend = load_backend(model_dir, "int8", 1)
    work = batches(model_dir, corpus_size, 8192, seed=0)
    tokens = int(sum(len(b.input_ids) for b in work))

    def run_all():
        for b in work:
            backend.forward(b)

    def run_int_mm():
        with mock.patch.object(host_kernels, "int8_linear_serves", return_value=False):
            run_all()

    calls = {"kernel": serving(host_kernels.kernels(), run_all)}
    if ref is not None:
        calls["ref"] = serving(ref, run_all)
    if int_mm:
        calls["int_mm"] = serving(host_kernels.kernels(), run_int_mm)
    best = alternated(calls, rounds)
    result = {"model": "minilm", "dtype": "int8", "tokens": tokens, "batches": len(work)}
    result["tokens_per_cpu_s"] = {name: round(tokens / s) for name, s in best.items()}
    if ref is not None:
        result["vs_ref"] = round(best["ref"] / best["kernel"], 3)
    if int_mm:
        result["vs_int_mm"] = round(best["int_mm"] / best["kernel"], 3)
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m encoderd.bench.int8_linear", description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=512, help="rows per call (int8_linear.ROWS_PER_PASS)")
    p.add_argument("--repeats", type=int, default=20, help="calls per timed turn")
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--forward", action="store_true", help="also time MiniLM's whole int8 forward over the corpus")
    p.add_argument("--corpus-size", type=int, default=256)
    p.add_argument("--compare-ref", help="also time the kernels of this git ref's host_kernels.c (e.g. main)")
    p.add_argument("--int-mm", action="store_true", help="also time torch._int_mm + rescale_rows")
    p.add_argument("--json", type=Path, help="also write the result here")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    from ..workers.backends import host_kernels

    built = host_kernels.kernels()
    if built is None or not built.int8_gemm:
        print("no int8 GEMM kernel here (no compiler or no avx512_vnni): nothing to time", file=sys.stderr)
        return 1
    ref = ref_kernels(args.compare_ref) if args.compare_ref else None
    result: dict = {"rows": args.rows, "ref": args.compare_ref}
    result["int8_products"] = built.int8_products
    result["per_layer"] = per_layer(args.rows, args.repeats, args.rounds, ref, args.int_mm)
    if args.forward:
        result["forward"] = forward(args.corpus_size, args.rounds, ref, args.int_mm)
        print(json.dumps(result["forward"]), flush=True)
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
