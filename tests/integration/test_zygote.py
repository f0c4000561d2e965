"""Issue 16 (9): CPU workers are forked from the zygote, a process that imported torch and
transformers once, so a killed worker comes back without re-importing them.

A real server on the bundled model: workers killed with SIGKILL (twice in a row, then with the
zygote killed too) come back forked from a zygote, as children of the frontend, and compute the
same vectors; kill -9 of the frontend leaves no process behind. How fast is the benchmark's
business (`encoderd bench --modes recovery`), not a test's.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time

import grpc
import numpy as np
import pytest
from support.server import ServerProcess

from encoderd.v1 import encoderd_pb2 as pb

ZYGOTE_MODULE = "encoderd.workers.zygote"


def _cmdline(pid: int) -> str:
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        return f.read().replace(b"\0", b" ").decode()


def _stat(pid: int) -> tuple[str, int]:
    """(state, parent pid)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rpartition(")")[2].split()
    return fields[0], int(fields[1])


def _alive(pid: int) -> bool:
    try:
        return _stat(pid)[0] != "Z"
    except FileNotFoundError:
        return False


def _descendants(root: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(FileNotFoundError, ProcessLookupError):
                children.setdefault(_stat(int(entry))[1], []).append(int(entry))
    out, todo = [], [root]
    while todo:
        out.extend(kids := children.get(todo.pop(), []))
        todo.extend(kids)
    return out


def _zygote(server) -> int:
    """The zygote: the frontend's child on the zygote's command line that is no worker (a forked
    worker keeps the command line it was forked with)."""
    workers = {r.pid for m in server.stub().ListModels(pb.ListModelsRequest()).models for r in m.replicas}
    found = [
        p for p in _descendants(server.proc.pid) if _alive(p) and p not in workers and ZYGOTE_MODULE in _cmdline(p)
    ]
    assert len(found) == 1, f"expected one zygote among the frontend's processes, found {found}"
    return found[0]


def _worker(stub) -> int:
    return stub.ListModels(pb.ListModelsRequest()).models[0].replicas[0].pid


def _embed(stub) -> np.ndarray:
    reply = stub.Embed(pb.EmbedRequest(inputs=["the zygote forks workers", "a second input"]), timeout=10)
    return np.array([e.values for e in reply.embeddings], dtype=np.float32)


def _assert_forked_child_of(server, pid: int) -> None:
    assert _stat(pid)[1] == server.proc.pid, "a forked worker is re-parented to the frontend"
    assert ZYGOTE_MODULE in _cmdline(pid), f"worker {pid} was not forked from the zygote: {_cmdline(pid)!r}"


def _kill_and_wait_serving(server, stub, pid: int, timeout: float = 120) -> int:
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + timeout
    while True:
        assert time.monotonic() < deadline, f"no worker serving {timeout:.0f}s after SIGKILL of {pid}"
        try:
            new = _worker(stub)
            if new not in (pid, 0):
                _embed(stub)
                return new
        except (grpc.RpcError, IndexError):  # UNAVAILABLE, or no replica listed yet, while it restarts
            pass
        time.sleep(0.1)


@pytest.fixture(scope="module")
def zygote_server(tmp_path_factory):
    server = ServerProcess(log_path=tmp_path_factory.mktemp("zygote") / "server.log").start()
    yield server
    server.stop()


def test_workers_are_forked_from_the_zygote_and_restart_from_it_after_sigkill(zygote_server):
    stub = zygote_server.stub()
    before = _embed(stub)
    first = _worker(stub)
    _assert_forked_child_of(zygote_server, first)
    zygote = _zygote(zygote_server)
    assert _stat(zygote)[1] == zygote_server.proc.pid
    # Twice: the restarted worker's own death must be seen too.
    second = _kill_and_wait_serving(zygote_server, stub, first)
    third = _kill_and_wait_serving(zygote_server, stub, second)
    for pid in (second, third):
        assert not _alive(pid) or pid == third
    _assert_forked_child_of(zygote_server, third)
    assert _zygote(zygote_server) == zygote, "the same zygote serves every restart"
    np.testing.assert_allclose(_embed(stub), before, rtol=0, atol=1e-6)
    log = zygote_server.log_path.read_text(errors="replace")
    assert log.count("forked from the zygote") >= 3, log[-3000:]
    assert "died with exit code -9" in log, log[-3000:]


def test_a_dead_zygote_is_replaced_and_workers_keep_coming_from_one(zygote_server):
    stub = zygote_server.stub()
    old_zygote = _zygote(zygote_server)
    os.kill(old_zygote, signal.SIGKILL)
    _embed(stub)  # the serving worker does not depend on the zygote
    worker = _kill_and_wait_serving(zygote_server, stub, _worker(stub))
    _assert_forked_child_of(zygote_server, worker)
    assert _zygote(zygote_server) != old_zygote
    assert "starting a new one" in zygote_server.log_path.read_text(errors="replace")


def test_sigkill_of_the_frontend_leaves_neither_zygote_nor_worker(zygote_server):
    tree = _descendants(zygote_server.proc.pid)
    assert _zygote(zygote_server) in tree and _worker(zygote_server.stub()) in tree
    os.kill(zygote_server.proc.pid, signal.SIGKILL)
    zygote_server.proc.wait(10)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(_alive(p) for p in tree):
        time.sleep(0.1)
    assert not [p for p in tree if _alive(p)], [(p, _cmdline(p)) for p in tree if _alive(p)]


def test_without_the_zygote_workers_are_spawned(tmp_path):
    """--no-worker-zygote (and the fallback when the zygote cannot run): the plain spawn path."""
    with ServerProcess("--no-worker-zygote", log_path=tmp_path / "server.log") as server:
        stub = server.stub()
        assert _embed(stub).shape == (2, 384)
        worker = _worker(stub)
        assert "multiprocessing" in _cmdline(worker) and _stat(worker)[1] == server.proc.pid
        assert not [p for p in _descendants(server.proc.pid) if ZYGOTE_MODULE in _cmdline(p)]
