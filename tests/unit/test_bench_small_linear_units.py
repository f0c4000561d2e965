"""bench.small_linear: the few-row bfloat16 GEMM against oneDNN on the same layers, its table and crossover."""

from __future__ import annotations

import json

import pytest
import torch

from encoderd.bench import small_linear
from encoderd.workers.backends import host_kernels


def test_crossover_is_the_first_row_count_where_the_kernel_is_slower():
    rows = [{"rows": m, "onednn_over_kernel": ratio} for m, ratio in ((8, 1.6), (32, 1.1), (40, 0.97), (64, 1.02))]
    assert small_linear.crossover(rows) == 40
    assert small_linear.crossover(rows[:2]) is None


@pytest.mark.skipif(
    host_kernels.find_compiler() is None or (host_kernels.kernels() is None or not host_kernels.kernels().bf16_gemm),
    reason="the few-row bfloat16 GEMM is built only for a CPU with avx512_bf16",
)
def test_times_both_at_every_row_count_asked_even_past_the_threshold(tmp_path, monkeypatch):
    """Rows past few_row_limit() still run through the kernel (the bench raises the threshold), and each
    row count gets both times and their ratio."""
    out = tmp_path / "result.json"
    past = host_kernels.few_row_limit() + 8
    monkeypatch.setattr(host_kernels, "SMALL_LINEAR_ROWS", host_kernels.SMALL_LINEAR_ROWS)  # main raises it
    threads = torch.get_num_threads()
    try:
        assert small_linear.main(["--rows", f"1,{past}", "--passes", "1", "--rounds", "1", "--json", str(out)]) == 0
    finally:
        torch.set_num_threads(threads)
    result = json.loads(out.read_text())
    assert [r["rows"] for r in result["per_rows"]] == [1, past]
    for row in result["per_rows"]:
        assert row["onednn_us"] > 0 and row["kernel_us"] > 0 and row["onednn_over_kernel"] > 0
