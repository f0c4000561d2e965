"""bench/attention.py: the packed attention kernel against the per-sequence operators, on real tensors
and the bundled MiniLM (the figures are the bench's to report; here only that they are produced)."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from encoderd.bench import attention
from encoderd.workers.backends import host_kernels

needs_kernels = pytest.mark.skipif(host_kernels.find_compiler() is None, reason="no C compiler: no kernel to time")


def test_layer_inputs_are_views_of_one_fused_projection():
    """q, k, v strided in one (tokens, 3, heads, dim) tensor, as BERT's fused QKV linear leaves them."""
    q, k, v, batch = attention.layer_inputs(40, 100, 12, 32)
    assert q.shape == k.shape == v.shape == (80, 12, 32) and q.stride() == (3 * 12 * 32, 32, 1)
    assert k.data_ptr() - q.data_ptr() == v.data_ptr() - k.data_ptr() == 12 * 32 * 2
    assert batch.cu_seqlens.tolist() == [0, 40, 80] and batch.longest == 40


@needs_kernels
def test_per_layer_and_forward_report_both_paths(tmp_path):
    threads = torch.get_num_threads()
    try:
        code = attention.main(["--lengths", "16,40", "--tokens", "200", "--rounds", "1", "--forward", "minilm",
                               "--corpus-size", "8", "--json", str(tmp_path / "r.json")])  # fmt: skip
    finally:
        torch.set_num_threads(threads)
    assert code == 0
    result = json.loads((tmp_path / "r.json").read_text())
    assert result["products"] in ("amx_bf16", "avx512_bf16", "float32")
    rows = result["per_layer"]
    assert [(r["shape"], r["length"]) for r in rows] == [(s, n) for s in attention.SHAPES for n in (16, 40)]
    assert all(r["kernel_ms"] > 0 and r["operators_ms"] > 0 and r["speedup"] > 0 for r in rows)
    forward = result["forward"]
    assert forward["tokens"] > 0 and set(forward["tokens_per_cpu_s"]) == {"kernel", "operators"}


@needs_kernels
def test_compare_ref_times_that_commits_kernels_beside_these(tmp_path):
    """--compare-ref builds the ref's host_kernels.c here and times it in turn with this checkout's, per
    layer and in the whole forward; the ref's kernel serves its own turns (its outputs are its own)."""
    ref = attention.ref_kernels("HEAD")
    assert ref.attention_products == host_kernels.kernels().attention_products
    q, k, v, batch = attention.layer_inputs(40, 200, 12, 32)
    calls = []
    counting = dataclasses.replace(ref, attend_full=lambda *args: calls.append(args) or ref.attend_full(*args))
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)  # where the kernels serve
        assert attention.serving(counting, host_kernels.attend_full)(q, k, v, batch, None) is not None
        assert len(calls) == 1
        arguments = ["--lengths", "16", "--tokens", "200", "--rounds", "1", "--forward", "minilm", "--corpus-size", "8"]
        code = attention.main([*arguments, "--compare-ref", "HEAD", "--json", str(tmp_path / "r.json")])
    finally:
        torch.set_num_threads(threads)
    assert code == 0
    result = json.loads((tmp_path / "r.json").read_text())
    assert result["ref"] == "HEAD"
    assert all(r["ref_ms"] > 0 and r["vs_ref"] > 0 for r in result["per_layer"])
    forward = result["forward"]
    assert set(forward["tokens_per_cpu_s"]) == {"kernel", "operators", "ref"} and forward["vs_ref"] > 0
