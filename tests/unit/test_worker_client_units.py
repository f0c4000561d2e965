"""WorkerClient's results socket (server/scheduling/worker_client.py), over real ZeroMQ ipc sockets with
the test in the worker's place: the event loop reads the socket's descriptor directly, so every result
reaches its call, and a message that cannot be decoded is skipped without stopping the reading (the
descriptor is edge-triggered: a reader that stopped halfway would never be woken again)."""

from __future__ import annotations

import asyncio
import logging

import numpy as np
import pytest
import zmq
import zmq.asyncio

from encoderd.server.scheduling.worker_client import WorkerClient
from encoderd.workers.contract import protocol

HANG_GUARD_S = 30  # only a client that stopped reading waits this long


@pytest.fixture
async def client_and_worker():
    """A WorkerClient whose sockets are open and watched, ready, and the PULL / PUSH pair of its worker."""
    client = WorkerClient(lambda batches, results: None, "test/model:0")
    client._open_sockets()
    ready = asyncio.get_running_loop().create_future()
    client._watch_results(ready)
    batches = zmq.asyncio.Context.instance().socket(zmq.PULL)  # the worker's: awaited by the test
    results = zmq.Context.instance().socket(zmq.PUSH)
    batches.connect(client._batch_address)
    results.connect(client._result_address)
    info = protocol.WorkerReady(pid=1, output_dim=4, engine="torch", device="cpu", dtype="float32", is_padded=False)
    results.send_multipart(protocol.encode_control(info))
    client._set_ready(await asyncio.wait_for(ready, HANG_GUARD_S))
    try:
        yield client, batches, results
    finally:
        await client._teardown()
        batches.close(linger=0)
        results.close(linger=0)


def _batch(ids: list[int]) -> protocol.TokenBatch:
    return protocol.TokenBatch.from_sequences(0, [ids])


async def _received_batch_id(batches: zmq.asyncio.Socket) -> int:
    """The id the client gave the next batch it sent."""
    _, header, _ = protocol.decode(await batches.recv_multipart())
    return header.batch_id


async def test_every_result_reaches_its_call_and_a_bad_message_is_skipped(client_and_worker, caplog):
    client, batches, results = client_and_worker
    calls = [asyncio.ensure_future(client.compute(_batch([1, 2 + k, 3]))) for k in range(3)]
    ids = [await _received_batch_id(batches) for _ in calls]
    rows = {batch_id: np.full((1, 4), batch_id, dtype=np.float32) for batch_id in ids}
    results.send_multipart([b"not a message"])  # then the answers, the last one first
    for batch_id in reversed(ids):
        results.send_multipart(protocol.encode_result(batch_id, rows[batch_id]), copy=False)
    with caplog.at_level(logging.ERROR, logger="encoderd.worker_client"):
        answers = await asyncio.wait_for(asyncio.gather(*calls), HANG_GUARD_S)
    for batch_id, answer in zip(ids, answers, strict=True):
        np.testing.assert_array_equal(answer, rows[batch_id])
    assert "could not be read" in caplog.text


async def test_a_result_for_a_call_that_left_is_dropped_and_the_next_one_served(client_and_worker):
    client, batches, results = client_and_worker
    left = asyncio.ensure_future(client.compute(_batch([1, 2, 3])))
    left_id = await _received_batch_id(batches)
    left.cancel()
    staying = asyncio.ensure_future(client.compute(_batch([1, 5, 3])))
    staying_id = await _received_batch_id(batches)
    results.send_multipart(protocol.encode_result(left_id, np.zeros((1, 4), dtype=np.float32)), copy=False)
    results.send_multipart(protocol.encode_result(staying_id, np.ones((1, 4), dtype=np.float32)), copy=False)
    np.testing.assert_array_equal(await asyncio.wait_for(staying, HANG_GUARD_S), np.ones((1, 4), dtype=np.float32))
    assert left.cancelled() and not client._pending
