"""Issue 10: CPU replicas pinned to their own cores, least-loaded dispatch, no failed
request when a replica dies."""

from __future__ import annotations

import concurrent.futures
import os
import re
import signal
import threading
import time
import urllib.request

import grpc
import numpy as np
import pytest
from support.corpus import sentences
from support.server import ServerProcess

from encoderd.v1 import encoderd_pb2 as pb
from encoderd.workers.backends import host_kernels
from encoderd.workers.contract import hardware

TEXTS = sentences(40, max_words=80, seed=5)


def _replica_batches(server) -> dict[str, float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=5).read().decode()
    pattern = r'^encoderd_batch_duration_seconds_count\{model="[^"]+",replica="([^"]+)"\} (\S+)$'
    return {replica: float(v) for replica, v in re.findall(pattern, text, re.M)}


def _affinity(pid: int) -> set[int]:
    return os.sched_getaffinity(pid)


@pytest.fixture
def replicated(tmp_path):
    server = ServerProcess("--replicas", "2", "--cpu-threads", "1", log_path=tmp_path / "s.log").start()
    yield server
    server.stop()


def test_two_pinned_replicas_share_the_load_and_survive_a_kill(replicated, minilm_path):
    from sentence_transformers import SentenceTransformer

    stub = replicated.stub()
    model = stub.ListModels(pb.ListModelsRequest()).models[0]
    pids = [r.pid for r in model.replicas]
    assert len(pids) == 2 and len(set(pids)) == 2 and all(r.status == "ready" for r in model.replicas)
    if len(os.sched_getaffinity(0)) >= 2:
        assert _affinity(pids[0]).isdisjoint(_affinity(pids[1])) and all(len(_affinity(p)) == 1 for p in pids)

    reference = SentenceTransformer(minilm_path, device="cpu").encode(TEXTS)
    failures, checked = [], [0]
    stop = threading.Event()

    def load(offset):
        i = offset
        while not stop.is_set():
            chunk = [TEXTS[(i + k) % len(TEXTS)] for k in range(4)]
            try:
                got = np.array([e.values for e in stub.Embed(pb.EmbedRequest(inputs=chunk), timeout=60).embeddings])
                want = reference[[(i + k) % len(TEXTS) for k in range(4)]]
                np.testing.assert_allclose(got, want, atol=1e-5)
                checked[0] += 1
            except grpc.RpcError as exc:
                failures.append(exc.code())
            i += 4

    threads = [threading.Thread(target=load, args=(k * 10,)) for k in range(4)]
    for t in threads:
        t.start()
    time.sleep(3)
    batches = _replica_batches(replicated)
    assert len(batches) == 2 and all(n > 0 for n in batches.values()), batches  # both replicas got batches
    os.kill(pids[0], signal.SIGKILL)
    deadline = time.monotonic() + 120
    while True:  # keep the load on until the killed replica is back
        replicas = stub.ListModels(pb.ListModelsRequest()).models[0].replicas
        if replicas[0].pid not in (0, pids[0]) and replicas[0].status == "ready":
            break
        assert time.monotonic() < deadline, "replica not restarted"
        time.sleep(0.2)
    time.sleep(1)
    stop.set()
    for t in threads:
        t.join()
    assert not failures, f"{len(failures)} failed requests: {set(failures)}"  # the other replica took the work
    assert checked[0] > 10
    assert replicas[0].restarts == 1 and replicas[1].pid == pids[1]


@pytest.mark.skipif(
    not hardware.cpu().has_any(hardware.NATIVE_BF16) or host_kernels.find_compiler() is None,
    reason="host kernels are built for bfloat16 where the CPU has it natively and a C compiler is here",
)
def test_replicas_starting_together_build_the_host_kernels_once(tmp_path):
    """Both replicas load at once: one compiles host_kernels.c into --cache-dir, the other waits for that
    build and loads it (a replaced worker, another model or the next start load it too)."""
    log = tmp_path / "s.log"
    args = ("--replicas", "2", "--cpu-threads", "1", "--dtype", "bfloat16", "--cache-dir", str(tmp_path / "cache"))
    with ServerProcess(*args, log_path=log) as server:
        [embedding] = server.stub().Embed(pb.EmbedRequest(inputs=TEXTS[:1])).embeddings
        assert len(embedding.values) == 384
    text = log.read_text()
    assert len(re.findall(r"cached kernels entry \S+ \(built in", text)) == 1, text[-3000:]
    assert text.count("reusing cached kernels entry") == 1, text[-3000:]
    assert len(list((tmp_path / "cache" / "kernels").glob(f"*/{host_kernels.LIBRARY}"))) == 1


def _gpus() -> int:
    from encoderd.server.scheduling.placement import visible_gpus

    return visible_gpus()


@pytest.mark.gpu
@pytest.mark.skipif(_gpus() < 1, reason="needs a CUDA device")
@pytest.mark.parametrize("devices", ["cuda:0", "cuda"])
def test_replicas_on_gpus(tmp_path, minilm_path, devices):
    """Two replicas of a small model on every GPU asked for (one GPU: both share cuda:0)."""
    from sentence_transformers import SentenceTransformer

    server = ServerProcess("--device", devices, "--replicas", "2", log_path=tmp_path / "s.log").start()
    try:
        stub = server.stub()
        replicas = stub.ListModels(pb.ListModelsRequest()).models[0].replicas
        expected = 2 * (1 if devices == "cuda:0" else _gpus())
        assert len(replicas) == expected and all(r.status == "ready" for r in replicas)
        assert all(r.device.startswith("cuda:") for r in replicas)
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            results = list(pool.map(lambda i: stub.Embed(pb.EmbedRequest(inputs=TEXTS[i : i + 4])), range(0, 40, 4)))
        got = np.concatenate([[e.values for e in r.embeddings] for r in results])
        np.testing.assert_allclose(got, SentenceTransformer(minilm_path, device="cpu").encode(TEXTS), atol=1e-4)
        assert sum(1 for n in _replica_batches(server).values() if n > 0) >= 2
    finally:
        server.stop()
