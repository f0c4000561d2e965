"""The frontend's handle on one worker process: spawn, ZeroMQ, supervision.

The frontend binds a PUSH socket (batches) and a PULL socket (results) on
fresh ipc:// endpoints per worker incarnation, so nothing meant for a dead
worker ever reaches its successor. Death is noticed through the process
sentinel; every pending batch then fails with Unavailable at once, and the
worker is restarted with back-off. A worker that is alive but silent (no
heartbeat for `stall_timeout` seconds: stopped, deadlocked, stuck) is marked
down the same way and killed, so the same supervisor restarts it.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import os
from collections.abc import Callable
from typing import cast

import msgspec
import numpy as np
import zmq
import zmq.asyncio

from ...workers.contract import ipc, protocol
from ...workers.contract.config import WorkerConfig
from ...workers.contract.launch import run_worker
from ..base.errors import Unavailable, worker_failure
from .supervisor import RestartPolicy, Supervisor
from .zygote_client import ForkedWorker, Zygote

log = logging.getLogger("encoderd.worker_client")

_spawn = multiprocessing.get_context("spawn")


class WorkerStartError(Exception):
    """The worker could not load its model."""


class WorkerClient:
    def __init__(
        self,
        make_config: Callable[[str, str], WorkerConfig],
        label: str,
        on_state: Callable[[bool], None] = lambda ready: None,
        start_timeout: float = 900.0,
        max_backoff: float = 30.0,
        stall_timeout: float = 0.0,
        zygote: Zygote | None = None,
    ):
        self._make_config = make_config  # (batch_address, result_address) -> WorkerConfig
        self._zygote = zygote  # forks CPU workers with torch already imported; None: spawn
        self.label = label
        self._on_state = on_state
        self._start_timeout = start_timeout
        self._stall_timeout = stall_timeout  # 0 = no heartbeat check
        self._last_heartbeat = 0.0  # loop.time() of the last message from the worker
        self._stalled = False  # killed by the heartbeat check, not dead on its own
        self._watchdog: asyncio.Task | None = None
        self._zmq = zmq.asyncio.Context.instance()
        self._pending: dict[int, asyncio.Future] = {}
        self._next_batch_id = 0
        self._process: multiprocessing.process.BaseProcess | ForkedWorker | None = None
        self._exit_waiter: asyncio.Future | None = None  # the one future that owns the sentinel's reader
        self._batches: zmq.asyncio.Socket | None = None
        self._results: zmq.Socket | None = None  # a plain socket, read by _read_results (see there)
        self._results_fd: int | None = None  # its file descriptor while the event loop watches it
        self._stopping = False
        self.ready_info: protocol.WorkerReady | None = None
        self.state_changed = asyncio.Event()
        # The first restart after a healthy run at once (a fork from the zygote is cheap); never gives
        # up: a model that cannot load now may load later (its files restored, memory freed).
        self._supervisor = Supervisor(
            f"worker {label}",
            self._spawn_and_wait,
            self._wait_exit,
            lambda: self.pid,
            RestartPolicy(first_delay=0.0, max_delay=max_backoff),
            (WorkerStartError,),
            on_exit=self._teardown,
            exit_detail=self._exit_detail,
            logger=log,
        )

    # ------------------------------------------------------------------ state
    @property
    def ready(self) -> bool:
        return self.ready_info is not None and not self._stopping

    @property
    def restarts(self) -> int:
        return self._supervisor.restarts

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process else None

    def _set_ready(self, info: protocol.WorkerReady | None) -> None:
        # Kept for the worker's life without its tokenizer (up to ~17 MB for XLM-R): the registry builds
        # the model's tokenizer once from what `start` returns.
        self.ready_info = msgspec.structs.replace(info, tokenizer_json="") if info else None
        self._on_state(info is not None)
        self.state_changed.set()

    # -------------------------------------------------------------- lifecycle
    async def start(self) -> protocol.WorkerReady:
        """Spawn the worker, wait until its model is loaded and warm, then supervise it."""
        info = await self._supervisor.start()
        if self._stall_timeout:
            self._watchdog = asyncio.create_task(self._watch_heartbeats(), name=f"heartbeats[{self.label}]")
        return info

    async def _spawn_and_wait(self) -> protocol.WorkerReady:
        self._open_sockets()
        self._process = await self._start_process(self._make_config(self._batch_address, self._result_address))
        ready = asyncio.get_running_loop().create_future()
        self._watch_results(ready)
        died = self._process_exit()
        done, _ = await asyncio.wait({ready, died}, timeout=self._start_timeout, return_when=asyncio.FIRST_COMPLETED)
        if ready in done and ready.exception() is None:
            died.cancel()
            self._last_heartbeat = asyncio.get_running_loop().time()
            self._stalled = False
            info: protocol.WorkerReady = ready.result()
            self._set_ready(info)
            return info
        assert self._process is not None  # started above; only _teardown drops it
        reason = (
            ready.exception()
            if ready in done
            else f"worker exited with code {self._process.exitcode}"
            if died in done
            else "start timed out"
        )
        await self._teardown()
        raise WorkerStartError(f"{self.label}: {reason}")

    async def _start_process(self, config: WorkerConfig) -> multiprocessing.process.BaseProcess | ForkedWorker:
        """Forked from the zygote (CPU workers), else spawned: either way a child of this process."""
        if self._zygote and config.options.device == "cpu":
            forked = await self._zygote.fork_async(config)
            if forked:
                log.info("worker %s forked from the zygote (pid %d)", self.label, forked.pid)
                return forked
        process = _spawn.Process(
            target=run_worker, args=(config, os.getpid()), name=f"encoderd-worker[{self.label}]", daemon=True
        )
        process.start()
        return process

    def _open_sockets(self) -> None:
        tag = self.label.rpartition("/")[2].replace(":", "_")[:16]  # the directory is this frontend's: short
        self._batch_address = ipc.new_ipc_address(tag + "-in")
        self._result_address = ipc.new_ipc_address(tag + "-out")
        self._batches = batches = self._zmq.socket(zmq.PUSH)
        batches.setsockopt(zmq.SNDHWM, 64)  # admission bounds traffic; this is a backstop
        batches.setsockopt(zmq.LINGER, 0)
        batches.bind(self._batch_address)
        self._results = results = zmq.Socket(self._zmq, zmq.PULL)
        results.setsockopt(zmq.LINGER, 0)
        results.bind(self._result_address)

    def _process_exit(self) -> asyncio.Future:
        """A future that completes when the worker process exits (its sentinel fd)."""
        loop = asyncio.get_running_loop()
        exited = loop.create_future()
        assert self._process is not None, "no worker process to watch"
        sentinel = self._process.sentinel

        def on_exit():
            if not exited.done():
                exited.set_result(None)

        def stop_watching(_):
            # Done callbacks run later: a start's `died`, cancelled once the worker is ready, must
            # not remove the reader the supervisor has installed meanwhile (its next death unseen).
            if self._exit_waiter is exited:
                loop.remove_reader(sentinel)
                self._exit_waiter = None

        self._exit_waiter = exited
        loop.add_reader(sentinel, on_exit)
        exited.add_done_callback(stop_watching)
        return exited

    async def _wait_exit(self) -> int | None:
        await self._process_exit()
        assert self._process is not None  # it just exited; _teardown, after this, keeps it
        return self._process.exitcode

    def _exit_detail(self) -> str:
        if self._stalled:  # the stall was logged when it was found, and its batches failed then
            return " (killed by the stall check)"
        return f"; failing its {len(self._pending)} pending batches"

    async def _watch_heartbeats(self) -> None:
        loop = asyncio.get_running_loop()
        period = min(0.5, self._stall_timeout / 4)
        while not self._stopping:
            asleep_at = loop.time()
            await asyncio.sleep(period)
            if loop.time() - asleep_at > 2 * period:
                continue  # this event loop was blocked, not the worker: let the reader take its beats first
            silent = loop.time() - self._last_heartbeat
            if self.ready and silent > self._stall_timeout:
                self._on_stall(silent)

    def _on_stall(self, silent: float) -> None:
        """Down at once (health, callers), then SIGKILL: the supervisor sees the exit and restarts it."""
        log.warning(
            "worker %s (pid %s) stalled: no heartbeat for %.1fs (--worker-stall-timeout %.1fs); "
            "failing its %d pending batches, killing and restarting it",
            self.label,
            self.pid,
            silent,
            self._stall_timeout,
            len(self._pending),
        )
        self._stalled = True
        self._mark_down(Unavailable(f"model worker {self.label} stopped responding; it is being restarted"))
        if self._process is not None:
            self._process.kill()

    def _mark_down(self, error: Exception) -> None:
        self._set_ready(None)
        self._fail_pending(error)

    async def _teardown(self) -> None:
        self._mark_down(Unavailable(f"model worker {self.label} is unavailable (crashed or restarting)"))
        self._unwatch_results()  # before its socket closes: its descriptor number may be reused at once
        for sock in (self._batches, self._results):
            if sock is not None:
                sock.close(linger=0)
        self._batches = self._results = None
        ipc.remove_ipc_files(getattr(self, "_batch_address", ""), getattr(self, "_result_address", ""))
        if self._process and self._process.is_alive():
            self._process.kill()
        if self._process:
            await asyncio.get_running_loop().run_in_executor(None, self._process.join, 5)

    def _fail_pending(self, error: Exception) -> None:
        pending, self._pending = self._pending, {}
        for future in pending.values():
            if not future.done():
                future.set_exception(error)

    async def stop(self) -> None:
        self._stopping = True
        self._supervisor.stop()
        if self._watchdog:
            self._watchdog.cancel()
        if self._process and self._process.is_alive():
            self._process.terminate()
            await asyncio.get_running_loop().run_in_executor(None, self._process.join, 5)
        await self._teardown()

    # ---------------------------------------------------------------- batches
    async def compute(self, batch: protocol.TokenBatch | protocol.MediaBatch) -> np.ndarray | list:
        """Send one batch and wait for its output rows."""
        rows, _ = await self.compute_timed(batch)
        return rows

    async def compute_timed(self, batch: protocol.TokenBatch | protocol.MediaBatch) -> tuple[np.ndarray | list, float]:
        """Send one batch and wait for its output rows and the seconds the worker spent on it."""
        if not self.ready:
            raise Unavailable(f"model worker {self.label} is unavailable (crashed or restarting)")
        self._next_batch_id += 1
        batch.batch_id = self._next_batch_id
        future = asyncio.get_running_loop().create_future()
        self._pending[batch.batch_id] = future
        assert self._batches is not None  # ready: its sockets are open
        sending = asyncio.ensure_future(self._batches.send_multipart(protocol.encode_batch(batch), copy=False))
        try:
            if not sending.done():
                # No peer to take it: the worker may have died unseen. Its death fails `future` (and
                # closing the socket cancels the send), so wait on both: the caller hears Unavailable,
                # never a bare cancellation that would leave its requests waiting forever.
                await asyncio.wait((sending, future), return_when=asyncio.FIRST_COMPLETED)
            if sending.done() and not sending.cancelled():
                sending.result()  # raises the send's own error, if it failed
            return await future
        finally:
            sending.cancel()  # no-op once sent
            self._pending.pop(batch.batch_id, None)

    # The results are read by a callback of the event loop on the socket's descriptor, not by a task
    # awaiting zmq.asyncio's recv_multipart: that creates a future and a timer per message, adds and
    # removes the descriptor's reader (two epoll_ctl calls) around each, and wakes the reading task
    # before the request's own, on the path of every live query (issue 42 item 3).
    def _watch_results(self, ready: asyncio.Future) -> None:
        assert self._results is not None  # opened before the worker starts
        loop = asyncio.get_running_loop()
        self._results_fd = self._results.FD
        loop.add_reader(self._results_fd, self._read_results, self._results, ready)
        loop.call_soon(self._read_results, self._results, ready)  # what came before: the descriptor signals changes

    def _unwatch_results(self) -> None:
        if self._results_fd is not None:
            asyncio.get_running_loop().remove_reader(self._results_fd)
            self._results_fd = None

    def _read_results(self, results: zmq.Socket, ready: asyncio.Future) -> None:
        """Every message waiting on the results socket. ZeroMQ's descriptor is edge-triggered: it
        signals again only once the socket has been read until it reports nothing more to read, so a
        message that fails to decode is logged and skipped, never left to stop the reading."""
        if results is not self._results or results.closed:
            return  # torn down (and perhaps restarted) after this read was scheduled
        while cast(int, results.get(zmq.EVENTS)) & zmq.POLLIN:
            frames = results.recv_multipart(zmq.NOBLOCK, copy=False)
            try:
                self._take_result(frames, ready)
            except Exception:
                log.exception("worker %s: a message on the results socket could not be read", self.label)

    def _take_result(self, frames: list, ready: asyncio.Future) -> None:
        _, header, rest = protocol.decode(frames)
        self._last_heartbeat = asyncio.get_running_loop().time()  # any message shows it alive
        if isinstance(header, protocol.ResultHeader):
            future = self._pending.get(header.batch_id)
            if future is None or future.done():
                return  # its request was cancelled meanwhile
            if header.error:
                future.set_exception(worker_failure(header.code, f"model {self.label}: {header.error}"))
            else:
                future.set_result((protocol.result_array(header, rest), header.compute_ns / 1e9))
        elif isinstance(header, protocol.WorkerReady) and not ready.done():
            ready.set_result(header)
        elif isinstance(header, protocol.WorkerFatal) and not ready.done():
            ready.set_exception(WorkerStartError(header.message))
