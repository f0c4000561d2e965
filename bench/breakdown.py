"""Where a bulk forward's time goes in the torch worker: matmuls, attention, element-wise, layout, and
what no operator accounts for (Python and dispatch between ops), as shares of the profiled time.

    python -m encoderd.bench.breakdown [--models minilm|base] [--dtype auto] [--threads N]

The worker's own backend (workers/backends/torch_backend.py, the packed forward it serves with) computes
the bench corpus (bench/corpus.py: 5-500 tokens, log-uniform) in batches of --batch-tokens tokens, as the
scheduler sends bulk work. Operators are timed by torch.profiler (self time, so nested calls count
once); the time outside every operator is the Python that runs the layers. Shares, not absolute
times, are the result: they hold on a loaded host where absolute times do not. The wall time without
the profiler is printed beside it, so the profiler's own overhead shows, and the CPU time of that pass
with tokens per CPU-second (others' processes on a shared host stretch it less than the wall time: the
figure to compare two checkouts by, run in turn); and `flop_shares`, the split
of the FLOPs between the matmuls and attention (bench/flops.py), so a category whose share of the
time exceeds its share of the FLOPs stands out.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

# aten operator -> category. Matched on the name without its namespace; first hit wins. The batched
# products (bmm, baddbmm) are attention's: the linears run as _linear_pointwise / addmm / mm, and
# attention's scores and context are the batched ones (packed_pieces._attend_by_products).
CATEGORIES = (
    ("matmul", ("_linear_pointwise", "addmm", "mm", "linear", "matmul")),
    (
        "attention",
        # attention: host_kernels' packed attention kernel (the profiler's encoderd::attention)
        (
            "scaled_dot_product",
            "_flash_attention",
            "_efficient_attention",
            "softmax",
            "varlen",
            "bmm",
            "masked_fill",
            "attention",
        ),
    ),
    (
        "element-wise",
        # add_layer_norm: workers/backends/host_kernels.py's one-pass residual add + LayerNorm
        (
            "layer_norm",
            "native_layer_norm",
            "add_layer_norm",
            "gelu",
            "add",
            "add_",
            "mul",
            "div",
            "tanh",
            "relu",
            "embedding",
        ),
    ),
    (
        "layout",
        (
            "copy_",
            "contiguous",
            "clone",
            "transpose",
            "view",
            "unbind",
            "flatten",
            "unsqueeze",
            "select",
            "slice",
            "as_strided",
            "empty",
            "empty_like",
            "cat",
            "index",
            "to",
            "_to_copy",
            "reshape",
            "permute",
            "expand",
            "fill_",
            "zeros_like",
            "resize_",
            "empty_strided",
            "t",
            "_unsafe_view",
            "lift_fresh",
            "detach",
            "alias",
        ),
    ),
)


def category(op: str) -> str:
    name = op.split("::")[-1]
    for label, names in CATEGORIES:
        if name in names or (label == "attention" and any(n in name for n in names)):
            return label
    return "other ops"


def batches(model_dir: str, corpus_size: int, batch_tokens: int, seed: int):
    """The bench corpus as packed TokenBatches of at most batch_tokens tokens each, in corpus order."""
    from ..workers.contract.protocol import TokenBatch
    from ..workers.contract.spec_reader import load_model_spec
    from .corpus import TokenCounter, make_corpus

    counter = TokenCounter(model_dir)
    limit = load_model_spec("bench", model_dir).max_length
    texts = make_corpus(counter, corpus_size, seed)
    ids = [np.array(e.ids[:limit], dtype=np.int32) for e in counter.tok.encode_batch(texts)]
    out: list[list[np.ndarray]] = []
    current: list[np.ndarray] = []
    for seq in ids:
        if current and sum(len(s) for s in current) + len(seq) > batch_tokens:
            out.append(current)
            current = []
        current.append(seq)
    out.append(current)
    made = []
    for i, group in enumerate(out):
        cu = np.concatenate([[0], np.cumsum([len(s) for s in group])]).astype(np.int32)
        made.append(TokenBatch(i, np.concatenate(group), cu))
    return made


def flop_shares(model_dir: str, work: list) -> dict:
    """What the time shares would be if every FLOP cost the same (bench/flops.py's model): beside the
    measured shares, how far attention and the matmuls each are from the hardware."""
    from .flops import FlopModel

    model = FlopModel.from_dir(model_dir)
    lengths = np.concatenate([b.lengths for b in work]).astype(np.float64)
    matmul = float(2 * model.matmul_params * lengths.sum())
    attention = float(4 * model.layers * model.hidden * (lengths**2).sum())
    total = matmul + attention
    return {"flop_shares": {"matmul": round(matmul / total, 4), "attention": round(attention / total, 4)}}


def load_backend(model_dir: str, dtype: str, threads: int):
    from ..workers.backends import create_backend
    from ..workers.contract.config import BackendOptions
    from ..workers.contract.spec_reader import load_model_spec

    backend = create_backend("torch", load_model_spec("bench", model_dir), BackendOptions(dtype=dtype, threads=threads))
    backend.load()
    return backend


def profile(backend, work: list, rounds: int) -> dict:
    import torch
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    for b in work[:2]:  # first calls pick kernels and allocate
        backend.forward(b)
    walls, cpus = [], []
    for _ in range(rounds):
        t0, c0 = time.perf_counter(), time.process_time()
        for b in work:
            backend.forward(b)
        walls.append(time.perf_counter() - t0)
        cpus.append(time.process_time() - c0)
    with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        for b in work:
            backend.forward(b)
        profiled_wall = time.perf_counter() - t0
    by_category: dict[str, float] = collections.defaultdict(float)
    by_op: dict[str, float] = collections.defaultdict(float)
    calls = 0
    for event in prof.key_averages():
        by_category[category(event.key)] += event.self_cpu_time_total / 1e6
        by_op[event.key] += event.self_cpu_time_total / 1e6
        calls += event.count
    in_ops = sum(by_category.values())
    by_category["Python between ops"] = max(0.0, profiled_wall - in_ops)
    shares = {k: round(v / profiled_wall, 4) for k, v in sorted(by_category.items(), key=lambda kv: -kv[1])}
    top = sorted(by_op.items(), key=lambda kv: -kv[1])[:15]
    return {
        "wall_s_without_profiler": round(min(walls), 3),
        "cpu_s_without_profiler": round(min(cpus), 3),
        "wall_s_profiled": round(profiled_wall, 3),
        "operator_calls": calls,
        "shares": shares,
        "top_ops": {k: round(v / profiled_wall, 4) for k, v in top},
        "threads": torch.get_num_threads(),
    }


def main(argv: list[str] | None = None) -> int:
    from .models import build_base_embedder
    from .options import worker_threads

    p = argparse.ArgumentParser(prog="python -m encoderd.bench.breakdown", description=__doc__.split("\n\n")[0])
    p.add_argument("--models", choices=("minilm", "base"), default="minilm")
    p.add_argument("--dtype", default="auto", help="the worker's --dtype (auto: what `encoderd serve` picks here)")
    p.add_argument("--threads", type=int, default=0, help="intra-op threads (default: one worker's, as served)")
    p.add_argument("--corpus-size", type=int, default=256)
    p.add_argument("--batch-tokens", type=int, default=8192, help="tokens per batch (the scheduler's budget)")
    p.add_argument("--rounds", type=int, default=2, help="unprofiled passes; the fastest is the wall time")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--cache-dir", type=Path, default=Path.home() / ".cache" / "encoderd-bench")
    p.add_argument("--json", type=Path, help="also write the result here")
    args = p.parse_args(argv)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from ..workers.contract.model_files import default_model_path

    model_dir = build_base_embedder(args.cache_dir) if args.models == "base" else default_model_path()
    threads = args.threads or worker_threads(argparse.Namespace(serve_args=""))
    backend = load_backend(model_dir, args.dtype, threads)
    work = batches(model_dir, args.corpus_size, args.batch_tokens, args.seed)
    result = {
        **flop_shares(model_dir, work),
        "model": args.models,
        "dtype": backend.options.dtype,
        "packed": backend.packed is not None,
        "batches": len(work),
        "tokens": int(sum(len(b.input_ids) for b in work)),
        **profile(backend, work, args.rounds),
    }
    result["tokens_per_cpu_s"] = round(result["tokens"] / max(result["cpu_s_without_profiler"], 1e-9))
    print(json.dumps(result, indent=2))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
