"""Rerank pairs assembled from ids (the query tokenized once) must equal what the tokenizer's
own pair encoding gives, truncation (longest_first, both directions) included."""

from __future__ import annotations

import asyncio
import random
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
from tokenizers import Tokenizer

from encoderd.server.base.errors import InvalidInput
from encoderd.server.models.tokenization import CHUNK_INPUTS, CHUNKS_IN_FLIGHT, ModelTokenizer, pair_lengths
from encoderd.workers.contract.model_files import default_model_path
from encoderd.workers.contract.tokenizer import load_tokenizer

WORDS = (
    "the cat sat on a mat while quantum chromodynamics unbelievably reorganised ĉƒ 東京 "
    "emoji 😀 don't re-run it, (x+y)=z"
).split()


def _text(rnd: random.Random, words: int) -> str:
    return " ".join(rnd.choice(WORDS) for _ in range(words))


@pytest.fixture(scope="module")
def pool():
    with ThreadPoolExecutor(1) as executor:
        yield executor


@pytest.mark.parametrize("max_length", [16, 128, 512])
@pytest.mark.parametrize("which", ["minilm", "reranker"])
def test_pairs_match_the_tokenizers_pair_encoding(which, max_length, pool, reranker_path):
    path = default_model_path() if which == "minilm" else reranker_path
    tokenizer = ModelTokenizer(load_tokenizer(path), max_length, pool)
    assert tokenizer.pair_template is not None  # else the old path ran and this test proves nothing
    rnd = random.Random(max_length)
    for side in ("right", "left"):
        reference = Tokenizer.from_file(f"{path}/tokenizer.json")
        reference.no_padding()  # the file pads to 128; encoderd never pads here
        reference.enable_truncation(max_length, direction=side)
        for _ in range(4):
            query = _text(rnd, rnd.choice([1, 5, 40, 300, 900]))
            documents = [_text(rnd, rnd.choice([1, 3, 30, 200, 700])) for _ in range(8)]
            got = asyncio.run(tokenizer.encode(documents, side=side, pairs_with=query))
            for doc, ids, types in zip(documents, got.ids, got.type_ids, strict=True):
                want = reference.encode(query, doc)
                assert ids.tolist() == want.ids and types.tolist() == want.type_ids


def test_over_long_pairs_without_truncation_are_refused(pool):
    tokenizer = ModelTokenizer(load_tokenizer(default_model_path()), 32, pool)
    with pytest.raises(InvalidInput, match="truncation is off"):
        asyncio.run(tokenizer.encode(["short", "a b " * 40], truncate=False, pairs_with="query"))
    fits = asyncio.run(tokenizer.encode(["short"], truncate=False, pairs_with="query"))
    assert len(fits.ids[0]) == 5  # [CLS] query [SEP] short [SEP]


def test_pair_lengths_cases():
    assert pair_lengths(3, 4, 10) == (3, 4)  # fits
    assert pair_lengths(2, 20, 10) == (2, 8)  # only the longer is cut
    assert pair_lengths(20, 2, 10) == (8, 2)
    assert pair_lengths(20, 30, 11) == (5, 6)  # both halve the budget
    assert pair_lengths(30, 20, 11) == (6, 5)


class _RunCountingPool(ThreadPoolExecutor):
    """Counts what was handed to the pool and what of it ran."""

    def __init__(self, threads: int):
        super().__init__(threads)
        self.submitted = self.ran = 0

    def submit(self, fn, /, *args, **kwargs):
        self.submitted += 1

        def counted():
            self.ran += 1
            return fn(*args, **kwargs)

        return super().submit(counted)


def test_a_live_query_is_tokenized_on_the_loop_and_the_rest_in_the_pool():
    """The pool hand-off costs more CPU than a short query's encoding; larger or bulk requests
    still go to the pool (the loop stays free, cancellation stops between chunks)."""
    with _RunCountingPool(1) as counting:
        tokenizer = ModelTokenizer(load_tokenizer(default_model_path()), 256, counting)
        reference = Tokenizer.from_file(f"{default_model_path()}/tokenizer.json")
        reference.no_padding()
        reference.no_truncation()

        def ids(texts, **kwargs):
            return [list(i) for i in asyncio.run(tokenizer.encode(texts, **kwargs)).ids]

        query = "what is a cross encoder"
        assert ids([query]) == [reference.encode(query).ids] and counting.submitted == 0
        assert ids([query], pairs_with="a query") == [reference.encode("a query", query).ids]
        assert counting.submitted == 0
        assert ids([query], bulk=True) == [reference.encode(query).ids] and counting.submitted == 1
        long_text = "word " * 400  # over INLINE_CHARS
        assert ids([long_text])[0][:5] == reference.encode(long_text).ids[:5] and counting.submitted == 2
        assert len(ids([query] * 8)) == 8 and counting.submitted == 3  # over INLINE_INPUTS


def test_a_big_request_is_tokenized_two_chunks_at_a_time_in_order():
    """Two chunks in the pool at once (CHUNKS_IN_FLIGHT): on a pool of two threads they may finish in
    either order, and the ids still come back in the request's order."""
    assert CHUNKS_IN_FLIGHT == 2
    reference = Tokenizer.from_file(f"{default_model_path()}/tokenizer.json")
    reference.no_padding()
    reference.enable_truncation(64)
    rnd = random.Random(11)
    texts = [_text(rnd, rnd.randrange(1, 120)) for _ in range(5 * CHUNK_INPUTS + 3)]
    with _RunCountingPool(2) as two:
        tokenizer = ModelTokenizer(load_tokenizer(default_model_path()), 64, two)
        got = asyncio.run(tokenizer.encode(texts))
    assert [list(ids) for ids in got.ids] == [e.ids for e in reference.encode_batch(texts)]
    assert two.submitted == two.ran == 6


def test_beside_live_queries_a_big_request_has_one_chunk_in_the_pool_at_a_time():
    """While live queries are around (serving_queries), a big request's chunks go one at a time: the
    pool's other thread, and the core, stay for their compute. The order is explicit: the pool's one
    thread is held until the request has handed over what it would."""

    async def scenario(pool: _RunCountingPool, live: bool) -> int:
        release = threading.Event()
        blocker = asyncio.get_running_loop().run_in_executor(pool, release.wait)
        tokenizer = ModelTokenizer(load_tokenizer(default_model_path()), 64, pool, serving_queries=lambda: live)
        request = asyncio.create_task(tokenizer.encode(["a few words here"] * (4 * CHUNK_INPUTS)))
        for _ in range(10):  # the request's task runs to its first await (its first chunk) and waits there
            await asyncio.sleep(0)
        handed = pool.submitted - 1
        release.set()
        await blocker
        assert len((await request).ids) == 4 * CHUNK_INPUTS
        return handed

    for live, handed in ((True, 1), (False, CHUNKS_IN_FLIGHT)):
        with _RunCountingPool(1) as one:
            assert asyncio.run(scenario(one, live)) == handed
        assert one.submitted == one.ran == 1 + 4  # the blocker, then the request's four chunks


def test_a_cancelled_request_never_starts_its_queued_chunks():
    """A request cancelled while its chunks wait for the pool: the ones not yet running are dropped,
    and at most CHUNKS_IN_FLIGHT of them were ever handed to the pool. The order is explicit: the
    pool's one thread is held by another task until the request has been cancelled."""

    async def scenario(pool: _RunCountingPool) -> None:
        release = threading.Event()
        blocker = asyncio.get_running_loop().run_in_executor(pool, release.wait)
        tokenizer = ModelTokenizer(load_tokenizer(default_model_path()), 64, pool)
        request = asyncio.create_task(tokenizer.encode(["a few words here"] * (4 * CHUNK_INPUTS)))
        for _ in range(10):  # the request's task runs to its first await (its first chunk) and waits there
            await asyncio.sleep(0)
        assert pool.submitted == 1 + CHUNKS_IN_FLIGHT  # the blocker, then the request's first two chunks
        request.cancel()
        with pytest.raises(asyncio.CancelledError):
            await request
        release.set()
        await blocker

    with _RunCountingPool(1) as one:
        asyncio.run(scenario(one))
    assert one.submitted == 1 + CHUNKS_IN_FLIGHT and one.ran == 1  # the blocker alone ran


@pytest.mark.parametrize("side", ["right", "left"])
def test_texts_are_the_tokenizers_own_encoding_without_its_offsets(side, pool):
    """The text path encodes without character offsets (tokenization.ids_only): the same ids,
    truncated on the side asked, and an over-long input still refused with truncation off."""
    tokenizer = ModelTokenizer(load_tokenizer(default_model_path()), 32, pool)
    reference = Tokenizer.from_file(f"{default_model_path()}/tokenizer.json")
    reference.no_padding()
    reference.enable_truncation(32, direction=side)
    rnd = random.Random(7)
    texts = [_text(rnd, rnd.randrange(1, 60)) for _ in range(200)]
    got = asyncio.run(tokenizer.encode(texts, side=side, bulk=True))
    assert [list(ids) for ids in got.ids] == [e.ids for e in reference.encode_batch(texts)]
    assert any(e.overflowing for e in reference.encode_batch(texts))  # so some are refused with truncation off
    with pytest.raises(InvalidInput, match="truncation is off"):
        asyncio.run(tokenizer.encode(texts, truncate=False))
