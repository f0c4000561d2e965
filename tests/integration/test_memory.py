"""Issue 16, finding 4: worker memory plateaus under batches of ever-new shapes.

Two real servers side by side, the same distinct-shape batches sent to each: one as shipped
(kernel caches bounded, heap trimmed: workers/memory.py), one with the oneDNN caches back at
their 1,024-entry defaults (the operator's environment wins), which reproduces the cause.
The shipped worker stays within a bound of its post-warm-up RSS; the other grows well past it.
The 10-minute soak is `python -m encoderd.bench.soak`; figures are in docs/performance.md.
"""

from __future__ import annotations

import random
import time
from pathlib import Path

import pytest
from support.server import ServerProcess

from encoderd.v1 import encoderd_pb2 as pb

WORDS = "each batch has a shape the worker has never seen before so its kernels are new".split()
# Warm-up: enough distinct shapes to fill the bounded (64-entry) kernel caches; until then the
# shipped worker grows too, by the caches filling to their cap (after only 8 batches it then grew
# +35 to +66 MB over the next 50 on a Zen 5, bf16). After 40, RSS read once settled: shipped -7 to
# +8 MB, 1,024-entry caches +108 to +123 MB (four runs). On a Zen 4 (bf16) the 1,024-entry caches grew
# less: +29 to +54 MB (four runs), shipped -11 to -2 MB.
WARMUP_BATCHES, BATCHES = 40, 50
BOUND_MB = 60  # growth allowed after warm-up
CAUSE_MB = 20  # the 1,024-entry caches' growth beyond the shipped worker's, at least: the cause reproduced


def _rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError(f"no VmRSS for {pid}")


@pytest.fixture(scope="module")
def servers(tmp_path_factory, minilm_path):
    logs = tmp_path_factory.mktemp("memory")
    old_caches = {"LRU_CACHE_CAPACITY": "1024", "ONEDNN_PRIMITIVE_CACHE_CAPACITY": "1024"}
    flags = ("--model", f"e={minilm_path}", "--cpu-threads", "1", "--replicas", "1")  # one worker takes every batch
    procs = {
        "shipped": ServerProcess(*flags, log_path=logs / "shipped.log"),
        "old caches": ServerProcess(*flags, env=old_caches, log_path=logs / "old.log"),
    }
    for proc in procs.values():
        proc.launch()  # both load at once
    try:
        for proc in procs.values():
            proc.wait_serving(300)
        yield procs
    finally:
        for proc in procs.values():
            proc.stop()


def _settled_rss_mb(stubs: dict, pids: dict) -> dict[str, float]:
    """Each worker's RSS once it has let go of its last batch: a worker gives freed heap back when
    it goes idle, at most once a second (workers/memory.py), so after a second's pause one tiny
    call triggers that trim. Read right after a batch, RSS also held that batch's freed memory
    (once +64 MB against the 60 MB bound, where the kept memory had not grown)."""
    time.sleep(1.2)
    for stub in stubs.values():
        stub.Embed(pb.EmbedRequest(inputs=["settle"]), timeout=60)
    return {name: _rss_mb(pid) for name, pid in pids.items()}


def test_worker_memory_is_bounded_under_ever_new_batch_shapes(servers):
    stubs = {name: proc.stub() for name, proc in servers.items()}
    pids = {
        name: stub.ListModels(pb.ListModelsRequest(), timeout=10).models[0].replicas[0].pid
        for name, stub in stubs.items()
    }
    rng = random.Random(7)
    shapes = set()
    for k in range(WARMUP_BATCHES + BATCHES):
        if k == WARMUP_BATCHES:
            warm = _settled_rss_mb(stubs, pids)
        while True:  # a (batch size, total tokens) pair not sent before: new GEMM shapes
            lengths = [rng.randint(3, 120) for _ in range(rng.randint(1, 12))]
            if (len(lengths), sum(lengths)) not in shapes:
                shapes.add((len(lengths), sum(lengths)))
                break
        inputs = [f"{k} {i} " + " ".join(rng.choice(WORDS) for _ in range(n)) for i, n in enumerate(lengths)]
        for stub in stubs.values():
            assert len(stub.Embed(pb.EmbedRequest(inputs=inputs), timeout=120).embeddings) == len(inputs)
    growth = {name: rss - warm[name] for name, rss in _settled_rss_mb(stubs, pids).items()}
    print(
        f"worker RSS growth over {BATCHES} new-shape batches: "
        + ", ".join(f"{name} {g:+.0f} MB" for name, g in growth.items())
    )
    assert growth["shipped"] < BOUND_MB, growth
    assert growth["old caches"] > growth["shipped"] + CAUSE_MB, growth  # the cause, reproduced
