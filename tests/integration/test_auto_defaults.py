"""Issue 19.1: with no --dtype / --replicas / --cpu-threads the server picks them for this host
(workers/contract/hardware.py, cpu_cores.py), serves what it says it picked, and logs one line per model saying why."""

from __future__ import annotations

import os

import numpy as np
from support.nice import process_nice, thread_priorities
from support.server import ServerProcess

from encoderd.server.base.config import WORKER_NICE
from encoderd.v1 import encoderd_pb2 as pb
from encoderd.workers.contract.cpu_cores import choose_cpu_layout, cpu_budget
from encoderd.workers.contract.hardware import choose_cpu_dtype
from encoderd.workers.contract.model_files import DEFAULT_MODEL_NAME
from encoderd.workers.process import BULK_LANE_NICE


def test_defaults_are_chosen_for_this_host_and_logged(tmp_path, minilm_path):
    from sentence_transformers import SentenceTransformer

    server = ServerProcess(log_path=tmp_path / "server.log")
    for pinned in ("ENCODERD_DTYPE", "ENCODERD_REPLICAS", "ENCODERD_CPU_THREADS"):  # tests/conftest.py pins them
        server.env.pop(pinned, None)
    layout = choose_cpu_layout(cpu_budget().usable)
    dtype, why = choose_cpu_dtype("torch")
    with server:
        model = server.stub().ListModels(pb.ListModelsRequest()).models[0]
        texts = ["a short query", "a somewhat longer passage about serving encoder models on any host " * 3]
        got = np.array([e.values for e in server.stub().Embed(pb.EmbedRequest(inputs=texts), timeout=60).embeddings])
        # Workers run --worker-nice below the frontend; with one thread each, their bulk lane 5 more, SCHED_IDLE.
        frontend = process_nice(server.proc.pid)
        for replica in model.replicas:
            threads = thread_priorities(replica.pid)
            own, bulk = (frontend + WORKER_NICE, os.SCHED_OTHER), threads[-1]
            assert threads[0] == own, (frontend, threads)
            assert bulk == ((own[0] + BULK_LANE_NICE, os.SCHED_IDLE) if layout.threads == 1 else own), threads
    log = server.log_text()
    # A log file is not a terminal: no progress bars redrawn with carriage returns (transformers' loading bar).
    assert "\r" not in log and "Loading weights" not in log, log
    [line] = [ln for ln in log.splitlines() if f"chose {DEFAULT_MODEL_NAME}:" in ln]
    # The dtype the hardware policy wants, unless the fidelity check sent it back to float32 (then it says so).
    assert model.dtype in (dtype, "float32") and f"dtype {model.dtype}" in line
    assert (why in line) if model.dtype == dtype else ("failed the fidelity self-check" in line), line
    assert (
        len(model.replicas) == layout.replicas and f"{layout.replicas} CPU worker(s) x {layout.threads} thread" in line
    )
    assert layout.why in line and "usable core" in line
    want = SentenceTransformer(minilm_path, device="cpu").encode(texts)
    cosines = (got * want).sum(1) / np.linalg.norm(got, axis=1) / np.linalg.norm(want, axis=1)
    assert cosines.min() >= 0.999, cosines  # the floor of the half-precision row (workers/fidelity.py)
