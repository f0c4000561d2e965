"""Scheduler timing: an idle worker gets work at once; a busy one gets fuller batches
after the batch delay; results return to each request in order; cancellation drops work.

The worker here is an in-process stand-in so timing can be controlled; the
real worker process is exercised by tests/integration.
"""

import asyncio

import numpy as np
import pytest

from encoderd.server.base.errors import Overloaded, Unavailable
from encoderd.server.scheduling.batching import BatchLimits, WorkItem
from encoderd.server.scheduling.scheduler import ModelScheduler, PendingRequest, Priority


class StandInWorker:
    """Echoes each sequence's first token id and length; holds batches until released."""

    def __init__(self, label="w"):
        self.label = label
        self.ready = True
        self.ready_info = None  # what a worker says when ready: no figure measured at load
        self.state_changed = asyncio.Event()
        self.batches = []
        self.release = asyncio.Event()
        self.release.set()

    async def compute(self, batch):
        self.batches.append(batch)
        await self.release.wait()
        starts = batch.cu_seqlens[:-1]
        return np.stack([batch.input_ids[starts], np.diff(batch.cu_seqlens)], axis=1).astype(np.float32)

    async def compute_timed(self, batch):
        return await self.compute(batch), 0.0


def make_request(first_ids):
    request = PendingRequest(len(first_ids))
    return request, [
        WorkItem(np.full(3 + (v % 5), v, dtype=np.int32), None, request, i) for i, v in enumerate(first_ids)
    ]


async def run(scheduler, first_ids, priority=Priority.INTERACTIVE):
    request, items = make_request(first_ids)
    return await scheduler.run(items, request, priority)


@pytest.fixture
async def scheduler():
    worker = StandInWorker()
    s = ModelScheduler("m", [worker], BatchLimits(max_batch_size=8), batch_delay=0.05, max_queued=100)
    s.worker = worker
    s.start()
    yield s
    await s.stop()


async def test_idle_worker_gets_a_lone_request_at_once(scheduler):
    loop = asyncio.get_running_loop()
    started = loop.time()
    out = await run(scheduler, [42])
    assert out[0, 0] == 42 and loop.time() - started < 0.04  # well under the 50 ms batch delay


async def test_busy_worker_coalesces_and_results_come_back_in_order(scheduler):
    worker = scheduler.worker
    worker.release.clear()
    first = asyncio.create_task(run(scheduler, [1]))
    await asyncio.sleep(0.01)  # batch 1 is at the worker; next ones queue
    others = [asyncio.create_task(run(scheduler, [10 * k + j for j in range(2)])) for k in range(1, 4)]
    await asyncio.sleep(0.01)
    assert len(worker.batches) == 1  # busy, and 6 < 8 queued: wait for the batch delay or a full batch
    full = [asyncio.create_task(run(scheduler, [50 + j for j in range(2)])) for _ in range(2)]
    await asyncio.sleep(0.01)
    assert len(worker.batches) == 2  # 10 queued >= a full batch of 8: sent without waiting
    worker.release.set()
    results = await asyncio.gather(first, *others, *full)
    assert len(worker.batches) == 3  # 11 inputs in 3 passes
    for k, out in enumerate(results[1:4], start=1):
        assert list(out[:, 0]) == [10 * k + j for j in range(2)]


async def test_batch_delay_closes_a_partial_batch(scheduler):
    worker = scheduler.worker
    worker.release.clear()
    blocker = asyncio.create_task(run(scheduler, [1]))
    await asyncio.sleep(0.005)
    waiting = asyncio.create_task(run(scheduler, [2]))
    await asyncio.sleep(0.02)
    assert len(worker.batches) == 1
    await asyncio.sleep(0.06)  # past the 50 ms delay: the second batch goes (two may be in flight)
    assert len(worker.batches) == 2
    worker.release.set()
    await asyncio.gather(blocker, waiting)


async def test_cancelled_request_is_not_computed(scheduler):
    worker = scheduler.worker
    worker.release.clear()
    blocker = asyncio.create_task(run(scheduler, [1]))
    blocker2 = asyncio.create_task(run(scheduler, [2]))
    await asyncio.sleep(0.07)
    doomed = asyncio.create_task(run(scheduler, [99]))
    await asyncio.sleep(0.005)
    doomed.cancel()
    worker.release.set()
    await asyncio.gather(blocker, blocker2)
    await asyncio.sleep(0.1)
    assert all(99 not in b.input_ids for b in worker.batches)


async def test_queue_bound_refuses_at_once(scheduler):
    scheduler.worker.release.clear()
    tasks = [asyncio.create_task(run(scheduler, [1] * 50)) for _ in range(2)]
    await asyncio.sleep(0.01)
    with pytest.raises(Overloaded):
        await run(scheduler, [1] * 60)
    scheduler.worker.release.set()
    await asyncio.gather(*tasks)


async def test_interactive_inputs_go_before_queued_bulk_inputs(scheduler):
    worker = scheduler.worker
    worker.release.clear()
    bulk = [asyncio.create_task(run(scheduler, [100 + k], Priority.BULK)) for k in range(3)]
    await asyncio.sleep(0.01)
    more_bulk = asyncio.create_task(run(scheduler, [200], Priority.BULK))
    await asyncio.sleep(0.07)
    assert len(worker.batches) == 1  # bulk fills all but one slot of the replica, however long it waits
    interactive = asyncio.create_task(run(scheduler, [7]))
    await asyncio.sleep(0.01)  # < the batch delay: only bulk work is ahead, which the worker pauses
    assert len(worker.batches) == 2 and worker.batches[1].input_ids[0] == 7  # took the slot bulk left free
    assert worker.batches[1].urgent and not worker.batches[0].urgent
    worker.release.set()
    await asyncio.gather(*bulk, more_bulk, interactive)


async def test_batches_go_to_the_least_loaded_replica_and_survive_a_lost_one():
    a, b = StandInWorker("a"), StandInWorker("b")
    scheduler = ModelScheduler("m", [a, b], BatchLimits(max_batch_size=2), batch_delay=0.0)
    scheduler.start()
    a.release.clear()
    b.release.clear()
    first = asyncio.create_task(run(scheduler, [1, 2]))
    second = asyncio.create_task(run(scheduler, [3, 4]))
    await asyncio.sleep(0.01)
    assert len(a.batches) == 1 and len(b.batches) == 1  # spread, not stacked on one replica

    async def die(batch):  # replica a dies under its batch
        a.batches.append(batch)
        a.ready = False
        raise Unavailable("gone")

    a.compute = die
    a.release.set()
    third = asyncio.create_task(run(scheduler, [5, 6]))
    await asyncio.sleep(0.01)
    b.release.set()
    results = await asyncio.gather(first, second, third)
    assert [list(r[:, 0]) for r in results] == [[1, 2], [3, 4], [5, 6]]
    await scheduler.stop()


async def test_one_request_is_cut_into_a_piece_for_each_idle_replica():
    """A lone rerank of 50 passages on 2 idle replicas: two pieces side by side, not one batch
    on one replica while the other idles; no third piece trails behind."""
    a, b = StandInWorker("a"), StandInWorker("b")
    scheduler = ModelScheduler(
        "m", [a, b], BatchLimits(max_batch_size=64, max_batch_tokens=8192, padded=False), batch_delay=1.0
    )
    scheduler.start()
    request = PendingRequest(50)
    items = [WorkItem(np.full(40 + (7 * i) % 90, i, dtype=np.int32), None, request, i) for i in range(50)]
    out = await asyncio.wait_for(scheduler.run(items, request), 0.5)  # < batch_delay: nothing waited for a slot
    assert len(a.batches) == 1 and len(b.batches) == 1
    pieces = [int(w.batches[0].cu_seqlens[-1]) for w in (a, b)]
    assert sum(pieces) == sum(item.length for item in items)
    assert abs(pieces[0] - pieces[1]) <= 130  # at most one input's length apart
    assert list(out[:, 0]) == list(range(50))
    await scheduler.stop()


async def test_short_work_is_not_cut_for_idle_replicas():
    a, b = StandInWorker("a"), StandInWorker("b")
    scheduler = ModelScheduler("m", [a, b], BatchLimits(max_batch_size=64, padded=False), batch_delay=1.0)
    scheduler.start()
    await asyncio.wait_for(run(scheduler, [1, 2, 3, 4]), 0.5)  # 4 inputs of <= 7 tokens
    assert len(a.batches) + len(b.batches) == 1
    await scheduler.stop()


async def test_bulk_lane_batches_take_the_lane_limits_and_queries_their_own():
    # A padding-free engine's bulk and split batches are bounded by tokens (ServerConfig.lane_batch_size):
    # 20 short bulk inputs go as one batch, the same 20 as queries in batches of the interactive size.
    worker = StandInWorker()
    scheduler = ModelScheduler(
        "m",
        [worker],
        BatchLimits(max_batch_size=4, padded=False),
        lane_limits=BatchLimits(max_batch_size=512, padded=False),
        batch_delay=0,
    )
    scheduler.start()
    await asyncio.wait_for(run(scheduler, list(range(20)), Priority.BULK), 5)
    assert [b.size for b in worker.batches] == [20]
    worker.batches.clear()
    await asyncio.wait_for(run(scheduler, list(range(20))), 5)
    assert [b.size for b in worker.batches] == [4] * 5
    await scheduler.stop()


def test_a_padding_free_engine_batches_bulk_work_by_tokens_unless_a_count_is_named():
    from encoderd.server.base.config import LANE_BATCH_INPUTS, ServerConfig

    auto, named = ServerConfig(models=()), ServerConfig(models=(), max_batch_size=8)
    assert (auto.batch_size, auto.lane_batch_size(padded=False), auto.lane_batch_size(padded=True)) == (
        16,
        LANE_BATCH_INPUTS,
        16,
    )
    assert (named.batch_size, named.lane_batch_size(padded=False)) == (8, 8)
    assert ServerConfig(models=(), device="cuda:0").lane_batch_size(padded=True) == 64


def test_a_padding_free_cpu_engine_takes_smaller_bulk_batches_unless_a_budget_is_named():
    from encoderd.server.base.config import CPU_LANE_BATCH_TOKENS, DEFAULT_BATCH_TOKENS, ServerConfig

    auto, named = ServerConfig(models=()), ServerConfig(models=(), max_batch_tokens=6000)
    assert (auto.batch_tokens, auto.lane_batch_tokens(padded=False), auto.lane_batch_tokens(padded=True)) == (
        DEFAULT_BATCH_TOKENS,
        CPU_LANE_BATCH_TOKENS,
        DEFAULT_BATCH_TOKENS,
    )
    assert (named.batch_tokens, named.lane_batch_tokens(padded=False)) == (6000, 6000)
    assert ServerConfig(models=(), device="cuda:0").lane_batch_tokens(padded=False) == DEFAULT_BATCH_TOKENS


def test_beside_live_queries_a_padding_free_cpu_engine_cuts_bulk_batches_by_tokens():
    from encoderd.server.base.config import LIVE_BULK_TOKENS, ServerConfig

    cpu, gpu = ServerConfig(models=()), ServerConfig(models=(), device="cuda:0")
    assert (cpu.live_bulk_batch_tokens(padded=False), cpu.live_bulk_batch_tokens(padded=True)) == (
        LIVE_BULK_TOKENS,
        8192,
    )
    assert gpu.live_bulk_batch_tokens(padded=False) == 8192  # measured on CPU only: GPUs keep full batches
    named = ServerConfig(models=(), bulk_batch_tokens=512)
    assert (named.live_bulk_batch_tokens(padded=False), named.live_bulk_batch_tokens(padded=True)) == (512, 512)
    assert ServerConfig(models=(), max_batch_tokens=1024).live_bulk_batch_tokens(padded=False) == 1024
