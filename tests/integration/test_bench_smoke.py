"""Smoke run of the benchmark (`encoderd bench --quick`): it runs end to end, writes every field
of its JSON report, and leaves no process behind. No timing is asserted: it is a benchmark."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROW_FIELDS = {
    "mode",
    "engine",
    "protocol",
    "inputs_per_s",
    "tokens_per_s",
    "p50_ms",
    "p95_ms",
    "p99_ms",
    "calls",
    "errors",
    "padding_ratio",
    "flop_utilisation",
    "worker_busy",
    "cpu_cores",
    "server",
}


def _alive(pid: int) -> bool:
    """Running or sleeping; a zombie (dead, waiting for whoever adopted it to reap it) is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rfind(")") + 2] != "Z"


def test_bench_quick_writes_report(tmp_path, reranker_path):
    out = tmp_path / "bench.json"
    cmd = [
        sys.executable,
        "-m",
        "encoderd.bench",
        "--quick",
        "--json",
        str(out),
        "--reranker",
        reranker_path,
        "--log-dir",
        str(tmp_path / "logs"),
        "--rest",
    ]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=280, check=False)
    assert done.returncode == 0, done.stderr[-4000:]
    report = json.loads(out.read_text())

    assert report["conditions"]["quick"] is True
    assert {"n", "min", "p50", "max", "mean_real", "histogram"} <= set(report["corpus"])
    assert report["corpus"]["min"] >= 5 and report["corpus"]["max"] <= 500
    assert report["peak_gflops"]["float32"] > 0 and report["peak_gflops"]["bfloat16"] > 0
    assert report["flop_model"]["matmul_params"] > 0
    assert report["floors"]["matmul_peak_gflops"]["float32"] > 0 and report["conditions"]["models"] == "minilm"

    rows = {(r["mode"], r["protocol"]): r for r in report["results"]}
    for mode in ("bulk", "single", "rerank"):
        for protocol in ("grpc", "rest"):
            row = rows[(mode, protocol)]
            assert set(row) >= ROW_FIELDS, (mode, protocol)
            assert row["engine"] == "encoderd" and row["calls"] > 0 and row["errors"] == 0, row
    bulk = rows[("bulk", "grpc")]
    assert bulk["padding_ratio"] >= 1 and bulk["worker_busy"] is not None and "worker" in bulk["cpu_cores"]
    assert "mode" in done.stdout and "bulk" in done.stdout  # the table was printed
    # What each model was served as is printed: an automatic dtype can differ from model to model
    # (a bfloat16 that fails its fidelity check is served float32).
    served = report["encoderd_models"]
    assert {m["kind"] for m in served} == {"embedding", "reranker"}
    assert all(m["fidelity_status"] == "passed" for m in served), served
    assert all(f"({m['kind']}): {m['engine']} {m['dtype']} x{m['replicas']}" in done.stdout for m in served)

    # Everything the benchmark started is gone.
    assert not [pid for pid in report["pids"]["encoderd"] if _alive(pid)]


def test_bench_recovery_mode_reports_cold_start_and_restart(tmp_path):
    out = tmp_path / "recovery.json"
    cmd = [
        sys.executable,
        "-m",
        "encoderd.bench",
        "--quick",
        "--modes",
        "recovery",
        "--json",
        str(out),
        "--log-dir",
        str(tmp_path / "logs"),
    ]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=280, check=False)
    assert done.returncode == 0, done.stderr[-4000:]
    rows = {(r["mode"], r["engine"]): r for r in json.loads(out.read_text())["results"]}
    for mode in ("coldstart", "recovery", "replaced"):
        row = rows[(mode, "encoderd")]
        assert row["calls"] == 1 and row["p50_ms"] > 0 and row["errors"] == 0, row
    assert "forked from the zygote" in "".join(p.read_text() for p in (tmp_path / "logs").rglob("encoderd.log"))
