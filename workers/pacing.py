"""How long a bulk batch may compute before urgent work gets a turn: a time, not a layer.

A bulk batch runs in steps (Backend.forward_in_steps: one layer of the torch padding-free
forward; the whole forward on engines that cannot stop midway), and urgent batches run between
steps (workers/process.py). A step's duration depends on the host and on the batch: one MiniLM
layer over 8,192 tokens is ~0.2 s on one Zen 5 core and ~3x that on a Zen 3, so "after each
layer" meant a different wait on every host. The pacer cuts a bulk batch into consecutive
sub-batches whose steps take about `target()` seconds, from what this worker measures:

  * seconds per token of one step: an EWMA over the bulk steps it times;
  * the target: URGENT_FACTOR times what urgent batches themselves take here (an EWMA), so a
    query waits for a fixed multiple of its own compute, on a fast host and a slow one alike;
    clamped to [MIN_STEP_S, MAX_STEP_S] (tiny steps would cost bulk throughput: every step has a
    fixed cost, and smaller GEMMs run slower). While no urgent batch has come for QUIET_S the
    target is MAX_STEP_S: bulk alone keeps big steps, and a query that arrives then still
    waits no more than that.

ENCODERD_BULK_STEP_MS fixes the target (0: no cutting, a step is whatever the batch is).
"""

from __future__ import annotations

import os
import time

import numpy as np

from .contract.protocol import TokenBatch

STEP_ENV = "ENCODERD_BULK_STEP_MS"
MIN_STEP_S = 0.002
MAX_STEP_S = 0.05
QUIET_S = 2.0  # as the scheduler's interactive window (server/scheduling/scheduler.py INTERACTIVE_WINDOW)
SMOOTHING = 0.2  # EWMA weight of the newest measurement
# A bulk step takes about this many urgent batches' time. The idle query's own latency is about
# twice its compute here (frontend, transport), and a query waits half a step on average: 2
# keeps its p95 near 2x idle, and costs bulk less than smaller steps (python -m
# encoderd.workers.bench_pacing: bulk tokens per CPU second 0.81-0.85 of uncut batches at 2,
# 0.74-0.77 at 1; the former 256-token bulk batches 0.72-0.82).
URGENT_FACTOR = 2.0
MIN_TOKENS = 32  # never cut below this: a step's fixed cost would dominate


class Ewma:
    def __init__(self):
        self.value: float | None = None

    def add(self, x: float) -> None:
        self.value = x if self.value is None else (1 - SMOOTHING) * self.value + SMOOTHING * x


class Pacer:
    def __init__(self, fixed_ms: float | None = None, clock=time.perf_counter, factor: float = URGENT_FACTOR):
        self.factor = factor
        if fixed_ms is None and os.environ.get(STEP_ENV, "").strip():
            fixed_ms = float(os.environ[STEP_ENV])
        self.fixed = None if fixed_ms is None else fixed_ms / 1000
        self.clock = clock
        self.step_per_token = Ewma()  # seconds per token of one bulk step
        self.urgent_seconds = Ewma()  # seconds one urgent batch takes
        self.urgent_at = float("-inf")

    def target(self) -> float | None:
        """Seconds one bulk step should take; None: do not cut."""
        if self.fixed is not None:
            return self.fixed or None
        if self.urgent_seconds.value is None or self.clock() - self.urgent_at > QUIET_S:
            return MAX_STEP_S
        return min(MAX_STEP_S, max(MIN_STEP_S, self.factor * self.urgent_seconds.value))

    def step_tokens(self) -> int | None:
        """Most tokens in one sub-batch, or None (unknown speed, or no cutting)."""
        target = self.target()
        if target is None or not self.step_per_token.value:
            return None
        return max(MIN_TOKENS, int(target / self.step_per_token.value))

    def cut(self, batch: TokenBatch) -> list[TokenBatch]:
        """Consecutive sub-batches of at most step_tokens() tokens (at least one sequence each)."""
        budget = self.step_tokens()
        if budget is None or len(batch.input_ids) <= budget:
            return [batch]
        parts, rest = [], batch
        while rest.size > 1 and len(rest.input_ids) > budget:
            # The most leading sequences within the budget, at least one.
            at = max(1, int(np.searchsorted(rest.cu_seqlens, budget, side="right")) - 1)
            if at >= rest.size:
                break
            first, rest = rest.split(at)
            parts.append(first)
        return [*parts, rest]

    def timed_step(self, tokens: int, seconds: float) -> None:
        if tokens:
            self.step_per_token.add(seconds / tokens)

    def timed_urgent(self, seconds: float) -> None:
        self.urgent_seconds.add(seconds)
        self.urgent_at = self.clock()
