"""The frontend's side of the zygote (workers/zygote.py): start it, ask it for CPU workers, restart
it when it dies, and a handle on each forked worker that behaves like a multiprocessing.Process.

A forked worker skips the imports a spawned one pays (torch, transformers: most of its start-up
on a small CPU host). Whenever the zygote cannot serve (it failed to start, died twice in a row,
the kernel has no subreapers), workers are spawned as before, with one WARNING.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import select
import signal
import socket
import subprocess
import sys
import threading

from ...workers.contract import zygote_wire as wire
from ...workers.contract.config import WorkerConfig

log = logging.getLogger("encoderd.zygote")


class ForkedWorker:
    """A worker forked by the zygote and re-parented to this process: the part of
    multiprocessing.Process that WorkerClient uses (pid, sentinel, exitcode, kill, join)."""

    def __init__(self, pid: int):
        self.pid = pid
        self.sentinel = os.pidfd_open(pid)  # readable once the process has exited
        self._exitcode: int | None = None

    @property
    def exitcode(self) -> int | None:
        """None while it runs; then its exit code (minus the signal that killed it), once reaped."""
        if self._exitcode is None:
            try:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:  # reaped by someone else: its code is lost, not its death
                self._exitcode = 255
            else:
                if pid:
                    self._exitcode = os.waitstatus_to_exitcode(status)
        return self._exitcode

    def is_alive(self) -> bool:
        return self.exitcode is None

    def join(self, timeout: float | None = None) -> None:
        if self.exitcode is None:
            select.select([self.sentinel], [], [], timeout)

    def kill(self) -> None:
        self._signal(signal.SIGKILL)

    def terminate(self) -> None:
        self._signal(signal.SIGTERM)

    def _signal(self, signum: int) -> None:
        if self.exitcode is None:  # a pidfd names this process, never a successor with its pid
            with contextlib.suppress(ProcessLookupError):
                signal.pidfd_send_signal(self.sentinel, signum)

    def __del__(self):
        with contextlib.suppress(Exception):
            _ = self.exitcode  # reading it reaps it, if it is gone and nobody asked
            os.close(self.sentinel)


_shared: Zygote | None = None


def shared_zygote(config) -> Zygote | None:
    """This frontend's zygote (a ServerConfig's settings), made on the first call: the CLI launches it
    before the frontend's own imports so that both import at once; the registry forks its workers from it.
    None when --no-worker-zygote or no model runs on CPU."""
    global _shared  # noqa: PLW0603 - one zygote per frontend process, made on first use
    if not config.worker_zygote or not any("cpu" in (m.device or config.device) for m in config.models):
        return None
    if _shared is None or _shared.stopped:
        _shared = Zygote(config.log_level, config.log_format, config.worker_start_timeout)
    return _shared


class Zygote:
    """One zygote per frontend, shared by every CPU worker; `fork` is blocking (call it off the loop)."""

    def __init__(self, log_level: str = "INFO", log_format: str = "text", ready_timeout: float = 900.0):
        self._log_args = (log_level, log_format)
        self._ready_timeout = ready_timeout
        self._lock = threading.Lock()
        self._process: subprocess.Popen | None = None
        self._sock: socket.socket | None = None
        self._disabled = ""  # why forking is off for good (then: spawn, warned once)
        self._stopped = False
        self._ready = False  # its imports are done (it said so)
        self.pid: int | None = None

    def start(self) -> None:
        """Launch the zygote now (its imports overlap the frontend's own start-up); never blocks."""
        with self._lock:
            if not self._disabled and self._process is None:
                self._launch()

    def _launch(self) -> None:
        # The zygote's PR_SET_PDEATHSIG fires when the launching *thread* ends: the main thread (the
        # CLI), or for a replacement an executor thread of the loop, which lives as long as the loop.
        if not wire.prctl(wire.PR_SET_CHILD_SUBREAPER, 1):
            self._disable("this kernel refuses PR_SET_CHILD_SUBREAPER")
            return
        ours, theirs = socket.socketpair()
        argv = [
            sys.executable,
            "-m",
            wire.ZYGOTE_MODULE,
            str(theirs.fileno()),
            str(os.getpid()),
            *self._log_args,
        ]
        try:
            self._process = subprocess.Popen(argv, pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL)
        except OSError as exc:
            ours.close()
            self._disable(f"it could not start: {exc}")
            return
        finally:
            theirs.close()
        self._sock, self.pid, self._ready = ours, self._process.pid, False

    def _connected(self) -> socket.socket:
        assert self._sock is not None, "no zygote running"  # _launch sets it with the process
        return self._sock

    def _await_ready(self) -> bool:
        self._connected().settimeout(self._ready_timeout)
        reply = self._receive()
        if reply is None or reply[0] != "ready":
            self._close(f"it failed to start: {reply[1] if reply else 'it exited'}")
            return False
        log.info("zygote (pid %d) ready: CPU workers are forked from it", self.pid)
        self._ready = True
        return True

    def fork(self, config: WorkerConfig) -> ForkedWorker | None:
        """A worker forked from the zygote, or None: spawn it instead (the reason was logged)."""
        with self._lock:
            for attempt in (1, 2):  # a zygote found dead is replaced once
                if self._process is not None and self._process.poll() is not None:
                    self._close(f"it exited with code {self._process.returncode}", retry=True)
                if self._process is None and not (self._disabled or self._stopped):
                    self._launch()
                if self._disabled or self._stopped or (not self._ready and not self._await_ready()):
                    return None
                self._connected().settimeout(60)
                try:
                    wire.send(self._connected(), (config, os.getpid()))
                    reply = self._receive()
                except OSError:
                    reply = None
                if reply and reply[0] == "forked":
                    return ForkedWorker(reply[1])
                self._close(f"a fork failed: {reply[1] if reply else 'the zygote died'}", retry=attempt == 1)
            return None

    def _receive(self):
        try:
            return wire.receive(self._connected())
        except (OSError, EOFError, ValueError):
            return None

    def _close(self, why: str, retry: bool = False) -> None:
        """Drop this zygote; with retry, a new one starts on the next fork, else forking is off."""
        self._stop_process()
        if self._stopped:
            return
        if retry:
            log.warning("zygote: %s; starting a new one", why)
        else:
            self._disable(why)

    def _disable(self, why: str) -> None:
        if not self._disabled:
            log.warning(
                "zygote unavailable (%s): CPU workers are spawned, each importing torch and transformers "
                "itself (slower starts and restarts)",
                why,
            )
        self._disabled = why or "off"

    def _stop_process(self) -> None:
        if self._sock is not None:
            self._sock.close()  # EOF: the zygote exits by itself
        if self._process is not None:
            try:
                self._process.wait(2)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait()
        self._process = self._sock = self.pid = None
        self._ready = False

    @property
    def stopped(self) -> bool:
        return self._stopped

    def stop(self) -> None:
        self._stopped = True
        process = self._process
        if process is not None:  # a fork waiting on it (its imports, say) gets EOF and gives up
            process.kill()
        with self._lock:
            self._stop_process()

    async def fork_async(self, config: WorkerConfig) -> ForkedWorker | None:
        forking = asyncio.get_running_loop().run_in_executor(None, self.fork, config)
        try:
            return await asyncio.shield(forking)
        except asyncio.CancelledError:  # nobody will supervise it: a worker forked now dies at once
            forking.add_done_callback(_kill_unwanted)
            raise


def _kill_unwanted(forking: asyncio.Future) -> None:
    worker = None if forking.cancelled() or forking.exception() else forking.result()
    if worker is not None:
        worker.kill()
        worker.join(5)
