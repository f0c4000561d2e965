"""Per-model scheduler: queues of single inputs -> dynamic batches -> replicas.

Policy (which inputs form the next batch) lives in batching.py; this file
decides *when* and *where* to send:
  * interactive inputs are always batched before bulk ones;
  * a batch goes at once to an idle replica (a lone query never waits for a
    batch window), and interactive work at once to a replica running only bulk
    work (the worker runs it between the bulk batch's layers); a busy replica
    gets one when it is full or the oldest input has waited `batch_delay`, with
    at most `max_in_flight` batches per replica;
  * bulk batches may fill all but one slot of a replica, and are cut small
    (`bulk_limits`) while interactive work is around, so a live query never
    queues behind much bulk work; with no interactive or split work around and
    a deep bulk queue, a replica also holds one bulk batch queued in its worker
    behind the one it computes (`_prefetching`), so it never idles while the
    frontend sends the next;
  * each batch goes to the ready replica with the fewest tokens in flight; work
    that finds several replicas idle is cut into one piece for each, so a lone
    rerank runs on all of them at once; a batch lost with a dying replica is
    queued again for the others;
  * a call is admitted by the time it would wait (admission.py: the work ahead
    of it at each replica's measured drain rate), not only by the queue's size:
    interactive calls within --max-queue-wait, bulk calls within their deadline;
  * an interactive request bigger than SPLIT_BATCHES batches is cut (`split_large`):
    all of it waits in the SPLIT queue, after every interactive input and before
    bulk work, and is computed like bulk work (in the worker's bulk lane, which a
    query preempts), so one maximum-size call does not hold other callers'
    queries behind it; while SPLIT holds a batch for every replica, each replica
    also holds one split batch queued behind the one it computes, queries or not
    (`_takes_split_ahead`); interactive work goes to the replica with the least
    interactive work in flight, so a query does not queue behind another's;
    different callers' split requests (CALLER: API key, else connection) take
    turns of a batch each in SPLIT, so a second big call does not wait for all of
    the first.

Over 400 lines for now: issue #42 is reworking admission here; splitting the queues from the dispatch waits for it.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import dataclasses
import enum
import functools
import itertools
import logging
import time
from collections import deque
from collections.abc import Hashable
from dataclasses import dataclass

import numpy as np

from ..base import metrics
from ..base.errors import Overloaded, Unavailable
from .admission import (
    CALL_DEADLINE,
    DrainFloor,
    DrainRate,
    TokenEstimate,
    WaitCalibration,
    admission,
    expected_wait,
)
from .batching import BatchLimits, WorkItem, interleave_callers, pack, queued_cost_reaches_budget, take_batch
from .timing import CALL_TIMING, Interval
from .worker_client import WorkerClient

log = logging.getLogger("encoderd.scheduler")

INTERACTIVE_WINDOW = 2.0  # seconds after an interactive request during which bulk batches stay small
MAX_ATTEMPTS = 2  # an input whose batch died twice with its worker is failed, not retried forever
MIN_SHARE_TOKENS = 64  # work is not cut for idle replicas below this: a batch's fixed cost would dominate
# An interactive request over this many batches (by inputs or tokens) is split (`split_large`). A few
# batches run whole: a query waits for at most that much of its work, and the request keeps its
# priority (on a busy shared host a split flood of 32-input calls starved in the workers' bulk lanes).
SPLIT_BATCHES = 4
# Bulk batches a replica may hold queued in its worker, past the one it computes, while no live work
# is around (`_prefetching`): the worker starts the next as the last ends, not a round trip later.
# MiniLM bulk on a shared 2-core Zen 5 host: the workers idled ~2 % of each batch waiting for the next.
BULK_PREFETCH = 1
# Split batches a replica may hold queued in its worker past the one it computes, live work or not,
# while the SPLIT queue holds a full batch for every replica: the worker's bulk lane starts the next
# piece of a big call as the last ends. A query never waits for it: it runs in the urgent lane, or
# (one lane) before queued batches, between a batch's steps. A second caller's split batch waits
# for at most the computing batch and the one queued. `python -m encoderd.bench.fair --rounds 3
# --big-calls 1 --idle-seconds 4` against the same code with 0 (shared 2-core Zen 5, one quiet
# round): the big call beside queries 369 / 228 / 211 inputs/s against 350 / 208 / 198, at the same
# bulk-lane CPU; query p99 / idle p99 1.93 / 2.95 / 2.75x against 2.35 / 4.24 / 3.81x.
SPLIT_PREFETCH = 1


class Priority(enum.IntEnum):
    """A queue of the scheduler's, in the order it serves them. Only INTERACTIVE and BULK are asked
    for; SPLIT holds interactive requests too big to run whole (`split_large`): served before bulk
    work, computed like it (in the worker's bulk lane, which a query preempts)."""

    INTERACTIVE = 1
    SPLIT = 2
    BULK = 3


# The priority of a request that names none: interactive, unless its API key is a bulk key
# (set per call by the service layer).
DEFAULT_PRIORITY: contextvars.ContextVar[Priority] = contextvars.ContextVar(
    "default_priority", default=Priority.INTERACTIVE
)


# Who the current call comes from (set per call by the service layer, request_options.bind_caller:
# its API key, else its connection): big requests of different callers take turns in the SPLIT
# queue instead of running one after the other; None (in-process callers) is one caller.
CALLER: contextvars.ContextVar[Hashable | None] = contextvars.ContextVar("caller", default=None)


class PendingRequest:
    """One request's inputs, reassembled in order as their batches finish. Dense rows are written
    into one array as they come: stacking 2,048 rows at the end held the event loop (and every
    other caller's query) ~5 ms on a loaded 2-core host, row by row."""

    __slots__ = ("computing", "future", "ragged", "remaining", "rows")

    def __init__(self, n_inputs: int, ragged: bool = False):
        self.future: asyncio.Future = asyncio.get_running_loop().create_future()
        self.rows: list | np.ndarray | None = [None] * n_inputs if ragged else None  # dense: made by the first row
        self.remaining = n_inputs
        self.ragged = ragged  # rows of different shapes (multi-vector, sparse): a list, not stacked
        self.computing: list[Interval] = []  # when each batch holding its inputs ran (timing.py)

    @property
    def done(self) -> bool:
        return self.future.done()

    def fill(self, index: int, row: np.ndarray) -> None:
        if self.rows is None:
            self.rows = np.empty((self.remaining, *np.shape(row)), dtype=np.result_type(row))
        self.rows[index] = row
        self.remaining -= 1
        if self.remaining == 0 and not self.future.done():
            self.future.set_result(self.rows)

    def fail(self, error: Exception) -> None:
        if not self.future.done():
            self.future.set_exception(error)


@dataclass
class ReplicaLoad:
    batches: int = 0
    bulk_batches: int = 0  # in the worker's bulk lane: bulk and split work
    tokens: int = 0
    bulk_tokens: int = 0
    split_batches: int = 0  # of the bulk lane's: split work, which the worker takes before queued bulk batches
    split_tokens: int = 0

    def add(self, tokens: int, priority: Priority, sign: int = 1) -> None:
        """Count a batch sent (sign 1) or back (-1)."""
        self.batches += sign
        self.tokens += sign * tokens
        if priority != Priority.INTERACTIVE:
            self.bulk_batches += sign
            self.bulk_tokens += sign * tokens
        if priority == Priority.SPLIT:
            self.split_batches += sign
            self.split_tokens += sign * tokens


class ModelScheduler:
    def __init__(
        self,
        model: str,
        replicas: list[WorkerClient],
        limits: BatchLimits,
        *,
        lane_limits: BatchLimits | None = None,
        bulk_limits: BatchLimits | None = None,
        batch_delay: float = 0.005,
        max_queued: int = 16384,
        max_queued_tokens: int = 0,
        max_in_flight: int = 2,
        max_queue_wait: float = 0.0,
        split_large: bool = False,
    ):
        self.model = model
        self.replicas = replicas
        # Bulk-lane work (SPLIT, BULK) may batch more inputs than queries do (ServerConfig.lane_batch_size),
        # and bulk batches are cut to `bulk_limits` while live work is around (_limits).
        lane = lane_limits or limits
        self.limits = {Priority.INTERACTIVE: limits, Priority.SPLIT: lane, Priority.BULK: lane}
        self.live_bulk_limits = bulk_limits or lane
        self.batch_delay = batch_delay
        self.max_queued = max_queued
        self.max_queued_tokens = max_queued_tokens
        self.max_in_flight = max_in_flight
        self.max_queue_wait = max_queue_wait  # seconds an interactive call may wait; 0 = no bound
        # An interactive request over SPLIT_BATCHES batches runs as bulk-lane work (the SPLIT queue).
        self.split_large = split_large
        self.queues: dict[Priority, deque[WorkItem]] = {p: deque() for p in Priority}
        self.load = {replica: ReplicaLoad() for replica in replicas}
        self.drain = {replica: DrainRate() for replica in replicas}
        for replica in replicas:
            self._seed_drain(replica)
        self.drain_floor = DrainFloor()  # the slowest the replicas drained together of late
        self.calibration = WaitCalibration()  # predicted waits against served ones
        self.token_estimate = TokenEstimate()  # real tokens per estimated one, for the predictions
        self._queued_tokens = dict.fromkeys(Priority, 0)
        # Admitted requests still tokenizing: their inputs, and their estimated tokens by the queue
        # they will wait in (a maximum-size call tokenizing must not count ahead of a query).
        self._reserved_inputs = 0
        self._reserved_tokens = dict.fromkeys(Priority, 0)
        self._interactive_seen = float("-inf")  # when interactive work last arrived
        self._live_seen = float("-inf")  # when interactive or split work last arrived
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._computing: set[asyncio.Task] = set()  # the event loop keeps only weak references to tasks

    @property
    def queued(self) -> int:
        return sum(len(q) for q in self.queues.values())

    @property
    def ready(self) -> bool:
        return any(r.ready for r in self.replicas)

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name=f"scheduler[{self.model}]")

    async def stop(self) -> None:
        if self._task:
            self._task.cancel()
        self._fail_queued(Unavailable(f"model {self.model} is shutting down"))

    @contextlib.contextmanager
    def reserve(self, inputs: int, tokens: int, priority: Priority = Priority.INTERACTIVE):
        """Admission before tokenization: refuse at once when the queue bounds, counting the
        requests still tokenizing, leave no room for `inputs` (~`tokens`, an estimate), or when the
        call would wait too long; else hold their place until the block ends (the request then
        queues its real inputs by submit). Yields a function the caller gives the real token count
        once tokenized: what the estimates turn out to hold scales admission's predictions."""
        self._refuse_if_full(inputs, tokens)
        waits_in = self._runs_as(priority, inputs, tokens)
        self._refuse_if_slow(round(tokens * self.token_estimate.scale), waits_in)
        self._reserved_inputs += inputs
        self._reserved_tokens[waits_in] += tokens
        try:
            yield functools.partial(self.token_estimate.observe, tokens)
        finally:
            self._reserved_inputs -= inputs
            self._reserved_tokens[waits_in] -= tokens

    def refuse_if_full(self, inputs: int, priority: Priority = Priority.INTERACTIVE) -> None:
        """The earliest check, before a request is validated or keyed: a flood is refused in
        microseconds of the event loop (reserve() checks again with the token estimate)."""
        self._refuse_if_full(inputs, 0)
        self._refuse_if_slow(0, self._runs_as(priority, inputs, 0))

    def _refuse_if_full(self, inputs: int, tokens: int) -> None:
        """The memory bounds: inputs (and tokens) queued or tokenizing."""
        if not self.ready:
            raise Unavailable(f"model {self.model} is unavailable (its worker is restarting)")
        queued = self.queued + self._reserved_inputs
        queued_tokens = sum(self._queued_tokens.values()) + sum(self._reserved_tokens.values())
        if queued + inputs > self.max_queued or (
            self.max_queued_tokens and queued_tokens + tokens > self.max_queued_tokens
        ):
            metrics.series(metrics.REJECTED, self.model, "queue_full").inc()
            raise Overloaded(
                f"model {self.model} is overloaded ({queued} inputs, {queued_tokens} tokens "
                f"queued or tokenizing); retry later"
            )

    def _refuse_if_slow(self, own_tokens: int, priority: Priority) -> None:
        """The time bound: refused when the work ahead would hold the call past its own deadline or,
        for interactive work (a split request's rest included), past --max-queue-wait (admission.py).
        A bulk call is bounded by its deadline and the memory bounds only: an ingestion job wants
        throughput, and a refusal every few seconds cost `encoderd bench`'s bulk clients ~15 %."""
        deadline, now = CALL_DEADLINE.get(), time.monotonic()
        refusal = admission(
            self.tokens_ahead(priority),
            own_tokens,
            self.admission_tokens_per_s(now),
            0.0 if priority == Priority.BULK else self.max_queue_wait,
            None if deadline is None else deadline - now,
            factor=self.calibration.factor_at(now),
        )
        if refusal:
            metrics.series(metrics.REJECTED, self.model, "deadline" if refusal.by_deadline else "queue_wait").inc()
            raise Overloaded(refusal.message(self.model), retry_after=refusal.retry_after_s)

    def tokens_ahead(self, priority: Priority, tokenizing: bool = True) -> int:
        """The work a call of this priority queues behind: queued work that goes before it, work
        still `tokenizing` (admitted before it; its estimate scaled by what estimates held, so a
        flood's first burst counts at its real length), and batches computing (an interactive
        call's batch preempts bulk-lane ones)."""
        ahead = [p for p in Priority if p <= priority]
        queued = sum(self._queued_tokens[p] for p in ahead)
        if tokenizing:
            queued += round(self.token_estimate.scale * sum(self._reserved_tokens[p] for p in ahead))
        return queued + round(sum(self._in_flight_ahead(load, priority) for load in self.load.values()))

    def _in_flight_ahead(self, load: ReplicaLoad, priority: Priority) -> float:
        """The tokens in a replica's batches that a batch of `priority` sent now waits for: an
        interactive one preempts the bulk lane; a split one goes before a prefetched bulk batch (the
        worker takes it first), counted at the bulk batches' mean size (prefetched ones are full)."""
        if priority == Priority.INTERACTIVE:
            return load.tokens - load.bulk_tokens
        prefetched = self._prefetched(load)
        if priority == Priority.SPLIT and prefetched:
            bulk_only = load.bulk_batches - load.split_batches
            return load.tokens - (load.bulk_tokens - load.split_tokens) * prefetched / bulk_only
        return load.tokens

    @property
    def tokens_per_s(self) -> float:
        """The calibrated rate: admission's, slowed by how much longer than predicted the recent
        waits were (WaitCalibration); admission counts the call's own compute apart."""
        now = time.monotonic()
        return self.admission_tokens_per_s(now) / self.calibration.factor_at(now)

    def admission_tokens_per_s(self, now: float) -> float:
        """The rate admission predicts with: the measured one, or the slowest it was of late
        (DrainFloor) where that was slower: a call waits through the coming seconds, not this one."""
        return self.drain_floor.bound(self.measured_tokens_per_s, now)

    @property
    def measured_tokens_per_s(self) -> float:
        """The model's drain rate: its ready replicas' together."""
        return sum(self.drain[r].tokens_per_s for r in self.replicas if r.ready)

    def _drains_measured(self) -> bool:
        """Whether every ready replica's rate is a drain rate: one still counted at its idle round
        trips or its worker's figure (a flood's first second) would set the floor of the whole window."""
        return all(self.drain[r].measured is not None for r in self.replicas if r.ready)

    def _predict_answer(self, tokens: int, priority: Priority) -> float:
        """How long until a request of `tokens` queued now is answered at the measured rate: the work
        queued and computing ahead of it, then its own. Requests still tokenizing are not counted (they
        queue behind it). At admission's rate, uncalibrated: the calibration is what such predictions
        miss by, not a correction of itself."""
        ahead = self.tokens_ahead(priority, tokenizing=False)
        return expected_wait(ahead + tokens, self.admission_tokens_per_s(time.monotonic()))

    def _runs_as(self, priority: Priority, inputs: int, tokens: int) -> Priority:
        """The queue a request of `inputs` (`tokens`) mostly waits in: a split one's rest waits in SPLIT."""
        one_batch = self.limits[Priority.INTERACTIVE]
        most_inputs, most_tokens = SPLIT_BATCHES * one_batch.max_batch_size, SPLIT_BATCHES * one_batch.max_batch_tokens
        bigger = inputs > most_inputs or tokens > most_tokens
        return Priority.SPLIT if self.split_large and priority == Priority.INTERACTIVE and bigger else priority

    def submit(self, items: list[WorkItem], priority: Priority = Priority.INTERACTIVE) -> float | None:
        """Queue a request's inputs, or refuse at once when over a memory bound (the wait was
        judged at admission: a request tokenized by then is not thrown away for it). A split request
        (`split_large`) queues all its inputs in SPLIT: none of it runs as urgent work, which a
        query cannot preempt (a first batch of 16 x 128 tokens there held queries on its replica
        ~0.1 s, bench/fair.py's start window). Returns, for an interactive request, how long the
        measured rate predicts until it is answered (None for the others: later interactive work
        goes before them, so their waits say nothing of the bound admission keeps)."""
        tokens = sum(item.length for item in items)
        self._refuse_if_full(len(items), tokens)
        now = time.monotonic()
        for item in items:
            item.enqueued = now
        waits_in = self._runs_as(priority, len(items), tokens)
        predicted = None
        if priority == Priority.INTERACTIVE:
            self._live_seen = now
        if waits_in == Priority.INTERACTIVE:
            self._interactive_seen = now
            predicted = self._predict_answer(tokens, waits_in)
        self._enqueue(items, waits_in)
        self._queue_changed()
        self._wake.set()
        return predicted

    def _enqueue(self, items: list[WorkItem], priority: Priority) -> None:
        if priority == Priority.SPLIT:  # callers take turns of a batch each (CALLER)
            caller = CALLER.get()
            for item in items:
                item.caller = caller
            turn = self.limits[Priority.INTERACTIVE].max_batch_size  # a lane batch may hold several turns
            self.queues[priority] = interleave_callers(self.queues[priority], items, turn)
        else:
            self.queues[priority].extend(items)
        metrics.series(metrics.QUEUED_INPUTS, self.model, priority.name.lower()).inc(len(items))
        self._queued_tokens[priority] += sum(item.length for item in items)

    async def run(
        self, items: list[WorkItem], request: PendingRequest, priority: Priority = Priority.INTERACTIVE
    ) -> np.ndarray:
        """Queue the inputs and wait for all their rows; cancellation drops queued ones. The time the
        rows took, against the time predicted, calibrates admission (admission.WaitCalibration):
        counted to the last row, as the caller waits, not the first, and from when the call reached
        the server (its CALL_TIMING's start), not when it queued: what admitting and tokenizing it
        took under load (up to 0.26 s in bench.flood) is time admission did not predict either. The
        call's timing (timing.py) also gets the span it queued and its batches' compute."""
        queued_at = time.monotonic()
        predicted = self.submit(items, priority)
        try:
            rows = await request.future
        finally:
            request.future.cancel()  # no-op once done; makes take_batch drop queued inputs
        answered_at, timing = time.monotonic(), CALL_TIMING.get()
        if predicted is not None:
            served_since = queued_at if timing is None else min(timing.started, queued_at)
            self.calibration.observe(predicted, answered_at - served_since, answered_at)
        if timing is not None:
            timing.ran(queued_at, answered_at, request.computing)
        return rows

    # ------------------------------------------------------------- the loop
    async def _run(self) -> None:
        watchers = [asyncio.create_task(self._watch_replica(r)) for r in self.replicas]
        try:
            while True:
                await self._wake.wait()
                self._wake.clear()
                self._dispatch_ready_batches()
        finally:
            for watcher in watchers:
                watcher.cancel()

    def _dispatch_ready_batches(self) -> None:
        for priority in Priority:
            queue, limits = self.queues[priority], self._limits(priority)
            shared = self._share_among_idle(priority, limits)  # for this round's idle replicas
            while queue:
                replica = self._pick_replica(priority)
                if replica is None:
                    break
                load = self.load[replica]
                # Interactive work goes at once to a replica running only bulk work: the worker
                # runs it in the next pause between the bulk batch's layers (workers/process.py).
                ahead = load.batches - (load.bulk_batches if priority == Priority.INTERACTIVE else 0)
                if ahead and not self._should_close(queue, limits):
                    break
                batch = self._take(priority, limits if load.batches else shared)
                if batch:
                    self._send(replica, batch, priority)
            if queue:
                return  # interactive work still waits: bulk work must not overtake it

    def _limits(self, priority: Priority) -> BatchLimits:
        """Bulk batches are cut small only while live traffic is around: alone, bulk work
        gets full batches; next to interactive work, each bulk batch is short, so a live
        query waits for little more than its own compute."""
        live = self.serving_queries()
        return self.live_bulk_limits if live and priority != Priority.INTERACTIVE else self.limits[priority]

    def serving_queries(self) -> bool:
        """Whether interactive work came within INTERACTIVE_WINDOW: live queries are around, and what
        runs beside them (bulk batches here, a big request's tokenizing) leaves them room."""
        return time.monotonic() - self._interactive_seen < INTERACTIVE_WINDOW

    def _share_among_idle(self, priority: Priority, limits: BatchLimits) -> BatchLimits:
        """With k replicas idle, cut the next batches to about 1/k of the queued tokens each:
        what would go to one replica goes out as k pieces computed side by side (2 one-thread
        CPU replicas rerank 50 passages faster than one two-thread worker). The token cap has
        one input's length of slack, so k pieces hold it all. A padding-free backend's size cap
        is lifted for them (short inputs must not fill a piece by count); a padded backend keeps
        it (TensorRT profiles end there), so its pieces may come out more than k."""
        queue = self.queues[priority]
        idle = sum(1 for r in self.replicas if r.ready and not self.load[r].batches)
        if idle < 2 or not queue:
            return limits
        longest = max(item.length for item in itertools.islice(queue, limits.window))
        tokens = max(MIN_SHARE_TOKENS, -(-self._queued_tokens[priority] // idle) + longest)
        if tokens >= limits.max_batch_tokens:
            return limits
        size = limits.max_batch_size if limits.padded else max(limits.max_batch_size, len(queue))
        return dataclasses.replace(limits, max_batch_tokens=tokens, max_batch_size=size)

    def _pick_replica(self, priority: Priority) -> WorkerClient | None:
        free = [r for r in self.replicas if r.ready and self._has_slot(self.load[r], priority)]
        if not free:
            return None
        if priority == Priority.INTERACTIVE:
            # A query preempts bulk-lane work but waits for urgent work: the replica with the least
            # urgent work in flight, then the least in all.
            return min(free, key=lambda r: (self.load[r].tokens - self.load[r].bulk_tokens, self.load[r].tokens))
        return min(free, key=lambda r: self.load[r].tokens)

    @property
    def _bulk_cap(self) -> int:
        """Bulk-lane batches a replica may compute: all but one slot, left free for interactive work."""
        return max(1, self.max_in_flight - 1)

    def _prefetched(self, load: ReplicaLoad) -> int:
        """A replica's bulk batches queued in its worker behind the bulk-lane work it computes."""
        return max(0, load.bulk_batches - load.split_batches - self._bulk_cap)

    def _has_slot(self, load: ReplicaLoad, priority: Priority) -> bool:
        """Whether a replica with this load takes another batch of `priority`. The bulk lane holds at
        most the bulk cap's slots, however many batches wait in it: the slot bulk leaves free stays
        free for a query, which the worker runs beside bulk work, never behind it. A split batch goes
        where the lane has room, before a prefetched bulk batch (the worker takes it first: it
        waits for the batch computing only, as it would with no prefetching), or queued behind the
        lane's computing batches (`_takes_split_ahead`)."""
        lane, cap = load.bulk_batches, self._bulk_cap
        if priority == Priority.SPLIT and self._takes_split_ahead(load):
            return True
        if load.batches - lane + min(lane, cap) >= self.max_in_flight:
            return False
        if priority == Priority.INTERACTIVE:
            return True
        if priority == Priority.SPLIT:
            return lane < cap or (self._prefetched(load) > 0 and load.split_batches < cap)
        return lane < cap + (BULK_PREFETCH if self._prefetching() else 0)

    def _takes_split_ahead(self, load: ReplicaLoad) -> bool:
        """Whether a replica whose bulk lane computes all it may takes a split batch queued behind
        (SPLIT_PREFETCH), live work around or not: it holds no slot (a query's batch runs beside or
        before it), so queries in flight there do not stop it. Only while the SPLIT queue holds a
        full batch for every replica: its last batches go to whichever replica frees first."""
        lane, cap = load.bulk_batches, self._bulk_cap
        return cap <= lane < cap + SPLIT_PREFETCH and self._holds_a_batch_per_replica(Priority.SPLIT)

    def _prefetching(self) -> bool:
        """Whether replicas take a bulk batch ahead: only with no interactive or split work for
        INTERACTIVE_WINDOW (beside live work the lanes stay as #42 measured them; a split request
        that comes meanwhile goes before the batches already ahead, `_has_slot`), and while the bulk
        queue holds a full batch for every replica (its last batches go to whichever replica frees
        first, so the replicas finish together)."""
        if self.queues[Priority.SPLIT] or time.monotonic() - self._live_seen < INTERACTIVE_WINDOW:
            return False
        return self._holds_a_batch_per_replica(Priority.BULK)

    def _holds_a_batch_per_replica(self, priority: Priority) -> bool:
        """Whether the queue of `priority` holds a full batch (bulk-sized) for every ready replica: only
        then does a replica take one ahead, so the last batches go to whichever replica frees first
        and the replicas finish together."""
        limits = self.limits[priority]
        replicas = sum(1 for r in self.replicas if r.ready)
        return (
            len(self.queues[priority]) >= replicas * limits.max_batch_size
            or self._queued_tokens[priority] >= replicas * limits.max_batch_tokens
        )

    def _should_close(self, queue: deque[WorkItem], limits: BatchLimits) -> bool:
        if queued_cost_reaches_budget(queue, limits):
            return True
        waited = time.monotonic() - queue[0].enqueued
        if waited >= self.batch_delay:
            return True
        asyncio.get_running_loop().call_later(self.batch_delay - waited, self._wake.set)
        return False

    def _take(self, priority: Priority, limits: BatchLimits) -> list[WorkItem]:
        queue = self.queues[priority]
        before = len(queue)
        batch = take_batch(queue, limits)
        dropped = before - len(queue) - len(batch)
        if dropped:
            metrics.series(metrics.DROPPED, self.model).inc(dropped)
        now = time.monotonic()
        for item in batch:
            metrics.series(metrics.QUEUE_WAIT, self.model).observe(now - item.enqueued)
        self._queued_tokens[priority] = (
            sum(item.length for item in queue)
            if dropped
            else (self._queued_tokens[priority] - sum(item.length for item in batch))
        )
        self._queue_changed()
        return batch

    def _send(self, replica: WorkerClient, batch: list[WorkItem], priority: Priority) -> None:
        tokens = sum(item.length for item in batch)
        self.load[replica].add(tokens, priority)
        task = asyncio.create_task(self._compute(replica, batch, priority, tokens))
        self._computing.add(task)
        task.add_done_callback(self._computing.discard)

    async def _compute(self, replica: WorkerClient, batch: list[WorkItem], priority: Priority, tokens: int) -> None:
        started, sent = time.perf_counter(), time.monotonic()
        try:
            packed = pack(batch, 0, urgent=priority == Priority.INTERACTIVE, ahead_of_bulk=priority == Priority.SPLIT)
            rows, computed_s = await replica.compute_timed(packed)
        except Unavailable as exc:
            self._retry_or_fail(batch, priority, exc)
            return
        except asyncio.CancelledError:  # the scheduler stops: its requests must not wait forever
            for item in batch:
                item.request.fail(Unavailable(f"model {self.model} is shutting down"))
            raise
        except Exception as exc:  # noqa: BLE001 - not swallowed: each request of the batch fails with it
            for item in batch:
                item.request.fail(exc)
            return
        finally:
            self.load[replica].add(tokens, priority, -1)
            self._wake.set()
        done = time.monotonic()
        ran = (max(sent, done - computed_s), done)  # the worker's own time, ending as its result came back
        for request in {id(item.request): item.request for item in batch}.values():
            request.computing.append(ran)
        if self.drain[replica].observe(tokens, sent, done) and self._drains_measured():
            prior = sum(self.drain[r].cold for r in self.replicas if r.ready)
            self.drain_floor.observe(self.measured_tokens_per_s, done, prior)
        metrics.observe_batch(
            self.model, replica.label, batch, self.limits[priority].padded, time.perf_counter() - started
        )
        for item, row in zip(batch, rows, strict=True):
            item.request.fill(item.index, row)

    def _retry_or_fail(self, batch: list[WorkItem], priority: Priority, error: Exception) -> None:
        """A replica died under this batch: let another replica take it, within limits."""
        retry = [item for item in batch if not item.request.done and item.attempts + 1 < MAX_ATTEMPTS]
        for item in batch:
            if item not in retry:
                item.request.fail(error)
        if retry and self.ready:
            for item in retry:
                item.attempts += 1
            self.queues[priority].extendleft(reversed(retry))
            self._queued_tokens[priority] += sum(item.length for item in retry)
            self._queue_changed()
        else:
            for item in retry:
                item.request.fail(error)

    async def _watch_replica(self, replica: WorkerClient) -> None:
        """When the last replica goes down, queued work fails fast instead of waiting."""
        while True:
            await replica.state_changed.wait()
            replica.state_changed.clear()
            self.drain[replica].forget_backlog()  # a new process: its first batch queues behind none
            self._seed_drain(replica)
            if not self.ready:
                self._fail_queued(Unavailable(f"model {self.model} is unavailable (its worker crashed; restarting)"))
            self._wake.set()

    def _seed_drain(self, replica: WorkerClient) -> None:
        """A ready replica's drain rate starts from what its worker measured at load."""
        if replica.ready_info is not None:
            self.drain[replica].seed(replica.ready_info.tokens_per_s)

    def _fail_queued(self, error: Exception) -> None:
        for priority, queue in self.queues.items():
            self.queues[priority] = deque()
            for item in queue:
                item.request.fail(error)
        self._queued_tokens = dict.fromkeys(Priority, 0)
        self._queue_changed()

    def _queue_changed(self) -> None:
        metrics.series(metrics.QUEUE_DEPTH, self.model).set(self.queued)
