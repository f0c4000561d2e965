"""Issue 19.1: what the server picks by itself (workers/contract/cpu_cores.py, hardware.py): worker
layout from the usable cores (affinity cut by a cgroup v1/v2 quota), and the CPU dtype from the
instruction sets, each with its reason; every explicit flag wins. Fake hardware descriptions, no model loaded."""

from __future__ import annotations

import pytest
from test_hardware import host

from encoderd.server.base.config import WORKER_NICE
from encoderd.server.main.configure import config_from_args
from encoderd.server.main.flags import build_parser
from encoderd.server.scheduling import placement
from encoderd.workers.contract.cpu_cores import CpuBudget, choose_cpu_layout, parse_cgroup_v1, parse_cgroup_v2
from encoderd.workers.contract.hardware import choose_cpu_dtype, explicit_dtype_note


@pytest.mark.parametrize(
    "text, cpus", [("max 100000", None), ("200000 100000", 2.0), ("150000 100000", 1.5), ("50000 100000", 0.5)]
)
def test_cgroup_v2_quota(text, cpus):
    assert parse_cgroup_v2(text + "\n") == cpus


@pytest.mark.parametrize("quota, period, cpus", [("-1", "100000", None), ("400000", "100000", 4.0)])
def test_cgroup_v1_quota(quota, period, cpus):
    assert parse_cgroup_v1(quota + "\n", period + "\n") == cpus


@pytest.mark.parametrize(
    "affinity, quota, usable",
    [
        (64, None, 64),  # a whole host
        (64, 2.0, 2),  # a container limited to 2 CPUs on a 64-core host acts as 2 cores
        (64, 1.5, 1),  # whole cores' worth only: a second worker would be throttled
        (64, 0.5, 1),  # never fewer than one
        (4, 8.0, 4),  # the affinity bounds a generous quota
    ],
)
def test_usable_cores_follow_affinity_and_quota(affinity, quota, usable):
    budget = CpuBudget(tuple(range(affinity)), quota)
    assert budget.usable == usable and budget.cores == tuple(range(usable))
    assert f"{usable} usable core" in budget.describe()


@pytest.mark.parametrize(
    "usable, replicas, threads",
    [
        (1, 1, 1),
        (2, 2, 1),
        (4, 4, 1),  # small hosts: one single-thread worker per core
        (8, 2, 4),
        (16, 4, 4),
        (32, 8, 4),  # bigger: 4-thread workers
        (64, 8, 8),
        (96, 8, 12),  # never more than 8 copies of the model
    ],
)
def test_automatic_layout(usable, replicas, threads):
    layout = choose_cpu_layout(usable)
    assert (layout.replicas, layout.threads) == (replicas, threads) and layout.why


def test_explicit_layout_flags_win():
    assert (choose_cpu_layout(2, replicas=1).replicas, choose_cpu_layout(2, replicas=1).threads) == (1, 2)
    assert (choose_cpu_layout(16, threads=8).replicas, choose_cpu_layout(16, threads=8).threads) == (2, 8)
    assert (choose_cpu_layout(2, replicas=3, threads=2).replicas, choose_cpu_layout(2, 3, 2).threads) == (3, 2)
    assert "--replicas 1 given" in choose_cpu_layout(2, replicas=1).why


def test_plan_under_a_quota(monkeypatch):
    """A 2-CPU container on a 64-core host: two pinned one-thread workers by default, and a single
    worker told to use 2 threads (not the 64 its affinity shows)."""
    monkeypatch.setattr(placement, "cpu_budget", lambda: CpuBudget(tuple(range(64)), 2.0))
    auto = placement.plan_replicas("cpu", replicas=0)
    assert [(p.cores, p.threads) for p in auto] == [((0,), 1), ((1,), 1)]
    [one] = placement.plan_replicas("cpu", replicas=1)
    assert (one.cores, one.threads) == ((), 2)
    gpu_and_cpu = placement.plan_replicas("cuda:0,cpu", replicas=0)
    assert [p.device for p in gpu_and_cpu] == ["cuda:0", "cpu", "cpu"] and gpu_and_cpu[0].threads == 0


@pytest.mark.parametrize(
    "name, engine, dtype",
    [
        ("zen4", "torch", "bfloat16"),
        ("spr", "torch", "bfloat16"),
        ("zen4", "auto", "bfloat16"),
        ("zen3", "torch", "float32"),
        ("skylake", "torch", "float32"),
        ("alderlake", "torch", "int8"),  # avx_vnni, no native bfloat16 (issue 19.3)
        ("alderlake", "auto", "int8"),
        ("alderlake", "onnx", "float32"),  # onnx int8 is ~1.1x torch float32
        ("zen4", "onnx", "float32"),
        ("spr", "ctranslate2", "float32"),  # engines without CPU bfloat16
    ],
)
def test_automatic_cpu_dtype(name, engine, dtype):
    chosen, why = choose_cpu_dtype(engine, host(name))
    assert chosen == dtype and why
    if dtype == "float32":  # issue 19.3: the server says why it does not pick int8 either
        assert "int8 not chosen" in why


def test_masking_bf16_chooses_int8_then_float32():
    assert choose_cpu_dtype("torch", host("zen4", mask="avx512_bf16"))[0] == "int8"  # VNNI left
    assert choose_cpu_dtype("torch", host("zen4", mask="avx512_bf16,avx512_vnni"))[0] == "float32"


def test_explicit_int8_or_float16_where_bfloat16_is_native_is_served_with_a_note():
    """Issue 19.3: where the host cannot give int8 both goals but has a better dtype, the server says so
    (the start-up line) and serves what it was asked for."""
    note = explicit_dtype_note("torch", "int8", host("spr"))
    assert note and "amx_bf16" in note and "--dtype auto picks it" in note and "measured faster" in note
    zen4 = explicit_dtype_note("torch", "int8", host("zen4"))  # no AMX: int8 faster, bfloat16 more faithful
    assert zen4 and "avx512_bf16" in zen4 and "trades it for speed" in zen4 and "measured faster" not in zen4
    assert explicit_dtype_note("torch", "int8", host("zen4", mask="avx512_bf16")) is None  # int8 is auto there
    assert explicit_dtype_note("onnx", "int8", host("spr")) is None  # onnx computes no bfloat16 on CPU
    assert explicit_dtype_note("torch", "float32", host("spr")) is None
    # float16 where its matrix products are no faster than float32's (avx512_fp16, no amx_fp16)
    assert "amx_fp16" in explicit_dtype_note("torch", "float16", host("spr"))
    assert explicit_dtype_note("torch", "bfloat16", host("spr")) is None


def test_cli_defaults_are_automatic(monkeypatch):
    for env in ("ENCODERD_DTYPE", "ENCODERD_REPLICAS", "ENCODERD_CPU_THREADS"):
        monkeypatch.delenv(env, raising=False)
    config = config_from_args(build_parser().parse_args(["serve"]))
    assert (config.dtype, config.replicas, config.cpu_threads) == ("auto", 0, 0)
    config = config_from_args(build_parser().parse_args(["serve", "--dtype", "float32", "--replicas", "1"]))
    assert (config.dtype, config.replicas) == ("float32", 1)


def test_workers_run_nicer_than_the_frontend_by_default(monkeypatch):
    monkeypatch.delenv("ENCODERD_WORKER_NICE", raising=False)
    assert config_from_args(build_parser().parse_args(["serve"])).worker_nice == WORKER_NICE == 10
    assert config_from_args(build_parser().parse_args(["serve", "--worker-nice", "0"])).worker_nice == 0
    for bad in ("-1", "20"):  # a worker may only lower its priority, and 19 is the lowest
        with pytest.raises(SystemExit):
            build_parser().parse_args(["serve", "--worker-nice", bad])
