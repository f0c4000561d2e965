"""The bfloat16 softmax built for this host (workers/backends/bf16_softmax.py, softmax_rows.c): equal to
torch.softmax within bfloat16's rounding wherever the kernel serves, and torch's own softmax wherever
it cannot be built (no compiler, a compiler that fails, ENCODERD_BUILD_KERNELS=0)."""

from __future__ import annotations

from unittest import mock

import numpy as np
import pytest
import torch

from encoderd.workers.backends import bf16_softmax, packed_pieces

HAS_COMPILER = bf16_softmax.find_compiler() is not None
needs_compiler = pytest.mark.skipif(not HAS_COMPILER, reason="no C compiler on this host: torch's softmax serves")


@pytest.fixture
def fresh_kernel():
    """kernel() built anew under the test's environment, and again afterwards under the real one."""
    bf16_softmax.kernel.cache_clear()
    yield
    bf16_softmax.kernel.cache_clear()


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
    assert bf16_softmax.kernel() is not None
    scores = _scores(4, length, seed=length)
    scores[1, :, : length // 3] = -torch.inf
    scores[1, :, -1] = scores[1, :, -1].clamp(min=0)  # every row keeps a visible key
    want = torch.softmax(scores, dim=-1)
    exact = torch.softmax(scores.float(), dim=-1)
    got = bf16_softmax.softmax_(scores.clone())
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
    assert bf16_softmax.softmax_(scores).data_ptr() == scores.data_ptr()
    torch.set_num_threads(2)
    scores = _scores(2, 40, seed=1)
    before = scores.clone()
    assert bf16_softmax.softmax_(scores).data_ptr() != scores.data_ptr()
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
    built = bf16_softmax.kernel()
    assert built is not None
    calls = []

    def counted(*args):
        calls.append(args[2])
        return built(*args)

    for window in (packed_pieces.FULL, packed_pieces.CAUSAL, (4, 4)):
        calls.clear()
        with mock.patch.object(bf16_softmax, "kernel", return_value=counted):
            got = packed_pieces.attend(q, k, v, batch, window)
        with mock.patch.object(bf16_softmax, "kernel", return_value=None):
            want = packed_pieces.attend(q, k, v, batch, window)
        assert calls == [n for n in lengths if n > packed_pieces.FLASH_UP_TO]
        torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)
        assert (got.float() - want.float()).abs().mean() < 1e-3


def test_no_compiler_leaves_torch_softmax(fresh_kernel, one_thread, monkeypatch, tmp_path):
    """No C compiler anywhere (PATH empty, $CC unset): kernel() is None and softmax_ is torch.softmax."""
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.delenv("CC", raising=False)
    assert bf16_softmax.find_compiler() is None
    assert bf16_softmax.kernel() is None
    scores = _scores(2, 40, seed=2)
    assert torch.equal(bf16_softmax.softmax_(scores.clone()), torch.softmax(scores, dim=-1))


def test_a_compiler_that_fails_leaves_torch_softmax(fresh_kernel, one_thread, monkeypatch, caplog):
    """$CC that exits with an error (here `false`): torch's softmax, and the log says which compiler failed."""
    monkeypatch.setenv("CC", "false")
    with caplog.at_level("INFO", logger=bf16_softmax.__name__):
        assert bf16_softmax.kernel() is None
    assert "false could not build it" in caplog.text


def test_build_switched_off_leaves_torch_softmax(fresh_kernel, monkeypatch, caplog):
    monkeypatch.setenv(bf16_softmax.SWITCH_ENV, "0")
    with caplog.at_level("INFO", logger=bf16_softmax.__name__):
        assert bf16_softmax.kernel() is None
    assert f"{bf16_softmax.SWITCH_ENV}=0" in caplog.text
