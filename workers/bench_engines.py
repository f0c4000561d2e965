"""Engine x dtype x kind throughput, in-process (no server, no sockets).

    python -m encoderd.workers.bench_engines [--device cuda] [--inputs 256] [--threads 1]

Every configuration computes the same deterministic corpus: inputs of 5 to
500 tokens (log-uniform, so most are short and a few are long, as in real
traffic), sorted by length and cut into fixed-size batches, which is what the
scheduler sends a padded engine. Reported: inputs/s and real (unpadded)
tokens/s over the whole corpus, and the median batch latency, from each
configuration's best of --rounds passes, taken round-robin. Conversions are
cached (--cache-dir), so only the first run pays for exports.

The reranker and classifier are the bundled MiniLM body with a seeded random
head: their speed is the body's, their scores are meaningless.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import statistics
import sys
import time
from pathlib import Path

import msgspec

from .backends import BackendOptions, create_backend
from .contract.config import default_cache_dir
from .contract.model_files import default_model_path
from .contract.model_spec import ModelKind
from .contract.protocol import TokenBatch
from .contract.spec_reader import load_model_spec

CPU_MATRIX = [
    ("torch", "float32"),
    ("onnx", "float32"),
    ("onnx", "int8"),
    ("ctranslate2", "float32"),
    ("ctranslate2", "int8"),
]
GPU_MATRIX = [
    ("torch", "float16"),
    ("onnx", "float16"),
    ("ctranslate2", "float16"),
    ("ctranslate2", "int8_float16"),
    ("tensorrt", "float16"),
]
KINDS = ("embedding", "reranker", "classifier")
# Words that are one WordPiece token each in the MiniLM vocabulary, so word count ~ token count.
WORDS = (
    "the model reads each word and maps it to a vector so that close meanings end near one another while "
    "search systems rank many short and long documents for every query users send during the day and night "
    "cats dogs rain sun money market river city music game food water light paper house"
).split()
QUERY = "which documents answer the question about search systems"
MAX_LENGTH = 512  # MiniLM's position limit: lets the corpus reach 500 tokens


def corpus(n: int, seed: int = 0) -> list[str]:
    """n texts of 5..500 tokens (with [CLS]/[SEP]), log-uniform in length."""
    rng = random.Random(seed)
    texts = []
    for _ in range(n):
        words = round(math.exp(rng.uniform(math.log(3), math.log(498))))
        texts.append(" ".join(rng.choice(WORDS) for _ in range(words)))
    return texts


def build_head_model(kind: str, out: Path) -> str:
    """MiniLM + a seeded classification head (1 label: reranker, 3: classifier)."""
    if (out / "config.json").exists():
        return str(out)
    import shutil

    import torch
    from transformers import AutoModelForSequenceClassification

    torch.manual_seed(0)
    model = AutoModelForSequenceClassification.from_pretrained(
        default_model_path(), num_labels=1 if kind == "reranker" else 3
    )
    tmp = out.with_name(out.name + f".tmp-{os.getpid()}")
    model.save_pretrained(tmp)
    for name in ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json"):
        shutil.copy(Path(default_model_path()) / name, tmp / name)
    os.replace(tmp, out)
    return str(out)


def batches(spec, texts: list[str], batch_size: int, pairs: bool) -> list[TokenBatch]:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(Path(spec.path) / "tokenizer.json"))
    tok.enable_truncation(spec.max_length)
    tok.no_padding()
    encodings = sorted(tok.encode_batch([(QUERY, t) for t in texts] if pairs else texts), key=lambda e: len(e.ids))
    chunks = [encodings[start : start + batch_size] for start in range(0, len(encodings), batch_size)]
    return [
        TokenBatch.from_sequences(k, [e.ids for e in chunk], [e.type_ids for e in chunk] if pairs else None)
        for k, chunk in enumerate(chunks)
    ]


def load(engine: str, dtype: str, spec, options: BackendOptions):
    started = time.perf_counter()
    backend = create_backend(engine, spec, msgspec.structs.replace(options, dtype=dtype))
    backend.load()
    backend.warmup(spec.max_length)
    return backend, time.perf_counter() - started


def run_corpus(backend, work: list[TokenBatch]) -> list[float]:
    latencies = []
    for batch in work:
        started = time.perf_counter()
        backend.forward(batch)
        latencies.append(time.perf_counter() - started)
    return latencies


def measure_kind(spec, matrix, work: list[TokenBatch], options: BackendOptions, rounds: int) -> list[dict]:
    """Load every engine, then time them round-robin and keep each one's best round:
    on a shared machine, load that comes and goes then hits every engine alike."""
    loaded, rows = {}, {}
    for engine, dtype in matrix:
        try:
            loaded[engine, dtype] = load(engine, dtype, spec, options)
        except Exception as exc:  # noqa: BLE001 - one missing engine should not hide the others' numbers
            rows[engine, dtype] = {
                "engine": engine,
                "dtype": dtype,
                "kind": spec.kind.value,
                "error": f"{type(exc).__name__}: {exc}",
            }
    best: dict = {}
    for _ in range(rounds):
        for key, (backend, _) in loaded.items():
            latencies = run_corpus(backend, work)
            if key not in best or sum(latencies) < sum(best[key]):
                best[key] = latencies
    inputs = sum(b.size for b in work)
    tokens = sum(int(b.cu_seqlens[-1]) for b in work)
    for (engine, dtype), latencies in best.items():
        total = sum(latencies)
        rows[engine, dtype] = {
            "engine": engine,
            "dtype": dtype,
            "kind": spec.kind.value,
            "inputs_per_s": inputs / total,
            "tokens_per_s": tokens / total,
            "p50_batch_ms": 1000 * statistics.median(latencies),
            "load_s": loaded[engine, dtype][1],
            "inputs": inputs,
            "tokens": tokens,
        }
    return [rows[key] for key in matrix]


def print_table(rows: list[dict], header: str) -> None:
    print(header)
    print(
        f"{'engine':12s} {'dtype':13s} {'kind':11s} {'inputs/s':>9s} {'tokens/s':>9s} {'p50 batch ms':>13s} "
        f"{'load s':>7s}"
    )
    for r in rows:
        if "error" in r:
            print(f"{r['engine']:12s} {r['dtype']:13s} {r['kind']:11s} failed: {r['error']}")
            continue
        print(
            f"{r['engine']:12s} {r['dtype']:13s} {r['kind']:11s} {r['inputs_per_s']:9.1f} {r['tokens_per_s']:9.0f} "
            f"{r['p50_batch_ms']:13.1f} {r['load_s']:7.1f}"
        )


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m encoderd.workers.bench_engines", description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (picks the matrix)")
    p.add_argument("--engines", default="", help="comma-separated engine:dtype pairs (default: the device's matrix)")
    p.add_argument("--kinds", default=",".join(KINDS))
    p.add_argument("--inputs", type=int, default=96, help="corpus size per configuration")
    p.add_argument("--rounds", type=int, default=2, help="timed passes per configuration; the best one counts")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--threads", type=int, default=0, help="intra-op threads (0 = the cores this process may use)")
    p.add_argument("--cache-dir", default=default_cache_dir())
    p.add_argument("--quick", action="store_true", help="32 inputs: a smoke run, not a measurement")
    p.add_argument("--json", default="", help="also write the rows to this file")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    on_gpu = args.device.startswith("cuda")
    matrix = (
        [tuple(pair.split(":")) for pair in args.engines.split(",")]
        if args.engines
        else (GPU_MATRIX if on_gpu else CPU_MATRIX)
    )
    n = 32 if args.quick else args.inputs
    texts = corpus(n)
    options = BackendOptions(
        device=args.device, threads=args.threads, cache_dir=args.cache_dir, max_batch_size=args.batch_size
    )
    models = Path(args.cache_dir) / "bench-models"
    rows = []
    for kind in args.kinds.split(","):
        path = default_model_path() if kind == "embedding" else build_head_model(kind, models / kind)
        spec = msgspec.structs.replace(load_model_spec(f"bench-{kind}", path, ModelKind(kind)), max_length=MAX_LENGTH)
        work = batches(spec, texts, args.batch_size, pairs=kind == "reranker")
        rows += measure_kind(spec, matrix, work, options, 1 if args.quick else args.rounds)
        print(f"  {kind} done", file=sys.stderr, flush=True)
    mean_tokens = sum(int(b.cu_seqlens[-1]) for b in work) / n
    threads = args.threads or len(os.sched_getaffinity(0))
    print_table(
        rows,
        f"\nMiniLM-L6 on {args.device}, {n} inputs of 5-500 tokens (mean {mean_tokens:.0f}), "
        f"length-sorted batches of {args.batch_size}, {threads} thread(s), "
        f"best of {1 if args.quick else args.rounds} round(s)",
    )
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0 if all("error" not in r for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
