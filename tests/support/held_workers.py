"""Stand-in replicas for the scheduler's unit tests: the order of events is made explicit by holding
every batch until the test releases it, never by timing."""

from __future__ import annotations

import asyncio

import numpy as np

from encoderd.server.scheduling.batching import WorkItem
from encoderd.server.scheduling.scheduler import PendingRequest


class HeldWorker:
    """Answers each sequence's first token id; every batch waits until the test releases it."""

    def __init__(self, label: str = "held"):
        self.label = label
        self.ready = True
        self.ready_info = None  # what a worker says when ready: no figure measured at load
        self.state_changed = asyncio.Event()
        self.batches: list = []
        self.release = asyncio.Event()

    async def compute(self, batch):
        self.batches.append(batch)
        await self.release.wait()
        return batch.input_ids[batch.cu_seqlens[:-1]].astype(np.float32)[:, None]

    async def compute_timed(self, batch):
        """As WorkerClient.compute_timed: the rows, and the seconds computing them (none here)."""
        return await self.compute(batch), 0.0


def request(first_ids, length=10):
    """A request of one input per id, each `length` tokens of that id."""
    pending = PendingRequest(len(first_ids))
    return pending, [WorkItem(np.full(length, v, dtype=np.int32), None, pending, i) for i, v in enumerate(first_ids)]


async def until(condition, what: str):
    """Let the event loop run until `condition` holds (no wall-clock wait: a bounded number of turns)."""
    for _ in range(1000):
        if condition():
            return
        await asyncio.sleep(0)
    raise AssertionError(what)


async def release_and_stop(scheduler, workers, *calls):
    """Release every batch the workers hold, wait for `calls` (tasks) and stop the scheduler: the calls'
    results, in order."""
    for worker in workers:
        worker.release.set()
    results = [await call for call in calls]
    await scheduler.stop()
    return results
