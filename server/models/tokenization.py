"""Tokenization with Hugging Face `tokenizers`, off the event loop.

`encode_batch` runs in Rust and releases the GIL, so a small thread pool
keeps the event loop free while batches are tokenized. The smallest
requests (INLINE_CHARS) are tokenized on the loop: the hand-off costs more.
"""

from __future__ import annotations

import asyncio
import collections
import functools
import os
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import cast

import numpy as np
from tokenizers import Encoding, Tokenizer

from ..base import metrics
from ..base.errors import InvalidInput
from .token_floor import TokenFloor


class InputTooLong(InvalidInput):
    """Inputs over the model's maximum with truncation off. `positions` are in the batch tokenized;
    the caller, who knows what each input is called, names the first (`named`)."""

    def __init__(self, positions: list[int], max_length: int):
        self.positions, self.max_length = positions, max_length
        super().__init__(self.named([f"input {i}" for i in range(positions[0] + 1)]))

    def named(self, names: Sequence[str]) -> str:
        more = f" ({len(self.positions)} inputs too long)" if len(self.positions) > 1 else ""
        return (
            f"{names[self.positions[0]]} is longer than the model's maximum of {self.max_length} tokens"
            f" and truncation is off{more}"
        )


@dataclass(slots=True)
class Tokenized:
    ids: list[np.ndarray]  # int32 per input
    type_ids: list[np.ndarray] | None  # int32 per input, for pairs
    total_tokens: int

    @property
    def lengths(self) -> np.ndarray:
        return np.fromiter((len(i) for i in self.ids), dtype=np.int64, count=len(self.ids))


class ModelTokenizer:
    def __init__(
        self,
        base: Tokenizer,
        max_length: int,
        executor: ThreadPoolExecutor,
        bulk_executor: ThreadPoolExecutor | None = None,
        model: str = "",
        serving_queries: Callable[[], bool] = lambda: False,
    ):
        """`base`: the model's tokenizer as its worker built it (workers/contract/tokenizer.py); this
        object takes it over. `model`: the name its metrics carry. `serving_queries`: whether live
        queries are around now (the registry's models' schedulers say), which a big request's
        tokenizing then leaves a core (CHUNKS_IN_FLIGHT)."""
        self.max_length = max_length
        self.model = model
        self.serving_queries = serving_queries
        self.floor = TokenFloor(base)  # the fewest tokens a text can become, untokenized
        self._executor = executor
        # Bulk work tokenizes on its own thread, so a live query never queues behind
        # a stream's chunks in the tokenizer pool.
        self._bulk_executor = bulk_executor or executor
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
            if full[start : start + len(plain)] == plain:
                return full[:start], full[start + len(plain) :]
        return [], []

    def with_special_tokens(self, ids: list[int]) -> list[int]:
        """Token ids as the model expects them: its special tokens added unless the ids already
        carry them, cut to the maximum length between them (as the text path truncates)."""
        prefix, suffix = self.special_affixes
        start = len(prefix) if ids[: len(prefix)] == prefix else 0
        end = len(ids) - len(suffix) if suffix and ids[-len(suffix) :] == suffix else len(ids)
        body = ids[start : max(start, end)]
        return prefix + body[: max(self.max_length - len(prefix) - len(suffix), 0)] + suffix

    def _truncating_copy(self, base: Tokenizer, side: str) -> Tokenizer:
        tok = Tokenizer.from_str(base.to_str())
        tok.enable_truncation(self.max_length, direction=side)
        return tok

    async def encode(
        self,
        texts: Sequence[str | tuple[str, str]],
        *,
        truncate: bool = True,
        side: str = "right",
        pairs_with: str | None = None,
        bulk: bool = False,
    ) -> Tokenized:
        """Tokenize inputs (or (pairs_with, input) pairs) into per-input id arrays. An input may
        itself be a (text, text_pair) pair, encoded (and truncated) as the tokenizer pairs them."""
        if pairs_with is not None and (template := self.pair_template) is not None:
            documents = cast("list[str]", texts)  # pairs_with: the inputs are single texts (documents)
            return await self._encode_pairs(template, pairs_with, documents, truncate, side, bulk)
        batch = [(pairs_with, t) for t in texts] if pairs_with is not None else list(texts)
        pairs = any(isinstance(item, tuple) for item in batch)
        read = functools.partial(_arrays, pairs=pairs, truncate=truncate)
        rows = await self._in_chunks(ids_only(self._by_side[side]), batch, bulk, read)
        return _collect(rows, truncate, pairs, self.max_length)

    async def _in_chunks(self, encode_batch, batch: list, bulk: bool, read=list, **kwargs) -> list:
        """encode_batch over the batch in pieces of bounded size, CHUNKS_IN_FLIGHT at a time (one
        while live queries are around): a cancelled or expired request stops between pieces (a
        running Rust call cannot be interrupted), and a huge request shares the pool with others
        instead of holding its threads for seconds. `read` turns a piece's encodings into what the
        caller keeps, on the pool's thread: a 2,048-input call's ids read on the event loop held it
        ~9 ms at once (2-vCPU Xeon), other callers' queries behind it."""
        metrics.series(metrics.TOKENIZED_TEXTS, self.model).inc(len(batch))
        if not bulk and len(batch) <= INLINE_INPUTS and sum(map(_size, batch)) <= INLINE_CHARS:
            return read(encode_batch(batch, **kwargs))  # a live query: on the loop itself (see INLINE_CHARS)
        loop = asyncio.get_running_loop()
        executor = self._bulk_executor if bulk else self._executor
        out: list = []
        started: collections.deque[asyncio.Future] = collections.deque()
        in_flight = 1 if self.serving_queries() else CHUNKS_IN_FLIGHT
        try:
            for chunk in _chunks(batch):
                started.append(loop.run_in_executor(executor, _encode_and_read, encode_batch, chunk, read, kwargs))
                if len(started) >= in_flight:
                    out += await started.popleft()
            while started:
                out += await started.popleft()
        finally:
            for piece in started:  # a request cancelled or refused: its chunks not yet running never start
                piece.cancel()
        return out

    async def _encode_pairs(
        self, template: PairTemplate, query: str, documents: list[str], truncate: bool, side: str, bulk: bool
    ) -> Tokenized:
        """(query, document) pairs with the query tokenized once, not once per document: each
        pair is assembled from ids with the tokenizer's own pair template and truncation
        (longest_first, see pair_lengths), which tests check against tokenizer.encode(q, d)."""
        plain = functools.partial(ids_only(self.untruncated), add_special_tokens=False)
        (query_ids,) = await self._in_chunks(plain, [query], bulk, _ids)
        doc_ids = await self._in_chunks(plain, documents, bulk, _ids)
        budget = self.max_length - template.added
        ids, types = [], []
        if not truncate:
            too_long = [i for i, doc in enumerate(doc_ids) if len(query_ids) + len(doc) > budget]
            if too_long:
                raise InputTooLong(too_long, self.max_length)
        for doc in doc_ids:
            n_query, n_doc = pair_lengths(len(query_ids), len(doc), budget)
            pair_ids, pair_types = template.assemble(_cut(query_ids, n_query, side), _cut(doc, n_doc, side))
            ids.append(pair_ids)
            types.append(pair_types)
        return Tokenized(ids, types, sum(len(i) for i in ids))

    @functools.cached_property
    def pair_template(self) -> PairTemplate | None:
        """How the tokenizer lays out a pair, read off probes; None when the layout is not the plain
        prefix + A + middle + B + suffix or the truncation is not longest_first (then pairs take
        the tokenizer's own path)."""
        truncation = self._by_side["right"].truncation or {}
        if truncation.get("strategy", "longest_first") != "longest_first" or truncation.get("stride", 0):
            return None
        template = PairTemplate.read(self.untruncated)
        if template is None:
            return None
        for a, b in (("hello world", "b c d e"), ("x", "a much longer second text, with punctuation")):
            want = self.untruncated.encode(a, b)
            got = template.assemble(
                self.untruncated.encode(a, add_special_tokens=False).ids,
                self.untruncated.encode(b, add_special_tokens=False).ids,
            )
            if got[0].tolist() != want.ids or got[1].tolist() != want.type_ids:
                return None
        return template

    async def tokenize(self, texts: list[str], add_special_tokens: bool) -> list[Encoding]:
        return await self._in_chunks(self.untruncated.encode_batch, texts, False, add_special_tokens=add_special_tokens)


@dataclass(slots=True)
class _Row:
    """One input as a tokenizer pool thread read it off its Encoding."""

    ids: np.ndarray  # int32
    type_ids: np.ndarray | None  # int32, for pairs
    too_long: bool  # over the model's maximum, with truncation off


def _encode_and_read(encode_batch, chunk: list, read, kwargs: dict) -> list:
    return read(encode_batch(chunk, **kwargs))


def _arrays(encodings: list[Encoding], pairs: bool, truncate: bool) -> list[_Row]:
    return [
        _Row(
            np.asarray(e.ids, dtype=np.int32),
            np.asarray(e.type_ids, dtype=np.int32) if pairs else None,
            not truncate and bool(e.overflowing),  # the tokenizer truncates: what it cut overflows
        )
        for e in encodings
    ]


def _ids(encodings: list[Encoding]) -> list[list[int]]:
    return [e.ids for e in encodings]


def _collect(rows: list[_Row], truncate: bool, pairs: bool, max_length: int) -> Tokenized:
    if not truncate:
        too_long = [i for i, row in enumerate(rows) if row.too_long]
        if too_long:
            raise InputTooLong(too_long, max_length)
    ids = [row.ids for row in rows]
    types = [cast("np.ndarray", row.type_ids) for row in rows] if pairs else None
    return Tokenized(ids, types, sum(len(i) for i in ids))


def tokenize_on_the_calling_thread() -> None:
    """Hugging Face tokenizers spreads each encode_batch over threads of its own (rayon's, one per
    core), made by whichever thread tokenizes first: the event loop, with a live query, at the
    frontend's priority. The tokenizer pool's nice value (registry._niced_pool) then held for the
    pool's thread only, waiting on them: a 2,048-input call's tokenizing (~0.3 s of CPU) took both
    cores ahead of the workers, and other callers' queries computing there waited for it (p99 38-45
    ms in the call's first 0.5 s, against 10-12 ms idle: `python -m encoderd.bench.fair`, 2-vCPU
    Xeon). Off, every call computes on the thread that makes it: the niced pool, or the loop for
    a live query. The library reads the variable at each call."""
    os.environ["TOKENIZERS_PARALLELISM"] = "false"


def ids_only(tokenizer: Tokenizer):
    """`encode_batch` without character offsets, which nothing served reads (the Tokenize RPC,
    which returns them, keeps `encode_batch`): the same ids, type ids and overflow. The bench corpus
    (2,048 texts, MiniLM, 64 a call) on Zen 5: 0.28 s of CPU against 0.34 s. `encode_batch_fast`
    came in tokenizers 0.21; older ones compute the offsets."""
    return getattr(tokenizer, "encode_batch_fast", tokenizer.encode_batch)


CHUNK_INPUTS = 64  # inputs per tokenizer call ...
CHUNK_CHARS = 256 * 1024  # ... and characters (a few tens of ms of one core)
# A request's chunks handed to the pool at once: two, so a big request is tokenized on both of the
# pool's threads (its workers wait for its first batch until then: 310-330 ms of a 2,048-input call on
# one thread, 165-180 ms on two; python -m encoderd.bench.bigcall, 2-vCPU Xeon with AMX). One while live
# queries are around: on two cores, two tokenizing threads took the core their compute runs on, and
# queries sent as a big call started waited for it (bench.fair: their p99 2.2-2.4x idle, 1.5-1.7x with one).
CHUNKS_IN_FLIGHT = 2
# A request this small (a live query or two) is tokenized on the event loop: encoding it takes
# less CPU than handing it to the pool and waking the loop again, and blocks the loop for
# microseconds. A 6-word query on Zen 5: 34 us of CPU inline, 122 us through the pool; the
# server's frontend CPU per sequential short query went from 3.9-4.5 to 3.7 ms.
INLINE_INPUTS = 4
INLINE_CHARS = 1024


def _size(item: str | tuple[str | None, str]) -> int:
    return sum(len(t) for t in item if t) if isinstance(item, tuple) else len(item)


def _chunks(batch: list):
    start, chars = 0, 0
    for i, item in enumerate(batch):
        size = _size(item)
        if i > start and (i - start >= CHUNK_INPUTS or chars + size > CHUNK_CHARS):
            yield batch[start:i]
            start, chars = i, 0
        chars += size
    if start < len(batch):
        yield batch[start:]


def pair_lengths(n1: int, n2: int, budget: int) -> tuple[int, int]:
    """Tokens kept of a pair's two sequences under `budget` (max_length less the template's
    special tokens): Hugging Face tokenizers' longest_first, reproduced exactly (both sequences
    halve the budget, or only the longer one is cut)."""
    if n1 + n2 <= budget:
        return n1, n2
    swap = n1 > n2
    short, long_ = (n2, n1) if swap else (n1, n2)
    long_ = short if short > budget else max(short, budget - short)
    if short + long_ > budget:
        short = budget // 2
        long_ = short + budget % 2
    return (long_, short) if swap else (short, long_)


def _cut(ids: list[int], n: int, side: str) -> list[int]:
    return ids[:n] if side == "right" else ids[len(ids) - n :]


@dataclass(frozen=True)
class PairTemplate:
    """prefix + A + middle + B + suffix, each special run with its type ids; A and B's own types."""

    prefix: tuple[list[int], list[int]]
    middle: tuple[list[int], list[int]]
    suffix: tuple[list[int], list[int]]
    type_a: int
    type_b: int

    @property
    def added(self) -> int:
        return len(self.prefix[0]) + len(self.middle[0]) + len(self.suffix[0])

    @classmethod
    def read(cls, tokenizer: Tokenizer) -> PairTemplate | None:
        a = tokenizer.encode("a", add_special_tokens=False).ids
        b = tokenizer.encode("b", add_special_tokens=False).ids
        full = tokenizer.encode("a", "b")
        ids, types = full.ids, full.type_ids
        if len(a) != 1 or len(b) != 1 or a == b or ids.count(a[0]) != 1 or ids.count(b[0]) != 1:
            return None
        i, j = ids.index(a[0]), ids.index(b[0])
        if i > j:
            return None
        return cls(
            (ids[:i], types[:i]), (ids[i + 1 : j], types[i + 1 : j]), (ids[j + 1 :], types[j + 1 :]), types[i], types[j]
        )

    def assemble(self, a: list[int], b: list[int]) -> tuple[np.ndarray, np.ndarray]:
        ids = np.asarray(self.prefix[0] + a + self.middle[0] + b + self.suffix[0], dtype=np.int32)
        types = np.asarray(
            self.prefix[1] + [self.type_a] * len(a) + self.middle[1] + [self.type_b] * len(b) + self.suffix[1],
            dtype=np.int32,
        )
        return ids, types
