"""In-flight sharing in the result cache (server/models/result_cache.py): a waiter gets the owner's
result, never the owner's own request error; a dead worker fails both."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from encoderd.server.base.errors import InvalidInput, Overloaded, Unavailable
from encoderd.server.models.result_cache import ResultCache, result_key, result_keys


def _rows(indices: list[int]):
    return np.ones((len(indices), 2), np.float32), np.full(len(indices), 7)


async def _owner_fails_while_a_waiter_waits(error: Exception):
    """The owner holds keys a, b and fails with `error`; a waiter asks for b meanwhile."""
    cache, waiter_computed = ResultCache("m"), []
    owner_started, release = asyncio.Event(), asyncio.Event()

    async def owner_compute(indices):
        owner_started.set()
        await release.wait()
        raise error

    async def waiter_compute(indices):
        waiter_computed.append(len(indices))
        return _rows(indices)

    owner = asyncio.create_task(cache.resolve([b"a", b"b"], owner_compute))
    await owner_started.wait()
    waiter = asyncio.create_task(cache.resolve([b"b"], waiter_compute))
    await asyncio.sleep(0.01)  # the waiter found b in flight
    release.set()
    with pytest.raises(type(error)):
        await owner
    return waiter, waiter_computed


@pytest.mark.parametrize(
    "error",
    [InvalidInput("the request holds 524288 tokens; the limit is 262144 per request"), Overloaded("queue full")],
)
async def test_a_waiter_computes_its_input_itself_when_the_owners_request_fails(error):
    waiter, computed = await _owner_fails_while_a_waiter_waits(error)
    rows, tokens = await waiter
    assert computed == [1] and rows.shape == (1, 2) and tokens == 7 and tokens.per_input == (7,)


async def test_a_dead_worker_fails_the_waiters_too():
    waiter, computed = await _owner_fails_while_a_waiter_waits(Unavailable("the worker died"))
    with pytest.raises(Unavailable):
        await waiter
    assert computed == []


def _numbered_rows(indices: list[int]):
    """Row i holds the key's own number: where an answer's row came from is visible."""
    return np.array([[i, i] for i in indices], np.float32), np.full(len(indices), 7)


async def test_an_answer_computed_whole_is_the_computes_rows_read_only():
    """Every input new and distinct (a big call's usual case): the compute's rows are the answer, not
    stacked again row by row on the event loop; read-only, as the LRU keeps views of them."""
    cache, outputs = ResultCache("m", max_entries=10), []

    async def compute(indices):
        rows, counts = _numbered_rows(indices)
        outputs.append(rows)
        return rows, counts

    rows, _ = await cache.resolve([b"a", b"b", b"c"], compute)
    assert rows is outputs[0] and not rows.flags.writeable
    with pytest.raises(ValueError):
        rows[0, 0] = 5  # a caller that changed the answer in place would change the cached rows
    again, _ = await cache.resolve([b"c", b"d", b"a", b"d"], compute)  # two cached, one repeated
    assert again.tolist() == [[2, 2], [1, 1], [0, 0], [1, 1]] and again is not outputs[1]
    assert outputs[1].tolist() == [[1, 1]]  # only d computed, once (its index in that request: 1)


def test_keys_with_a_common_start_are_result_keys_of_the_whole():
    """result_keys hashes the common parts once; each key is result_key of common + its own parts,
    and the parts' boundaries count (("ab", "c") is not ("a", "bc"))."""
    common = ("reranker", "right", "True", "a long query " * 1000)
    each = [("doc one",), ("",), ("é\ud800 surrogate",), ("a", "bc"), ("ab", "c")]
    assert result_keys(common, each) == [result_key(*common, *parts) for parts in each]
    assert len(set(result_keys(common, each))) == len(each)
    assert result_keys((), [("x",)]) == [result_key("x")]


def test_request_keys_keep_their_inputs_order_across_kinds():
    """compute._keys: texts and pairs keyed by what shapes their output, token ids and media by theirs,
    each at its own place."""
    from encoderd.server.models.compute import POOLED as output
    from encoderd.server.models.compute import TokenIds, _keys, _Media

    ids = TokenIds(np.array([101, 7, 102], dtype=np.int32))
    payloads: list = ["a text", ids, ("left", "right"), _Media("image", b"\x89PNG"), "another"]
    got = _keys(output, payloads, True, "right", "the query")
    assert got[0] == result_key("embed", "right", "True", "the query", "a text")
    assert got[2] == result_key("embed", "right", "True", "the query", "left", "right")
    assert got[4] == result_key("embed", "right", "True", "the query", "another")
    assert got[1] == result_key("embed", "ids", ids.ids.tobytes().hex())
    assert got[3] != got[0] and len(set(got)) == len(got)
    assert _keys(output, ["a text"], False, "right", None) != _keys(output, ["a text"], True, "right", None)
