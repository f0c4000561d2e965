"""Fair sharing of the replicas between a big request and other callers' queries (issue 42, item 3):
the order is made explicit with held stand-in workers, never by timing."""

from __future__ import annotations

import asyncio
import contextvars
import os
import threading
from collections import deque

import numpy as np
import pytest
from support.held_workers import HeldWorker, release_and_stop, request, until

from encoderd.server.base.config import ServerConfig
from encoderd.server.models import request_options
from encoderd.server.models.registry import ModelRegistry
from encoderd.server.scheduling.batching import BatchLimits, WorkItem, interleave_callers
from encoderd.server.scheduling.scheduler import CALLER, ModelScheduler, Priority


@pytest.fixture
async def two_replicas():
    workers = [HeldWorker("a"), HeldWorker("b")]
    scheduler = ModelScheduler(
        "m", workers, BatchLimits(max_batch_size=4, max_batch_tokens=1000), batch_delay=0, split_large=True
    )
    scheduler.start()
    yield scheduler, workers
    await release_and_stop(scheduler, workers)


def firsts(worker: HeldWorker) -> list[list[int]]:
    return [list(b.input_ids[b.cu_seqlens[:-1]]) for b in worker.batches]


async def test_a_query_goes_to_the_replica_whose_work_it_preempts(two_replicas):
    """A query runs at once beside bulk-lane work (the worker's urgent lane, or the pauses of its
    steps) but waits for another query's batch: it goes where only bulk-lane work computes, even
    where more tokens are in flight."""
    scheduler, (a, b) = two_replicas
    bulk_pending, bulk = request([500], length=600)  # one input: not cut for the idle replicas
    streamed = asyncio.create_task(scheduler.run(bulk, bulk_pending, Priority.BULK))
    await until(lambda: a.batches, "the bulk batch reached the first replica")
    first_pending, first = request([1])
    first_query = asyncio.create_task(scheduler.run(first, first_pending))
    await until(lambda: b.batches, "the first query went to the idle replica")
    second_pending, second = request([2])
    second_query = asyncio.create_task(scheduler.run(second, second_pending))
    await until(lambda: len(a.batches) == 2, "the second query went beside the bulk batch")
    assert firsts(a) == [[500], [2]] and a.batches[1].urgent
    assert firsts(b) == [[1]]  # not behind the first query (the fewest tokens: 10 against 600)
    for worker in (a, b):
        worker.release.set()
    assert (await second_query)[0, 0] == 2
    await asyncio.gather(streamed, first_query)


async def test_a_query_is_sent_at_once_while_a_big_request_holds_both_replicas(two_replicas):
    """A 2,048-input call keeps each replica's bulk slot busy; a query arriving then is sent at once
    (no part of the big call is urgent work it would queue behind), and the big call's rest waits."""
    scheduler, (a, b) = two_replicas
    big_pending, big = request(range(1000, 1040))  # 10 batches of 4: split
    big_call = asyncio.create_task(scheduler.run(big, big_pending))
    await until(lambda: len(a.batches) == len(b.batches) == 2, "a piece computing and one queued, each replica")
    assert not any(batch.urgent for batch in a.batches + b.batches)
    query_pending, query = request([7])
    query_task = asyncio.create_task(scheduler.run(query, query_pending))
    await until(lambda: len(a.batches) + len(b.batches) == 5, "the query was sent")
    sent = [batch for batch in a.batches + b.batches if batch.urgent]
    assert len(sent) == 1 and list(sent[0].input_ids) == [7] * 10
    for worker in (a, b):
        worker.release.set()
    assert (await query_task)[0, 0] == 7
    assert list((await big_call)[:, 0]) == list(range(1000, 1040))


async def test_a_big_request_keeps_a_piece_queued_at_each_worker_while_queries_come(two_replicas):
    """Beside a query in flight (live work, which stops bulk prefetching) each replica still takes a
    second piece of a big call, queued in its worker behind the piece it computes (SPLIT_PREFETCH):
    the worker's bulk lane starts the next as the last ends, not a round trip later. The replica
    running the query takes one too (a queued piece holds no slot), and the last piece waits in the
    queue for whichever replica frees first."""
    scheduler, (a, b) = two_replicas
    query_pending, query = request([7])
    query_task = asyncio.create_task(scheduler.run(query, query_pending))
    await until(lambda: a.batches or b.batches, "the query was sent")
    big_pending, big = request(range(1000, 1020))  # 5 batches of 4: split
    big_call = asyncio.create_task(scheduler.run(big, big_pending))
    pieces = lambda w: [batch for batch in w.batches if not batch.urgent]  # noqa: E731
    await until(lambda: len(pieces(a)) == len(pieces(b)) == 2, "two pieces at each replica")
    for _ in range(50):  # the scheduler sends all it would in one pass: no third piece comes
        await asyncio.sleep(0)
    assert len(pieces(a)) == len(pieces(b)) == 2 and scheduler.queued == 4
    assert all(batch.ahead_of_bulk for w in (a, b) for batch in pieces(w))
    assert scheduler.tokens_ahead(Priority.INTERACTIVE) == 10  # a next query waits for none of them
    (query_rows, big_rows) = await release_and_stop(scheduler, (a, b), query_task, big_call)
    assert query_rows[0, 0] == 7 and list(big_rows[:, 0]) == list(range(1000, 1020))


# ------------------------------------------------------------------ callers take turns (CALLER)


def items_of(caller, first_ids):
    """Queued inputs of one caller (batching is pure: no request behind them is needed)."""
    return [WorkItem(np.full(3, v, dtype=np.int32), None, None, i, caller=caller) for i, v in enumerate(first_ids)]


def test_callers_take_turns_of_a_batch_each_and_keep_their_own_order():
    queue = deque(items_of("a", range(10)))
    queue = interleave_callers(queue, items_of("b", range(100, 105)), turn=4)
    queue = interleave_callers(queue, items_of("a", range(20, 22)), turn=4)  # a's second request: after its first
    queue = interleave_callers(queue, items_of("c", [500]), turn=4)
    order = [int(item.ids[0]) for item in queue]
    assert order == [0, 1, 2, 3, 100, 101, 102, 103, 500, 4, 5, 6, 7, 104, 8, 9, 20, 21]


def test_one_caller_keeps_the_queue_as_it_is():
    queue = deque(items_of(None, range(3)))
    same = interleave_callers(queue, items_of(None, range(3, 6)), turn=2)
    assert same is queue and [int(i.ids[0]) for i in same] == list(range(6))


async def test_two_callers_big_requests_interleave(two_replicas):
    """Two 40-input calls from different callers, the second sent while the first holds both
    replicas: the second's batches run between the first's, not after all of them."""
    scheduler, workers = two_replicas

    async def call(caller, first_ids):
        CALLER.set(caller)  # as the service layer does at the start of each call (its own task)
        pending, items = request(first_ids)
        return await scheduler.run(items, pending)

    first = asyncio.create_task(call(("key", 1), range(1000, 1040)))
    await until(lambda: all(len(w.batches) == 2 for w in workers), "the first call holds both replicas, one ahead")
    second = asyncio.create_task(call(("key", 2), range(2000, 2040)))
    await until(lambda: scheduler.queues[Priority.SPLIT] and scheduler.queued == 24 + 40, "the second call queued")
    for worker in workers:
        worker.release.set()
    await asyncio.gather(first, second)
    batches = sorted(
        ((i, b) for w in workers for i, b in enumerate(w.batches)), key=lambda ib: ib[0]
    )  # the order each replica took them: round by round
    seconds_first = min(i for i, b in batches if b.input_ids[0] >= 2000)
    firsts_last = max(i for i, b in batches if b.input_ids[0] < 2000)
    assert seconds_first < firsts_last  # on the old code the second call waited for all of the first


def test_a_caller_is_its_api_key_else_its_connection():
    def caller_of(key: str, peer: str):
        def call():
            request_options.bind_caller(key, peer)
            return CALLER.get()

        return contextvars.copy_context().run(call)

    # Behind Envoy one pooled connection carries many callers: the key tells them apart.
    assert caller_of("k1", "ipv4:127.0.0.1:1") == caller_of("k1", "ipv4:127.0.0.1:2")
    assert caller_of("k1", "ipv4:127.0.0.1:1") != caller_of("k2", "ipv4:127.0.0.1:1")
    assert caller_of("", "ipv4:127.0.0.1:1") != caller_of("", "ipv4:127.0.0.1:2")
    assert "k1" not in repr(caller_of("k1", "x"))  # the key itself is not kept
    assert CALLER.get() is None  # each call's own context only


def _thread_nice() -> int:
    return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())


@pytest.mark.parametrize("worker_nice", [0, 7])
def test_tokenizer_threads_yield_to_the_event_loop_as_the_workers_do(worker_nice):
    """A huge request's tokenizing (a 200,000-character rerank query: ~0.15 s of a core) runs at the
    workers' nice, not the event loop's, where live queries are tokenized and answered."""
    registry = ModelRegistry(ServerConfig(models=(), worker_nice=worker_nice))
    expected = min(19, _thread_nice() + worker_nice)
    for pool in (registry._tokenizer_pool, registry._bulk_tokenizer_pool):
        assert pool.submit(_thread_nice).result() == expected
        pool.shutdown()
