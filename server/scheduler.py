"""Per-model scheduler: queue of single inputs -> dynamic batches -> worker.

Policy (which inputs form the next batch) lives in batching.py; this file
decides *when* to send: at once when the worker is idle (a lone query never
waits for a batch window), otherwise when a batch is full or the oldest
queued input has waited `batch_delay`, keeping at most `max_in_flight`
batches at the worker so it never waits for the frontend.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque

import numpy as np

from . import metrics
from .batching import BatchLimits, WorkItem, pack, queued_cost_reaches_budget, take_batch
from .errors import Overloaded, Unavailable
from .worker_client import WorkerClient

log = logging.getLogger("encoderd.scheduler")


class PendingRequest:
    """One request's inputs, reassembled in order as their batches finish."""

    __slots__ = ("future", "rows", "remaining")

    def __init__(self, n_inputs: int):
        self.future: asyncio.Future = asyncio.get_running_loop().create_future()
        self.rows: list = [None] * n_inputs
        self.remaining = n_inputs

    @property
    def done(self) -> bool:
        return self.future.done()

    def fill(self, index: int, row: np.ndarray) -> None:
        self.rows[index] = row
        self.remaining -= 1
        if self.remaining == 0 and not self.future.done():
            self.future.set_result(np.stack(self.rows))

    def fail(self, error: Exception) -> None:
        if not self.future.done():
            self.future.set_exception(error)


class ModelScheduler:
    def __init__(self, model: str, worker: WorkerClient, limits: BatchLimits, *,
                 batch_delay: float = 0.005, max_queued: int = 16384, max_in_flight: int = 2):
        self.model = model
        self.worker = worker
        self.limits = limits
        self.batch_delay = batch_delay
        self.max_queued = max_queued
        self.max_in_flight = max_in_flight
        self.queue: deque[WorkItem] = deque()
        self._wake = asyncio.Event()
        self._first_queued_at: float | None = None
        self._in_flight = 0
        self._task: asyncio.Task | None = None
        self.batches_sent = 0

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name=f"scheduler[{self.model}]")

    async def stop(self) -> None:
        if self._task:
            self._task.cancel()
        self._fail_queued(Unavailable(f"model {self.model} is shutting down"))

    def submit(self, items: list[WorkItem]) -> None:
        """Queue a request's inputs, or refuse at once when over the bound."""
        if not self.worker.ready:
            raise Unavailable(f"model {self.model} is unavailable (its worker is restarting)")
        if len(self.queue) + len(items) > self.max_queued:
            metrics.REJECTED.labels(self.model, "queue_full").inc()
            raise Overloaded(f"model {self.model} is overloaded: {len(self.queue)} inputs queued; retry later")
        if not self.queue:
            self._first_queued_at = time.monotonic()
        self.queue.extend(items)
        metrics.QUEUE_DEPTH.labels(self.model).set(len(self.queue))
        self._wake.set()

    async def run(self, items: list[WorkItem], request: PendingRequest) -> np.ndarray:
        """Queue the inputs and wait for all their rows; cancellation drops queued ones."""
        self.submit(items)
        try:
            return await request.future
        finally:
            request.future.cancel()  # no-op once done; drops queued inputs when cancelled

    # ------------------------------------------------------------- the loop
    async def _run(self) -> None:
        worker_state = asyncio.create_task(self._watch_worker())
        try:
            while True:
                await self._wake.wait()
                self._wake.clear()
                self._dispatch_ready_batches()
        finally:
            worker_state.cancel()

    def _dispatch_ready_batches(self) -> None:
        while self.queue and self._in_flight < self.max_in_flight and self.worker.ready:
            if self._in_flight and not self._should_close_batch():
                return
            batch = take_batch(self.queue, self.limits)
            metrics.QUEUE_DEPTH.labels(self.model).set(len(self.queue))
            self._first_queued_at = time.monotonic() if self.queue else None
            if not batch:
                return
            self._in_flight += 1
            self.batches_sent += 1
            asyncio.create_task(self._compute(batch))

    def _should_close_batch(self) -> bool:
        if queued_cost_reaches_budget(self.queue, self.limits):
            return True
        waited = time.monotonic() - (self._first_queued_at or time.monotonic())
        if waited >= self.batch_delay:
            return True
        asyncio.get_running_loop().call_later(self.batch_delay - waited, self._wake.set)
        return False

    async def _compute(self, batch: list[WorkItem]) -> None:
        started = time.perf_counter()
        try:
            rows = await self.worker.compute(pack(batch, 0))
        except Exception as exc:
            for item in batch:
                item.request.fail(exc)
            return
        finally:
            self._in_flight -= 1
            self._wake.set()
        metrics.observe_batch(self.model, batch, self.limits.padded, time.perf_counter() - started)
        for item, row in zip(batch, rows):
            item.request.fill(item.index, row)

    async def _watch_worker(self) -> None:
        """When the worker goes down, queued work fails fast instead of waiting."""
        while True:
            await self.worker.state_changed.wait()
            self.worker.state_changed.clear()
            if not self.worker.ready:
                self._fail_queued(Unavailable(f"model {self.model} is unavailable (its worker crashed; restarting)"))
            self._wake.set()

    def _fail_queued(self, error: Exception) -> None:
        queued, self.queue = self.queue, deque()
        for item in queued:
            item.request.fail(error)
        metrics.QUEUE_DEPTH.labels(self.model).set(0)
