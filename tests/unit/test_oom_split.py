"""A batch that runs out of device memory is computed in halves, not failed; one input that
still does not fit fails with the out-of-memory code (RESOURCE_EXHAUSTED at the frontend).

CUDA cannot run here, so the backend below raises the error torch raises
(an exception named OutOfMemoryError) above a batch size; the GPU check script
covers the real thing."""

import itertools

import grpc
import numpy as np
import pytest
import zmq

from encoderd.server.base.errors import EncoderdError, worker_failure
from encoderd.workers.contract import protocol
from encoderd.workers.contract.errors import ErrorCode
from encoderd.workers.contract.protocol import Ragged, TokenBatch
from encoderd.workers.process import _compute_and_reply, forward_halving_on_oom


class OutOfMemoryError(RuntimeError):
    pass


class SmallDevice:
    def __init__(self, fits: int):
        self.fits, self.calls, self.released = fits, [], 0

    def forward(self, batch):
        self.calls.append(batch.size)
        if batch.size > self.fits:
            raise OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        starts = batch.cu_seqlens[:-1]
        return np.stack([batch.input_ids[starts], batch.lengths], axis=1).astype(np.float32)

    def release_memory(self):
        self.released += 1


def batch_of(lengths):
    cu = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    ids = np.concatenate([np.full(n, i, dtype=np.int32) for i, n in enumerate(lengths)])
    return TokenBatch(7, ids, cu, ids.copy())


def test_split_keeps_sequences_whole():
    first, rest = batch_of([2, 3, 4]).split(1)
    assert list(first.input_ids) == [0, 0] and list(first.cu_seqlens) == [0, 2]
    assert list(rest.input_ids) == [1, 1, 1, 2, 2, 2, 2] and list(rest.cu_seqlens) == [0, 3, 7]
    assert list(rest.token_type_ids) == list(rest.input_ids)


def test_runs_stay_within_their_padded_size_and_keep_every_sequence_in_order():
    """The ONNX engine's CPU pieces: rows x longest row within the budget, at least one sequence each."""
    lengths = [2, 3, 3, 5, 9, 1, 1, 1, 1]
    runs = batch_of(lengths).runs(10)
    assert [list(run.lengths) for run in runs] == [[2, 3, 3], [5], [9], [1, 1, 1, 1]]
    assert np.array_equal(np.concatenate([run.input_ids for run in runs]), batch_of(lengths).input_ids)
    assert [run.size for run in batch_of(lengths).runs(1)] == [1] * len(lengths)
    assert batch_of([4]).runs(1)[0].size == 1


def test_out_of_memory_halves_until_it_fits_and_keeps_order():
    device = SmallDevice(fits=2)
    out = forward_halving_on_oom(device, batch_of([3, 1, 4, 1, 5, 9, 2]))
    assert list(out[:, 0]) == list(range(7)) and list(out[:, 1]) == [3, 1, 4, 1, 5, 9, 2]
    assert max(device.calls[1:]) <= 4 and device.released >= 2


def test_a_single_input_that_does_not_fit_fails():
    with pytest.raises(OutOfMemoryError):
        forward_halving_on_oom(SmallDevice(fits=0), batch_of([3]))


def test_other_errors_are_not_retried():
    class Broken(SmallDevice):
        def forward(self, batch):
            raise ValueError("bad ids")

    with pytest.raises(ValueError):
        forward_halving_on_oom(Broken(fits=8), batch_of([1, 2]))


class MultiVectorDevice(SmallDevice):
    """One row per token, (input index, position) in it: a ColBERT-shaped ragged output."""

    def forward(self, batch):
        super().forward(batch)
        starts = batch.cu_seqlens[:-1].repeat(batch.lengths)
        positions = np.arange(len(batch.input_ids)) - starts
        values = np.stack([batch.input_ids, positions], axis=1).astype(np.float32)
        return Ragged(values, batch.cu_seqlens.copy())


def test_ragged_outputs_are_joined_in_order_after_a_split():
    lengths = [3, 1, 4, 1, 5, 9, 2]
    whole = MultiVectorDevice(fits=99).forward(batch_of(lengths))
    out = forward_halving_on_oom(MultiVectorDevice(fits=2), batch_of(lengths))
    assert isinstance(out, Ragged) and out.cu_seqlens.dtype == np.int32
    assert np.array_equal(out.cu_seqlens, whole.cu_seqlens) and np.array_equal(out.values, whole.values)
    assert [len(v) for v in out.split()] == lengths


def test_sparse_ragged_outputs_keep_their_indices():
    parts = [
        Ragged(np.array([[1.0], [2.0]], np.float32), np.array([0, 1, 2], np.int32), np.array([5, 7], np.int32)),
        Ragged(np.array([[3.0]], np.float32), np.array([0, 0, 1], np.int32), np.array([9], np.int32)),
    ]
    joined = Ragged.join(parts)
    assert [(list(i), list(v)) for i, v in joined.split()] == [([5], [1.0]), ([7], [2.0]), ([], []), ([9], [3.0])]


# One inproc address per call: an id() is reused once its object is freed, and a just-closed socket may
# still hold the address (zmq unbinds in its own thread), which made the second call flaky.
_ADDRESSES = itertools.count()


def _failed_batch_through_the_wire(device) -> tuple[protocol.ResultHeader, EncoderdError]:
    """One urgent batch through the worker's batch loop (process._compute_and_reply) onto a real ZeroMQ socket:
    the result header the frontend reads, and the error its requests fail with."""
    ctx = zmq.Context.instance()
    pull, push = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    address = f"inproc://oom-{next(_ADDRESSES)}"
    pull.bind(address)
    push.connect(address)
    try:
        work = batch_of([3, 4])
        work.urgent = True  # the path without pacing: forward (halving), then the modules
        _compute_and_reply(device, lambda rows: rows, work, None, push, None)
        _, header, _ = protocol.decode(pull.recv_multipart())
    finally:
        push.close(linger=0)
        pull.close(linger=0)
    assert isinstance(header, protocol.ResultHeader)
    return header, worker_failure(header.code, header.error)


def test_out_of_memory_on_one_input_is_resource_exhausted_at_the_frontend():
    device = SmallDevice(fits=0)  # not even one input fits
    header, error = _failed_batch_through_the_wire(device)
    assert device.calls == [2, 1]  # halved down to one input first
    assert header.code == ErrorCode.OUT_OF_MEMORY
    assert error.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "CUDA out of memory" in str(error)


def test_an_unnamed_failure_is_internal_at_the_frontend():
    class Broken(SmallDevice):
        def forward(self, batch):
            raise KeyError("head")

    header, error = _failed_batch_through_the_wire(Broken(fits=8))
    assert header.code == ErrorCode.INTERNAL
    assert error.code == grpc.StatusCode.INTERNAL
    assert str(error) == "KeyError: 'head'"


def test_the_cpu_allocators_refusal_counts_as_out_of_memory():
    """torch on CPU under an address-space limit (ulimit -v) fails a batch's buffers with
    "DefaultCPUAllocator: can't allocate memory": halved like a GPU's, not an internal error."""
    import torch

    from encoderd.workers.process import is_out_of_memory

    with pytest.raises(RuntimeError) as refused:
        torch.empty(2**50, dtype=torch.uint8)  # a petabyte: refused by the allocator, not by a check
    assert is_out_of_memory(refused.value)
    assert not is_out_of_memory(RuntimeError("could not create a primitive"))
