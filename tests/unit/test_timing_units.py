"""A call's server-timing (server/scheduling/timing.py): unions of intervals, the header's form, and
what the scheduler records for the calls whose inputs ride in a batch."""

from __future__ import annotations

import asyncio
import re
import time

import pytest
from support.held_workers import HeldWorker, release_and_stop, request, until

from encoderd.server.scheduling.batching import BatchLimits
from encoderd.server.scheduling.scheduler import ModelScheduler
from encoderd.server.scheduling.timing import CALL_TIMING, CallTiming, covered


@pytest.mark.parametrize(
    "intervals, length",
    [
        ([], 0.0),
        ([(1.0, 2.0)], 1.0),
        ([(1.0, 2.0), (3.0, 5.0)], 3.0),  # apart
        ([(1.0, 3.0), (2.0, 4.0)], 3.0),  # overlapping
        ([(3.0, 4.0), (1.0, 5.0), (2.0, 2.5)], 4.0),  # nested, any order
        ([(1.0, 2.0), (2.0, 3.0)], 2.0),  # touching
    ],
)
def test_covered_is_the_length_of_the_union(intervals, length):
    assert covered(intervals) == pytest.approx(length)


def test_the_header_names_the_steps_a_call_went_through_in_milliseconds():
    timing = CallTiming(started=100.0)
    assert timing.header(now=100.25) == "total;dur=250.00"  # answered without tokenizing or computing
    timing.tokenizing.append((100.0, 100.002))
    # Two runs of one call side by side (a query and its documents): overlapping time counts once.
    timing.ran(100.01, 100.2, [(100.05, 100.1), (100.08, 100.15)])
    timing.ran(100.02, 100.19, [(100.12, 100.18)])
    assert timing.header(now=100.25) == "tokenize;dur=2.00, queue;dur=60.00, compute;dur=130.00, total;dur=250.00"


class ReportingWorker(HeldWorker):
    """Reports more seconds of compute than the batch can have taken (a worker's clock is its own):
    the scheduler keeps a batch's time within the time it was away."""

    async def compute_timed(self, batch):
        return await self.compute(batch), 1e6


async def _timed_run(scheduler, first_ids):
    """Run a request as a unary call does: in a context holding its CallTiming; returns the timing."""
    timing = CallTiming(started=time.monotonic())
    CALL_TIMING.set(timing)
    pending, items = request(first_ids)
    await scheduler.run(items, pending)
    return timing


async def test_each_call_of_a_batch_records_the_batch_within_its_own_wait():
    worker = ReportingWorker()
    scheduler = ModelScheduler("m", [worker], BatchLimits(8, 1000), batch_delay=0, max_in_flight=1)
    scheduler.start()
    first = asyncio.create_task(_timed_run(scheduler, [1]))
    await until(lambda: len(worker.batches) == 1, "the first call's batch went to the worker")
    others = [asyncio.create_task(_timed_run(scheduler, [2, 3])), asyncio.create_task(_timed_run(scheduler, [4]))]
    await until(lambda: scheduler.queued == 3, "both other calls queued behind it")
    worker.release.set()
    await until(lambda: len(worker.batches) == 2, "the other calls' inputs went as one batch")
    timings = await release_and_stop(scheduler, [worker], first, *others)
    assert [len(worker.batches[0].cu_seqlens) - 1, len(worker.batches[1].cu_seqlens) - 1] == [1, 3]
    for timing in timings:
        ((queued_at, answered_at),), (ran,) = timing.scheduled, timing.computing
        assert queued_at <= ran[0] <= ran[1] <= answered_at  # clamped to when the batch was away
        assert re.fullmatch(r"queue;dur=[\d.]+, compute;dur=[\d.]+, total;dur=[\d.]+", timing.header())
    assert timings[1].computing == timings[2].computing  # one batch: the same interval for both calls


async def test_a_run_outside_a_call_records_nothing():
    worker = HeldWorker()
    scheduler = ModelScheduler("m", [worker], BatchLimits(8, 1000), batch_delay=0)
    scheduler.start()
    pending, items = request([7])
    call = asyncio.create_task(scheduler.run(items, pending))
    await until(lambda: len(worker.batches) == 1, "its batch went to the worker")
    (rows,) = await release_and_stop(scheduler, [worker], call)
    assert rows[0, 0] == 7 and CALL_TIMING.get() is None
