"""Retries with exponential backoff and jitter, always inside the caller's deadline.

Every encoderd RPC computes a pure function of its request, so resending one is
safe. Only the statuses that mean "try again later" are retried: UNAVAILABLE (no
server, a worker restarting, a draining server) and RESOURCE_EXHAUSTED (a full
queue, or a call that would wait too long in it). A server that says when to come
back (the `retry-after` trailer of an overload) is believed: the client waits at
least that long, and where that is past the deadline it fails at once instead of
retrying into another refusal. A retry that could not start before the deadline is
not made: the call then fails with the last error the server gave.
"""

from __future__ import annotations

import asyncio
import math
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

import grpc

from .errors import from_rpc_error, retry_after

T = TypeVar("T")

RETRYABLE = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED})


@dataclass(frozen=True)
class RetryPolicy:
    """`max_attempts` counts the first call (1 = no retries). Before retry n (1-based) the client
    sleeps min(max_backoff, initial_backoff * multiplier**(n-1)), less a random share of up to
    `jitter` of it, so that clients rejected together do not come back together; or, where the
    server sent `retry-after` and `honor_retry_after` holds, at least that long, plus up to `jitter`
    of it (so the clients it refused together still spread out)."""

    max_attempts: int = 4
    initial_backoff: float = 0.1
    max_backoff: float = 2.0
    multiplier: float = 2.0
    jitter: float = 0.5
    retry_on: frozenset = RETRYABLE
    honor_retry_after: bool = True

    def __post_init__(self):
        if self.max_attempts < 1 or self.initial_backoff < 0 or self.max_backoff < 0 or self.multiplier < 1:
            raise ValueError(f"invalid retry policy: {self}")
        if not 0 <= self.jitter <= 1:
            raise ValueError("jitter is a fraction in [0, 1]")

    def backoff(self, retry: int, rng: random.Random | None = None) -> float:
        """Seconds to sleep before retry number `retry` (1-based)."""
        ceiling = min(self.max_backoff, self.initial_backoff * self.multiplier ** (retry - 1))
        return ceiling * (1 - self.jitter * (rng or random).random())


NO_RETRY = RetryPolicy(max_attempts=1)


class _Attempts:
    """One call's retry state: its deadline and how many attempts were sent."""

    def __init__(self, policy: RetryPolicy, timeout: float | None):
        self.policy = policy
        self.deadline = math.inf if timeout is None else time.monotonic() + timeout
        self.count = 0

    def start(self) -> float | None:
        """Count an attempt; its gRPC timeout is what is left of the call's deadline."""
        self.count += 1
        return None if self.deadline == math.inf else max(self.deadline - time.monotonic(), 0.0)

    def delay_before_retry(self, error: grpc.RpcError) -> float | None:
        """How long to sleep before the next attempt, or None to give up."""
        if error.code() not in self.policy.retry_on or self.count >= self.policy.max_attempts:
            return None
        delay = self.policy.backoff(self.count)
        asked = retry_after(error) if self.policy.honor_retry_after else None
        if asked is not None:
            if time.monotonic() + asked >= self.deadline:
                return None  # the server will not serve it in time: fail now, not after a doomed retry
            spread = asked * (1 + self.policy.jitter * random.random())
            delay = max(delay, min(spread, self.deadline - time.monotonic()))
        return delay if time.monotonic() + delay < self.deadline else None


def call_with_retry(send: Callable[[float | None], T], policy: RetryPolicy, timeout: float | None) -> T:
    """send(attempt_timeout) until it succeeds or the policy gives up; failures come out typed."""
    attempts = _Attempts(policy, timeout)
    while True:
        try:
            return send(attempts.start())
        except grpc.RpcError as error:
            delay = attempts.delay_before_retry(error)
            if delay is None:
                raise from_rpc_error(error, attempts.count) from None
        time.sleep(delay)


async def acall_with_retry(
    send: Callable[[float | None], Awaitable[T]], policy: RetryPolicy, timeout: float | None
) -> T:
    """The asyncio form of call_with_retry."""
    attempts = _Attempts(policy, timeout)
    while True:
        try:
            return await send(attempts.start())
        except grpc.RpcError as error:
            delay = attempts.delay_before_retry(error)
            if delay is None:
                raise from_rpc_error(error, attempts.count) from None
        await asyncio.sleep(delay)


def channel_options(policy: RetryPolicy) -> list[tuple[str, int]]:
    """Reconnect as often as the policy retries. After a failed connect gRPC waits 1 s (growing
    to 2 min) before it tries again and fails every call meanwhile, so retries of a server that
    is restarting would all be spent before the channel looked at it again."""
    initial_ms = max(int(policy.initial_backoff * 1000), 1)
    return [
        ("grpc.initial_reconnect_backoff_ms", initial_ms),
        ("grpc.max_reconnect_backoff_ms", max(int(policy.max_backoff * 1000), initial_ms)),
    ]
