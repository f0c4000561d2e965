"""tests/gpu/device_check.sh --device cpu: the GPU check's every phase at tiny sizes, so that the
script a GPU session runs in its one call is never first run there (issue 41).

It runs the real thing: the MiniLM rebuilt from its files with seeded weights, `pytest -m gpu` (all
skipped here, but collected and selected as on the GPU), a real `encoderd serve` end to end with a
worker killed, and `encoderd bench` with every mode against sentence-transformers."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PHASES = ("env", "install", "which", "models", "pytest", "serve", "bench")
# What the device tool brings back from $OUT: at most 8 files.
OUTPUTS = {
    "device_check.log",
    "summary.txt",
    "pytest.log",
    "serve.log",
    "serve-server.log",
    "bench.log",
    "bench.json",
    "bench-server.log",
}


@pytest.mark.timeout(1800)  # the phases' own limits add up to 1,620 s; a quiet 2-core host takes ~3 min
def test_device_check_passes_on_cpu_at_tiny_sizes(tmp_path):
    out = tmp_path / "out"
    done = subprocess.run(
        ["bash", str(REPO / "tests/gpu/device_check.sh"), "--device", "cpu", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=1700,
        check=False,
    )
    summary = (out / "summary.txt").read_text() if (out / "summary.txt").exists() else ""
    assert done.returncode == 0, f"{summary}\n{done.stdout[-6000:]}"
    for phase in PHASES:
        assert f"== {phase}: ok" in summary, summary
    assert {p.name for p in out.iterdir()} == OUTPUTS
    log = (out / "device_check.log").read_text()
    assert "== summary" in log  # everything printed is in the log file too (a run cut off still reports)
    assert "/site/encoderd/server/main/cli.py" in log  # the phases ran encoderd's wheel, installed --target

    serve = (out / "serve.log").read_text()
    for line in ("Embed vs sentence-transformers", "EmbedStream", "Rerank vs", "Classify", "kill -9 of the worker"):
        assert f"ok    {line}" in serve, serve[-3000:]

    bench = json.loads((out / "bench.json").read_text())
    rows = {(r["mode"], r["engine"]) for r in bench["results"]}
    for mode in ("bulk", "single", "rerank"):
        assert {(mode, "encoderd"), (mode, "sentence-transformers")} <= rows
    assert {("memory", "encoderd"), ("oom", "encoderd")} <= rows
    assert all(r["errors"] == 0 for r in bench["results"]), bench["results"]
    bulk = next(r for r in bench["results"] if r["mode"] == "bulk" and r["engine"] == "encoderd")
    assert bulk["frontend_ms_per_input"] > 0 and bulk["flop_utilisation"] > 0
    memory = next(r for r in bench["results"] if r["mode"] == "memory")
    assert memory["server"]["samples"] >= 2 and memory["server"]["memory_last_mb"] > 0
    oom = next(r for r in bench["results"] if r["mode"] == "oom")
    assert oom["server"]["lost"] == 0 and oom["server"]["wrong"] == 0
