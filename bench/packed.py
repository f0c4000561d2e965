"""`python -m encoderd.bench.packed`: the padding-free torch forward against the padded one, in
this process, on one rerank-sized batch (a query + N corpus passages of mixed length), alternating
the two so they share the machine's conditions; prints both times, the ratio, and checks they agree.

Default model: the bge-reranker-base-sized XLM-R cross-encoder of `encoderd bench --models base`.
"""

from __future__ import annotations

import argparse
import contextlib
import time
from pathlib import Path
from typing import cast
from unittest import mock

import numpy as np


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m encoderd.bench.packed", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="cross-encoder directory (default: the bge-reranker-base-sized one, built once)")
    p.add_argument("--passages", type=int, default=20)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--cache-dir", type=Path, default=Path.home() / ".cache" / "encoderd-bench")
    args = p.parse_args(argv)

    from tokenizers import Tokenizer

    from ..workers.backends import BackendOptions, create_backend, packed_encoder
    from ..workers.contract.model_spec import ModelKind
    from ..workers.contract.protocol import TokenBatch
    from ..workers.contract.spec_reader import load_model_spec
    from .corpus import TokenCounter, make_corpus, make_queries
    from .models import build_xlmr_reranker

    path = args.model or build_xlmr_reranker(args.cache_dir)
    spec = load_model_spec("reranker", path, ModelKind.RERANKER)
    tok = Tokenizer.from_file(str(Path(path) / "tokenizer.json"))
    tok.no_padding()
    tok.enable_truncation(spec.max_length)
    query = make_queries(1, 0)[0]
    pairs = tok.encode_batch([(query, d) for d in make_corpus(TokenCounter(path), args.passages, 0)])
    batch = TokenBatch.from_sequences(0, [e.ids for e in pairs], [e.type_ids for e in pairs])
    backends = {}
    for name in ("packed", "padded"):
        backend = create_backend("torch", spec, BackendOptions(threads=args.threads))
        off = mock.patch.object(packed_encoder, "usable", return_value=False)
        with off if name == "padded" else contextlib.nullcontext():
            backend.load()
        backend.forward(batch)  # first-call costs
        backends[name] = backend
    times: dict[str, list[float]] = {name: [] for name in backends}
    for _ in range(args.rounds):
        for name, backend in backends.items():
            start = time.perf_counter()
            backend.forward(batch)
            times[name].append(time.perf_counter() - start)
    packed, padded = (cast("np.ndarray", backends[name].forward(batch)) for name in ("packed", "padded"))  # pooled
    np.testing.assert_allclose(packed, padded, atol=1e-4)
    real, computed = int(batch.lengths.sum()), len(batch.lengths) * int(batch.lengths.max())
    print(
        f"{Path(path).name}: {len(batch.lengths)} pairs, {real} real tokens, {computed} padded ({computed / real:.2f}x)"
    )
    for name, values in times.items():
        print(f"  {name}: best {min(values) * 1000:.0f} ms of {', '.join(f'{v * 1000:.0f}' for v in values)}")
    print(f"  padded / packed: {min(times['padded']) / min(times['packed']):.2f}x (outputs agree within 1e-4)")


if __name__ == "__main__":
    main()
