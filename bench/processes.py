"""The processes the benchmarks start (ports, readiness, stopping) and the CPU they use.

CPU accounting. Every process we start is sampled from /proc (utime + stime) at the start
and the end of each measurement window; "worker busy" = worker CPU seconds / (window x
worker threads). OpenMP threads spin-wait between parallel regions, so CPU time overstates
useful work, badly so when the cores are oversubscribed (a spinning thread waits for a
preempted peer): compare busy% with FLOP%. "foreign" = CPU the rest of the machine used
meanwhile (other people's tests on a shared box): when it is not ~0 the numbers are noisy.
Environment variables (OMP_WAIT_POLICY, OMP_NUM_THREADS...) reach every server it starts.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

_GIVEN: set[int] = set()  # ports handed out in this process


# Where the CLI has lived, newest first: server/main/ (issue #46), server/ops/, server/ before it was grouped.
CLI_MODULES = ("encoderd.server.main.cli", "encoderd.server.ops.cli", "encoderd.server.cli")


def serve_command(checkout: str | None = None) -> list[str]:
    """`python -m <its CLI> serve` of this checkout, or of an older one exported under `checkout`
    (flood.export_ref), whose CLI may still be at one of its former homes (CLI_MODULES)."""
    found = [m for m in CLI_MODULES if checkout and (Path(checkout) / (m.replace(".", "/") + ".py")).exists()]
    return [sys.executable, "-m", (found or CLI_MODULES)[0], "serve"]


def free_port() -> int:
    """A port free now and not handed out before: the servers bind theirs only once started, so
    the kernel may offer the same free port twice in a row (encoderd and Infinity once collided)."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port not in _GIVEN:
            _GIVEN.add(port)
            return port


class Managed:
    """A child process in its own session (Ctrl-C in our terminal does not reach it: we stop it,
    in order, from `finally`); stop() ends its whole process group."""

    def __init__(self, name: str, argv: list[str], log_path: Path, env: dict | None = None, cwd: str | None = None):
        self.name, self.argv, self.log_path = name, argv, log_path
        self.env = {**os.environ, **(env or {})}
        self.cwd = cwd
        self.proc: subprocess.Popen | None = None

    def start(self) -> Managed:
        with open(self.log_path, "wb") as out:
            self.proc = subprocess.Popen(
                self.argv,
                env=self.env,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
                cwd=self.cwd,
            )
        return self

    def _started(self) -> subprocess.Popen:
        assert self.proc is not None, f"{self.name} was not started"
        return self.proc

    @property
    def pid(self) -> int:
        return self._started().pid

    def check_alive(self) -> None:
        proc = self._started()
        if proc.poll() is not None:
            raise RuntimeError(f"{self.name} exited with {proc.returncode}; log {self.log_path}:\n{self.log_tail()}")

    def log_tail(self, chars: int = 3000) -> str:
        return self.log_path.read_text(errors="replace")[-chars:] if self.log_path.exists() else ""

    def stop(self, timeout: float = 30) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)  # graceful: the server stops its own children
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)  # anything of its group still there
        self.proc.wait()


def wait_until(check, what: str, proc: Managed, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        proc.check_alive()
        with contextlib.suppress(Exception):
            if check():
                return
        time.sleep(0.25)
    raise TimeoutError(f"{what} not ready after {timeout:.0f}s; log {proc.log_path}:\n{proc.log_tail()}")


def http_ok(url: str) -> bool:
    import httpx

    return httpx.get(url, timeout=2).status_code == 200


def grpc_serving(address: str) -> bool:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(address) as channel:
        status = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=2).status
    return status == health_pb2.HealthCheckResponse.SERVING


# ------------------------------------------------------------------ CPU accounting

CLK_TCK = os.sysconf("SC_CLK_TCK")


SCHED_IDLE = 5  # a thread's scheduling policy, field 41 of its stat


def _stat_fields(path: str) -> list[str] | None:
    """The fields of a /proc stat file after "(comm)" (which may hold spaces); None once it is gone."""
    try:
        raw = Path(path).read_text()
    except OSError:
        return None
    return raw[raw.rfind(")") + 2 :].split()


def _cpu(fields: list[str]) -> float:
    return (int(fields[11]) + int(fields[12])) / CLK_TCK  # utime + stime


def _proc_stat(pid: int) -> tuple[int, float] | None:
    """(parent pid, CPU seconds) of a live process."""
    fields = _stat_fields(f"/proc/{pid}/stat")
    return None if fields is None else (int(fields[1]), _cpu(fields))


def thread_stats(pids: list[int], idle: bool) -> list[str]:
    """The stat files of these processes' threads that run under SCHED_IDLE (idle) or not (not idle):
    a CpuProbe group of threads, e.g. the workers' bulk lanes (workers/process.py)."""
    out = []
    for pid in pids:
        with contextlib.suppress(OSError):
            for tid in os.listdir(f"/proc/{pid}/task"):
                path = f"/proc/{pid}/task/{tid}/stat"
                fields = _stat_fields(path)
                if fields is not None and (int(fields[38]) == SCHED_IDLE) == idle:
                    out.append(path)
    return out


def cpu_seconds(member: int | str) -> float:
    """CPU seconds of a process (a pid: all its threads) or of one thread (its stat file)."""
    fields = _stat_fields(member if isinstance(member, str) else f"/proc/{member}/stat")
    return 0.0 if fields is None else _cpu(fields)


def process_tree(root: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and (st := _proc_stat(int(entry.name))):
            children.setdefault(st[0], []).append(int(entry.name))
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo.extend(children.get(pid, ()))
    return out


def descendant_named(root: int, name: str) -> int | None:
    """The first process under `root` (itself included) whose command name is `name`, else None."""
    for pid in process_tree(root):
        with contextlib.suppress(OSError):
            if Path(f"/proc/{pid}/comm").read_text().strip() == name:
                return pid
    return None


def system_busy_seconds() -> float:
    """CPU seconds all cores spent not idle since boot."""
    values = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = values[3] + values[4]  # idle + iowait
    return (sum(values[:8]) - idle) / CLK_TCK


class CpuProbe:
    """Snapshots of CPU seconds per named group of processes (pids) or threads (stat files, from
    thread_stats); groups are fixed at creation."""

    def __init__(self, groups: Mapping[str, Sequence[int | str]]):
        self.groups = groups

    def snapshot(self) -> dict:
        snap = {"t": time.monotonic(), "system": system_busy_seconds(), "client": time.process_time()}
        for name, members in self.groups.items():
            snap[name] = sum(cpu_seconds(m) for m in members)
        return snap

    @staticmethod
    def cores(a: dict, b: dict) -> dict:
        """Average cores used per group between two snapshots, plus everyone else's ("foreign")."""
        wall = max(b["t"] - a["t"], 1e-9)
        used = {k: (b[k] - a[k]) / wall for k in a if k not in ("t", "system")}
        used["foreign"] = max(0.0, (b["system"] - a["system"]) / wall - sum(used.values()))
        return {k: round(v, 3) for k, v in used.items()}


def busy(cores: dict, group: str, threads: int) -> float | None:
    """The fraction of the wall time a worker's compute threads were on a CPU."""
    return round(cores[group] / threads, 3) if group in cores else None
