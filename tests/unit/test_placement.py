import os

import pytest

from encoderd.server.scheduling import placement
from encoderd.server.scheduling.placement import Placement, expand_devices, plan_replicas


def test_single_cpu_worker_is_not_pinned():
    assert plan_replicas("cpu") == [Placement("cpu")]


def test_cpu_replicas_get_disjoint_core_sets(monkeypatch):
    monkeypatch.setattr(placement, "usable_cores", lambda: [0, 1, 2, 3])
    plan = plan_replicas("cpu", replicas=2)
    assert [p.cores for p in plan] == [(0, 1), (2, 3)] and [p.threads for p in plan] == [2, 2]
    assert [p.cores for p in plan_replicas("cpu", replicas=2, cpu_threads=1)] == [(0,), (1,)]


def test_more_replicas_than_cores_wrap_around(monkeypatch):
    monkeypatch.setattr(placement, "usable_cores", lambda: [0, 1])
    assert [p.cores for p in plan_replicas("cpu", replicas=3, cpu_threads=1)] == [(0,), (1,), (0,)]


def test_device_lists(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    assert expand_devices("cuda") == ["cuda:0", "cuda:1"]
    assert [p.device for p in plan_replicas("cuda:1,cpu", replicas=2)] == ["cuda:1", "cuda:1", "cpu", "cpu"]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    with pytest.raises(ValueError, match="no GPU"):
        expand_devices("cuda")
    with pytest.raises(ValueError, match="unknown device"):
        expand_devices("tpu")


def test_usable_cores_respects_affinity():
    assert set(placement.usable_cores()) <= os.sched_getaffinity(0)
