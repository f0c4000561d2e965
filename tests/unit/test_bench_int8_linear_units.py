"""bench/int8_linear.py: the int8 GEMM kernel per MiniLM layer and in the whole int8 forward, beside a git
ref's build (the figures are the bench's to report; here only that they are produced, by both builds)."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from encoderd.bench import int8_linear
from encoderd.workers.backends import host_kernels

needs_vnni_gemm = pytest.mark.skipif(
    host_kernels.find_compiler() is None or not (host_kernels.kernels() and host_kernels.kernels().int8_gemm),
    reason="the int8 GEMM kernel is built only for a CPU with avx512_vnni",
)


@needs_vnni_gemm
def test_each_layers_calls_run_on_the_build_they_were_made_for():
    """A layer's timed calls go through the given build's int8_linear_rows, `repeats` times."""
    ref = int8_linear.ref_kernels("HEAD")
    calls = []
    counting = dataclasses.replace(
        ref, int8_linear_rows=lambda *args: calls.append(args) or ref.int8_linear_rows(*args)
    )
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)  # where the kernels serve
        int8_linear.layer_call(counting, 384, 1536, "gelu", rows=24, repeats=3)()
    finally:
        torch.set_num_threads(threads)
    assert len(calls) == 3 and all(args[1] == 24 and args[5] == 1536 for args in calls)


@needs_vnni_gemm
def test_per_layer_and_forward_report_this_checkout_beside_the_ref(tmp_path):
    """Both measurements time this checkout's kernel, the ref's and (--int-mm) torch._int_mm + rescale_rows."""
    threads = torch.get_num_threads()
    try:
        code = int8_linear.main(["--rows", "40", "--repeats", "1", "--rounds", "1", "--forward", "--corpus-size", "8",
                                 "--compare-ref", "HEAD", "--int-mm", "--json", str(tmp_path / "r.json")])  # fmt: skip
    finally:
        torch.set_num_threads(threads)
    assert code == 0
    result = json.loads((tmp_path / "r.json").read_text())
    assert result["ref"] == "HEAD" and [r["layer"] for r in result["per_layer"]] == list(int8_linear.LAYERS)
    assert result["int8_products"] in ("amx_int8", "avx512_vnni")
    assert all(r["gops"] > 0 and r["ref_gops"] > 0 and r["vs_ref"] > 0 for r in result["per_layer"])
    assert all(r["int_mm_gops"] > 0 and r["vs_int_mm"] > 0 for r in result["per_layer"])
    forward = result["forward"]
    assert forward["tokens"] > 0 and set(forward["tokens_per_cpu_s"]) == {"kernel", "ref", "int_mm"}
    assert forward["vs_ref"] > 0 and forward["vs_int_mm"] > 0
