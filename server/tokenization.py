"""Tokenization with Hugging Face `tokenizers`, off the event loop.

`encode_batch` runs in Rust and releases the GIL, so a small thread pool
keeps the event loop free while batches are tokenized.
"""

from __future__ import annotations

import asyncio
import functools
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tokenizers import Encoding, Tokenizer, normalizers

from .errors import InvalidInput


@dataclass(slots=True)
class Tokenized:
    ids: list[np.ndarray]                 # int32 per input
    type_ids: list[np.ndarray] | None     # int32 per input, for pairs
    total_tokens: int

    @property
    def lengths(self) -> np.ndarray:
        return np.fromiter((len(i) for i in self.ids), dtype=np.int64, count=len(self.ids))


def load_tokenizer(model_dir: str, lowercase: bool = False, trust_remote_code: bool = False) -> Tokenizer:
    """The model's fast tokenizer; `lowercase` (sentence-transformers' do_lower_case) lower-cases texts
    first, as sentence-transformers does: a Lowercase normalizer ahead of the tokenizer's own."""
    path = Path(model_dir) / "tokenizer.json"
    if path.exists():
        tokenizer = Tokenizer.from_file(str(path))
    else:  # Slow-tokenizer-only models: let transformers convert to a fast tokenizer.
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(model_dir, use_fast=True,
                                                  trust_remote_code=trust_remote_code).backend_tokenizer
    if lowercase and not _lowercases(tokenizer.normalizer):
        rest = tokenizer.normalizer
        rest = [] if rest is None else list(rest) if isinstance(rest, normalizers.Sequence) else [rest]
        tokenizer.normalizer = normalizers.Sequence([normalizers.Lowercase(), *rest])
    return tokenizer


def _lowercases(normalizer) -> bool:
    """Whether a Lowercase normalizer is there already; the same test sentence-transformers makes
    (a BertNormalizer's own lowercase does not count: it adds a Lowercase then too, harmlessly)."""
    if isinstance(normalizer, normalizers.Sequence):
        return any(isinstance(n, normalizers.Lowercase) for n in normalizer)
    return isinstance(normalizer, normalizers.Lowercase)


class ModelTokenizer:
    def __init__(self, model_dir: str, max_length: int, executor: ThreadPoolExecutor,
                 bulk_executor: ThreadPoolExecutor | None = None, lowercase: bool = False,
                 trust_remote_code: bool = False):
        self.max_length = max_length
        self._executor = executor
        # Bulk work tokenizes on its own thread, so a live query never queues behind
        # a stream's chunks in the tokenizer pool.
        self._bulk_executor = bulk_executor or executor
        base = load_tokenizer(model_dir, lowercase, trust_remote_code)
        base.no_padding()
        base.no_truncation()
        self.untruncated = base
        # One tokenizer object per truncation side: their settings are global state.
        self._by_side = {side: self._truncating_copy(base, side) for side in ("right", "left")}

    @functools.cached_property
    def special_affixes(self) -> tuple[list[int], list[int]]:
        """The ids the tokenizer puts before and after a single text ([CLS] and [SEP], <s> and
        </s>, a trailing EOS...), read off how it encodes a probe with and without them."""
        full = self.untruncated.encode("a").ids
        plain = self.untruncated.encode("a", add_special_tokens=False).ids
        for start in range(len(full) - len(plain) + 1):
            if full[start:start + len(plain)] == plain:
                return full[:start], full[start + len(plain):]
        return [], []

    def with_special_tokens(self, ids: list[int]) -> list[int]:
        """Token ids as the model expects them: its special tokens added unless the ids already
        carry them, cut to the maximum length between them (as the text path truncates)."""
        prefix, suffix = self.special_affixes
        start = len(prefix) if ids[:len(prefix)] == prefix else 0
        end = len(ids) - len(suffix) if suffix and ids[-len(suffix):] == suffix else len(ids)
        body = ids[start:max(start, end)]
        return prefix + body[:max(self.max_length - len(prefix) - len(suffix), 0)] + suffix

    def _truncating_copy(self, base: Tokenizer, side: str) -> Tokenizer:
        tok = Tokenizer.from_str(base.to_str())
        tok.enable_truncation(self.max_length, direction=side)
        return tok

    async def encode(self, texts: list[str], *, truncate: bool = True, side: str = "right",
                     pairs_with: str | None = None, bulk: bool = False) -> Tokenized:
        """Tokenize inputs (or (pairs_with, input) pairs) into per-input id arrays."""
        loop = asyncio.get_running_loop()
        batch = [(pairs_with, t) for t in texts] if pairs_with is not None else texts
        executor = self._bulk_executor if bulk else self._executor
        encodings = await loop.run_in_executor(executor, self._by_side[side].encode_batch, batch)
        return self._collect(encodings, truncate, pairs_with is not None)

    def _collect(self, encodings: list[Encoding], truncate: bool, pairs: bool) -> Tokenized:
        if not truncate:
            too_long = [i for i, e in enumerate(encodings) if e.overflowing]
            if too_long:
                raise InvalidInput(f"input {too_long[0]} is longer than the model's maximum of {self.max_length} "
                                   f"tokens and truncation is off ({len(too_long)} inputs too long)")
        ids = [np.asarray(e.ids, dtype=np.int32) for e in encodings]
        types = [np.asarray(e.type_ids, dtype=np.int32) for e in encodings] if pairs else None
        return Tokenized(ids, types, sum(len(i) for i in ids))

    async def tokenize(self, texts: list[str], add_special_tokens: bool) -> list[Encoding]:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, lambda: self.untruncated.encode_batch(
            texts, add_special_tokens=add_special_tokens))
