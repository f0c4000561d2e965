"""The command line: the quick and full profiles, every knob, and the progress log."""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

# The package's docstring: its first paragraph is --help's description.
from . import __doc__ as _overview


def log(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# Bulk is a fixed amount of work by default (every corpus input once, C clients x B inputs a request),
# timed from the first request to the last answer. A fixed time window instead (--bulk-requests 0
# --bulk-seconds S --bulk-warmup W) counts only the requests that finish inside it, which undercounts a
# server that sorts inputs across requests (they all finish late) unless S is many times C x B / rate.
FULL = {
    "corpus_size": 2048,
    "concurrency": 32,
    "batch": 32,
    "bulk_seconds": 300.0,
    "bulk_warmup": 0.0,
    "bulk_requests": -1,
    "single_calls": 200,
    "rerank_calls": 10,
    "rerank_docs": 50,
    "recovery_runs": 3,
    "soak_seconds": 120.0,
    "peak_sizes": ((2048, 2048, 2048), (4096, 384, 1536), (4096, 1536, 384)),
}
QUICK = {
    "corpus_size": 64,
    "concurrency": 4,
    "batch": 4,
    "bulk_seconds": 60.0,
    "bulk_warmup": 0.0,
    "bulk_requests": 8,
    "single_calls": 10,
    "rerank_calls": 2,
    "rerank_docs": 8,
    "recovery_runs": 1,
    "soak_seconds": 5.0,
    "peak_sizes": ((512, 512, 512),),
}
# On a GPU a matmul reaches its peak only at large sizes (KINDS.md: 8192^3 bf16 ~790 TFLOP/s on an H200).
GPU_PEAK_SIZES = ((8192, 8192, 8192), (16384, 768, 3072), (16384, 3072, 768))


def build_parser(prog: str = "encoderd bench") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=prog, description=_overview.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help="CI smoke run: tiny corpus, a few requests, no Infinity, no sentence-transformers (< 60 s)",
    )
    p.add_argument("--json", type=Path, help="write all results to this JSON file")
    p.add_argument(
        "--modes",
        default="bulk,single,rerank",
        help="comma-separated subset of bulk,single,rerank,recovery,memory,oom (recovery: cold starts and "
        "kill -9 of a worker, its own servers; see bench/recovery.py; memory: worker memory over a "
        "--soak-seconds bulk soak; oom: a batch too big for the GPU halves and loses nothing; see bench/device.py)",
    )
    p.add_argument(
        "--device",
        default="cpu",
        help="cpu, or cuda[:N]: encoderd serves there (--device added to --serve-args), the matmul peak is "
        "measured there and sentence-transformers runs there in float16 (its usual GPU setting)",
    )
    p.add_argument("--serve-args", default="", help='extra `encoderd serve` flags, e.g. "--dtype bfloat16"')
    p.add_argument("--target-grpc", help="host:port of a running encoderd instead of starting one")
    p.add_argument("--target-rest", help="base URL of a running encoderd's REST gateway (with --target-grpc)")
    p.add_argument("--target-metrics", help="metrics URL of a running encoderd (with --target-grpc)")
    p.add_argument("--rest", action="store_true", help="also benchmark encoderd over REST (Envoy)")
    p.add_argument("--infinity", action="store_true", help="also run infinity-emb 0.0.78 side by side (own venv)")
    p.add_argument(
        "--infinity-no-warmup",
        action="store_true",
        help="start Infinity with --no-model-warmup: its start-up timing of 512-token batches takes "
        "minutes per 12-layer model on busy cores (each mode still warms every target up)",
    )
    p.add_argument(
        "--infinity-bf16",
        action="store_true",
        help="also run Infinity in its best CPU configuration here: its torch engine with --dtype bfloat16 "
        "(0.0.78 loads the model in bfloat16 on CPU; its optimum engine needs a model.onnx in the model "
        "directory and runs ONNX Runtime float32). Its own server, beside --infinity's defaults",
    )
    p.add_argument(
        "--openvino",
        action="store_true",
        help='also run bulk on sentence-transformers backend="openvino" in-process (own venv, '
        "optimum-intel 2.2, openvino 2026.4): at OpenVINO's own precision (bfloat16 on CPUs with it) and "
        "int8 (optimum-intel's static quantization), each only above its fidelity floor vs float32",
    )
    p.add_argument(
        "--bulk-priority",
        choices=("bulk", "interactive"),
        default="bulk",
        help="the priority encoderd's bulk clients ask for over gRPC (default: bulk, what an ingestion job "
        "should send; REST calls run at the API key's priority, interactive here)",
    )
    p.add_argument("--stream", action="store_true", help="also run bulk through one gRPC EmbedStream (ingestion)")
    p.add_argument("--no-st", action="store_true", help="skip the in-process sentence-transformers reference")
    p.add_argument(
        "--models",
        choices=("minilm", "base", "tiny"),
        default="minilm",
        help="minilm: the bundled all-MiniLM-L6-v2 and a MiniLM cross-encoder; base: a bge-base-sized "
        "BERT embedder and a bge-reranker-base-sized XLM-R cross-encoder (real sizes, random "
        "weights, built once under --cache-dir; see bench/models.py); tiny: the same two architectures "
        "at 2 layers x 64 (the CPU run of tests/gpu/device_check.sh)",
    )
    p.add_argument("--reranker", help="cross-encoder directory for rerank (default: per --models)")
    p.add_argument(
        "--cache-dir",
        type=Path,
        default=Path.home() / ".cache" / "encoderd-bench",
        help="Infinity virtualenv and built models (default: %(default)s)",
    )
    p.add_argument("--log-dir", type=Path, help="server logs (default: a temporary folder, kept on failure)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--quiet-wait",
        type=float,
        default=0.0,
        help="before each measurement, wait up to this many seconds for other processes to go quiet",
    )
    for name, help_ in (
        ("corpus_size", "inputs in the corpus"),
        ("concurrency", "bulk clients (C)"),
        ("batch", "inputs per bulk request (B)"),
        ("bulk_seconds", "bulk time limit (or window), s"),
        ("bulk_warmup", "bulk load before the window opens, s"),
        ("bulk_requests", "bulk requests in all (-1 = the corpus once; 0 = a time window)"),
        ("single_calls", "sequential single-query calls"),
        ("rerank_calls", "sequential rerank calls"),
        ("rerank_docs", "passages per rerank call"),
        ("recovery_runs", "cold starts (and worker kills) per server in the recovery mode"),
        ("soak_seconds", "bulk traffic of the memory mode, s"),
    ):
        kind = float if name.startswith(("bulk_s", "soak")) or name == "bulk_warmup" else int
        p.add_argument(
            "--" + name.replace("_", "-"), type=kind, help=f"{help_} (full: {FULL[name]}, quick: {QUICK[name]})"
        )
    return p


def resolve_options(args: argparse.Namespace) -> argparse.Namespace:
    """Fill unset knobs from the profile (quick or full); an explicit flag always wins."""
    profile = QUICK if args.quick else FULL
    for key, value in profile.items():
        if getattr(args, key, None) is None:
            setattr(args, key, value)
    if args.bulk_requests < 0:
        args.bulk_requests = max(1, args.corpus_size // args.batch)
    args.modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if unknown := set(args.modes) - {"bulk", "single", "rerank", "recovery", "memory", "oom"}:
        raise SystemExit(f"encoderd bench: unknown modes {sorted(unknown)}")
    if args.quick:
        args.infinity, args.infinity_bf16, args.openvino, args.no_st = False, False, False, True
    if args.device != "cpu":
        import shlex

        if "--device" not in shlex.split(args.serve_args):
            args.serve_args = f"{args.serve_args} --device {args.device}".strip()
        if args.peak_sizes == FULL["peak_sizes"]:
            args.peak_sizes = GPU_PEAK_SIZES
    return args


def _serve_flag(args, flag: str) -> int:
    """A positive integer `encoderd serve` flag from --serve-args, else 0."""
    import shlex

    tokens = shlex.split(args.serve_args)
    for i, tok in enumerate(tokens):
        if tok == flag and i + 1 < len(tokens) and int(tokens[i + 1]) > 0:
            return int(tokens[i + 1])
        if tok.startswith(flag + "=") and int(tok.split("=", 1)[1]) > 0:
            return int(tok.split("=", 1)[1])
    return 0


def _layout(args):
    """The server's CPU layout for these --serve-args: its flags, else what it picks on this host."""
    from ..server.scheduling.placement import cpu_layout

    replicas = _serve_flag(args, "--replicas") or int(os.environ.get("ENCODERD_REPLICAS", "0"))
    threads = _serve_flag(args, "--cpu-threads") or int(os.environ.get("ENCODERD_CPU_THREADS", "0"))
    return cpu_layout(replicas, threads)


def worker_threads(args) -> int:
    """Intra-op threads of one encoderd worker."""
    return _layout(args).threads


def serving_threads(args) -> int:
    """Threads of all the embedding model's workers together (--replicas x --cpu-threads, at most
    the cores here): the matmul peak that FLOP utilisation is measured against."""
    layout = _layout(args)
    return min(layout.threads * layout.replicas, len(os.sched_getaffinity(0)))
