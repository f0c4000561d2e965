"""Run a real `encoderd serve` process for tests and wait until it is SERVING."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterable, Iterator
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from encoderd.v1 import encoderd_pb2_grpc

# Loopback requests must not follow an http_proxy from the environment.
_DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def until(condition, what: str, timeout: float = 60) -> None:
    """Wait for a state of the server (not for time to pass): fails with `what` only if it never comes."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.02)


@contextlib.contextmanager
def stopped(pids: Iterable[int]) -> Iterator[None]:
    """The processes `pids` (a server's workers) stopped by SIGSTOP within the block and resumed after it,
    however it ends: the calls a test sends wait for them, and are held by the server, whatever the host's
    speed. A process that died meanwhile is skipped."""
    pids = list(pids)
    for pid in pids:
        os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)


def free_ports(count: int) -> list[int]:
    """`count` distinct free loopback ports: each socket stays bound until all are chosen, so the kernel
    cannot hand one port out twice (separate free_port() calls can, and a server then refuses its
    own arguments)."""
    with contextlib.ExitStack() as sockets:
        ports = []
        for _ in range(count):
            s = sockets.enter_context(socket.socket())
            s.bind(("127.0.0.1", 0))
            ports.append(s.getsockname()[1])
        return ports


def free_port() -> int:
    return free_ports(1)[0]


class ServerProcess:
    """`encoderd serve ARGS` on a free loopback port; stop() leaves nothing running.

    REST (the Envoy child) is off unless rest=True, which puts it on a free port
    too and makes start() also wait until Envoy answers /health with 200."""

    def __init__(
        self,
        *args: str,
        env: dict | None = None,
        log_path: Path | None = None,
        rest: bool = False,
        credentials: grpc.ChannelCredentials | None = None,
        rest_tls: ssl.SSLContext | None = None,
    ):
        """`credentials` / `rest_tls`: how this test's own checks reach a server started with --tls-*."""
        self.credentials = credentials
        self._rest_opener = (
            urllib.request.build_opener(urllib.request.ProxyHandler({}), urllib.request.HTTPSHandler(context=rest_tls))
            if rest_tls
            else _DIRECT
        )
        self.grpc_port, self.metrics_port, rest_port = free_ports(3)
        self.rest_port = rest_port if rest else 0
        rest_args = ["--rest-port", str(self.rest_port)] if rest else ["--no-rest"]
        self.args = ["--grpc-port", str(self.grpc_port), "--metrics-port", str(self.metrics_port), *rest_args, *args]
        self.env = {**os.environ, **(env or {})}
        self.log_path = log_path
        self.proc: subprocess.Popen | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    @property
    def rest_url(self) -> str:
        return f"{'https' if self._rest_opener is not _DIRECT else 'http'}://127.0.0.1:{self.rest_port}"

    def launch(self) -> ServerProcess:
        """Start the process without waiting for it."""
        # The child keeps its own copy of the log's descriptor.
        with open(self.log_path, "wb") if self.log_path else contextlib.nullcontext(subprocess.DEVNULL) as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "encoderd.server.main.cli", "serve", *self.args],
                env=self.env,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        return self

    def start(self, timeout: float = 180) -> ServerProcess:
        self.launch()
        try:
            self.wait_serving(timeout)
            if self.rest_port:
                self.wait_rest(timeout)
        except BaseException:
            self.stop()  # a server that never came up must not outlive the test
            raise
        return self

    def rest_health(self) -> int | None:
        """The HTTP status of GET /health through Envoy; None while nothing answers."""
        try:
            with self._rest_opener.open(self.rest_url + "/health", timeout=2) as response:
                return response.status
        except urllib.error.HTTPError as exc:
            return exc.code
        except OSError:
            return None

    def wait_rest(self, timeout: float = 180, status: int = 200) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"encoderd exited with {self.proc.returncode}; log: {self.log_text()}")
            if self.rest_health() == status:
                return
            time.sleep(0.1)
        raise TimeoutError(f"REST /health not {status} after {timeout}s; log: {self.log_text()}")

    def wait_serving(self, timeout: float = 180, service: str = "") -> None:
        deadline = time.monotonic() + timeout
        with self.channel() as channel:
            health = health_pb2_grpc.HealthStub(channel)
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"encoderd exited with {self.proc.returncode}; log: {self.log_text()}")
                try:
                    status = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=1).status
                    if status == health_pb2.HealthCheckResponse.SERVING:
                        return
                except grpc.RpcError:
                    pass
                time.sleep(0.2)
        raise TimeoutError(f"encoderd not SERVING after {timeout}s; log: {self.log_text()}")

    def envoy_pid(self) -> int:
        """The pid of this server's Envoy child (REST)."""
        for entry in os.listdir("/proc"):
            if entry.isdigit():
                try:
                    stat = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
                    cmdline = Path(f"/proc/{entry}/cmdline").read_bytes()
                except OSError:
                    continue
                if int(stat[1]) == self.proc.pid and b"envoy" in cmdline:
                    return int(entry)
        raise AssertionError("no Envoy child")

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:] if self.log_path and self.log_path.exists() else ""

    def channel(self) -> grpc.Channel:
        if self.credentials:
            return grpc.secure_channel(self.address, self.credentials)
        return grpc.insecure_channel(self.address)

    def stub(self) -> encoderd_pb2_grpc.EncoderStub:
        return encoderd_pb2_grpc.EncoderStub(self.channel())

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30) -> int:
        if self.proc is None:
            return 0
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        return self.proc.returncode

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()
