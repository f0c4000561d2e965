"""The synthetic ingestion workload: mixed-length document chunks.

The mixed benchmark (bench/mixed.py) streams them to a server, and the worker's pacing
calibration (workers/bench_pacing.py) cuts them into bulk batches, so both measure the same load;
this is the one place both sides may import it from.
"""

from __future__ import annotations

import numpy as np


def chunk_corpus(n: int, seed: int = 0) -> list[str]:
    """Mixed-length ingestion chunks: mostly paragraphs, some long, some short."""
    rng = np.random.default_rng(seed)
    words = (
        "retrieval augmented generation splits documents into chunks and embeds each one so that a query can "
        "find the passages most similar to it before a reranker orders them"
    ).split()
    lengths = np.clip(rng.lognormal(mean=4.0, sigma=0.8, size=n), 5, 400).astype(int)
    return [f"chunk {i}: " + " ".join(rng.choice(words, size=k)) for i, k in enumerate(lengths)]
