"""How long a live query waits for bulk work in the worker, and what that costs the bulk work:
the worker's step loop in-process, timed in CPU time (one thread), so a shared or busy machine
does not move the figures.

    python -m encoderd.workers.bench_pacing [--dtypes float32,bfloat16] [--inputs 400]

For each dtype (a faster and a slower "host" for the same code) and each policy:
  layer     the scheduler's full bulk batches, a pause after each layer (no pacing);
  cut256    bulk batches cut to 256 tokens while live traffic is around, a pause after each layer
            (what the scheduler did before the pacer: --bulk-batch-tokens 256);
  paced     full bulk batches cut by workers/pacing.py (steps of about one urgent batch's time);
  quiet     the same while no query has come for pacing.QUIET_S (steps of pacing.MAX_STEP_S): what
            a lone bulk workload gets;
  whole     full batches in one forward each, as urgent (interactive) batches are computed;
it reports the urgent batch's own time (a short query), the p95 and longest bulk step (what an
arriving query waits for, at most), both also as multiples of the query's time, and bulk tokens
per CPU second relative to `layer`. Host-independent means: the paced rows' step/query ratio is
the same for every dtype, and the bulk throughput stays close to `layer`.
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np

from .backends import BackendOptions, create_backend
from .contract.model_files import default_model_path
from .contract.protocol import TokenBatch
from .contract.spec_reader import load_model_spec
from .pacing import Pacer

BATCH_SIZE = 16  # the CPU default of --batch-size
CUT_TOKENS = 256  # the former --bulk-batch-tokens default
FACTORS = (1.0, 1.5, 2.0)  # pacing.URGENT_FACTOR candidates


def corpus(tokenizer, n: int) -> list[np.ndarray]:
    """The mixed bench's ingestion chunks (bench/mixed.py), tokenized, in arrival order."""
    from .contract.corpus import chunk_corpus

    return [np.asarray(e.ids, dtype=np.int32) for e in tokenizer.encode_batch(chunk_corpus(n))]


def batches(seqs: list[np.ndarray], max_tokens: int) -> list[TokenBatch]:
    out: list[TokenBatch] = []
    chunk: list[np.ndarray] = []
    for s in seqs:
        if chunk and (len(chunk) == BATCH_SIZE or sum(map(len, chunk)) + len(s) > max_tokens):
            out.append(TokenBatch.from_sequences(0, chunk))
            chunk = []
        chunk.append(s)
    return out + ([TokenBatch.from_sequences(0, chunk)] if chunk else [])


def cpu_steps(backend, batch: TokenBatch) -> list[float]:
    steps = backend.forward_in_steps(batch)
    times: list[float] = []
    while True:
        started = time.process_time()
        try:
            next(steps)
        except StopIteration:
            return times
        times.append(time.process_time() - started)


def cpu_forward(backend, batch: TokenBatch) -> float:
    started = time.process_time()
    backend.forward(batch)
    return time.process_time() - started


def run(dtype: str, seqs: list[np.ndarray], query: TokenBatch) -> list[dict]:
    spec = load_model_spec("bench", default_model_path())
    backend = create_backend("torch", spec, BackendOptions(dtype=dtype, threads=1))
    backend.load()
    backend.warmup(spec.max_length)
    urgent = []
    for _ in range(30):
        started = time.process_time()
        backend.forward(query)
        urgent.append(time.process_time() - started)
    u = float(np.median(urgent))
    pacer = Pacer(fixed_ms=None)
    pacer.timed_urgent(u)
    full = batches(seqs, 8192)
    for b in full[:2]:  # the pacer learns seconds per token from the first steps, as a worker does
        for t in cpu_steps(backend, b):
            pacer.timed_step(len(b.input_ids), t)
    policies = {"layer": full, "cut256": batches(seqs, CUT_TOKENS)}
    quiet = Pacer(fixed_ms=None)  # no query yet: steps of MAX_STEP_S
    quiet.step_per_token = pacer.step_per_token
    policies["quiet"] = [part for b in full for part in quiet.cut(b)]
    for factor in FACTORS:
        pacer.factor = factor
        pacer.timed_urgent(u)  # live: a query has just run
        policies[f"paced{factor:g}"] = [part for b in full for part in pacer.cut(b)]
    rows, tokens = [], sum(len(s) for s in seqs)
    for name, work in [*policies.items(), ("whole", full)]:
        steps = (
            [cpu_forward(backend, b) for b in work]
            if name == "whole"
            else [t for b in work for t in cpu_steps(backend, b)]
        )
        rows.append(
            {
                "dtype": dtype,
                "policy": name,
                "query_ms": u * 1000,
                "step_p95_ms": float(np.percentile(steps, 95)) * 1000,
                "step_max_ms": max(steps) * 1000,
                "tokens_per_cpu_s": tokens / sum(steps),
            }
        )
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--inputs", type=int, default=400)
    args = parser.parse_args(argv)
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    from .contract.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(default_model_path())
    tokenizer.no_padding()
    tokenizer.enable_truncation(256)
    seqs = corpus(tokenizer, args.inputs)
    query = TokenBatch.from_sequences(0, [np.asarray(tokenizer.encode("what is a cross encoder").ids, np.int32)])
    print(
        f"{'dtype':<9} {'policy':<9} {'query ms':>8} {'step p95':>9} {'max':>7} {'p95/query':>9} "
        f"{'max/query':>9} {'bulk vs layer':>13}"
    )
    for dtype in args.dtypes.split(","):
        rows = run(dtype, seqs, query)
        for r in rows:
            print(
                f"{r['dtype']:<9} {r['policy']:<9} {r['query_ms']:8.2f} {r['step_p95_ms']:9.2f} "
                f"{r['step_max_ms']:7.2f} {r['step_p95_ms'] / r['query_ms']:9.2f} "
                f"{r['step_max_ms'] / r['query_ms']:9.2f} {r['tokens_per_cpu_s'] / rows[0]['tokens_per_cpu_s']:13.2f}",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
