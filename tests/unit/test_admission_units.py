"""Admission by expected wait (issue 42, item 2) and the split of big requests (item 3).

Deterministic: the drain rate is fed explicit times, the decision explicit figures, and the
scheduler runs against a stand-in worker whose batches are held until the test releases them, so
every order asserted here is made by the test, not by timing.
"""

import asyncio
import time

import numpy as np
import pytest
from support.held_workers import HeldWorker, request, until

from encoderd.server.base.errors import Overloaded
from encoderd.server.scheduling import scheduler as scheduler_module
from encoderd.server.scheduling.admission import (
    CALIBRATION_HORIZON_S,
    CALIBRATION_RANGE,
    CALL_DEADLINE,
    COLD_SHARE,
    DRAIN_FLOOR_S,
    DrainFloor,
    DrainRate,
    TokenEstimate,
    WaitCalibration,
    admission,
    expected_wait,
)
from encoderd.server.scheduling.batching import BatchLimits
from encoderd.server.scheduling.scheduler import ModelScheduler, Priority
from encoderd.server.scheduling.timing import CALL_TIMING, CallTiming
from encoderd.workers.contract.protocol import WorkerReady

# ------------------------------------------------------------------ the drain rate


def test_a_replica_counts_at_the_prior_until_it_computes_then_at_its_idle_batches_until_a_backlog():
    rate = DrainRate(cold=50_000)
    assert rate.tokens_per_s == 50_000
    rate.observe(10, sent=0.0, done=0.005)  # sent to an idle replica: round trip included
    assert rate.measured is None and rate.tokens_per_s == pytest.approx(2000)  # an underestimate, for now
    rate.observe(2000, sent=0.004, done=0.105)  # queued behind the first: busy 0.1 s
    assert rate.tokens_per_s == pytest.approx(20_000)
    rate.observe(10, sent=1.0, done=1.005)  # idle batches no longer count
    assert rate.tokens_per_s == pytest.approx(20_000)


def test_a_batch_queued_behind_another_is_measured_from_that_ones_end():
    rate = DrainRate(cold=5000)
    rate.observe(800, sent=0.0, done=0.1)  # idle before: not measured
    rate.observe(2000, sent=0.05, done=0.2)  # waited behind the first: busy 0.1 s for 2000 tokens
    assert rate.tokens_per_s == pytest.approx(20_000)


def test_samples_are_weighted_by_their_duration():
    """Tokens over time busy: a long batch at 10k tokens/s weighs more than a short one at 40k."""
    rate = DrainRate(memory_s=2.0)
    rate.observe(1, sent=-1.0, done=0.0)
    rate.observe(10_000, sent=-0.5, done=1.0)  # first measurement: 10k tokens/s
    rate.observe(400, sent=0.5, done=1.01)  # 10 ms at 40k tokens/s
    short_weight = 1 - np.exp(-0.01 / 2.0)
    assert rate.tokens_per_s == pytest.approx(10_000 + short_weight * 30_000)
    rate.observe(40_000, sent=0.5, done=2.01)  # a whole second at 40k tokens/s
    assert rate.tokens_per_s > 20_000


def test_a_replica_starts_from_its_workers_figure_at_load_discounted():
    rate = DrainRate(cold=10_000)
    rate.seed(0.0)  # the worker measured nothing (a kind the self-check does not cover)
    assert rate.tokens_per_s == 10_000
    rate.seed(30_000.0)
    assert rate.tokens_per_s == pytest.approx(COLD_SHARE * 30_000)
    rate.observe(2000, sent=0.0, done=0.1)  # then what this replica really does
    assert rate.tokens_per_s == pytest.approx(20_000)


def test_a_restarted_replica_forgets_its_old_backlog():
    rate = DrainRate(cold=5000)
    rate.observe(1000, sent=0.0, done=1.0)
    rate.forget_backlog()
    rate.observe(1000, sent=0.5, done=1.5)  # the new process's first batch queued behind nothing
    assert rate.measured is None and rate.unloaded == pytest.approx(1000)


def test_a_rate_says_whether_it_was_measured_under_a_backlog():
    rate = DrainRate(cold=5000)
    assert rate.observe(800, sent=0.0, done=0.1) is False  # sent to an idle replica: a round trip
    assert rate.observe(2000, sent=0.05, done=0.2) is True  # queued behind the first: a drain rate
    assert rate.observe(0, sent=0.1, done=0.3) is False  # nothing computed teaches nothing


def test_the_drain_floor_is_the_slowest_rate_of_its_window():
    floor = DrainFloor(window_s=10.0)
    assert floor.bound(23_000, now=0.0) == 23_000  # nothing measured yet
    floor.observe(20_000, now=0.0)
    floor.observe(12_000, now=3.0)  # a slow stretch
    floor.observe(22_000, now=5.0)
    assert floor.bound(23_000, now=5.0) == 12_000  # a call admitted now waits through the next one
    assert floor.bound(10_000, now=5.0) == 10_000  # slower now than of late: now's rate
    assert floor.bound(23_000, now=13.0) == 12_000  # still within the window
    assert floor.bound(23_000, now=13.1) == 22_000  # the slow stretch forgotten, the later rate kept
    assert floor.bound(23_000, now=15.1) == 23_000


def test_a_backlogs_first_window_counts_at_most_at_the_prior():
    floor = DrainFloor(window_s=10.0)
    floor.observe(18_000, now=100.0, prior=12_000)  # a flood's first backlog: no slower rate known yet
    assert floor.bound(18_000, now=105.0) == 12_000
    floor.observe(15_000, now=108.0, prior=12_000)  # within the window: the prior is not taken again
    assert floor.bound(18_000, now=110.0) == 12_000
    assert floor.bound(18_000, now=110.1) == 15_000  # a window measured: what it measured
    floor.observe(20_000, now=130.0, prior=12_000)  # a backlog after a quiet window starts again
    assert floor.bound(20_000, now=130.0) == 12_000
    floor.observe(10_000, now=131.0, prior=12_000)  # slower than the prior: that
    assert floor.bound(20_000, now=131.0) == 10_000


# ------------------------------------------------------------------ the decision


def test_the_wait_is_the_work_ahead_at_the_drain_rate():
    assert expected_wait(30_000, 10_000) == pytest.approx(3.0)


def test_an_empty_queue_admits_whatever_the_rate():
    assert admission(0, 10**6, tokens_per_s=1.0, max_wait_s=0.1, time_left_s=0.01) is None


def test_a_wait_past_the_limit_is_refused_with_when_to_retry():
    assert admission(19_000, 0, tokens_per_s=10_000, max_wait_s=2.0) is None
    refusal = admission(51_000, 0, tokens_per_s=10_000, max_wait_s=2.0)
    assert refusal and not refusal.by_deadline
    assert refusal.wait_s == pytest.approx(5.1) and refusal.retry_after_s == 4  # ceil(5.1 - 2)
    assert "5.1 s" in refusal.message("m") and "--max-queue-wait is 2.0 s" in refusal.message("m")
    assert admission(51_000, 0, tokens_per_s=10_000, max_wait_s=0) is None  # 0: no time bound


def test_a_call_whose_deadline_cannot_cover_wait_and_compute_is_refused():
    # 1 s ahead + 0.5 s of its own: fits 2 s, not 1.2 s.
    assert admission(10_000, 5_000, tokens_per_s=10_000, max_wait_s=5.0, time_left_s=2.0) is None
    refusal = admission(10_000, 5_000, tokens_per_s=10_000, max_wait_s=5.0, time_left_s=1.2)
    assert refusal and refusal.by_deadline and "its deadline leaves 1.2 s" in refusal.message("m")


def test_a_call_is_admitted_by_its_wait_beyond_its_own_compute():
    # Measured 10,000 tokens/s; answers have come 1.5x later than predicted. 1.2 s ahead at the
    # calibrated rate, and 1,000 tokens of its own: 0.1 s of compute, answered after 0.15 s of it.
    assert admission(8_000, 0, tokens_per_s=10_000, max_wait_s=2.0, factor=1.5) is None
    assert admission(8_000, 1_000, tokens_per_s=10_000, max_wait_s=2.0, factor=1.5) is None  # 1.25 s
    # 1.95 s ahead (the old rule admitted it): its own compute slowed by the same 1.5x is 2.2 s past
    # its compute alone, and the slowest such calls were answered past --max-queue-wait + compute.
    refusal = admission(13_000, 5_000, tokens_per_s=10_000, max_wait_s=2.0, factor=1.5)
    assert refusal and not refusal.by_deadline and refusal.wait_s == pytest.approx(2.2)


def test_a_call_longer_than_the_bound_is_still_admitted_behind_a_short_queue():
    # Its own compute (10 s) is not a wait: a big call is bounded by the work ahead of it, not refused
    # whenever anything is queued.
    assert admission(5_000, 100_000, tokens_per_s=10_000, max_wait_s=2.0) is None
    assert admission(5_000, 100_000, tokens_per_s=10_000, max_wait_s=2.0, factor=1.2) is not None  # +2.1 s


def test_a_deadline_counts_the_answer_at_the_calibrated_rate():
    # 1 s ahead and 0.5 s of its own at the measured rate; answers come 1.5x late: 2.25 s.
    assert admission(10_000, 5_000, tokens_per_s=10_000, max_wait_s=5.0, time_left_s=2.3, factor=1.5) is None
    refusal = admission(10_000, 5_000, tokens_per_s=10_000, max_wait_s=5.0, time_left_s=2.2, factor=1.5)
    assert refusal and refusal.by_deadline and refusal.wait_s == pytest.approx(1.5)


def test_the_token_estimate_learns_what_estimates_hold():
    estimate = TokenEstimate(memory=4)
    assert estimate.scale == 1.0  # nothing tokenized yet
    estimate.observe(1260, 4096)  # bench.flood's 32 texts: 8 characters a token estimated, ~2.5 real
    assert estimate.scale == pytest.approx(4096 / 1260)
    estimate.observe(0, 10)  # an empty estimate teaches nothing
    assert estimate.scale == pytest.approx(4096 / 1260)
    for _ in range(40):  # texts that hold what they were estimated at: the old ratio fades
        estimate.observe(100, 100)
    assert estimate.scale == pytest.approx(1.0, abs=0.01)
    estimate.observe(10_000, 20_000)  # a long request counts by its length
    assert estimate.scale > 1.9


# ------------------------------------------------------------------ in the scheduler


@pytest.fixture
async def held():
    worker = HeldWorker()
    scheduler = ModelScheduler(
        "m",
        [worker],
        BatchLimits(max_batch_size=4, max_batch_tokens=1000),
        batch_delay=0,
        max_queued=10_000,
        max_queue_wait=2.0,
        split_large=True,
    )
    scheduler.drain[worker].measured = 1000.0  # tokens/s, as if measured
    scheduler.start()
    yield scheduler, worker
    worker.release.set()
    await scheduler.stop()


async def test_a_call_that_would_wait_too_long_is_refused_at_once(held):
    scheduler, worker = held
    queued = [request(range(10 * k, 10 * k + 10), length=100) for k in range(3)]  # 3,000 tokens: 3 s
    calls = [asyncio.create_task(scheduler.run(items, pending)) for pending, items in queued]
    await until(lambda: len(worker.batches) == 2, "the replica's two slots taken")
    with pytest.raises(Overloaded) as refused:
        scheduler.refuse_if_full(1)
    assert refused.value.retry_after == 1  # ceil(3.0 - 2.0)
    assert "wait about 3.0 s" in str(refused.value)
    worker.release.set()
    assert [len(await call) for call in calls] == [10, 10, 10]


async def test_bulk_calls_wait_past_max_queue_wait_within_their_deadline(held):
    scheduler, worker = held
    pending, items = request(range(30), length=100)  # 3,000 tokens: 3 s at 1,000 tokens/s
    big = asyncio.create_task(scheduler.run(items, pending, Priority.BULK))
    await until(lambda: worker.batches, "the first batch reached the worker")
    # An ingestion job wants throughput: --max-queue-wait (2 s) bounds interactive callers only.
    scheduler.refuse_if_full(1, Priority.BULK)
    with scheduler.reserve(1, 10, Priority.BULK):
        pass
    # Its own deadline still bounds it.
    token = CALL_DEADLINE.set(asyncio.get_running_loop().time() + 1.0)
    try:
        with pytest.raises(Overloaded, match="its deadline leaves"):
            scheduler.refuse_if_full(1, Priority.BULK)
    finally:
        CALL_DEADLINE.reset(token)
    # Interactive work goes before queued bulk work, and preempts the bulk batch computing:
    # nothing is ahead of it.
    assert scheduler.tokens_ahead(Priority.INTERACTIVE) == 0
    scheduler.refuse_if_full(1, Priority.INTERACTIVE)
    # The rest of a big interactive request counts the bulk batch computing, not the queued ones.
    assert scheduler.tokens_ahead(Priority.SPLIT) == 400
    worker.release.set()
    assert len(await big) == 30


async def test_a_call_is_refused_when_its_deadline_cannot_wait(held):
    scheduler, worker = held
    pending, items = request(range(4), length=100)  # 400 tokens ahead: 0.4 s
    first = asyncio.create_task(scheduler.run(items, pending))
    await until(lambda: worker.batches, "the first batch reached the worker")
    loop_clock = asyncio.get_running_loop().time  # the scheduler's clock is time.monotonic, the same here
    token = CALL_DEADLINE.set(loop_clock() + 0.1)
    try:
        with pytest.raises(Overloaded, match="its deadline leaves"):
            scheduler.refuse_if_full(1)
    finally:
        CALL_DEADLINE.reset(token)
    scheduler.refuse_if_full(1)  # no deadline: 0.4 s is within --max-queue-wait
    worker.release.set()
    await first


async def test_a_small_request_goes_before_a_big_ones_remaining_pieces(held):
    scheduler, worker = held
    big_pending, big_items = request(range(100, 120))  # 20 inputs, over 4 batches of 4: split
    big = asyncio.create_task(scheduler.run(big_items, big_pending))
    await until(lambda: len(worker.batches) == 2, "the big request's first batch and one queued behind it")
    head, ahead = worker.batches  # the replica's bulk slot and one queued (SPLIT_PREFETCH): the other slot stays free
    assert list(head.input_ids[head.cu_seqlens[:-1]]) == [100, 101, 102, 103]
    assert not head.urgent and not ahead.urgent  # all of it runs as bulk work, which a query's batch preempts
    small_pending, small_items = request([7])
    small = asyncio.create_task(scheduler.run(small_items, small_pending))
    await until(lambda: len(worker.batches) == 3, "the small request was sent beside the big one's batches")
    assert list(worker.batches[2].input_ids) == [7] * 10 and worker.batches[2].urgent
    worker.release.set()
    assert (await small)[0, 0] == 7
    out = await big
    assert list(out[:, 0]) == list(range(100, 120))  # reassembled in order from all its pieces
    pieces = [b for i, b in enumerate(worker.batches) if i != 2]
    assert sorted(v for b in pieces[1:] for v in b.input_ids[b.cu_seqlens[:-1]]) == list(range(104, 120))
    assert not any(b.urgent for b in pieces)


async def test_a_request_of_a_few_batches_is_not_split(held):
    scheduler, worker = held
    pending, items = request(range(16))  # 4 batches of 4
    task = asyncio.create_task(scheduler.run(items, pending))
    await until(lambda: len(worker.batches) == 2, "the replica's two slots taken")
    assert not scheduler.queues[Priority.SPLIT] and len(scheduler.queues[Priority.INTERACTIVE]) == 8
    worker.release.set()
    await task
    assert all(batch.urgent for batch in worker.batches)


async def test_the_rest_of_a_big_request_goes_before_queued_bulk_work(held):
    scheduler, worker = held
    blocker_pending, blocker = request([1])
    first = asyncio.create_task(scheduler.run(blocker, blocker_pending))
    await until(lambda: worker.batches, "the worker holds a batch")
    bulk_pending, bulk = request(range(200, 204))
    streamed = asyncio.create_task(scheduler.run(bulk, bulk_pending, Priority.BULK))
    await until(lambda: len(worker.batches) == 2, "a bulk batch took the replica's bulk slot")
    big_pending, big = request(range(100, 120))  # all in SPLIT
    more_pending, more_bulk = request(range(300, 304))
    big_task = asyncio.create_task(scheduler.run(big, big_pending))
    await until(lambda: scheduler.queues[Priority.SPLIT], "the big request queued")
    more = asyncio.create_task(scheduler.run(more_bulk, more_pending, Priority.BULK))
    await until(lambda: scheduler.queues[Priority.BULK], "the bulk request queued")
    worker.release.set()
    await asyncio.gather(first, streamed, big_task, more)
    order = [v for b in worker.batches for v in b.input_ids[b.cu_seqlens[:-1]]]
    assert max(order.index(v) for v in range(100, 120)) < min(order.index(v) for v in range(300, 304))
    assert all(not b.urgent for b in worker.batches if set(b.input_ids) & {*range(100, 120), 300})


async def test_a_big_request_still_tokenizing_does_not_count_ahead_of_a_query(held):
    scheduler, _ = held
    with scheduler.reserve(2048, 200_000):  # 200 s at 1,000 tokens/s, all of it in SPLIT
        scheduler.refuse_if_full(1)  # a query goes before it
        assert scheduler.tokens_ahead(Priority.INTERACTIVE) < 1000  # at most its first batch
        assert scheduler.tokens_ahead(Priority.BULK) == 200_000  # bulk work goes after it
        with pytest.raises(Overloaded):
            scheduler.refuse_if_full(2048)  # as does another big one, past --max-queue-wait
    assert scheduler.tokens_ahead(Priority.BULK) == 0


def ready(tokens_per_s: float) -> WorkerReady:
    return WorkerReady(1, 384, "torch", "cpu", "float32", False, tokens_per_s=tokens_per_s)


async def test_a_flood_on_a_fresh_replica_is_admitted_at_its_workers_own_figure():
    worker = HeldWorker()
    worker.ready_info = ready(2000.0)  # its self-check's batches: 2,000 tokens/s; counted at 1,000
    scheduler = ModelScheduler("m", [worker], BatchLimits(4, 1000), batch_delay=0, max_queue_wait=2.0)
    scheduler.start()
    try:
        assert scheduler.tokens_per_s == pytest.approx(COLD_SHARE * 2000)
        with scheduler.reserve(10, 1500):  # 1.5 s ahead at 1,000 tokens/s: admitted
            scheduler.refuse_if_full(1)
            with scheduler.reserve(10, 1000), pytest.raises(Overloaded, match=r"wait about 2\.5 s"):
                scheduler.refuse_if_full(1)  # where the fixed guess of 10,000 would have admitted it
        # A restarted worker's new figure is its replica's until it has computed.
        worker.ready_info = ready(8000.0)
        worker.state_changed.set()
        await until(lambda: scheduler.tokens_per_s == pytest.approx(COLD_SHARE * 8000), "the replica reseeded")
    finally:
        worker.release.set()
        await scheduler.stop()


# ------------------------------------------------------------------ predicted waits against served ones


def test_the_calibration_is_the_ratio_most_predicted_time_was_served_within():
    calibration = WaitCalibration(memory_s=4.0, floor_s=0.1, quantile=0.9)
    assert calibration.factor == 1.0  # nothing served yet
    calibration.observe(2.0, served_s=4.0, now=10.0)
    assert calibration.factor == pytest.approx(2.0)
    for _ in range(9):  # nine on time, each as long as the first: 90 % of the time within 1.0
        calibration.observe(2.0, served_s=2.0, now=10.0)
    assert calibration.factor == pytest.approx(1.0)
    calibration.observe(2.0, served_s=3.0, now=10.0)  # 10 of 11 on time: no longer 90 %
    assert calibration.factor == pytest.approx(1.5)


def test_the_calibration_weighs_samples_by_length_and_age():
    calibration = WaitCalibration(memory_s=4.0, floor_s=0.1, quantile=0.9)
    calibration.observe(1.0, served_s=3.0, now=0.0)
    calibration.observe(10.0, served_s=10.0, now=0.0)  # a long wait on time outweighs a short late one
    assert calibration.factor == pytest.approx(1.0)
    calibration.observe(1.0, served_s=1.0, now=40.0)  # ten memories later the first two weigh ~nothing
    calibration.observe(1.0, served_s=2.0, now=40.0)
    assert calibration.factor == pytest.approx(2.0)


def test_the_calibration_forgets_a_slow_answer_once_answers_stop():
    calibration = WaitCalibration(memory_s=4.0, floor_s=0.1)
    calibration.observe(1.0, served_s=3.0, now=100.0)  # a stray slow answer, then a quiet server
    assert calibration.factor_at(100.0 + CALIBRATION_HORIZON_S) == pytest.approx(3.0)
    assert calibration.factor_at(100.1 + CALIBRATION_HORIZON_S) == 1.0
    assert WaitCalibration().factor_at(0.0) == 1.0


def test_short_predictions_teach_nothing_and_the_factor_is_bounded():
    calibration = WaitCalibration(floor_s=0.1)
    calibration.observe(0.01, served_s=0.3, now=0.0)  # a near-empty queue: the event loop's delay
    assert calibration.factor == 1.0
    calibration.observe(0.5, served_s=60.0, now=1.0)  # the host paused
    assert calibration.factor == CALIBRATION_RANGE[1]
    calibration = WaitCalibration(floor_s=0.1)
    calibration.observe(2.0, served_s=0.5, now=1.0)  # shorter than predicted: the margin is kept
    assert calibration.factor == CALIBRATION_RANGE[0] == 1.0


async def test_an_interactive_request_is_calibrated_from_queued_to_its_last_row(held):
    scheduler, worker = held  # batches of at most 4 inputs, 1,000 tokens/s measured
    blocker_pending, blocker = request(range(4), length=100)  # 400 tokens computing
    first = asyncio.create_task(scheduler.run(blocker, blocker_pending))
    await until(lambda: worker.batches, "the worker holds a batch")
    pending, items = request(range(10, 16), length=100)  # 600 tokens: two batches
    seen = []
    scheduler.calibration.observe = lambda predicted, served, now: seen.append((predicted, pending.done))
    with scheduler.reserve(4, 400):  # another call still tokenizing: it will queue behind this one
        second = asyncio.create_task(scheduler.run(items, pending))
        await until(lambda: len(worker.batches) == 2, "the second request's first batch was sent")
    worker.release.set()
    await asyncio.gather(first, second)
    # The blocker: its own 400 tokens, nothing ahead. The second: the blocker's 400 and its own 600 at
    # the rate measured when it queued (the tokenizing call's 400 not counted), observed once all its
    # rows were back (the old code observed its first batch's return).
    assert sorted(seen) == [(pytest.approx(0.4), False), (pytest.approx(1.0), True)]


async def test_bulk_requests_do_not_calibrate_the_interactive_bound(held):
    scheduler, worker = held
    seen = []
    scheduler.calibration.observe = lambda predicted, served, now: seen.append(predicted)
    pending, items = request(range(4), length=100)
    worker.release.set()
    await scheduler.run(items, pending, Priority.BULK)
    assert seen == []


async def test_admission_counts_with_the_rate_the_served_waits_show(held):
    scheduler, worker = held
    pending, items = request(range(12), length=100)  # 1,200 tokens ahead: 1.2 s at the measured rate
    queued = asyncio.create_task(scheduler.run(items, pending))
    await until(lambda: worker.batches, "the first batch reached the worker")
    scheduler.refuse_if_full(1)  # within --max-queue-wait's 2 s
    scheduler.calibration.observe(1.0, served_s=2.0, now=time.monotonic())  # answers came twice as late
    with pytest.raises(Overloaded, match=r"wait about 2\.4 s"):
        scheduler.refuse_if_full(1)
    worker.release.set()
    await queued


async def test_requests_still_tokenizing_count_at_what_estimates_turned_out_to_hold(held):
    scheduler, _ = held  # 1,000 tokens/s measured, --max-queue-wait 2 s
    with scheduler.reserve(4, 100) as tokenized:
        tokenized(300)  # estimated at 100 tokens, it held 300
    with scheduler.reserve(10, 700):  # still tokenizing: 2.1 s at what estimates hold, not 0.7 s
        assert scheduler.tokens_ahead(Priority.INTERACTIVE) == 2100
        with pytest.raises(Overloaded, match=r"wait about 2\.1 s"):
            scheduler.refuse_if_full(1)  # the old code counted 0.7 s and admitted it
    assert scheduler.tokens_ahead(Priority.INTERACTIVE) == 0


async def test_admission_counts_a_calls_own_compute_at_the_calibrated_rate(held):
    scheduler, worker = held
    pending, items = request(range(12), length=100)  # 1,200 tokens ahead: 1.2 s at the measured rate
    queued = asyncio.create_task(scheduler.run(items, pending))
    await until(lambda: worker.batches, "the first batch reached the worker")
    scheduler.calibration.observe(1.0, served_s=1.5, now=time.monotonic())  # answers came 1.5x late
    with scheduler.reserve(4, 100):  # 1.8 s ahead at the calibrated rate, +0.05 s of its own: admitted
        pass
    # 1.8 s ahead and 1,000 tokens of its own, 1 s of compute taking 1.5 s: 2.3 s past its compute
    # alone (the old rule, counting the work ahead only, admitted it at 1.8 s).
    with pytest.raises(Overloaded, match=r"wait about 2\.3 s"), scheduler.reserve(4, 1000):
        pass
    worker.release.set()
    await queued


async def test_a_unary_call_is_calibrated_from_when_it_reached_the_server(held):
    scheduler, worker = held
    seen = []
    scheduler.calibration.observe = lambda predicted, served, now: seen.append(served)
    worker.release.set()
    pending, items = request(range(4), length=100)
    token = CALL_TIMING.set(CallTiming(time.monotonic() - 1000.0))  # admitted and tokenized for 1,000 s, say
    try:
        await scheduler.run(items, pending)
    finally:
        CALL_TIMING.reset(token)
    pending, items = request(range(4, 8), length=100)
    await scheduler.run(items, pending)  # in-process (no CALL_TIMING): from when it queued
    assert seen[0] >= 1000.0 and seen[1] < 1000.0  # the old code counted both from their submit


async def test_admission_counts_at_the_slowest_rate_of_late(held):
    scheduler, worker = held  # 1,000 tokens/s measured, --max-queue-wait 2 s
    pending, items = request(range(12), length=100)  # 1,200 tokens ahead: 1.2 s at the measured rate
    queued = asyncio.create_task(scheduler.run(items, pending))
    await until(lambda: worker.batches, "the first batch reached the worker")
    scheduler.drain_floor.observe(500.0, now=time.monotonic() - DRAIN_FLOOR_S - 1.0)  # long ago
    scheduler.refuse_if_full(1)  # within --max-queue-wait's 2 s
    # The replicas drained half as fast a moment ago: the old code admitted at 1.2 s, as if the
    # call's wait were sure to go at the rate of this moment.
    scheduler.drain_floor.observe(500.0, now=time.monotonic())
    with pytest.raises(Overloaded, match=r"wait about 2\.4 s"):
        scheduler.refuse_if_full(1)
    worker.release.set()
    await queued


class Clock:
    """The scheduler's time.monotonic, set by the test."""

    def __init__(self, now: float):
        self.now = now
        self.perf_counter = time.perf_counter

    def monotonic(self) -> float:
        return self.now


class GatedWorker(HeldWorker):
    """Each batch waits for its own gate: the test ends them one at a time, at times it sets."""

    def __init__(self, label: str = "gated"):
        super().__init__(label)
        self.gates: list[asyncio.Event] = []

    async def compute(self, batch):
        gate = asyncio.Event()
        self.gates.append(gate)
        self.batches.append(batch)
        await gate.wait()
        return batch.input_ids[batch.cu_seqlens[:-1]].astype(np.float32)[:, None]


async def test_the_floor_learns_the_models_rate_from_batches_drained_under_a_backlog(monkeypatch):
    clock = Clock(100.0)
    monkeypatch.setattr(scheduler_module, "time", clock)
    worker = GatedWorker()
    scheduler = ModelScheduler("m", [worker], BatchLimits(4, 1000), batch_delay=0, max_queue_wait=2.0)
    scheduler.start()
    try:
        calls = [
            asyncio.create_task(scheduler.run(items, pending))
            for pending, items in (request(range(4 * k, 4 * k + 4), length=100) for k in range(3))
        ]
        await until(lambda: len(worker.batches) == 2, "the replica's two slots taken at 100.0")
        clock.now = 100.4
        worker.gates[0].set()  # sent to an idle replica: a round trip, no drain rate
        await calls[0]
        assert scheduler.drain[worker].measured is None
        assert scheduler.admission_tokens_per_s(100.4) == scheduler.measured_tokens_per_s
        clock.now = 100.8
        worker.gates[1].set()  # queued behind the first: 400 tokens in 0.4 s
        await calls[1]
        assert scheduler.drain[worker].measured == pytest.approx(1000)
        scheduler.drain[worker].measured = 4000.0  # faster since
        assert scheduler.admission_tokens_per_s(100.8) == pytest.approx(1000)
        assert scheduler.admission_tokens_per_s(100.8 + DRAIN_FLOOR_S) == pytest.approx(1000)
        assert scheduler.admission_tokens_per_s(100.9 + DRAIN_FLOOR_S) == pytest.approx(4000)
    finally:
        for gate in worker.gates:
            gate.set()
        await asyncio.gather(*calls)
        await scheduler.stop()
