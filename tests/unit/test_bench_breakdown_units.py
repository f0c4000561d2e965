"""bench/breakdown.py: the torch worker's bulk forward profiled by category, on the bundled MiniLM."""

from __future__ import annotations

import pytest

from encoderd.bench import breakdown


@pytest.mark.parametrize(
    ("op", "label"),
    [
        ("mkldnn::_linear_pointwise", "matmul"),
        ("aten::addmm", "matmul"),
        ("aten::_scaled_dot_product_flash_attention_for_cpu", "attention"),
        ("aten::baddbmm", "attention"),
        ("aten::bmm", "attention"),
        ("aten::_softmax", "attention"),
        ("encoderd::attention", "attention"),  # host_kernels' packed attention kernel
        ("aten::native_layer_norm", "element-wise"),
        ("aten::transpose", "layout"),
        ("aten::segment_reduce", "other ops"),
    ],
)
def test_operators_fall_in_their_category(op, label):
    assert breakdown.category(op) == label


def test_batches_hold_the_corpus_within_the_token_budget():
    from encoderd.workers.contract.model_files import default_model_path

    work = breakdown.batches(default_model_path(), 40, 600, seed=0)
    assert sum(b.size for b in work) == 40
    assert all(len(b.input_ids) <= 600 or b.size == 1 for b in work)


def test_the_shares_of_a_real_forward_add_up(tmp_path, capsys):
    breakdown.main(["--corpus-size", "12", "--rounds", "1", "--threads", "1", "--json", str(tmp_path / "r.json")])
    import json

    result = json.loads((tmp_path / "r.json").read_text())
    assert result["packed"] and result["tokens"] > 0
    assert result["cpu_s_without_profiler"] > 0 and result["tokens_per_cpu_s"] > 0
    assert sum(result["shares"].values()) == pytest.approx(1.0, abs=0.01)
    assert result["shares"]["matmul"] > 0 and result["shares"]["attention"] > 0
    assert sum(result["flop_shares"].values()) == pytest.approx(1.0, abs=1e-3)
