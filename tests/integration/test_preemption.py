"""An interactive batch does not wait for a whole bulk batch (workers/process.py): on one CPU
thread the worker computes it on its urgent lane, beside the bulk batch; with one lane (GPUs,
several intra-op threads; forced here with `urgent_lane=False`) it runs in a pause between the
bulk batch's layers (Backend.forward_in_steps).

A real worker process over ZeroMQ, the bundled MiniLM on one thread, so the bulk batch
(16 x 256 tokens) computes for about a second.
"""

from __future__ import annotations

import asyncio
import os

import numpy as np
import pytest
from support.nice import thread_priorities

from encoderd.server.base.config import WORKER_NICE
from encoderd.server.scheduling.worker_client import WorkerClient
from encoderd.workers.contract.config import BackendOptions, WorkerConfig
from encoderd.workers.contract.model_files import default_model_path
from encoderd.workers.contract.model_spec import ModelKind
from encoderd.workers.contract.protocol import TokenBatch
from encoderd.workers.contract.spec_reader import load_model_spec
from encoderd.workers.process import BULK_LANE_NICE

BULK = [[101] + [2000 + (i * 7 + j) % 5000 for j in range(254)] + [102] for i in range(16)]
QUERY = [[101, 2029, 3194, 4240, 102]]


def batch(sequences, urgent: bool) -> TokenBatch:
    packed = TokenBatch.from_sequences(0, sequences)
    packed.urgent = urgent
    return packed


@pytest.fixture(params=[True, False], ids=["urgent-lane", "pause-points"])
def lane(request) -> bool:
    return request.param


async def start_worker(lane: bool, nice: int) -> WorkerClient:
    spec = load_model_spec("minilm", default_model_path(), ModelKind.EMBEDDING)
    client = WorkerClient(
        lambda batches, results: WorkerConfig(
            spec, "torch", BackendOptions(threads=1), batches, results, urgent_lane=lane, nice=nice
        ),
        "preempt",
    )
    await client.start()
    return client


@pytest.fixture
async def worker(lane):
    client = await start_worker(lane, WORKER_NICE)  # as the server starts them by default
    yield client
    await client.stop()


async def query_during_bulk(worker, query_urgent: bool):
    """A bulk batch, then a query sent while it computes: their outputs, and the order they finished."""
    finished = []

    async def compute(name, work):
        rows = await worker.compute(work)
        finished.append(name)
        return rows

    bulk = asyncio.create_task(compute("bulk", batch(BULK, urgent=False)))
    await asyncio.sleep(0.3)  # the worker has taken the bulk batch and is inside it
    query = await compute("query", batch(QUERY, urgent=query_urgent))
    return await bulk, query, finished


async def test_an_urgent_batch_does_not_wait_for_a_bulk_batch(worker, lane):
    assert worker.ready_info.urgent_lane == lane  # torch on one CPU thread: it runs where asked
    paused_bulk, query, finished = await query_during_bulk(worker, query_urgent=True)
    assert finished == ["query", "bulk"]

    # Computing beside it or in its pause changes nothing in either result: each equals the
    # same batch computed alone.
    np.testing.assert_allclose(query, await worker.compute(batch(QUERY, urgent=False)), atol=1e-6)
    np.testing.assert_allclose(paused_bulk, await worker.compute(batch(BULK, urgent=False)), atol=1e-6)


async def test_the_ready_message_carries_the_speed_measured_at_load(worker):
    # The self-check's calibration batches, timed: the frontend's first drain-rate estimate
    # (server/scheduling/admission.py DrainRate.seed). MiniLM on one thread: thousands of tokens/s.
    assert worker.ready_info.tokens_per_s > 100


async def test_without_urgency_batches_run_in_arrival_order(worker):
    """The control: the same two batches, neither urgent, finish in the order they came."""
    _, _, finished = await query_during_bulk(worker, query_urgent=False)
    assert finished == ["bulk", "query"]


@pytest.mark.parametrize("ahead", [True, False], ids=["split", "control"])
async def test_a_split_batch_goes_before_the_bulk_batches_queued_at_the_worker(worker, ahead):
    """The scheduler keeps a bulk batch queued at the worker behind the one it computes; a split
    request's batch (ahead_of_bulk) sent after both runs before the queued one, whenever the worker
    took the first. Unmarked (the control), the three run in arrival order."""
    finished = []

    async def compute(name, work):
        await worker.compute(work)
        finished.append(name)

    split = batch(BULK[:4], urgent=False)
    split.ahead_of_bulk = ahead
    first, queued = batch(BULK[:8], urgent=False), batch(BULK[:8], urgent=False)
    await asyncio.gather(compute("bulk", first), compute("queued", queued), compute("split", split))  # sent in order
    if ahead:
        assert finished.index("split") < finished.index("queued")
    else:
        assert finished == ["bulk", "queued", "split"]


async def test_the_bulk_lane_runs_nicer_than_the_urgent_lane(worker, lane):
    threads = thread_priorities(worker.ready_info.pid)
    own = (threads[0][0], os.SCHED_OTHER)
    # Only the bulk (main) thread is lowered, 5 nicer and SCHED_IDLE (the workers run nicer than
    # the frontend); the urgent lane and the rest keep the worker's own.
    bulk = (own[0] + BULK_LANE_NICE, os.SCHED_IDLE)
    assert threads == ([own] * (len(threads) - 1) + [bulk] if lane else [own] * len(threads))


async def test_with_worker_nice_0_the_bulk_lane_stays_sched_other():
    """--worker-nice 0 asks that workers do not yield to other busy processes: no SCHED_IDLE."""
    client = await start_worker(lane=True, nice=0)
    try:
        threads = thread_priorities(client.ready_info.pid)
    finally:
        await client.stop()
    own = (threads[0][0], os.SCHED_OTHER)
    assert threads == [own] * (len(threads) - 1) + [(own[0] + BULK_LANE_NICE, os.SCHED_OTHER)]
