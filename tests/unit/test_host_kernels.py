"""The bfloat16 kernels built for this host (workers/backends/host_kernels.py, host_kernels.c): softmax
and add + LayerNorm equal to torch's operators within bfloat16's rounding wherever they serve, and
torch's own operators wherever they cannot be built (no compiler, a compiler that fails,
ENCODERD_BUILD_KERNELS=0)."""

from __future__ import annotations

import dataclasses
from unittest import mock

import numpy as np
import pytest
import torch

from encoderd.workers.backends import host_kernels, packed_pieces

HAS_COMPILER = host_kernels.find_compiler() is not None
needs_compiler = pytest.mark.skipif(not HAS_COMPILER, reason="no C compiler on this host: torch's softmax serves")


@pytest.fixture
def fresh_kernel():
    """kernels() built anew under the test's environment, and again afterwards under the real one."""
    host_kernels.kernels.cache_clear()
    yield
    host_kernels.kernels.cache_clear()


@pytest.fixture
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _scores(rows: int, length: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, length, length, generator=generator) * 5).bfloat16()


@needs_compiler
@pytest.mark.parametrize("length", [1, 2, 15, 16, 17, 33, 100, 257, 600])
def test_kernel_equals_torch_softmax_within_bfloat16_rounding(length, fresh_kernel, one_thread):
    """Row lengths on both sides of the 16-float vector, and past one, with a third of the keys masked
    (-inf, as sliding-window attention masks them): each probability within one bfloat16 step of
    torch's bfloat16 softmax, at most as far from the float32 softmax as twice torch's is, masked
    keys exactly 0, and almost every value bit-identical to torch's."""
    assert host_kernels.kernels() is not None
    scores = _scores(4, length, seed=length)
    scores[1, :, : length // 3] = -torch.inf
    scores[1, :, -1] = scores[1, :, -1].clamp(min=0)  # every row keeps a visible key
    want = torch.softmax(scores, dim=-1)
    exact = torch.softmax(scores.float(), dim=-1)
    got = host_kernels.softmax_(scores.clone())
    assert got.dtype == torch.bfloat16 and got.shape == want.shape
    torch.testing.assert_close(got.float(), want.float(), atol=2**-8, rtol=2**-7)
    assert (got.float() - exact).abs().max() <= 2 * (want.float() - exact).abs().max() + 1e-6
    assert (got[1, :, : length // 3] == 0).all()
    assert (got != want).float().mean() < 0.01


@needs_compiler
def test_kernel_softmax_is_in_place_and_torch_elsewhere(fresh_kernel, one_thread):
    """On one thread the kernel overwrites the scores; on more, or for float32, torch's softmax returns
    a new tensor and the scores are left as they were."""
    scores = _scores(2, 40, seed=1)
    assert host_kernels.softmax_(scores).data_ptr() == scores.data_ptr()
    torch.set_num_threads(2)
    scores = _scores(2, 40, seed=1)
    before = scores.clone()
    assert host_kernels.softmax_(scores).data_ptr() != scores.data_ptr()
    assert torch.equal(scores, before)


@needs_compiler
def test_one_thread_attention_runs_the_kernel_and_matches_torch_softmax(fresh_kernel, one_thread):
    """attend() in bfloat16 on one thread (the served default on small hosts), BERT's full window,
    Qwen3's causal one and ModernBERT's band, over sequences longer than FLASH_UP_TO: the kernel is
    called once per such sequence, and the attention output is what torch's softmax gives within
    bfloat16's rounding."""
    lengths = [3, 40, 33, 100, 257]
    cu_seqlens = torch.tensor(np.concatenate([[0], np.cumsum(lengths)]), dtype=torch.int32)
    batch = packed_pieces.PackedBatch.of(torch.zeros(int(cu_seqlens[-1]), dtype=torch.long), cu_seqlens)
    generator = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(int(cu_seqlens[-1]), 12, 32, generator=generator).bfloat16() for _ in range(3))
    built = host_kernels.kernels()
    assert built is not None
    calls = []

    def counted(*args):
        calls.append(args[2])
        return built.softmax_rows(*args)

    counting = dataclasses.replace(built, softmax_rows=counted)
    for window in (packed_pieces.FULL, packed_pieces.CAUSAL, (4, 4)):
        calls.clear()
        with mock.patch.object(host_kernels, "kernels", return_value=counting):
            got = packed_pieces.attend(q, k, v, batch, window)
        with mock.patch.object(host_kernels, "kernels", return_value=None):
            want = packed_pieces.attend(q, k, v, batch, window)
        assert calls == [n for n in lengths if n > packed_pieces.FLASH_UP_TO]
        torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)
        assert (got.float() - want.float()).abs().mean() < 1e-3


def test_no_compiler_leaves_torch_softmax(fresh_kernel, one_thread, monkeypatch, tmp_path):
    """No C compiler anywhere (PATH empty, $CC unset): kernels() is None, softmax_ is torch.softmax and
    add_layer_norm is torch's add then LayerNorm."""
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.delenv("CC", raising=False)
    assert host_kernels.find_compiler() is None
    assert host_kernels.kernels() is None
    scores = _scores(2, 40, seed=2)
    assert torch.equal(host_kernels.softmax_(scores.clone()), torch.softmax(scores, dim=-1))
    norm, a, b = _norm_and_inputs(384, seed=2)
    assert torch.equal(host_kernels.add_layer_norm(norm, a, b), norm(a + b))


def test_a_compiler_that_fails_leaves_torch_softmax(fresh_kernel, one_thread, monkeypatch, caplog):
    """$CC that exits with an error (here `false`): torch's softmax, and the log says which compiler failed."""
    monkeypatch.setenv("CC", "false")
    with caplog.at_level("INFO", logger=host_kernels.__name__):
        assert host_kernels.kernels() is None
    assert "false could not build them" in caplog.text


def test_build_switched_off_leaves_torch_softmax(fresh_kernel, monkeypatch, caplog):
    monkeypatch.setenv(host_kernels.SWITCH_ENV, "0")
    with caplog.at_level("INFO", logger=host_kernels.__name__):
        assert host_kernels.kernels() is None
    assert f"{host_kernels.SWITCH_ENV}=0" in caplog.text


def _norm_and_inputs(width: int, seed: int):
    generator = torch.Generator().manual_seed(seed)
    norm = torch.nn.LayerNorm(width, eps=1e-12).bfloat16().requires_grad_(False)
    norm.weight.copy_(torch.randn(width, generator=generator))
    norm.bias.copy_(torch.randn(width, generator=generator))
    a, b = (torch.randn(300, width, generator=generator).bfloat16() * scale for scale in (1, 4))
    return norm, a, b


@needs_compiler
@pytest.mark.parametrize("width", [8, 100, 384, 768, 1024])
def test_add_layer_norm_equals_torch_within_bfloat16_rounding(width, fresh_kernel, one_thread):
    """LayerNorm(a + b) in one pass against torch's add then LayerNorm, at widths with and without a
    vector tail: within one bfloat16 step, no further from the float32 norm than twice torch's, and
    almost every value bit-identical; a and b untouched."""
    assert host_kernels.kernels() is not None
    norm, a, b = _norm_and_inputs(width, seed=width)
    before = a.clone(), b.clone()
    want = norm(a + b)
    exact = torch.nn.functional.layer_norm((a + b).float(), (width,), norm.weight.float(), norm.bias.float(), 1e-12)
    got = host_kernels.add_layer_norm(norm, a, b)
    assert got.dtype == torch.bfloat16 and got.shape == want.shape
    torch.testing.assert_close(got.float(), want.float(), atol=2**-6, rtol=2**-7)
    assert (got.float() - exact).abs().max() <= 2 * (want.float() - exact).abs().max() + 1e-6
    assert (got != want).float().mean() < 0.01
    assert torch.equal(a, before[0]) and torch.equal(b, before[1])


@needs_compiler
def test_add_layer_norm_leaves_other_cases_to_torch(fresh_kernel, one_thread):
    """Two threads, a non-contiguous input or a float32 norm: torch's add then LayerNorm, exactly."""
    norm, a, b = _norm_and_inputs(64, seed=3)
    calls = []
    built = host_kernels.kernels()
    assert built is not None
    counting = dataclasses.replace(built, add_layer_norm=lambda *args: calls.append(args))
    with mock.patch.object(host_kernels, "kernels", return_value=counting):
        torch.set_num_threads(2)
        assert torch.equal(host_kernels.add_layer_norm(norm, a, b), norm(a + b))
        torch.set_num_threads(1)
        wide = torch.randn(300, 128).bfloat16()
        assert torch.equal(host_kernels.add_layer_norm(norm, wide[:, :64], b), norm(wide[:, :64] + b))
        full = torch.nn.LayerNorm(64).requires_grad_(False)
        assert torch.equal(host_kernels.add_layer_norm(full, a.float(), b.float()), full(a.float() + b.float()))
    assert calls == []
