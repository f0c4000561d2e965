"""The workload every target is sent: a synthetic corpus, short queries and rerank sets.

Tokens. The corpus is measured with the model's own tokenizer (special tokens included).
"Real tokens" are the tokens a model actually computes on: min(length, model maximum),
identical for every engine; padding is never counted as real.
"""

from __future__ import annotations

import itertools
import math
import random
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..workers.contract.spec_reader import load_model_spec

_SUBJECTS = (
    "the committee",
    "a small team of engineers",
    "our customers",
    "the city council",
    "researchers at the lab",
    "the new model",
    "most users",
    "the support agent",
    "the quarterly report",
    "a local bakery",
    "the hospital",
    "each student",
    "the delivery driver",
    "the search engine",
    "investors",
    "the museum curator",
    "the farmers in the valley",
    "the airline",
    "my neighbour",
    "the database",
)
_VERBS = (
    "announced",
    "reviewed",
    "improved",
    "measured",
    "described",
    "rejected",
    "compared",
    "shipped",
    "tested",
    "explained",
    "questioned",
    "documented",
    "scheduled",
    "cancelled",
    "recommended",
    "summarised",
    "translated",
    "repaired",
    "predicted",
    "celebrated",
)
_OBJECTS = (
    "the budget for next year",
    "a faster search index",
    "the results of the clinical trial",
    "several new recipes",
    "the migration plan",
    "an unexpected drop in sales",
    "the water supply",
    "the price of electricity",
    "a detailed travel itinerary",
    "the security vulnerability",
    "the football season",
    "their hiring process",
    "the climate data from 1998",
    "the customer feedback",
    "a short documentary about bees",
    "the contract with the supplier",
    "the broken elevator",
    "the vaccination schedule",
    "a new bicycle lane",
    "the embeddings of every product description",
)
_TAILS = (
    "after a long discussion",
    "because latency matters",
    "in the second quarter",
    "without any downtime",
    "despite the heavy rain",
    "before the deadline on Friday",
    "for the third time this month",
    "with help from volunteers",
    "according to the press release",
    "although nobody asked for it",
    "while the servers were under load",
    "at 3:45 pm",
    "near the old railway station",
    "in Zürich and Lyon",
    "using about 12% less energy",
    "on behalf of the board",
    "once the tests passed",
    "as expected",
)
_QUERIES = (
    "how do I reset my password",
    "best pizza near the station",
    "what is the capital of Australia",
    "symptoms of vitamin D deficiency",
    "cheap flights to Lisbon in May",
    "python sort list of dicts",
    "why is the sky blue",
    "refund policy for cancelled orders",
    "how long to boil an egg",
    "side effects of ibuprofen",
    "train times Berlin to Prague",
    "what does a cross encoder do",
    "how to fix a leaking tap",
    "weather tomorrow in Oslo",
    "open source vector database",
    "history of the printing press",
)


def _sentence(rng: random.Random) -> str:
    parts = [rng.choice(_SUBJECTS), rng.choice(_VERBS), rng.choice(_OBJECTS)]
    if rng.random() < 0.6:
        parts.append(rng.choice(_TAILS))
    text = " ".join(parts)
    return text[0].upper() + text[1:] + rng.choice((".", ".", ".", "!", "?"))


class TokenCounter:
    """The model's tokenizer, untruncated: lengths include special tokens, as a model sees them."""

    def __init__(self, model_dir: str):
        from tokenizers import Tokenizer

        self.tok = Tokenizer.from_file(str(Path(model_dir) / "tokenizer.json"))
        self.tok.no_truncation()
        self.tok.no_padding()

    def lengths(self, texts: list[str]) -> np.ndarray:
        return np.array([len(e.ids) for e in self.tok.encode_batch(texts)], dtype=np.int64)

    def pair_lengths(self, query: str, docs: list[str]) -> np.ndarray:
        return np.array([len(e.ids) for e in self.tok.encode_batch([(query, d) for d in docs])], dtype=np.int64)

    def cut(self, text: str, tokens: int) -> str:
        """The longest prefix of `text` that tokenizes to at most `tokens` tokens (specials included)."""
        enc = self.tok.encode(text, add_special_tokens=False)
        keep = max(1, tokens - 2)  # [CLS] ... [SEP]
        return text if keep >= len(enc.offsets) else text[: enc.offsets[keep - 1][1]]


def make_corpus(counter: TokenCounter, n: int, seed: int, lo: int = 5, hi: int = 500) -> list[str]:
    """n passages whose token lengths are log-uniform in [lo, hi]: many short chunks, a long tail,
    shuffled so any slice of the corpus has the same mix."""
    rng = random.Random(seed)
    texts = []
    for _ in range(n):
        target = round(math.exp(rng.uniform(math.log(lo), math.log(hi))))
        text = ""
        while len(text) < target * 6:  # ~4.5 characters a token here: overshoot, then cut exactly
            text = (text + " " + _sentence(rng)).strip()
        texts.append(counter.cut(text, target))
    return texts


def make_queries(n: int, seed: int) -> list[str]:
    rng = random.Random(seed + 1)
    return [rng.choice(_QUERIES) + rng.choice(("", "?", " 2024", " please", " for beginners")) for _ in range(n)]


def length_stats(lengths: np.ndarray, max_length: int) -> dict:
    effective = np.minimum(lengths, max_length)
    edges = (5, 16, 32, 64, 128, 256, 512, 10**9)
    hist = {
        f"{a}-{b - 1}" if b < 10**9 else f"{a}+": int(((lengths >= a) & (lengths < b)).sum())
        for a, b in itertools.pairwise(edges)
    }
    return {
        "n": int(lengths.size),
        "min": int(lengths.min()),
        "p10": float(np.percentile(lengths, 10)),
        "p50": float(np.percentile(lengths, 50)),
        "p90": float(np.percentile(lengths, 90)),
        "max": int(lengths.max()),
        "mean": float(lengths.mean()),
        "model_max_length": max_length,
        "truncated_fraction": float((lengths > max_length).mean()),
        "mean_real": float(effective.mean()),
        "histogram": hist,
    }


@dataclass
class Workload:
    corpus: list[str]
    real: np.ndarray  # real (truncated) tokens per corpus input
    queries: list[str]
    query_real: np.ndarray
    rerank_sets: list[tuple[str, list[str], np.ndarray]]  # query, passages, real pair tokens


def make_workload(args, embed_dir: str, rerank_dir: str | None) -> tuple[Workload, dict]:
    counter = TokenCounter(embed_dir)
    embed_max = load_model_spec("bench", embed_dir).max_length
    corpus = make_corpus(counter, args.corpus_size, args.seed)
    lengths = counter.lengths(corpus)
    queries = make_queries(64, args.seed)
    info = {"corpus": length_stats(lengths, embed_max), "queries": length_stats(counter.lengths(queries), embed_max)}
    sets = []
    if rerank_dir:
        rerank_max = load_model_spec("bench", rerank_dir).max_length
        pairs = TokenCounter(rerank_dir)  # the cross-encoder's own tokenizer (XLM-R's differs from the embedder's)
        rng = random.Random(args.seed + 2)
        for i in range(args.rerank_calls):
            docs = [corpus[rng.randrange(len(corpus))] for _ in range(args.rerank_docs)]
            sets.append(
                (
                    queries[i % len(queries)],
                    docs,
                    np.minimum(pairs.pair_lengths(queries[i % len(queries)], docs), rerank_max),
                )
            )
        info["rerank_pairs"] = length_stats(np.concatenate([s[2] for s in sets]), rerank_max)
    work = Workload(
        corpus, np.minimum(lengths, embed_max), queries, np.minimum(counter.lengths(queries), embed_max), sets
    )
    return work, info
