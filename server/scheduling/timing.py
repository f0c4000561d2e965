"""Where a call's time went, for its `server-timing` trailer (REST: the Server-Timing header).

A unary call (server/api/service.py, `rpc`) holds a CallTiming in CALL_TIMING; tokenizing
(server/models/compute.py) and the scheduler (`ModelScheduler.run`) add the intervals they spent.
Each figure is the length of a union of intervals, so the runs of one call that overlap (a
multimodal query and its documents) are not counted twice:
  * tokenize: turning its texts into token ids;
  * queue: from its inputs' queueing to its answer, less the time its batches were computing
    (waiting for a free replica, behind other work, between its own batches, and the hand-off of
    each batch to its worker and back: ~1 ms on an idle 2-core host);
  * compute: the time some batch holding its inputs ran in a worker (the worker's own figure);
  * total: from the call's arrival to its answer.
A call that tokenized nothing, or scheduled nothing (its inputs all in the result cache, or computed
by another call in flight), has no such figure; `total` is always there.
"""

from __future__ import annotations

import contextvars
import time
from dataclasses import dataclass, field

Interval = tuple[float, float]  # (start, end), time.monotonic()


def covered(intervals: list[Interval]) -> float:
    """The length of the union of `intervals`."""
    length, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end > reach:
            length += end - max(start, reach)
            reach = end
    return length


@dataclass
class CallTiming:
    started: float  # time.monotonic() when the call arrived
    tokenizing: list[Interval] = field(default_factory=list)
    scheduled: list[Interval] = field(default_factory=list)  # from its inputs' queueing to their answer
    computing: list[Interval] = field(default_factory=list)  # within `scheduled`

    def tokenized(self, since: float) -> None:
        self.tokenizing.append((since, time.monotonic()))

    def ran(self, queued_at: float, answered_at: float, computing: list[Interval]) -> None:
        self.scheduled.append((queued_at, answered_at))
        self.computing.extend(computing)

    def header(self, now: float | None = None) -> str:
        """The W3C Server-Timing value, in milliseconds: the steps the call went through, and total."""
        figures = []
        if self.tokenizing:
            figures.append(("tokenize", covered(self.tokenizing)))
        if self.scheduled:
            compute = covered(self.computing)
            figures += [("queue", max(0.0, covered(self.scheduled) - compute)), ("compute", compute)]
        figures.append(("total", (time.monotonic() if now is None else now) - self.started))
        return ", ".join(f"{name};dur={seconds * 1000:.2f}" for name, seconds in figures)


# The current unary call's timing (None outside one: streams, in-process callers). Its `started` is
# also where admission's calibration counts the call's wait from (ModelScheduler.run).
CALL_TIMING: contextvars.ContextVar[CallTiming | None] = contextvars.ContextVar("call_timing", default=None)

# The trailer's name; Envoy moves it into REST responses' headers (gateway/server_timing.lua).
TRAILER = "server-timing"
