"""Admission by expected wait: pure, synchronous, unit-testable.

A queue bounded in inputs is bounded in memory, not in time: 16,384 short inputs are ~25 s of
work on a 2-core host, and a caller admitted behind them times out anyway. So each replica's drain
rate is measured (DrainRate: tokens per second of the time it was busy with a backlog), the work
ahead of a new call is divided by the model's rate, and a call that would wait longer than
--max-queue-wait, or than its own deadline allows, is refused at once (RESOURCE_EXHAUSTED, REST 429)
with how long to wait before a retry. The work ahead and the drain rate are estimates, and both
miss in the same direction under a flood (the frontend starves the workers of the cores they were
measured with; requests still tokenizing are counted by their characters), so the times predicted
are checked against the times served (WaitCalibration) and the prediction is scaled by how far they
fell short (never the other way); the rate counted is the slowest of the last seconds where that
was slower (DrainFloor: a call waits through the coming seconds, not this one). A call's answer is
predicted, its own compute included, and it is admitted when what it would wait beyond that compute
is within the bound: the slowest calls admitted near the bound finish within --max-queue-wait plus
their compute, not after it plus their compute slowed by the same factor. The scheduler
(scheduler.py) counts the work ahead; this file only estimates and decides.
"""

from __future__ import annotations

import collections
import contextvars
import math
from dataclasses import dataclass

# A replica's drain rate before it has computed anything, where its worker measured none at load (a
# kind the fidelity self-check does not cover): a small CPU model's figure (MiniLM-L6, one Zen 5 core,
# does 10-30k tokens/s). It counts only until the first batch returns.
COLD_TOKENS_PER_S = 10_000.0
# What a worker's own figure at load (its self-check's calibration batches, with a core to itself) is
# worth before the frontend has measured it: a flood's first burst is admitted with it, and under a
# flood the frontend's tokenizing and refusing take the cores the figure was measured with (MiniLM-L6
# on 2 shared Zen 5 cores: 5-9k tokens/s per worker under bench.flood where ~11k alone). Erring low
# refuses a few calls of the first burst with a retry-after; erring high admits them into waits past
# --max-queue-wait.
COLD_SHARE = 0.5
# How fast the estimate follows a change (another model loading the host, a longer-text workload):
# a measurement 2 s old weighs 1/e of a new one, whatever the batch sizes.
RATE_MEMORY_S = 2.0

# The monotonic time by which the current call must be answered (its gRPC deadline), None without
# one. Set per call by the service layer (service.py), read where the scheduler admits work.
CALL_DEADLINE: contextvars.ContextVar[float | None] = contextvars.ContextVar("call_deadline", default=None)


class DrainRate:
    """One replica's tokens per second while it has work queued behind the batch it computes.

    A batch sent while the previous one still computes starts when that one ends, so its service
    time is the time between the two completions: that is the replica's throughput under load,
    which is what a long queue drains at. A batch sent to an idle replica also carries the round
    trip and a batch's fixed cost (a lone query: ~3 ms for 10 tokens): an underestimate, used only
    until a backlog has been measured (a guess would be worse: on a busy shared host the cold
    figure admitted a flood's first calls into 15 s waits). Before any batch has returned, the
    estimate is the worker's own figure at load, discounted (`seed`). Samples are averaged weighted by their
    duration (exponentially, RATE_MEMORY_S): the estimate is tokens done over time busy, not the
    mean of small and large batches' rates."""

    def __init__(self, cold: float = COLD_TOKENS_PER_S, memory_s: float = RATE_MEMORY_S):
        self.cold = cold
        self.memory_s = memory_s
        self.measured: float | None = None  # under a backlog
        self.unloaded: float | None = None  # batches sent to an idle replica: round trips included
        self._last_done = float("-inf")

    @property
    def tokens_per_s(self) -> float:
        if self.measured is not None:
            return self.measured
        return self.cold if self.unloaded is None else self.unloaded

    def observe(self, tokens: int, sent: float, done: float) -> bool:
        """A batch of `tokens` sent at `sent` came back at `done` (monotonic seconds). True when it
        was measured under a backlog (the estimate is then a drain rate, not a round trip's)."""
        queued_behind = sent < self._last_done
        busy = done - self._last_done if queued_behind else done - sent
        self._last_done = max(self._last_done, done)
        if busy <= 0 or tokens <= 0:
            return False
        if queued_behind:
            self.measured = self._average(self.measured, tokens / busy, busy)
        else:
            self.unloaded = self._average(self.unloaded, tokens / busy, busy)
        return queued_behind

    def _average(self, estimate: float | None, sample: float, busy: float) -> float:
        if estimate is None:
            return sample
        return estimate + (1.0 - math.exp(-busy / self.memory_s)) * (sample - estimate)

    def seed(self, measured_at_load: float) -> None:
        """The worker's own tokens/s at load (0: none), COLD_SHARE of it counted until this replica
        has computed: the model's scale (a GPU drains a hundred times a CPU core, a large model a
        tenth of a small one), which no fixed guess has."""
        if measured_at_load > 0:
            self.cold = COLD_SHARE * measured_at_load

    def forget_backlog(self) -> None:
        """The replica restarted: its next batch does not queue behind one of the old process."""
        self._last_done = float("-inf")


# How long admission remembers that a model drained slower than it does now. The drain rate moves
# while a call waits, and a call admitted at the rate of a fast moment waits through the slow one
# that follows: bench.flood on 2 cores shared with other processes drained 22-24k tokens/s for a few
# seconds, then 12-15k for one or two, and calls admitted at 23k tokens/s with a calibration of 1.0
# (the waits answered just before had come in early) were answered after 3.0-3.3 s where 2 s were
# predicted. In that run the slow stretches came every ~7 s: a window longer than that keeps the last
# one in mind.
DRAIN_FLOOR_S = 10.0


class DrainFloor:
    """The slowest a model's drain rate (its replicas' DrainRate together) was over the last
    `window_s` seconds, as measured under a backlog: admission counts with it where the rate now is
    faster. The rate a call is admitted at is the rate of the moment, but it waits through the next
    seconds': erring low in a fast moment keeps fewer calls queued (each answered sooner; the
    replicas still never idle under a backlog), erring high admits calls into waits past
    --max-queue-wait that nothing can shorten once they are queued. The calibration (WaitCalibration)
    learns the same miss, but only from answers, a queue's length late, and forgets it as soon as a
    few answers come in early. Kept as a sliding minimum: each rate is dropped once a slower one has
    come after it, so a lookup is O(1) amortized."""

    def __init__(self, window_s: float = DRAIN_FLOOR_S):
        self.window_s = window_s
        self._rates: collections.deque[tuple[float, float]] = collections.deque()  # (when, rate), rising

    def observe(self, tokens_per_s: float, now: float, prior: float = 0.0) -> None:
        """The model's drain rate was `tokens_per_s` at `now` (after a batch measured under a backlog).
        A backlog's first window, with nothing slower known yet, counts at most at `prior` (the
        replicas' figures at load, discounted: DrainRate.cold): a flood's first seconds are measured
        before its refusals and tokenizing have taken their share of the cores (bench.flood: 18k
        tokens/s measured in its second second, 12-15k in its sixth and seventh)."""
        self.bound(tokens_per_s, now)  # drops what the window has passed
        if not self._rates and prior > 0:
            self._rates.append((now, prior))
        while self._rates and self._rates[-1][1] >= tokens_per_s:
            self._rates.pop()
        self._rates.append((now, tokens_per_s))

    def bound(self, tokens_per_s: float, now: float) -> float:
        """`tokens_per_s`, or the slowest rate of the last window_s seconds if that was slower."""
        while self._rates and self._rates[0][0] < now - self.window_s:
            self._rates.popleft()
        return min(tokens_per_s, self._rates[0][1]) if self._rates else tokens_per_s


# How fast the calibration follows: a served wait 4 s old weighs 1/e of a new one (waits last up to
# --max-queue-wait, so the feedback is that late already).
CALIBRATION_MEMORY_S = 4.0
# Waits predicted shorter than this teach nothing: a call admitted to a near-empty queue waits for
# the event loop and a batch's fixed cost, which no drain rate predicts.
CALIBRATION_FLOOR_S = 0.1
# What the calibration may scale a prediction by. Never below 1: waits shorter than predicted are the
# headroom the goal needs (a p99 within --max-queue-wait, not a mean at it); the uncalibrated rate
# already runs low, and scaled up to the mean, single queries under bench.flood waited 2.2 s at
# p50 where main's 0.4 s. At most 5: a few stray samples (a pause of the host) must not stop admission.
CALIBRATION_RANGE = (1.0, 5.0)
# The goal is a p99 within --max-queue-wait, and calls admitted near the limit miss their prediction
# by more than the mean miss (bench.flood, 600 x 32 inputs, 2 shared cores: answered 0.9 s past the
# prediction at p50, 3.7 s at p99): the factor is the ratio that this share of the recent predicted
# time was served within, not the mean ratio.
CALIBRATION_QUANTILE = 0.9
# Samples kept; older ones weigh next to nothing after a few CALIBRATION_MEMORY_S anyway.
CALIBRATION_SAMPLES = 256
# With no answer this long, the factor is 1 again: weights decay only against newer samples, so one
# stray slow answer would otherwise set it until traffic returned (a quiet server's next queue refused
# at a fraction of --max-queue-wait).
CALIBRATION_HORIZON_S = 5 * CALIBRATION_MEMORY_S


class WaitCalibration:
    """How long admitted calls really took to be answered, over how long admission predicted.

    Under a flood of 32-input calls on 2 shared cores, calls admitted at a predicted 2.0 s were
    answered after 3-5 s: the frontend, busy refusing, took the cores the drain rate was measured
    with, and a call's inputs came back in batches spread over its replicas' queues. The scheduler
    predicts, when it queues an interactive request, how long until its last row is back (the work
    ahead of it and its own, at the measured rate) and records the time it really took. The factor
    is the CALIBRATION_QUANTILE of served over predicted, each sample weighted by its predicted
    seconds (a long wait counts by its length, not as one vote) and decayed by its age. It only
    ever slows admission (CALIBRATION_RANGE)."""

    def __init__(
        self,
        memory_s: float = CALIBRATION_MEMORY_S,
        floor_s: float = CALIBRATION_FLOOR_S,
        quantile: float = CALIBRATION_QUANTILE,
    ):
        self.memory_s = memory_s
        self.floor_s = floor_s
        self.quantile = quantile
        self.samples: collections.deque[tuple[float, float, float]] = collections.deque(maxlen=CALIBRATION_SAMPLES)
        self.factor = 1.0  # as of the last sample: admission reads it on every call, a flood's refusals included

    def factor_at(self, now: float) -> float:
        """The factor admission scales predictions by now: 1 once no answer has been seen for
        CALIBRATION_HORIZON_S."""
        if not self.samples or now - self.samples[-1][0] > CALIBRATION_HORIZON_S:
            return 1.0
        return self.factor

    def observe(self, predicted_s: float, served_s: float, now: float) -> None:
        """A request predicted to be answered after `predicted_s` was answered after `served_s` (at `now`)."""
        if predicted_s < self.floor_s:
            return
        self.samples.append((now, predicted_s, served_s))
        self.factor = self._served_within(now)

    def _served_within(self, now: float) -> float:
        """The ratio served / predicted that `quantile` of the decayed predicted time fell within."""
        weighted = sorted(
            (served / predicted, predicted * math.exp(-(now - when) / self.memory_s))
            for when, predicted, served in self.samples
        )
        goal, running = self.quantile * sum(weight for _, weight in weighted), 0.0
        for ratio, weight in weighted[:-1]:
            running += weight
            if running >= goal:
                return _bounded(ratio)
        return _bounded(weighted[-1][0])


def _bounded(factor: float) -> float:
    low, high = CALIBRATION_RANGE
    return min(high, max(low, factor))


# How fast the token estimate follows: each request tokenized weighs 1/ESTIMATE_MEMORY of the figure.
ESTIMATE_MEMORY = 32


class TokenEstimate:
    """How many tokens a request's character estimate (registry.estimate_tokens) turns out to hold.

    The estimate is deliberately low (8 characters a token, where English runs ~4), and bench.flood's
    32 texts of 60 words are 1,260 estimated and 4,096 real tokens: counted as estimated, a flood's
    first burst of calls still tokenizing was admitted at a third of its work (those calls were
    answered after 2.3-2.5 s), and a call's own compute at a third of its length. Admission's
    predictions scale the estimates by the ratio recent requests showed (real over estimated tokens,
    summed, so a long request counts by its length); the memory bounds keep the estimate itself."""

    def __init__(self, memory: int = ESTIMATE_MEMORY):
        self.decay = 1.0 - 1.0 / memory
        self._estimated = 0.0
        self._real = 0.0

    @property
    def scale(self) -> float:
        """Real tokens per estimated token; 1 until a request has been tokenized."""
        return self._real / self._estimated if self._estimated > 0 else 1.0

    def observe(self, estimated: int, real: int) -> None:
        """A request estimated at `estimated` tokens held `real` once tokenized."""
        if estimated <= 0 or real < 0:
            return
        self._estimated = self.decay * self._estimated + estimated
        self._real = self.decay * self._real + real


@dataclass(frozen=True)
class Refusal:
    """Why a call is refused, and when a retry may be served (whole seconds, for Retry-After)."""

    wait_s: float
    limit_s: float
    by_deadline: bool

    @property
    def retry_after_s(self) -> int:
        return max(1, math.ceil(self.wait_s - self.limit_s))

    def message(self, model: str) -> str:
        why = "its deadline leaves" if self.by_deadline else "the server's --max-queue-wait is"
        return (
            f"model {model} is overloaded: a call now would wait about {self.wait_s:.1f} s for the work "
            f"queued ahead of it, and {why} {self.limit_s:.1f} s; retry in {self.retry_after_s} s"
        )


def expected_wait(tokens_ahead: int, tokens_per_s: float) -> float:
    """Seconds until work queued now starts: what is ahead of it at the model's drain rate."""
    return tokens_ahead / tokens_per_s if tokens_per_s > 0 else math.inf


def admission(
    tokens_ahead: int,
    own_tokens: int,
    tokens_per_s: float,
    max_wait_s: float,
    time_left_s: float | None = None,
    factor: float = 1.0,
) -> Refusal | None:
    """None to admit, else the Refusal. `tokens_per_s` is the measured drain rate and `factor` the
    calibration's (WaitCalibration: how much longer than predicted answers take). The call's answer
    is predicted at the calibrated rate, the work ahead then its own (`own_tokens`, 0 where not yet
    known). Refused: when it would wait longer than `max_wait_s` (0: no limit) beyond its own compute
    at the measured rate (the part of its answer's time that is not its compute, including what the
    calibration adds to that compute), or when its answer would come past its deadline. An empty
    queue admits every call, whatever the rate says: a cold estimate never refuses the first."""
    if tokens_ahead <= 0:
        return None
    calibrated = tokens_per_s / factor
    answer = expected_wait(tokens_ahead + own_tokens, calibrated)
    wait = answer - (own_tokens / tokens_per_s if tokens_per_s > 0 else 0.0)
    if max_wait_s and wait > max_wait_s:
        return Refusal(wait, max_wait_s, by_deadline=False)
    if time_left_s is not None and answer > time_left_s:
        return Refusal(expected_wait(tokens_ahead, calibrated), max(time_left_s, 0.0), by_deadline=True)
    return None
