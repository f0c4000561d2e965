"""Deterministic mixed-length English-like text for tests and benchmarks."""

from __future__ import annotations

import random

WORDS = (
    "the model embeds every passage into a vector space where similar meanings land close together while "
    "retrieval systems rank candidate documents by cosine similarity before a cross encoder reranks the best "
    "few for precision search engines serve millions of queries each day and latency matters as much as "
    "throughput cats dogs weather finance protein sequence kernel batching tokenizer attention"
).split()


def sentences(n: int, min_words: int = 1, max_words: int = 120, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        # Skew towards short inputs, as real queries and chunks are, with a long tail.
        k = min(max_words, max(min_words, int(rng.paretovariate(1.2) * min_words * 3)))
        out.append(" ".join(rng.choice(WORDS) for _ in range(k)).capitalize() + ".")
    return out
