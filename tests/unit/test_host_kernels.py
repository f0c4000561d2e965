"""The kernels built for this host (workers/backends/host_kernels.py, host_kernels.c): softmax and
add + LayerNorm (bfloat16), an int8 linear's quantize and rescale (bfloat16 or float32), equal to
torch's operators within the dtype's rounding wherever they serve, and torch's own operators wherever
they cannot be built (no compiler, a compiler that fails, ENCODERD_BUILD_KERNELS=0)."""

from __future__ import annotations

import dataclasses
from unittest import mock

import numpy as np
import pytest
import torch

from encoderd.workers.backends import host_kernels, int8_linear, packed_pieces

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


def _int8_rows(rows: int, width: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Activations as a LayerNorm or GELU leaves them: most small, one loud channel, one loud token,
    one all-zero token (the scale's floor)."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, width, generator=generator)
    x[:, width // 2] *= 30
    x[1] *= 100
    x[2] = 0
    return x.to(dtype)


@needs_compiler
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("width", [5, 16, 17, 100, 384, 1536])
def test_quantize_rows_equals_torch(width, dtype, fresh_kernel, one_thread):
    """Per-token int8 from float32 and bfloat16, with and without a SmoothQuant input scale, at widths
    with and without a vector tail: the token scales equal torch's, and the int8 values too but for
    an occasional rounding tie (one level)."""
    assert host_kernels.kernels() is not None
    rows = _int8_rows(300, width, dtype, seed=width)
    input_scale = torch.rand(width, generator=torch.Generator().manual_seed(1)) + 0.25
    for scale in (None, input_scale):
        got, got_scale = host_kernels.quantize_rows(rows, scale)
        want, want_scale = host_kernels._quantize_by_torch(rows, scale)
        assert got.dtype == torch.int8 and got.shape == (300, width) and got_scale.shape == (300, 1)
        torch.testing.assert_close(got_scale, want_scale, rtol=1e-6, atol=0)
        assert (got.int() - want.int()).abs().max() <= 1
        assert (got != want).float().mean() < 1e-3
        assert (got[2] == 0).all() and got.abs().max() == 127


@needs_compiler
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("activation", ["none", "gelu", "relu"])
@pytest.mark.parametrize("width", [5, 16, 17, 384, 1536])
def test_rescale_rows_equals_torch(width, activation, dtype, fresh_kernel, one_thread):
    """int32 products x token scale x channel scale + bias (+ exact GELU or ReLU), against the same computed in
    float64: within float32's rounding (the float32 result), and one bfloat16 step with almost every
    value the float64 one rounded (bfloat16); without a bias too. torch's own float32 GELU is no
    reference for the negative tail: 1 + erf(x / sqrt 2) cancels there (gelu(-5): torch -1.19e-6,
    exactly -1.4333e-6; the kernel's erfc keeps 1e-7 of it)."""
    assert host_kernels.kernels() is not None
    generator = torch.Generator().manual_seed(width)
    products = torch.randint(-(2**20), 2**20, (300, width), generator=generator, dtype=torch.int32)
    token_scale = torch.rand(300, 1, generator=generator) * 1e-3
    weight_scale = torch.rand(width, generator=generator) * 1e-2
    for bias in (torch.randn(width, generator=generator), None):
        exact = products.double() * token_scale.double() * weight_scale.double()
        exact = exact + bias.double() if bias is not None else exact
        exact = {"gelu": torch.nn.functional.gelu, "relu": torch.relu}.get(activation, lambda v: v)(exact)
        out = torch.empty(300, width, dtype=dtype)
        got = host_kernels.rescale_rows(products, token_scale, weight_scale, bias, activation, out)
        assert got is out
        assert got.dtype == dtype and got.shape == (300, width)
        if dtype == torch.float32:
            torch.testing.assert_close(got.double(), exact, rtol=1e-6, atol=1e-6)
        else:
            torch.testing.assert_close(got.double(), exact, rtol=2**-8, atol=1e-6)
            assert (got != exact.bfloat16()).float().mean() < 0.01


@needs_compiler
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_int8_linear_serves_through_the_kernels_as_through_torch(dtype, fresh_kernel, one_thread):
    """An Int8Linear (SmoothQuant scale, bias, GELU) gives within its dtype's rounding what it gives on
    torch's operators, and calls each kernel once per forward; on two threads torch's operators serve."""
    generator = torch.Generator().manual_seed(5)
    linear = torch.nn.Linear(384, 1536).requires_grad_(False)
    ranges = torch.rand(384, generator=generator) * 10 + 0.1
    layer = int8_linear.Int8Linear.from_linear(linear, 8, ranges, 0.5)
    x = _int8_rows(64, 384, dtype, seed=6).view(4, 16, 384)
    built = host_kernels.kernels()
    assert built is not None
    calls: list[str] = []

    def counted(name, function):
        return lambda *args: (calls.append(name), function(*args))[1]

    counting = dataclasses.replace(
        built,
        quantize_rows=counted("quantize", built.quantize_rows),
        rescale_rows=counted("rescale", built.rescale_rows),
    )
    with mock.patch.object(host_kernels, "kernels", return_value=counting):
        got = layer(x, activation="gelu")
        assert calls == ["quantize", "rescale"]
        torch.set_num_threads(2)
        calls.clear()
        two_threads = layer(x, activation="gelu")
        assert calls == []
        torch.set_num_threads(1)
    with mock.patch.object(host_kernels, "kernels", return_value=None):
        want = layer(x, activation="gelu")
    assert got.dtype == want.dtype == two_threads.dtype == dtype and got.shape == (4, 16, 1536)
    assert torch.equal(two_threads, want)
    step = 2**-7 if dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(got.float(), want.float(), rtol=step, atol=1e-5)


def test_no_compiler_leaves_torch_softmax(fresh_kernel, one_thread, monkeypatch, tmp_path):
    """No C compiler anywhere (PATH empty, $CC unset): kernels() is None, softmax_ is torch.softmax,
    add_layer_norm is torch's add then LayerNorm, and quantize_rows torch's operators."""
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.delenv("CC", raising=False)
    assert host_kernels.find_compiler() is None
    assert host_kernels.kernels() is None
    scores = _scores(2, 40, seed=2)
    assert torch.equal(host_kernels.softmax_(scores.clone()), torch.softmax(scores, dim=-1))
    norm, a, b = _norm_and_inputs(384, seed=2)
    assert torch.equal(host_kernels.add_layer_norm(norm, a, b), norm(a + b))
    rows = _int8_rows(20, 64, torch.bfloat16, seed=2)
    served, by_torch = host_kernels.quantize_rows(rows, None), host_kernels._quantize_by_torch(rows, None)
    for got, want in zip(served, by_torch, strict=True):
        assert torch.equal(got, want)


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
