"""Batching policy: length sorting, token budgets, oldest-first progress, cancellation."""

from collections import deque

import numpy as np

from encoderd.server.scheduling.batching import BatchLimits, WorkItem, pack, queued_cost_reaches_budget, take_batch


class Req:
    def __init__(self, done=False):
        self.done = done


def items(lengths, request=None):
    request = request or Req()
    return [WorkItem(np.arange(n, dtype=np.int32), None, request, i) for i, n in enumerate(lengths)]


def test_batch_is_sorted_by_length_and_holds_the_oldest_input():
    queue = deque(items([50, 3, 40, 5, 4]))
    batch = take_batch(queue, BatchLimits(max_batch_size=3, max_batch_tokens=10_000))
    # Sorted window: 3,4,5 | 40,50 ; the oldest input (length 50) is in the second chunk.
    assert [i.length for i in batch] == [40, 50]
    assert [i.length for i in queue] == [3, 5, 4]  # the rest keep arrival order
    assert [i.length for i in take_batch(queue, BatchLimits(max_batch_size=3))] == [3, 4, 5]
    assert not queue and take_batch(queue, BatchLimits()) == []


def test_padded_budget_counts_size_times_longest():
    queue = deque(items([10, 10, 10, 30]))
    batch = take_batch(queue, BatchLimits(max_batch_tokens=60, padded=True))
    assert [i.length for i in batch] == [10, 10, 10]  # adding 30 would cost 4 x 30 = 120
    assert [i.length for i in take_batch(queue, BatchLimits(max_batch_tokens=60, padded=True))] == [30]


def test_unpadded_budget_counts_real_tokens():
    queue = deque(items([10, 10, 10, 30]))
    assert [i.length for i in take_batch(queue, BatchLimits(max_batch_tokens=60, padded=False))] == [10, 10, 10, 30]


def test_an_input_over_the_budget_still_runs_alone():
    queue = deque(items([500, 2]))
    assert [i.length for i in take_batch(queue, BatchLimits(max_batch_tokens=100))] == [500]


def test_one_request_splits_across_batches_and_keeps_indices():
    request = Req()
    queue = deque(items([5] * 10, request))
    first = take_batch(queue, BatchLimits(max_batch_size=4))
    second = take_batch(queue, BatchLimits(max_batch_size=4))
    third = take_batch(queue, BatchLimits(max_batch_size=4))
    assert [len(b) for b in (first, second, third)] == [4, 4, 2]
    assert sorted(i.index for b in (first, second, third) for i in b) == list(range(10))


def test_done_requests_are_dropped_before_compute():
    live, gone = Req(), Req(done=True)
    queue = deque(items([5, 5], gone) + items([6], live))
    batch = take_batch(queue, BatchLimits())
    assert [i.request for i in batch] == [live] and not queue


def test_window_bounds_how_far_sorting_reaches():
    queue = deque(items([9, 9, 1, 1]))
    batch = take_batch(queue, BatchLimits(max_batch_size=2, window=2))
    assert [i.length for i in batch] == [9, 9]


def test_full_budget_detection():
    assert queued_cost_reaches_budget(deque(items([1] * 8)), BatchLimits(max_batch_size=8))
    assert queued_cost_reaches_budget(deque(items([100, 100])), BatchLimits(max_batch_tokens=200))
    assert not queued_cost_reaches_budget(deque(items([10])), BatchLimits())


def test_pack_concatenates_with_offsets():
    batch = pack(items([2, 3]), batch_id=7)
    assert batch.batch_id == 7
    assert list(batch.cu_seqlens) == [0, 2, 5] and list(batch.input_ids) == [0, 1, 0, 1, 2]
    assert batch.token_type_ids is None
