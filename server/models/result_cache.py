"""In-flight deduplication and an optional LRU of recent results, per model.

Identical inputs (same model, same options that shape the raw output, same
text) are computed once: while one is queued or computing, later copies wait
for it; with a cache, recent results are served without compute at all.
Post-processing (normalize, dimensions, output dtype) happens after, per
request, so it is not part of the key.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Iterable, Sequence
from typing import Literal, overload

import numpy as np

from ..base import metrics
from ..base.errors import Unavailable

# (rows, token counts) for the given input indices
ComputeFn = Callable[[list[int]], Awaitable[tuple[np.ndarray, np.ndarray]]]


class TokenCount(int):
    """A request's token total (what usage reports) that keeps each input's own count, for answers
    given per input (EmbedStream's `prompt_tokens`)."""

    per_input: tuple[int, ...]

    def __new__(cls, per_input):
        total = super().__new__(cls, sum(per_input))
        total.per_input = tuple(int(n) for n in per_input)
        return total


class _OwnerGone(Exception):
    """The request computing a shared input went away or failed; waiters compute it themselves."""


def result_key(*parts: str) -> bytes:
    return _hashed(hashlib.blake2b(digest_size=20), parts).digest()


def result_keys(common: Sequence[str], each: Iterable[Sequence[str]]) -> list[bytes]:
    """result_key(*common, *parts) for each `parts`, `common` hashed once: a rerank's query was
    hashed again for every document (1,000 documents and a 200,000-character query: 0.2 s of the
    event loop, other callers' queries waiting)."""
    start = _hashed(hashlib.blake2b(digest_size=20), common)
    return [_hashed(start.copy(), parts).digest() for parts in each]


def _hashed(digest, parts: Iterable[str]):
    for part in parts:  # each part's length first: ("ab", "c") and ("a", "bc") differ
        data = part.encode("utf-8", "surrogatepass")
        digest.update(len(data).to_bytes(8, "little"))
        digest.update(data)
    return digest


class ResultCache:
    def __init__(self, model: str, max_entries: int = 0):
        self.model = model
        self.max_entries = max_entries
        self._inflight: dict[bytes, asyncio.Future] = {}
        self._lru: OrderedDict[bytes, tuple[np.ndarray, int]] = OrderedDict()

    @overload
    async def resolve(
        self, keys: list[bytes], compute: ComputeFn, stack: Literal[True] = True, remember: bool = True
    ) -> tuple[np.ndarray, TokenCount]: ...

    @overload
    async def resolve(
        self, keys: list[bytes], compute: ComputeFn, stack: bool, remember: bool = True
    ) -> tuple[np.ndarray | list, TokenCount]: ...

    async def resolve(
        self, keys: list[bytes], compute: ComputeFn, stack: bool = True, remember: bool = True
    ) -> tuple[np.ndarray | list, TokenCount]:
        """Rows for every key, in order, and their token counts; `stack=False`
        leaves ragged rows (multi-vector, sparse) as a list. `remember=False`: shared while in
        flight, never kept in the LRU (outputs too large for an LRU sized in entries)."""
        rows: list = [None] * len(keys)
        tokens = [0] * len(keys)
        unresolved = list(range(len(keys)))
        whole = []  # each round's compute output, where that round computed every one of its inputs itself
        while unresolved:
            unresolved, out = await self._resolve_round(keys, unresolved, rows, tokens, compute, remember)
            if out is not None:
                whole.append(out)
        if stack and len(whole) == 1 and len(whole[0]) == len(keys) and isinstance(whole[0], np.ndarray):
            # One compute of every input, in order (no repeat, cache hit or shared input): its rows are
            # the answer as they are. Stacking 2,048 row views again held the event loop ~5 ms. Read-only:
            # the LRU and the requests that shared an input hold views of the same rows.
            whole[0].flags.writeable = False
            return whole[0], TokenCount(tokens)
        return (np.stack(rows) if stack else rows), TokenCount(tokens)

    async def _resolve_round(self, keys, indices, rows, tokens, compute, remember: bool):
        """One pass over `indices`: fills `rows` from the LRU, the inputs in flight and its own compute.
        Returns the indices to retry (their owner failed) and the compute's output where this round
        computed all of `indices` itself, else None."""
        owned: dict[bytes, list[int]] = {}
        waiting: dict[bytes, tuple[asyncio.Future, list[int]]] = {}
        for i in indices:
            key = keys[i]
            cached = self._lru_get(key)
            if cached is not None:
                rows[i], tokens[i] = cached
                metrics.series(metrics.CACHE, self.model, "hit").inc()
            elif key in owned:
                owned[key].append(i)  # a repeat within this request
            elif key in waiting:
                waiting[key][1].append(i)
            elif key in self._inflight:
                waiting[key] = (self._inflight[key], [i])
                metrics.series(metrics.CACHE, self.model, "inflight_hit").inc()
            else:
                owned[key] = [i]
                if self.max_entries:
                    metrics.series(metrics.CACHE, self.model, "miss").inc()
        whole = None
        if owned:
            out = await self._compute_owned(owned, rows, tokens, compute, remember)
            if len(owned) == len(indices):
                whole = out
        retry = []
        for future, where in waiting.values():
            try:
                row, count = await asyncio.shield(future)
            except _OwnerGone:
                retry += where
                continue
            for i in where:
                rows[i], tokens[i] = row, count
        return retry, whole

    async def _compute_owned(self, owned: dict[bytes, list[int]], rows, tokens, compute, remember: bool):
        """Compute the inputs first named by `owned`'s keys; returns the compute's rows (theirs, in order)."""
        loop = asyncio.get_running_loop()
        futures = {key: loop.create_future() for key in owned}
        self._inflight.update(futures)
        first = [where[0] for where in owned.values()]
        try:
            out, counts = await compute(first)
        except BaseException as exc:
            # The owner's failure is its own (its request's limits, its admission, its other inputs),
            # except a worker's death, which would fail the waiters too: they compute theirs themselves.
            error = exc if isinstance(exc, Unavailable) else _OwnerGone()
            for future in futures.values():
                future.set_exception(error)
                # Nobody may be waiting: don't warn. Added here, not to every future: a callback each
                # is a call_soon each on success, 2,048 on the event loop at a big call's end.
                future.add_done_callback(_consume)
            raise
        finally:
            for key in owned:
                self._inflight.pop(key, None)
        for j, (key, where) in enumerate(owned.items()):
            result = (out[j], int(counts[j]))
            futures[key].set_result(result)
            if remember:
                self._lru_put(key, result)
            for i in where:
                rows[i], tokens[i] = result
        return out

    def _lru_get(self, key: bytes):
        if not self.max_entries:
            return None
        hit = self._lru.get(key)
        if hit is not None:
            self._lru.move_to_end(key)
        return hit

    def _lru_put(self, key: bytes, value) -> None:
        if not self.max_entries:
            return
        self._lru[key] = value
        self._lru.move_to_end(key)
        while len(self._lru) > self.max_entries:
            self._lru.popitem(last=False)


def _consume(future: asyncio.Future) -> None:
    if not future.cancelled():
        future.exception()
