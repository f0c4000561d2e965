"""Token states (TEI's /embed_all on a plain embedder): batches never mix them with pooled
work, the flag crosses the wire and survives splitting, and padded hidden states become
each input's real tokens only."""

from collections import deque

import numpy as np
import pytest

from encoderd.server.scheduling.batching import BatchLimits, MediaItem, WorkItem, pack, take_batch
from encoderd.workers.backends.base import token_states, wants_token_states
from encoderd.workers.contract import protocol
from encoderd.workers.contract.model_spec import ModelKind, ModelSpec
from encoderd.workers.contract.protocol import Ragged, TokenBatch
from encoderd.workers.st_modules import SentenceModules


class Req:
    done = False


def item(length: int, states: bool, index: int = 0) -> WorkItem:
    return WorkItem(np.arange(length, dtype=np.int32), None, Req(), index, token_states=states)


def test_pooled_and_token_state_items_never_share_a_batch():
    # Arrival order: pooled, states, pooled, states, ... of equal lengths (one batch if mixed).
    queue = deque(item(5, i % 2 == 1, i) for i in range(8))
    limits = BatchLimits(max_batch_size=64, max_batch_tokens=10_000)
    batches = []
    while batch := take_batch(queue, limits):
        batches.append(batch)
    assert [[i.token_states for i in b] for b in batches] == [[False] * 4, [True] * 4]
    assert [i.index for i in batches[0]] == [0, 2, 4, 6]  # the oldest input's output goes first
    assert [pack(b, 0).token_states for b in batches] == [False, True]


def test_the_oldest_input_decides_and_the_others_keep_their_order():
    queue = deque([item(9, True, 0), item(3, False, 1), item(4, True, 2), item(2, False, 3)])
    batch = take_batch(queue, BatchLimits())
    assert [i.index for i in batch] == [2, 0] and [i.index for i in queue] == [1, 3]


def test_media_items_are_their_own_output():
    text = item(4, False)
    image = MediaItem(np.zeros(0, np.int32), None, Req(), 1, features=np.zeros(3, np.float32), cost=4)
    queue = deque([image, text])
    assert take_batch(queue, BatchLimits(mixed_modalities=True)) == [image]
    assert text.output == ("text", False) and image.output == ("image", False)


@pytest.mark.parametrize("states", [False, True])
def test_the_flag_crosses_the_wire_and_survives_a_split(states):
    batch = TokenBatch.from_sequences(7, [np.arange(3), np.arange(5), np.arange(2)])
    batch.token_states, batch.urgent = states, True
    frames = [bytes(memoryview(f)) for f in protocol.encode_batch(batch)]
    _, header, rest = protocol.decode(frames)
    got = protocol.batch_from_frames(header, rest)
    assert got.token_states is states and got.urgent
    first, second = got.split(1)
    assert first.token_states is states and second.token_states is states


def test_padded_hidden_states_keep_each_inputs_real_tokens():
    batch = TokenBatch.from_sequences(0, [np.arange(3), np.arange(1), np.arange(2)])
    hidden = np.arange(3 * 3 * 2, dtype=np.float64).reshape(3, 3, 2)  # (n, longest, d), right-padded
    rows = token_states(hidden, batch)
    assert rows.values.dtype == np.float32 and rows.cu_seqlens.tolist() == [0, 3, 4, 6]
    split = rows.split()
    np.testing.assert_array_equal(split[0], hidden[0])
    np.testing.assert_array_equal(split[1], hidden[1, :1])
    np.testing.assert_array_equal(split[2], hidden[2, :2])
    # Sent as a ragged result and read back by the frontend: one (tokens, d) array per input.
    frames = [bytes(memoryview(f)) if not isinstance(f, bytes) else f for f in protocol.encode_result(4, rows)]
    _, header, rest = protocol.decode(frames)
    back = protocol.result_array(header, rest)
    assert [r.shape for r in back] == [(3, 2), (1, 2), (2, 2)]


def _spec(kind: ModelKind) -> ModelSpec:
    return ModelSpec(name="m", path="/nowhere", kind=kind, max_length=16)


def test_only_embedding_models_give_token_states():
    batch = TokenBatch.from_sequences(0, [np.arange(3)])
    assert not wants_token_states(_spec(ModelKind.CLASSIFIER), batch)
    batch.token_states = True
    assert wants_token_states(_spec(ModelKind.EMBEDDING), batch)
    with pytest.raises(ValueError, match="embedding model"):
        wants_token_states(_spec(ModelKind.RERANKER), batch)


def test_dense_modules_leave_token_states_alone():
    modules = SentenceModules(_spec(ModelKind.EMBEDDING))
    modules.layers = [lambda x: x * 0]  # a Dense layer: it must not touch token states
    rows = Ragged(np.ones((3, 2), np.float32), np.array([0, 3], np.int32))
    assert modules(rows) is rows


def test_token_states_are_shared_in_flight_but_not_kept():
    import asyncio

    from encoderd.server.models.result_cache import ResultCache

    cache, calls = ResultCache("m", max_entries=8), []

    async def compute(indices):
        calls.append(len(indices))
        await asyncio.sleep(0.01)
        return [np.ones((2 + i, 4), np.float32) for i in indices], np.array([2 + i for i in indices])

    async def main():
        keys = [b"a", b"b", b"a"]
        together = await asyncio.gather(*(cache.resolve(keys, compute, stack=False, remember=False) for _ in range(2)))
        assert calls == [2]  # the repeat and the concurrent request waited for the one computation
        assert [r.shape for r in together[1][0]] == [(2, 4), (3, 4), (2, 4)]
        await cache.resolve(keys, compute, stack=False, remember=False)
        assert calls == [2, 2]  # nothing was kept

    asyncio.run(main())
