"""One supervisor for the frontend's child processes (model workers, Envoy).

start → wait for ready → watch → on death: log, back off, start again. The back-off doubles
after each failure (a start that fails, or a child that dies soon after starting) up to a
ceiling, and returns to its first value once a child has run a while: one that ran long died of
something transient, one that dies at once will again. A policy may give up after some fast
failures in a row, saying so in one clear line, rather than respawn forever.

The child's handle keeps what is its own (how to start it and wait until it is ready, how its
exit is seen, what to clean up); this module holds only the restart policy and loop.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

log = logging.getLogger("encoderd.supervisor")

T = TypeVar("T")


@dataclass(frozen=True)
class RestartPolicy:
    first_delay: float = 0.5  # before the first restart after a healthy run
    min_delay: float = 0.5  # the least delay after a failure; it doubles from there
    max_delay: float = 30.0
    healthy_after: float = 10.0  # a child that ran this long died of something transient
    give_up_after: int = 0  # fast failures in a row (deaths soon after start, failed starts); 0 = never

    def after_failure(self, delay: float) -> float:
        return min(max(self.min_delay, delay * 2), self.max_delay)

    def gives_up(self, fast_failures: int) -> bool:
        return 0 < self.give_up_after < fast_failures


class Supervisor(Generic[T]):
    """Starts a child through `launch` (which returns once it is ready, or raises one of
    `start_errors`), then restarts it whenever `wait_exit` (returning its exit code) returns."""

    def __init__(
        self,
        name: str,
        launch: Callable[[], Awaitable[T]],
        wait_exit: Callable[[], Awaitable[int | None]],
        pid: Callable[[], int | None],
        policy: RestartPolicy,
        start_errors: tuple[type[Exception], ...],
        on_exit: Callable[[], Awaitable[None]] | None = None,
        exit_detail: Callable[[], str] = lambda: "",
        giving_up: str = "",
        on_give_up: Callable[[], None] | None = None,
        logger: logging.Logger = log,
    ):
        self.name = name  # as log lines name the child: "worker a@cpu", "Envoy"
        self._launch = launch
        self._wait_exit = wait_exit
        self._pid = pid
        self.policy = policy
        self._start_errors = start_errors
        self._on_exit = on_exit  # clean-up after a death, before any restart
        self._exit_detail = exit_detail  # appended to the death line
        self._giving_up = giving_up  # what giving up leaves broken, for the last line
        self._on_give_up = on_give_up  # what the owner does then (a server whose Envoy held gRPC stops)
        self._log = logger  # the child's own, so its lines read as before
        self.restarts = 0  # deaths seen
        self.gave_up = False
        self._task: asyncio.Task | None = None
        self._stopping = False

    async def start(self) -> T:
        """The first start: its failure is the caller's (raised), not retried."""
        ready = await self._launch()
        self._task = asyncio.create_task(self._supervise(), name=f"supervise[{self.name}]")
        return ready

    def stop(self) -> None:
        """From now on a dead child stays dead."""
        self._stopping = True
        if self._task:
            self._task.cancel()

    async def _supervise(self) -> None:
        try:
            await self._watch()
        except Exception:  # noqa: BLE001 - a bug here must not end supervision silently: say it, once
            self.gave_up = True
            self._log.exception("supervision of %s stopped by an unexpected error; it stays down", self.name)

    async def _watch(self) -> None:
        loop = asyncio.get_running_loop()
        delay, fast_failures = self.policy.first_delay, 0
        while not self._stopping:
            ready_at = loop.time()
            code = await self._wait_exit()
            if self._stopping:
                return
            self.restarts += 1
            if loop.time() - ready_at >= self.policy.healthy_after:
                delay, fast_failures = self.policy.first_delay, 0
            fast_failures += 1
            why = f"{self.name} (pid {self._pid()}) died with exit code {code}{self._exit_detail()}"
            if self._on_exit:
                await self._on_exit()
            while not self._stopping:
                if self.policy.gives_up(fast_failures):
                    self._give_up(fast_failures - 1)
                    return
                self._log.error("%s; restarting it in %.3gs", why, delay)
                await asyncio.sleep(delay)
                delay = self.policy.after_failure(delay)
                if self._stopping:
                    return
                started = time.perf_counter()
                try:
                    await self._launch()
                except self._start_errors as exc:
                    fast_failures += 1
                    self._log.error("restart of %s failed: %s", self.name, exc)
                    why = f"{self.name} is down"
                    continue
                self._log.info("%s restarted (pid %s) in %.1fs", self.name, self._pid(), time.perf_counter() - started)
                break

    def _give_up(self, restarts: int) -> None:
        self.gave_up = True
        self._log.error(
            "%s failed %d times in a row within %.0fs of starting; giving up: %s",
            self.name,
            restarts,
            self.policy.healthy_after,
            self._giving_up or f"{self.name} stays down",
        )
        if self._on_give_up:
            self._on_give_up()
