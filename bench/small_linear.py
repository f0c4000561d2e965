"""The few-row bfloat16 GEMM (workers/backends/host_kernels.c, bf16_linear_rows) against oneDNN's
_linear_pointwise on the same weights (packed_linear.PackedLinear, which picks between them by
host_kernels.few_row_limit()), alternated in one process, on one thread, at every row count asked for
whatever the threshold:

    python -m encoderd.bench.small_linear [--rows 1,2,4,...,64] [--shape minilm|bge-base] [--rounds 7]
                                          [--compare-ref REF [--query-tokens 6,8,...]]

A layer is a BERT layer's four linears at the shape's sizes (fused QKV, attention output, FFN up with
its GELU, FFN down), run in the forward's order over the shape's --layers layers in turn, so each
layer's weights come from wherever the previous layers left them (L3 or memory for MiniLM's 21 MB, as in
the forward), --passes times a call. Per row count: CPU microseconds per layer of each (the fastest of
--rounds calls) and their ratio, oneDNN's over the kernel's; the crossover is the first row count where
the kernel is slower. Ratios, not absolute times, are the result on a shared host.

--compare-ref: also the kernel of git REF's host_kernels.c (main, a commit before a change), built here with
the same flags, taking its turn on the same packed weights: "ref_over_kernel" is REF's time over this
checkout's. With --query-tokens, also a lone query's whole forward (the bundled MiniLM, the worker's torch
backend in bfloat16, one thread) at each token count, with this checkout's kernels and REF's in turn.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from ..workers.backends import packed_linear
from .attention import alternated, ref_kernels, serving

# (hidden, intermediate, layers) of the models the packed forward serves most
SHAPES = {"minilm": (384, 1536, 6), "bge-base": (768, 3072, 12)}


def layer_linears(hidden: int, intermediate: int, seed: int) -> list[tuple[packed_linear.PackedLinear, str]]:
    """A BERT layer's four linears as the packed forward holds them (PackedLinear, seeded bfloat16 weights),
    each with the activation the forward asks of it."""
    torch.manual_seed(seed)
    sizes = [(hidden, 3 * hidden, "none"), (hidden, hidden, "none"), (hidden, intermediate, "gelu")]
    sizes.append((intermediate, hidden, "none"))
    linears = []
    for k, n, activation in sizes:
        linear = torch.nn.Linear(k, n).bfloat16().requires_grad_(False)
        linears.append((packed_linear.PackedLinear(linear), activation))
    return linears


def by_onednn(layer, x: torch.Tensor, activation: str) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, layer.weight, layer.bias, activation, [], "none")


def by_kernel(layer, x: torch.Tensor, activation: str) -> torch.Tensor:
    from ..workers.backends import host_kernels

    out = host_kernels.bf16_linear(x, layer.few_rows, activation)
    assert out is not None, "the few-row kernel must serve here (bench: SMALL_LINEAR_ROWS raised)"
    return out


def per_rows(rows: list[int], shape: str, passes: int, rounds: int, ref=None) -> list[dict]:
    from ..workers.backends import host_kernels

    hidden, intermediate, count = SHAPES[shape]
    layers = [layer_linears(hidden, intermediate, seed) for seed in range(count)]
    if any(linear.few_rows is None for layer in layers for linear, _ in layer):
        raise SystemExit("the few-row kernel is not built here (no avx512_bf16, or see the log)")
    results = []
    for m in rows:
        inputs = {k: torch.randn(m, k).bfloat16() for k in (hidden, intermediate)}

        def run(product, inputs=inputs):
            def call():
                for _ in range(passes):
                    for layer in layers:
                        for linear, activation in layer:
                            product(linear, inputs[linear.in_features], activation)

            return call

        kernel = run(by_kernel)
        calls = {"onednn": run(by_onednn), "kernel": kernel}
        if ref is not None:  # both kernels through the same patching, so that its cost falls on both
            calls |= {"kernel": serving(host_kernels.kernels(), kernel), "ref": serving(ref, kernel)}
        seconds = alternated(calls, rounds)
        per_layer = {name: s / (passes * count) * 1e6 for name, s in seconds.items()}
        row = {"rows": m, "onednn_us": round(per_layer["onednn"], 1), "kernel_us": round(per_layer["kernel"], 1)}
        row["onednn_over_kernel"] = round(per_layer["onednn"] / per_layer["kernel"], 2)
        if ref is not None:
            row["ref_us"] = round(per_layer["ref"], 1)
            row["ref_over_kernel"] = round(per_layer["ref"] / per_layer["kernel"], 2)
        print(json.dumps(row), flush=True)
        results.append(row)
    return results


def query_forwards(token_counts: list[int], passes: int, rounds: int, ref) -> list[dict]:
    """A lone query's forward (the bundled MiniLM, bfloat16, one thread) at each token count, this checkout's
    kernels and REF's in turn: milliseconds per forward of each and REF's over this checkout's."""
    import numpy as np

    from ..workers.backends import host_kernels
    from ..workers.contract.model_files import default_model_path
    from ..workers.contract.protocol import TokenBatch
    from .breakdown import load_backend

    backend = load_backend(default_model_path(), "bfloat16", 1)
    rng = np.random.default_rng(0)
    results = []
    for n in token_counts:  # [CLS], word pieces, [SEP]
        ids = np.concatenate([[101], rng.integers(2000, 20000, max(0, n - 2)), [102]]).astype(np.int32)
        batch = TokenBatch(1, ids, np.array([0, len(ids)], dtype=np.int32))

        def run(batch=batch):
            for _ in range(passes):
                backend.forward(batch)

        calls = {"kernel": serving(host_kernels.kernels(), run), "ref": serving(ref, run)}
        seconds = {name: s / passes * 1e3 for name, s in alternated(calls, rounds).items()}
        row = {"tokens": len(ids), "forward_ms": round(seconds["kernel"], 3)}
        row["ref_forward_ms"] = round(seconds["ref"], 3)
        row["ref_over_kernel"] = round(seconds["ref"] / seconds["kernel"], 2)
        print(json.dumps(row), flush=True)
        results.append(row)
    return results


def crossover(results: list[dict]) -> int | None:
    """The first row count where the kernel is slower than oneDNN, or None."""
    return next((r["rows"] for r in results if r["onednn_over_kernel"] < 1.0), None)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m encoderd.bench.small_linear", description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", default="1,2,4,8,16,24,32,40,48,56,64", help="row counts, comma-separated")
    p.add_argument("--shape", choices=tuple(SHAPES), default="minilm")
    p.add_argument("--passes", type=int, default=10, help="passes over the layers per timed call")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--compare-ref", help="also time the kernel of this git ref's host_kernels.c (e.g. main)")
    p.add_argument("--query-tokens", help="with --compare-ref: a lone query's forward at these token counts")
    p.add_argument("--json", type=Path, help="also write the result here")
    args = p.parse_args(argv)
    if args.query_tokens and not args.compare_ref:
        p.error("--query-tokens compares with --compare-ref's kernels: give both")
    torch.set_num_threads(1)
    from ..workers.backends import host_kernels

    host_kernels.SMALL_LINEAR_ROWS = 1 << 30  # every row count through the kernel when asked
    ref = ref_kernels(args.compare_ref) if args.compare_ref else None
    results = per_rows([int(n) for n in args.rows.split(",")], args.shape, args.passes, args.rounds, ref)
    result = {"shape": args.shape, "per_rows": results, "crossover_rows": crossover(results)}
    print(json.dumps({"crossover_rows": result["crossover_rows"]}), flush=True)
    if args.query_tokens:
        tokens = [int(n) for n in args.query_tokens.split(",")]
        result["query_forwards"] = query_forwards(tokens, args.passes, args.rounds, ref)
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
