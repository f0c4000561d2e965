"""An interactive batch does not wait for a whole bulk batch (workers/process.py): on one CPU
thread the worker computes it on its urgent lane, beside the bulk batch; with one lane (GPUs,
several intra-op threads; forced here with `urgent_lane=False`) it runs in a pause between the
bulk batch's layers (Backend.forward_in_steps).

A real worker process over ZeroMQ, the bundled MiniLM on one thread, so the bulk batch
(16 x 256 tokens) computes for about a second.
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
from support.nice import thread_nice_values

from encoderd.server.scheduling.worker_client import WorkerClient
from encoderd.workers.contract.config import BackendOptions, WorkerConfig
from encoderd.workers.contract.model_spec import ModelKind, default_model_path, load_model_spec
from encoderd.workers.contract.protocol import TokenBatch
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


@pytest.fixture
async def worker(lane):
    spec = load_model_spec("minilm", default_model_path(), ModelKind.EMBEDDING)
    client = WorkerClient(
        lambda batches, results: WorkerConfig(
            spec, "torch", BackendOptions(threads=1), batches, results, urgent_lane=lane
        ),
        "preempt",
    )
    await client.start()
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


async def test_without_urgency_batches_run_in_arrival_order(worker):
    """The control: the same two batches, neither urgent, finish in the order they came."""
    _, _, finished = await query_during_bulk(worker, query_urgent=False)
    assert finished == ["bulk", "query"]


async def test_the_bulk_lane_runs_nicer_than_the_urgent_lane(worker, lane):
    nice = thread_nice_values(worker.ready_info.pid)
    lowest = nice[0]
    # Only the bulk (main) thread is lowered; the urgent lane and the rest keep the worker's own.
    expected = [lowest] * (len(nice) - 1) + [lowest + BULK_LANE_NICE] if lane else [lowest] * len(nice)
    assert nice == expected
