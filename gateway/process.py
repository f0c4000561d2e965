"""Envoy as a supervised child of `encoderd serve`: restarted when it dies, and
never left behind when the server goes, even by SIGKILL.

Envoy is exec'd through a tiny launcher that sets PR_SET_PDEATHSIG first: the
kernel kills Envoy when the server thread that spawned it exits, however the
server died. The launcher is a separate interpreter because preexec_fn runs
Python between fork and exec of a multi-threaded process (gRPC, tokenizer
threads), which can deadlock.

Envoy gets its own process group so that a terminal's Ctrl-C reaches only the
server, which drains in-flight calls (REST ones too, through Envoy) and stops
Envoy last; the death signal covers every way the server can die.
"""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import logging
import math
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.parse
from collections.abc import Callable
from pathlib import Path

from ..server.scheduling.supervisor import RestartPolicy, Supervisor
from ..workers.contract.cpu_cores import cpu_budget
from .envoy import GatewayError, GatewaySettings, find_envoy, local_address, render

log = logging.getLogger("encoderd.gateway")

# argv: PARENT_PID ENVOY ARGS... -- dies with the parent, then becomes Envoy.
_LAUNCHER = (
    "import ctypes, os, signal, sys\n"
    "os.setpgid(0, 0)  # out of the terminal's process group: Ctrl-C reaches the frontend alone\n"
    "signal.signal(signal.SIGTTOU, signal.SIG_IGN)  # so it may log to the terminal under `stty tostop`\n"
    "ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL), 0, 0, 0)  # PR_SET_PDEATHSIG\n"
    "if os.getppid() != int(sys.argv[1]): os._exit(1)  # the parent died before prctl\n"
    "os.execv(sys.argv[2], sys.argv[2:])\n"
)
# Restarts 0.5 s after a death, doubling while they fail; gives up after 5 restarts in a row that
# die within 10 s (a taken port, a broken config: respawning cannot fix those).
RESTART_POLICY = RestartPolicy(first_delay=0.5, give_up_after=5, healthy_after=10.0)
_ENVOY_LOG_LEVELS = {"DEBUG": "info", "INFO": "warning", "WARNING": "warning", "ERROR": "error"}


def envoy_workers(usable_cores: int) -> int:
    """Envoy's worker threads: half the usable cores, at least one.

    Envoy's own default is one per core it may run on, blind to the cgroup quota (64 threads in a
    2-CPU container on a 64-core host), and it shares the cores with the workers, which use them
    all. On 2 cores, under a flood of 640 connections (`python -m encoderd.bench.flood --gateway 64
    --own-connections`, measured while gRPC calls still ran the REST filters), one thread refused
    in p50 47-53 ms / p99 182-206 ms against 85-92 ms / 0.8-1.2 s for two; a single REST query's
    p50 moved by under 0.5 ms."""
    return max(1, usable_cores // 2)


class EnvoyProcess:
    def __init__(
        self,
        settings: GatewaySettings,
        envoy_bin: str = "",
        log_level: str = "INFO",
        on_give_up: Callable[[], None] | None = None,
        drain_s: float = 30.0,
    ):
        """on_give_up: called once if the supervisor gives up restarting Envoy (after its line).
        drain_s: the longest drain (`drain`), which Envoy must not cut short by closing its listeners."""
        self.settings = settings
        self.drain_s = drain_s
        self.binary = find_envoy(envoy_bin)
        self.log_level = _ENVOY_LOG_LEVELS.get(log_level.upper(), "warning")
        self._proc: subprocess.Popen | None = None
        self._start_timeout = 30.0
        self._supervisor = Supervisor(
            "Envoy",
            lambda: self._spawn_and_wait(self._start_timeout),
            self._wait_exit,
            lambda: self.pid,
            RESTART_POLICY,
            (GatewayError,),
            giving_up=self._down_line(),
            on_give_up=on_give_up,
            logger=log,
        )

    def _down_line(self) -> str:
        """What giving up on Envoy leaves down, for the supervisor's last line."""
        if self.settings.grpc_port:
            return (
                f"REST on port {self.settings.rest_port} and gRPC on port {self.settings.grpc_port} are down, "
                "so encoderd stops. Fix the cause in Envoy's log above and start it again"
            )
        return (
            f"REST on port {self.settings.rest_port} is down (gRPC still serves). Fix the cause in Envoy's "
            "log above and restart encoderd"
        )

    @property
    def ports(self) -> dict[str, int]:
        """Envoy's public ports, by the flag that sets each."""
        ports = {"--rest-port": self.settings.rest_port}
        if self.settings.grpc_port:
            ports["--grpc-port"] = self.settings.grpc_port
        return ports

    @property
    def restarts(self) -> int:
        return self._supervisor.restarts

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None

    @property
    def url(self) -> str:
        host = local_address(self.settings.rest_host)
        scheme = "https" if self.settings.tls_cert else "http"
        return f"{scheme}://{'[' + host + ']' if ':' in host else host}:{self.settings.rest_port}"

    # -------------------------------------------------------------- lifecycle
    @property
    def _started(self) -> subprocess.Popen:
        """Envoy's process: set by the first start, replaced by each restart, never cleared."""
        assert self._proc is not None, "Envoy was not started"
        return self._proc

    async def start(self, timeout: float = 30.0) -> None:
        """Start Envoy (its failure raised), then restart it whenever it dies (30 s per restart)."""
        self._start_timeout = timeout
        await self._supervisor.start()

    def _spawn(self, config: Path) -> subprocess.Popen:
        args = [
            self.binary,
            "--config-path",
            str(config),
            "--disable-hot-restart",
            "--concurrency",
            str(envoy_workers(cpu_budget().usable)),
            "--log-level",
            self.log_level,
            "--log-format",
            "%Y-%m-%d %T,%e %l envoy: %v",
            # A drain (`drain`) tells every client at once (HTTP/2 GOAWAY, HTTP/1 connection: close),
            # and keeps the listeners open longer than the server's own drain lasts.
            "--drain-strategy",
            "immediate",
            "--drain-time-s",
            str(math.ceil(self.drain_s) + 1),
        ]
        return subprocess.Popen(
            [sys.executable, "-I", "-S", "-c", _LAUNCHER, str(os.getpid()), *args],
            stdin=subprocess.DEVNULL,
            # Ctrl-C reaches the frontend, which drains Envoy itself: the launcher leaves the
            # terminal's process group. Not a session of its own (start_new_session): with the
            # kernel's autogroup scheduling, a new session is a CPU group of its own, which then
            # competes with the frontend's group as an equal, and the workers' nice no longer
            # ranks them below Envoy. Under `python -m encoderd.bench.flood --gateway 16
            # --own-connections` (2-core Zen 4) the probe's refusal p99 went from 138-196 ms
            # (10 runs) to 103-135 ms (5 runs).
        )

    async def _spawn_and_wait(self, timeout: float) -> None:
        """Start Envoy and wait until its listener accepts connections.

        Its files live only until then (Envoy reads them once at start), so even a
        SIGKILLed server leaves nothing in /tmp; a restart renders them again."""
        workdir = Path(tempfile.mkdtemp(prefix="encoderd-envoy-"))
        if self.settings.admin_path:  # a killed Envoy's socket file would fail the new one's bind
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.settings.admin_path)
        try:
            config = await asyncio.get_running_loop().run_in_executor(None, render, workdir, self.settings)
            self._proc = self._spawn(config)
            await self._wait_listening(timeout)
        finally:
            shutil.rmtree(workdir, ignore_errors=True)

    async def _wait_listening(self, timeout: float) -> None:
        """Until *this* Envoy holds a listening socket on each of its ports: a connection that
        succeeds proves nothing when another process has the port (Envoy then exits on its bind error)."""
        ports = " or ".join(f"{flag} {port}" for flag, port in self.ports.items())
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._started.poll() is not None:
                raise GatewayError(
                    f"Envoy exited with code {self._started.returncode} at start ({ports} taken? see its log above)"
                )
            if all(listens_on(self._started.pid, port) for port in self.ports.values()):
                return
            await asyncio.sleep(0.05)
        self._kill()
        raise GatewayError(f"Envoy did not listen on {ports} within {timeout:.0f}s")

    async def _wait_exit(self) -> int:
        """Wait for the child without holding a thread: its pidfd becomes readable at exit."""
        if self._started.poll() is not None:
            return self._started.returncode
        loop = asyncio.get_running_loop()
        exited = loop.create_future()
        fd = os.pidfd_open(self._started.pid)  # works on an unreaped zombie too: only we reap it

        def on_exit() -> None:
            if not exited.done():
                exited.set_result(None)

        loop.add_reader(fd, on_exit)
        try:
            await exited
        finally:
            loop.remove_reader(fd)
            os.close(fd)
        return self._started.wait()

    def _kill(self) -> None:
        if self._proc and self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait()

    def stop_supervising(self) -> None:
        """From now on a dead Envoy stays dead (the server is shutting down)."""
        self._supervisor.stop()

    async def drain(self, timeout: float) -> None:
        """Take no new calls and wait, up to `timeout`, until the calls Envoy has taken are answered:
        clients are told to go (GOAWAY, connection: close) while the server still serves whatever
        Envoy forwards, so a call a client sent just before the drain is not reset on its way.
        Needs the admin socket (settings.admin_path); without one, or with Envoy down, returns at once."""
        if not self.settings.admin_path or not self._proc or self._proc.poll() is not None:
            return
        deadline = time.monotonic() + timeout
        try:
            await _admin(self.settings.admin_path, "POST", "/drain_listeners?graceful&skip_exit")
            while time.monotonic() < deadline:  # Envoy's stats can only be polled
                if not await self._calls_in_flight():
                    return
                await asyncio.sleep(0.05)
        except (OSError, ValueError, http.client.HTTPException) as exc:  # Envoy died or answered oddly
            log.warning("could not drain Envoy through its admin socket (%s); stopping it as it is", exc)

    async def _calls_in_flight(self) -> int:
        """Requests in flight on the public listeners (the admin interface's own are not counted)."""
        text = await _admin(self.settings.admin_path, "GET", "/stats?filter=" + _IN_FLIGHT_STATS)
        return sum(int(value) for value in re.findall(r"downstream_rq_active: (\d+)", text))

    async def stop(self, timeout: float = 5.0) -> None:
        self.stop_supervising()
        if self._proc and self._proc.poll() is None:
            self._proc.send_signal(signal.SIGTERM)
            try:
                await asyncio.wait_for(self._wait_exit(), timeout)
            except asyncio.TimeoutError:
                self._kill()


# The public listeners' connection managers (stat_prefix in envoy.yaml, grpc_listener.yaml).
_IN_FLIGHT_STATS = urllib.parse.quote(r"^http\.(encoderd_rest|encoderd_grpc_public)\.downstream_rq_active$")


class _UnixHTTPConnection(http.client.HTTPConnection):
    """http.client over a unix socket: Envoy's admin interface (settings.admin_path)."""

    def __init__(self, path: str, timeout: float):
        super().__init__("envoy", timeout=timeout)
        self._path = path

    def connect(self) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(self.timeout)
        self.sock.connect(self._path)


def _admin_request(path: str, method: str, target: str, timeout: float) -> str:
    connection = _UnixHTTPConnection(path, timeout)
    try:
        connection.request(method, target)
        response = connection.getresponse()
        body = response.read().decode(errors="replace")
    finally:
        connection.close()
    if response.status != 200:
        raise ValueError(f"{method} {target}: HTTP {response.status}")
    return body


async def _admin(path: str, method: str, target: str, timeout: float = 5.0) -> str:
    """One request to Envoy's admin interface on the unix socket `path`: the body of a 200 answer."""
    return await asyncio.to_thread(_admin_request, path, method, target, timeout)


def listens_on(pid: int, port: int) -> bool:
    """Whether process `pid` holds a TCP socket listening on `port` (Linux /proc): its listener,
    not whatever else answers there. The tables are read from the process's own entry: a
    systemd unit with ProcSubset=pid hides /proc/net, not /proc/PID/net."""
    inodes = set()
    for table in (f"/proc/{pid}/net/tcp", f"/proc/{pid}/net/tcp6"):
        try:
            with open(table) as rows:
                next(rows)
                for row in rows:
                    fields = row.split()
                    if fields[3] == "0A" and int(fields[1].rsplit(":", 1)[1], 16) == port:  # 0A: LISTEN
                        inodes.add(f"socket:[{fields[9]}]")
        except OSError:
            continue
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return False
    for fd in fds:
        try:
            if os.readlink(f"/proc/{pid}/fd/{fd}") in inodes:
                return True
        except OSError:
            continue
    return False
