"""The `recovery` mode: how soon a server serves after a cold start, and after kill -9 of a worker.

  coldstart  launch -> first embedding answered (the bundled model), per server: encoderd (CPU
             workers forked from its zygote), encoderd --no-worker-zygote (each worker spawned,
             importing torch and transformers itself; not with --quick) and, with --infinity,
             Infinity. One server at a time, rounds alternating between them, so they share the
             machine's conditions.
  recovery   SIGKILL of the embedding worker -> first embedding answered again, for both encoderd
             variants (Infinity has no worker to kill: its recovery is a cold start). With two or
             more replicas the other one answers at once;
  replaced   SIGKILL of the embedding worker -> its replacement ready (ListModels: the replica's
             new pid, status "ready"): what a one-replica server waits before it serves again, and
             how long a replicated one runs short of a replica.
Times are p50 and max over --recovery-runs cold starts / kills, in the p50 ms and p99 ms columns.
"""

from __future__ import annotations

import contextlib
import os
import signal
import statistics
import time
from pathlib import Path

from ..workers.contract.model_files import DEFAULT_MODEL_NAME
from .modes import Row
from .options import log
from .processes import Managed
from .servers import list_models, start_encoderd, start_infinity

PROBE = ["how soon does it serve again?"]
SPAWNED = "encoderd(spawn)"


class _GrpcProbe:
    """One Embed per call on a channel that retries connecting every 50 ms (the default backs off
    for seconds after a refused connection, which would be counted as start-up time)."""

    def __init__(self, address: str):
        import grpc

        from ..v1 import encoderd_pb2, encoderd_pb2_grpc

        self._pb = encoderd_pb2
        self._channel = grpc.insecure_channel(
            address,
            options=[
                ("grpc.initial_reconnect_backoff_ms", 50),
                ("grpc.min_reconnect_backoff_ms", 50),
                ("grpc.max_reconnect_backoff_ms", 100),
            ],
        )
        self._stub = encoderd_pb2_grpc.EncoderStub(self._channel)

    def __call__(self) -> bool:
        reply = self._stub.Embed(self._pb.EmbedRequest(model=DEFAULT_MODEL_NAME, inputs=PROBE), timeout=5)
        return len(reply.embeddings) == 1

    def close(self) -> None:
        self._channel.close()


class _RestProbe:
    def __init__(self, base_url: str):
        import httpx

        self._client = httpx.Client(base_url=base_url, timeout=5)

    def __call__(self) -> bool:
        reply = self._client.post("/embeddings", json={"model": DEFAULT_MODEL_NAME, "input": PROBE})
        return reply.status_code == 200 and len(reply.json()["data"]) == 1

    def close(self) -> None:
        self._client.close()


def _until_served(probe, server: Managed, started: float, timeout: float = 600) -> float:
    """Seconds from `started` to the first answered probe."""
    while time.monotonic() - started < timeout:
        server.check_alive()
        with contextlib.suppress(Exception):
            if probe():
                return time.monotonic() - started
        time.sleep(0.02)
    raise TimeoutError(f"{server.name} served nothing {timeout:.0f}s after its start; log {server.log_path}")


def _encoderd(args, embed_dir: str, logs: Path, zygote: bool):
    serve_args = args.serve_args + ("" if zygote else " --no-worker-zygote")
    started = time.monotonic()
    server, ports = start_encoderd(_with(args, serve_args=serve_args), embed_dir, None, logs, rest=False)
    return server, _GrpcProbe(f"127.0.0.1:{ports['grpc']}"), started


def _infinity(venv: Path, embed_dir: str, logs: Path):
    started = time.monotonic()
    server, port = start_infinity(venv, embed_dir, None, logs)
    return server, _RestProbe(f"http://127.0.0.1:{port}"), started


def _with(args, **changes):
    copy = type(args)(**vars(args))
    for key, value in changes.items():
        setattr(copy, key, value)
    return copy


def _first_replica(address: str):
    model = next(m for m in list_models(address) if m.id == DEFAULT_MODEL_NAME)
    return model.replicas[0]


def _replaced(server: Managed, address: str, killed_pid: int, killed: float, timeout: float = 600) -> float:
    """Seconds from `killed` until the killed worker's replica is ready again with a new process."""
    while time.monotonic() - killed < timeout:
        server.check_alive()
        with contextlib.suppress(Exception):
            replica = _first_replica(address)
            if replica.pid not in (0, killed_pid) and replica.status == "ready":
                return time.monotonic() - killed
        time.sleep(0.02)
    raise TimeoutError(f"{server.name}: worker {killed_pid} not replaced {timeout:.0f}s after its kill")


def _kill_and_time(probe, server: Managed, address: str) -> tuple[float, float]:
    """SIGKILL the embedding worker; seconds until an embedding is answered again, and until the
    worker is replaced."""
    pid = _first_replica(address).pid
    os.kill(pid, signal.SIGKILL)  # it runs no code after this returns: any answer is its successor's
    killed = time.monotonic()
    served = _until_served(probe, server, killed)
    return served, _replaced(server, address, pid, killed)


def run_recovery(args, embed_dir: str, logs: Path, infinity_venv: Path | None) -> list[Row]:
    variants = {"encoderd": True} if args.quick else {"encoderd": True, SPAWNED: False}  # --quick: a smoke run
    cold: dict[str, list[float]] = {name: [] for name in [*variants, *(["infinity"] if infinity_venv else [])]}
    kills: dict[str, list[float]] = {name: [] for name in variants}
    replaced: dict[str, list[float]] = {name: [] for name in variants}
    for round_ in range(args.recovery_runs):
        for name in cold:
            log(f"recovery round {round_ + 1}/{args.recovery_runs}: cold start of {name}")
            run_logs = logs / f"{name.replace('(', '-').rstrip(')')}-{round_}"
            run_logs.mkdir(parents=True, exist_ok=True)
            server, probe, started = (
                _infinity(infinity_venv, embed_dir, run_logs)
                if name == "infinity" and infinity_venv
                else _encoderd(args, embed_dir, run_logs, variants[name])
            )
            try:
                cold[name].append(_until_served(probe, server, started))
                log(f"  {name}: first embedding {cold[name][-1]:.2f}s after launch")
                if name in kills:  # one kill per round: the same number as cold starts
                    address = f"127.0.0.1:{server.argv[server.argv.index('--grpc-port') + 1]}"
                    time.sleep(1.0)  # the server settles (its first requests are answered)
                    served, ready = _kill_and_time(probe, server, address)
                    kills[name].append(served)
                    replaced[name].append(ready)
                    log(f"  {name}: serving again {served:.2f}s after SIGKILL of its worker, replaced {ready:.2f}s")
            finally:
                probe.close()
                server.stop()
    rows = [
        _row("coldstart", name, "rest" if name == "infinity" else "grpc", times, "launch -> first embedding answered")
        for name, times in cold.items()
    ]
    rows += [
        _row("recovery", name, "grpc", times, "SIGKILL of the worker -> first embedding answered again")
        for name, times in kills.items()
    ]
    rows += [
        _row("replaced", name, "grpc", times, "SIGKILL of the worker -> its replacement ready")
        for name, times in replaced.items()
    ]
    return rows


def _row(mode: str, engine: str, protocol: str, seconds: list[float], what: str) -> Row:
    row = Row(mode, engine, protocol, calls=len(seconds))
    if seconds:
        row.p50_ms = round(statistics.median(seconds) * 1e3, 1)
        row.p99_ms = round(max(seconds) * 1e3, 1)
        row.wall_s = round(sum(seconds), 2)
        row.notes = f"{what}: " + ", ".join(f"{s:.2f}s" for s in seconds) + " (p50 / max in the p50 / p99 columns)"
    return row
