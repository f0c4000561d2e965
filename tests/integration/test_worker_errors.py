"""Issue 20: a batch the worker fails arrives with its class of failure, not one generic status.

A real worker process over ZeroMQ (the test reranker, torch, one thread) is sent batches the
frontend's own checks would have stopped earlier, so the worker's refusal is what answers: each
arrives at the frontend as the error server/base/errors.py's WORKER_FAILURES maps its code to, whose
`code` is the gRPC status the RPC fails with (server/api/handlers.py). Device out-of-memory cannot
happen on this CPU machine; tests/unit/test_oom_split.py sends one through the worker's batch loop
and wire instead.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time

import grpc
import numpy as np
import pytest

from encoderd.server.base.errors import EncoderdError, Unavailable
from encoderd.server.scheduling.worker_client import WorkerClient
from encoderd.workers.contract.config import BackendOptions, WorkerConfig
from encoderd.workers.contract.model_spec import ModelKind
from encoderd.workers.contract.protocol import MediaBatch, TokenBatch
from encoderd.workers.contract.spec_reader import load_model_spec

QUERY_AND_PASSAGE = [[101, 2029, 3194, 102, 4240, 2003, 1037, 3231, 102]]


@pytest.fixture(scope="module")
async def worker(reranker_path):
    spec = load_model_spec("reranker", reranker_path, ModelKind.RERANKER)
    client = WorkerClient(
        lambda batches, results: WorkerConfig(spec, "torch", BackendOptions(threads=1), batches, results), "errors"
    )
    await client.start()
    yield client
    await client.stop()


async def failure(worker, batch) -> EncoderdError:
    with pytest.raises(EncoderdError) as caught:
        await worker.compute(batch)
    # One bad batch fails its requests, not the worker: the next good batch computes.
    assert np.isfinite(await worker.compute(TokenBatch.from_sequences(0, QUERY_AND_PASSAGE))).all()
    return caught.value


async def test_an_input_the_worker_refuses_is_invalid_argument(worker):
    image = MediaBatch(0, "image", np.zeros((1, 3, 8, 8), dtype=np.float32))
    error = await failure(worker, image)
    assert error.code == grpc.StatusCode.INVALID_ARGUMENT
    assert str(error) == "model errors: reranker models take no image input"


async def test_work_the_model_does_not_do_is_failed_precondition(worker):
    batch = TokenBatch.from_sequences(0, QUERY_AND_PASSAGE)
    batch.token_states = True  # an embedding model's output; the frontend asks no reranker for it
    error = await failure(worker, batch)
    assert error.code == grpc.StatusCode.FAILED_PRECONDITION
    assert "token states are an embedding model's output" in str(error)


async def test_anything_else_is_internal_with_the_message(worker):
    out_of_vocabulary = TokenBatch.from_sequences(0, [[101, 10**6, 102]])
    error = await failure(worker, out_of_vocabulary)
    assert error.code == grpc.StatusCode.INTERNAL
    assert str(error).startswith("model errors: IndexError: ")  # the exception's type and message


# ------------------------------------------------------------ a batch sent as its worker dies
def _has_exited(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in "ZX"  # exited: its sockets are closed
    except OSError:
        return True


def _block_until_exited(pid: int) -> None:
    deadline = time.monotonic() + 10
    while not _has_exited(pid):
        assert time.monotonic() < deadline, "the killed worker did not exit"
        time.sleep(0.01)
    time.sleep(0.2)  # ZeroMQ's I/O thread drops the dead peer meanwhile


async def test_a_batch_sent_after_the_worker_died_unseen_fails_unavailable(reranker_path):
    """Issue 16 (CI, session 16): a call arriving after kill -9 of the worker but before the event
    loop had seen the death hung. ZeroMQ had already dropped the dead peer, so the send waited for
    one; the death's teardown then closed the socket, which cancelled the send, and the bare
    cancellation left the request waiting forever. Here the event loop is held while the worker
    dies, so the batch is sent exactly in that window."""
    spec = load_model_spec("reranker", reranker_path, ModelKind.RERANKER)
    client = WorkerClient(
        lambda batches, results: WorkerConfig(spec, "torch", BackendOptions(threads=1), batches, results), "dying"
    )
    await client.start()
    try:
        pid = client.pid
        assert pid is not None
        os.kill(pid, signal.SIGKILL)
        _block_until_exited(pid)  # the event loop is held: it must not see the death yet
        assert client.ready  # the frontend has not noticed: this is the window
        with pytest.raises(Unavailable, match="dying"):
            await asyncio.wait_for(client.compute(TokenBatch.from_sequences(0, QUERY_AND_PASSAGE)), 10)
    finally:
        await client.stop()
