"""Issue 19.5: bulk batches cut so one step takes about as long as an urgent batch here."""

from __future__ import annotations

import numpy as np
import pytest

from encoderd.workers import pacing
from encoderd.workers.contract.protocol import Ragged, TokenBatch, join_outputs


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def _batch(lengths):
    return TokenBatch.from_sequences(1, [np.full(n, 7, dtype=np.int32) for n in lengths])


def test_nothing_is_cut_before_the_speed_is_known():
    pacer = pacing.Pacer(clock=Clock())
    batch = _batch([100] * 10)
    assert pacer.cut(batch) == [batch]


def test_steps_follow_the_urgent_time_on_fast_and_slow_hosts():
    """Twice the seconds per token (a slower host) and twice the urgent time: the same share."""
    for per_token, urgent in ((20e-6, 0.004), (40e-6, 0.008)):
        clock = Clock()
        pacer = pacing.Pacer(clock=clock, factor=1.0)
        pacer.timed_step(1000, 1000 * per_token)
        pacer.timed_urgent(urgent)
        assert pacer.target() == urgent and pacer.step_tokens() == 200
        parts = pacer.cut(_batch([50] * 20))
        assert [len(p.input_ids) for p in parts] == [200] * 5
        assert np.array_equal(np.concatenate([p.input_ids for p in parts]), _batch([50] * 20).input_ids)
        clock.now += pacing.QUIET_S + 1  # no urgent work for a while: big steps again
        assert pacer.target() == pacing.MAX_STEP_S
    default = pacing.Pacer(clock=Clock())
    default.timed_urgent(0.004)
    assert default.target() == pytest.approx(pacing.URGENT_FACTOR * 0.004)


def test_cut_keeps_whole_sequences_and_bounds():
    pacer = pacing.Pacer(clock=Clock())
    pacer.timed_step(100, 100 * 1e-5)
    pacer.timed_urgent(0.0005)  # below the floor: MIN_STEP_S, 200 tokens
    parts = pacer.cut(_batch([300, 10, 10, 150, 60, 5]))
    assert [p.lengths.tolist() for p in parts] == [[300], [10, 10, 150], [60, 5]]
    assert all(p.cu_seqlens[0] == 0 for p in parts)


def test_fixed_target_from_the_environment(monkeypatch):
    monkeypatch.setenv(pacing.STEP_ENV, "0")
    pacer = pacing.Pacer()
    pacer.timed_step(100, 1.0)
    assert pacer.target() is None and pacer.cut(_batch([100] * 5))[0].size == 5
    monkeypatch.setenv(pacing.STEP_ENV, "10")
    assert pacing.Pacer().target() == 0.01


def test_join_puts_sub_batch_outputs_back_in_order():
    assert join_outputs([np.ones((2, 3)), np.zeros((1, 3))]).tolist() == [[1] * 3, [1] * 3, [0] * 3]
    a = Ragged(np.ones((3, 2), np.float32), np.array([0, 1, 3], np.int32))
    b = Ragged(np.zeros((2, 2), np.float32), np.array([0, 2], np.int32))
    assert join_outputs([a, b]).cu_seqlens.tolist() == [0, 1, 3, 5]
