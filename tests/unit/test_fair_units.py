"""Fair sharing of the replicas between a big request and other callers' queries (issue 42, item 3):
the order is made explicit with held stand-in workers, never by timing."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from encoderd.server.scheduling.batching import BatchLimits, WorkItem
from encoderd.server.scheduling.scheduler import ModelScheduler, PendingRequest, Priority


class HeldWorker:
    """Holds every batch until released; answers each input with its first token id."""

    def __init__(self, label: str):
        self.label = label
        self.ready = True
        self.state_changed = asyncio.Event()
        self.batches: list = []
        self.release = asyncio.Event()

    async def compute(self, batch):
        self.batches.append(batch)
        await self.release.wait()
        return batch.input_ids[batch.cu_seqlens[:-1]].astype(np.float32)[:, None]


def request(first_ids, length=10):
    pending = PendingRequest(len(first_ids))
    return pending, [WorkItem(np.full(length, v, dtype=np.int32), None, pending, i) for i, v in enumerate(first_ids)]


async def until(condition, what: str):
    """Let the event loop run until `condition` holds (a bounded number of turns, no clock)."""
    for _ in range(1000):
        if condition():
            return
        await asyncio.sleep(0)
    raise AssertionError(what)


@pytest.fixture
async def two_replicas():
    workers = [HeldWorker("a"), HeldWorker("b")]
    scheduler = ModelScheduler(
        "m", workers, BatchLimits(max_batch_size=4, max_batch_tokens=1000), batch_delay=0, split_large=True
    )
    scheduler.start()
    yield scheduler, workers
    for worker in workers:
        worker.release.set()
    await scheduler.stop()


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
    await until(lambda: a.batches and b.batches, "a piece of the big call on each replica")
    assert not any(batch.urgent for batch in a.batches + b.batches)
    query_pending, query = request([7])
    query_task = asyncio.create_task(scheduler.run(query, query_pending))
    await until(lambda: len(a.batches) + len(b.batches) == 3, "the query was sent")
    sent = [batch for batch in a.batches + b.batches if batch.urgent]
    assert len(sent) == 1 and list(sent[0].input_ids) == [7] * 10
    for worker in (a, b):
        worker.release.set()
    assert (await query_task)[0, 0] == 7
    assert list((await big_call)[:, 0]) == list(range(1000, 1040))
