"""A replica keeps a bulk batch queued in its worker behind the one it computes, while no live work is
around (scheduler._prefetching): the worker starts the next batch as the last ends instead of a
round trip later. Queries and split requests keep their place: a query still finds the slot bulk
leaves free, a split request's batch goes before the prefetched one (Inbox), and live work stops
the prefetching. The stand-in workers hold every batch, so each order here is made by the test."""

import asyncio
import threading
import time
from pathlib import Path

import numpy as np
from support.held_workers import HeldWorker, release_and_stop, request, until

from encoderd.server.scheduling.batching import BatchLimits
from encoderd.server.scheduling.scheduler import ModelScheduler, Priority
from encoderd.workers.contract import protocol
from encoderd.workers.contract.protocol import MediaBatch, TokenBatch
from encoderd.workers.process import Inbox


def two_replicas(**kwargs):
    a, b = HeldWorker("a"), HeldWorker("b")
    scheduler = ModelScheduler("m", [a, b], BatchLimits(max_batch_size=4), batch_delay=0, max_queued=1000, **kwargs)
    scheduler.start()
    return scheduler, a, b


async def settled():
    """Enough event-loop turns for the scheduler to send all it would (it sends in one pass)."""
    for _ in range(50):
        await asyncio.sleep(0)


def send(scheduler, first_ids, priority):
    """A request of one 10-token input per id, run as a task."""
    pending, items = request(first_ids)
    return asyncio.create_task(scheduler.run(items, pending, priority))


def firsts_of(batch):
    return [int(batch.input_ids[start]) for start in batch.cu_seqlens[:-1]]


async def test_a_deep_bulk_queue_keeps_a_second_batch_at_each_worker():
    scheduler, a, b = two_replicas()
    call = send(scheduler, range(40), Priority.BULK)  # 10 batches of 4
    await until(lambda: len(a.batches) == 2 and len(b.batches) == 2, "a batch computing and one queued, each")
    await settled()
    assert len(a.batches) == 2 and len(b.batches) == 2  # one ahead, no more
    assert scheduler.queued == 40 - 16
    (rows,) = await release_and_stop(scheduler, (a, b), call)
    assert len(rows) == 40


async def test_the_last_bulk_batches_wait_for_whichever_replica_frees_first():
    scheduler, a, b = two_replicas()
    call = send(scheduler, range(12), Priority.BULK)  # 3 batches: after one each, less than one per replica left
    await until(lambda: len(a.batches) == 1 and len(b.batches) == 1, "one batch each")
    await settled()
    assert len(a.batches) == 1 and len(b.batches) == 1 and scheduler.queued == 4
    (rows,) = await release_and_stop(scheduler, (a, b), call)
    assert len(rows) == 12


async def test_no_bulk_batch_goes_ahead_while_queries_come():
    scheduler, a, b = two_replicas()
    query = send(scheduler, [7], Priority.INTERACTIVE)
    await until(lambda: a.batches or b.batches, "the query reached a replica")
    call = send(scheduler, range(100, 140), Priority.BULK)
    await until(lambda: len(a.batches) + len(b.batches) == 3, "a bulk batch each")
    await settled()
    assert sorted(len(w.batches) for w in (a, b)) == [1, 2]  # the query, and one bulk batch per replica
    assert sum(not batch.urgent for w in (a, b) for batch in w.batches) == 2
    await release_and_stop(scheduler, (a, b), query, call)


async def test_a_query_still_finds_the_slot_bulk_leaves_free():
    scheduler, a, b = two_replicas()
    call = send(scheduler, range(100, 140), Priority.BULK)
    await until(lambda: len(a.batches) == 2 and len(b.batches) == 2, "two bulk batches each")
    query = send(scheduler, [7], Priority.INTERACTIVE)
    await until(lambda: len(a.batches) + len(b.batches) == 5, "the query sent at once")
    sent = next(w.batches[-1] for w in (a, b) if len(w.batches) == 3)
    assert sent.urgent and firsts_of(sent) == [7]
    # It waits for no bulk work (the worker runs it beside the bulk lane): the next query counts it alone.
    assert scheduler.tokens_ahead(Priority.INTERACTIVE) == 10
    await release_and_stop(scheduler, (a, b), query, call)


async def test_a_split_request_goes_before_the_prefetched_bulk_batches():
    scheduler, a, b = two_replicas(split_large=True)
    call = send(scheduler, range(100, 140), Priority.BULK)
    await until(lambda: len(a.batches) == 2 and len(b.batches) == 2, "two bulk batches each")
    big = send(scheduler, range(500, 520), Priority.INTERACTIVE)  # 20 inputs > SPLIT_BATCHES x 4: split
    # Sent at once, one batch to each replica, marked to go before the bulk batch queued there: it
    # waits for the batch computing only, as it would with no prefetching.
    await until(lambda: len(a.batches) == 3 and len(b.batches) == 3, "a split batch each")
    await settled()
    split = [w.batches[2] for w in (a, b)]
    assert all(batch.ahead_of_bulk and not batch.urgent for batch in split)
    assert all(not batch.ahead_of_bulk for w in (a, b) for batch in w.batches[:2])
    assert len(a.batches) == 3 and len(b.batches) == 3  # one split batch each, the rest waits in SPLIT
    # Its rest counts the bulk batches computing, not the prefetched ones it goes before.
    assert scheduler.tokens_ahead(Priority.SPLIT) == scheduler._queued_tokens[Priority.SPLIT] + 2 * 40 + 2 * 40
    big_rows, rows = await release_and_stop(scheduler, (a, b), big, call)
    assert len(big_rows) == 20 and len(rows) == 40


def test_the_worker_takes_split_batches_before_queued_bulk_ones():
    def batch(batch_id, urgent=False, ahead=False):
        packed = TokenBatch.from_sequences(batch_id, [np.arange(3)])
        packed.urgent, packed.ahead_of_bulk = urgent, ahead
        return packed

    for take in ("get", "get_bulk"):
        inbox = Inbox()
        for queued in (batch(1), batch(2), batch(3, ahead=True), batch(4, urgent=True), batch(5, ahead=True)):
            inbox.put(queued)
        order = [getattr(inbox, take)().batch_id for _ in range(4 if take == "get_bulk" else 5)]
        assert order == ([4, 3, 5, 1, 2] if take == "get" else [3, 5, 1, 2])


def _task(native_id: int) -> tuple[str, int]:
    """A thread's state letter and its voluntary context switches so far."""
    stat = Path(f"/proc/self/task/{native_id}/stat").read_text()
    status = Path(f"/proc/self/task/{native_id}/status").read_text()
    return stat.rpartition(")")[2].split()[0], int(status.split("\nvoluntary_ctxt_switches:")[1].split()[0])


def _asleep(native_id: int) -> int:
    """Waits until the thread sleeps and stays asleep across a pause in which this thread holds no
    GIL (so it is not waiting for that): its switch count then."""
    while True:
        state, switches = _task(native_id)
        time.sleep(0.02)
        if state == "S" and _task(native_id) == (state, switches):
            return switches


def test_a_query_wakes_the_urgent_lane_only():
    """An idle bulk lane (waiting in get_bulk) sleeps through queries: with one condition it was woken
    twice a query to find nothing for it (a sleeping thread's voluntary switches count its wake-ups)."""
    inbox = Inbox()
    bulk_lane = threading.Thread(target=inbox.get_bulk, daemon=True)
    bulk_lane.start()
    before = _asleep(bulk_lane.native_id)
    for i in range(50):
        query = TokenBatch.from_sequences(i, [np.arange(3)])
        query.urgent = True
        inbox.put(query)
        assert inbox.get_urgent().batch_id == i
    assert _task(bulk_lane.native_id) == ("S", before)
    inbox.put(TokenBatch.from_sequences(99, [np.arange(3)]))
    bulk_lane.join(timeout=30)
    assert not bulk_lane.is_alive()  # a bulk batch does wake it


def _over_the_wire(batch):
    frames = [bytes(memoryview(f)) for f in protocol.encode_batch(batch)]
    return protocol.batch_from_frames(*protocol.decode(frames)[1:])


def test_the_mark_crosses_the_wire_and_survives_a_split():
    packed = TokenBatch.from_sequences(7, [np.arange(3), np.arange(5)])
    packed.ahead_of_bulk = True
    got = _over_the_wire(packed)
    assert got.ahead_of_bulk and not got.urgent
    assert all(half.ahead_of_bulk for half in got.split(1))


def test_a_split_media_batch_goes_ahead_too():
    image = MediaBatch(3, "image", np.zeros((2, 3, 4, 4), np.float32))
    image.ahead_of_bulk = True
    got = _over_the_wire(image)
    assert got.ahead_of_bulk and not _over_the_wire(MediaBatch(4, "image", image.features)).ahead_of_bulk
    inbox = Inbox()
    inbox.put(MediaBatch(1, "image", image.features))
    inbox.put(got)
    assert [inbox.get_bulk().batch_id for _ in range(2)] == [3, 1]
