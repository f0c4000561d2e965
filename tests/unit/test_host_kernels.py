"""The kernels built for this host (workers/backends/host_kernels.py, host_kernels.c): softmax and
add + LayerNorm (bfloat16) equal to torch's operators within bfloat16's rounding wherever they serve,
mean pooling equal to segment_reduce's float32 mean bit for bit,
packed attention as close to float32 SDPA as torch's bfloat16 SDPA is, an int8 linear's quantize and
rescale (bfloat16 or float32) equal to torch's within the dtype's rounding; built for this CPU and (the
attention kernel) for older targets (no AVX-512, plain x86-64), and torch's own operators wherever they
cannot be built (no compiler, a compiler that fails, ENCODERD_BUILD_KERNELS=0)."""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import gc
import itertools
import platform
from pathlib import Path
from unittest import mock

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from support.memory_maps import mapping

from encoderd.workers.backends import host_kernels, huge_pages, int8_linear, packed_linear, packed_pieces

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
def test_one_thread_attention_runs_the_kernels_and_matches_torch_operators(fresh_kernel, one_thread):
    """attend() in bfloat16 on one thread (the served default on small hosts): BERT's full window is one
    call of the attention kernel for the whole batch (no softmax of its own); Qwen3's causal window and
    ModernBERT's band go sequence by sequence, the softmax kernel once per sequence longer than
    FLASH_UP_TO. Either way the output is what torch's operators give within bfloat16's rounding."""
    lengths = [3, 40, 33, 100, 257]
    cu_seqlens = torch.tensor(np.concatenate([[0], np.cumsum(lengths)]), dtype=torch.int32)
    batch = packed_pieces.PackedBatch.of(torch.zeros(int(cu_seqlens[-1]), dtype=torch.long), cu_seqlens)
    generator = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(int(cu_seqlens[-1]), 12, 32, generator=generator).bfloat16() for _ in range(3))
    built = host_kernels.kernels()
    assert built is not None
    softmaxes, attentions = [], []

    def counted_softmax(*args):
        softmaxes.append(args[2])
        return built.softmax_rows(*args)

    def counted_attention(*args):
        attentions.append(args[7])  # the number of sequences
        return built.attend_full(*args)

    counting = dataclasses.replace(built, softmax_rows=counted_softmax, attend_full=counted_attention)
    for window in (packed_pieces.FULL, packed_pieces.CAUSAL, (4, 4)):
        softmaxes.clear(), attentions.clear()
        with mock.patch.object(host_kernels, "kernels", return_value=counting):
            got = packed_pieces.attend(q, k, v, batch, window)
        with mock.patch.object(host_kernels, "kernels", return_value=None):
            want = packed_pieces.attend(q, k, v, batch, window)
        if window == packed_pieces.FULL:
            assert (softmaxes, attentions) == ([], [len(lengths)])
        else:
            assert (softmaxes, attentions) == ([n for n in lengths if n > packed_pieces.FLASH_UP_TO], [])
        torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)
        assert (got.float() - want.float()).abs().mean() < 1e-3


# The attention kernel as built here (-march=native) and for targets without avx512_bf16: AVX2 on this
# CPU (-mno-avx512f), and the x86-64 baseline (SSE2). Each must build and be as faithful.
TARGETS = {
    "native": host_kernels.FLAGS,
    "no-avx512": (*host_kernels.FLAGS, "-mno-avx512f"),
    "x86-64": ("-O3", "-march=x86-64", "-shared", "-fPIC"),
}
x86_only = pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="x86-64 targets")
# This CPU without AMX: on an AMX host, the build a Zen 4/5 gets (the int8 GEMM by VNNI tiles alone).
NO_AMX = (*host_kernels.FLAGS, "-mno-amx-tile", "-mno-amx-int8")


@functools.cache
def _built_for(target: str) -> host_kernels.Kernels:
    compiler = host_kernels.find_compiler()
    assert compiler is not None
    return host_kernels._build(compiler, NO_AMX if target == "no-amx" else TARGETS[target])


@needs_compiler
@x86_only
@pytest.mark.parametrize("target", TARGETS)
def test_every_kernel_passes_its_load_check_on_every_target(target):
    """The checks kernels() runs before anything serves (softmax, add + LayerNorm, attention against
    torch and float32 SDPA) pass for the library built for this CPU and for the older targets."""
    built = _built_for(target)
    checks = (
        host_kernels._check_softmax,
        host_kernels._check_add_layer_norm,
        host_kernels._check_attention,
        host_kernels._check_bf16_linear_rows,
    )
    assert [check(built) for check in checks] == [None, None, None, None]


@needs_compiler
@x86_only
@pytest.mark.parametrize("target", ["no-avx512", "x86-64"])
def test_builds_without_vnni_keep_torch_int_mm(target):
    """The VNNI GEMM and the few-row bfloat16 GEMM are compiled only where the target has avx512_vnni and
    avx512_bf16: the older targets build, say they have neither (int8 linears keep torch._int_mm, bfloat16
    linears oneDNN at every size), and their load checks pass by having none."""
    built = _built_for(target)
    assert built.int8_gemm is False and built.bf16_gemm is False and built.int8_products == ""
    assert host_kernels._check_int8_linear_rows(built) is None
    assert host_kernels._check_bf16_linear_rows(built) is None


def _amx_granted() -> bool:
    """Whether Linux gives this process AMX's tile state (arch_prctl ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA),
    as host_kernels.c asks; False on a CPU without AMX."""
    cpuinfo = Path("/proc/cpuinfo").read_text().splitlines()
    flags = next((line for line in cpuinfo if line.startswith("flags")), "").split()
    if not {"amx_tile", "amx_int8"} <= set(flags):
        return False
    sys_arch_prctl, request_permission, tile_data = 158, 0x1023, 18
    return ctypes.CDLL(None, use_errno=True).syscall(sys_arch_prctl, request_permission, tile_data) == 0


@needs_compiler
@x86_only
def test_the_int8_gemm_uses_amx_exactly_where_built_for_it_and_granted(one_thread):
    """The int8 GEMM's choice (host_kernels.c, Kernels.int8_products): AMX tiles where the build targets
    amx_int8 and Linux grants the tile state, else the VNNI tiles (a build without AMX, as on Zen 4/5, says
    so and passes its load check). Both give the same layer output, bit for bit, over AMX's 32 x 32 blocks,
    the rows past them (6) and an odd last panel (5 panels of 16 columns, the last partial)."""
    native, vnni = _built_for("native"), _built_for("no-amx")
    if not native.int8_gemm:
        pytest.skip("the int8 GEMM kernel is built only for a CPU with avx512_vnni")
    assert vnni.int8_products == "avx512_vnni" and host_kernels._check_int8_linear_rows(vnni) is None
    assert native.int8_products == ("amx_int8" if _amx_granted() else "avx512_vnni")
    weight, inputs, token_scale, weight_scale, bias = _int8_layer(70, 192, 75, seed=5)
    outputs = []
    for built in (native, vnni):
        with mock.patch.object(host_kernels, "kernels", return_value=built):
            packed = host_kernels.pack_int8(weight, weight_scale, bias)
            unsigned, _ = host_kernels.quantize_rows(inputs, None, to_unsigned=True)
            assert packed is not None
            out = torch.empty(70, 75, dtype=torch.bfloat16)
            outputs.append(host_kernels.int8_linear(unsigned, token_scale, packed, "gelu", out))
    assert torch.equal(*outputs)


def _packed_qkv(lengths: list[int], heads: int, dim: int, seed: int):
    """q, k, v as strided views of one (tokens, 3, heads, dim) projection, as a BERT layer's fused QKV
    linear leaves them, and cu_seqlens."""
    generator = torch.Generator().manual_seed(seed)
    fused = (torch.randn(sum(lengths), 3, heads, dim, generator=generator) * 2).bfloat16()
    cu_seqlens = torch.tensor(np.concatenate([[0], np.cumsum(lengths)]), dtype=torch.int32)
    return (*fused.unbind(1), cu_seqlens)


def _batch(cu_seqlens: torch.Tensor) -> packed_pieces.PackedBatch:
    return packed_pieces.PackedBatch.of(torch.zeros(int(cu_seqlens[-1]), dtype=torch.long), cu_seqlens)


def _sdpa_each_sequence(q, k, v, cu_seqlens, dtype, scale=None) -> torch.Tensor:
    """SDPA on each sequence alone in `dtype`, returned in float32."""
    out = torch.empty(q.shape)
    for a, b in zip(cu_seqlens[:-1].tolist(), cu_seqlens[1:].tolist(), strict=True):
        queries, keys, values = (t[a:b].transpose(0, 1).to(dtype) for t in (q, k, v))
        out[a:b] = F.scaled_dot_product_attention(queries, keys, values, scale=scale).float().transpose(0, 1)
    return out


ATTENTION_CASES = {  # (lengths, heads, head size)
    "minilm": ([1, 2, 15, 16, 17, 33, 100, 257, 512], 12, 32),
    "bge-base": ([512, 1, 64, 130, 5], 12, 64),
    "narrow": ([1, 31, 32, 48], 4, 16),
    "wide": ([7, 200], 2, 128),
    "one-token-texts": ([1] * 9, 3, 32),
    "heads-in-uneven-groups": ([130, 3, 300], 5, 64),  # packed 3 heads, then 2 (130 tokens); 1 by 1 (300)
}


@needs_compiler
@x86_only
@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("case", ATTENTION_CASES)
def test_attend_full_is_as_close_to_float32_sdpa_as_torch_bfloat16(target, case, one_thread):
    """The attention kernel over a packed batch (1-token to 512-token sequences; MiniLM's and bge-base's
    heads, narrower and wider ones), q, k, v read strided in place: against float32 SDPA on each
    sequence, no further than twice torch's own bfloat16 SDPA is (at most, and on average), for every
    build target; the instruction set each target used is the one its flags allow."""
    built = _built_for(target)
    assert built.attention_products in ("avx512_bf16", "float32")
    if target != "native":
        assert built.attention_products == "float32"
    lengths, heads, dim = ATTENTION_CASES[case]
    q, k, v, cu_seqlens = _packed_qkv(lengths, heads, dim, seed=len(lengths) + dim)
    with mock.patch.object(host_kernels, "kernels", return_value=built):
        got = host_kernels.attend_full(q, k, v, _batch(cu_seqlens), None)
    assert got is not None and got.dtype == torch.bfloat16 and got.shape == q.shape and got.is_contiguous()
    exact = _sdpa_each_sequence(q, k, v, cu_seqlens, torch.float32)
    torch_own = _sdpa_each_sequence(q, k, v, cu_seqlens, torch.bfloat16)
    error, torch_error = (got.float() - exact).abs(), (torch_own - exact).abs()
    assert error.max() <= 2 * torch_error.max() + 1e-6, (error.max(), torch_error.max())
    assert error.mean() <= 2 * torch_error.mean() + 1e-6, (error.mean(), torch_error.mean())


@needs_compiler
def test_attend_full_takes_the_scale_and_separate_dense_tensors(fresh_kernel, one_thread):
    """A model's own scaling (not 1/sqrt(d)) and q, k, v as three dense tensors (not views of one
    projection): as close to float32 SDPA at that scale as torch's bfloat16 SDPA is."""
    q, k, v, cu_seqlens = _packed_qkv([9, 70, 1, 40], 6, 32, seed=4)
    q, k, v = (t.contiguous() for t in (q, k, v))
    got = host_kernels.attend_full(q, k, v, _batch(cu_seqlens), 0.3)
    assert got is not None
    exact = _sdpa_each_sequence(q, k, v, cu_seqlens, torch.float32, scale=0.3)
    torch_own = _sdpa_each_sequence(q, k, v, cu_seqlens, torch.bfloat16, scale=0.3)
    assert (got.float() - exact).abs().max() <= 2 * (torch_own - exact).abs().max() + 1e-6


@needs_compiler
def test_attend_full_leaves_other_cases_to_the_operators(fresh_kernel, one_thread):
    """Where the kernel does not serve, attend_full answers None and never calls it: two threads, float32,
    grouped-query heads, a head size that is not a multiple of 16 or past 256, q, k, v laid out differently,
    int64 cu_seqlens, cu_seqlens that do not cover the tokens, or a scale that is not positive (the kernel
    finds each row's largest score before scaling it)."""
    built = host_kernels.kernels()
    assert built is not None
    calls = []
    counting = dataclasses.replace(built, attend_full=lambda *args: calls.append(args))
    q, k, v, cu_seqlens = _packed_qkv([5, 40], 4, 32, seed=5)
    narrow = _packed_qkv([5, 40], 4, 24, seed=5)
    cases = {
        "float32": (q.float(), k.float(), v.float(), cu_seqlens),
        "grouped-query": (q, k[:, :2], v[:, :2], cu_seqlens),
        "head size 24": narrow,
        "head size 272": _packed_qkv([5, 40], 1, 272, seed=5),
        "dense q beside strided k, v": (q.contiguous(), k, v, cu_seqlens),
        "int64 cu_seqlens": (q, k, v, cu_seqlens.long()),
        "short cu_seqlens": (q, k, v, cu_seqlens[:-1]),
    }
    with mock.patch.object(host_kernels, "kernels", return_value=counting):
        for name, (q_, k_, v_, cu_) in cases.items():
            assert host_kernels.attend_full(q_, k_, v_, _batch(cu_), None) is None, name
        for scale in (-0.3, 0.0):
            assert host_kernels.attend_full(q, k, v, _batch(cu_seqlens), scale) is None, scale
        torch.set_num_threads(2)
        assert host_kernels.attend_full(q, k, v, _batch(cu_seqlens), None) is None
    assert calls == []


@needs_compiler
def test_a_wrong_attention_kernel_is_refused_at_build(fresh_kernel):
    """The check before the kernels serve compares attention with float32 SDPA: a build whose products
    were off (here its scale doubled) is reported, so torch's operators would serve instead."""
    built = host_kernels.kernels()
    assert built is not None and host_kernels._check_attention(built) is None

    def doubled_scale(*args):
        return built.attend_full(*args[:10], args[10] * 2, args[11])

    message = host_kernels._check_attention(dataclasses.replace(built, attend_full=doubled_scale))
    assert message is not None and "attention with 32-wide heads off by" in message


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
    with and without a vector tail: the token scales and the int8 values equal torch's."""
    assert host_kernels.kernels() is not None
    rows = _int8_rows(300, width, dtype, seed=width)
    input_scale = torch.rand(width, generator=torch.Generator().manual_seed(1)) + 0.25
    for scale in (None, input_scale):
        got, got_scale = host_kernels.quantize_rows(rows, scale)
        want, want_scale = host_kernels._quantize_by_torch(rows, scale)
        assert got.dtype == torch.int8 and got.shape == (300, width) and got_scale.shape == (300, 1)
        assert torch.equal(got_scale, want_scale) and torch.equal(got, want)
        assert (got[2] == 0).all() and got.abs().max() == 127


@needs_compiler
@pytest.mark.parametrize("width", [2, 16])
def test_quantize_rows_rounds_a_tie_of_the_rounded_product_as_torch(width, fresh_kernel, one_thread):
    """0.7048009 x 127 / 1.4554425 is 61.5 in float32 (torch rounds it to 62, ties to even) but 61.4999981
    exactly: a product fused into the rounding (an FMA) went to 61."""
    rows = torch.zeros(1, width)
    rows[0, :2] = torch.tensor([1.4554425477981567, 0.7048009037971497])
    got, _ = host_kernels.quantize_rows(rows, None)
    want, _ = host_kernels._quantize_by_torch(rows, None)
    assert want[0, :2].tolist() == [127, 62]
    assert torch.equal(got, want)


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
def test_gelu_is_the_erf_gelu_to_float32_precision(fresh_kernel, one_thread):
    """The kernels' GELU (gelu_rows: a piecewise fit of log2 of the Gaussian tail where AVX-512 is built,
    an erfc fit elsewhere) at every 2^-12 from -16 to 16 (fed as rescale_rows' bias, products 0), against
    the float64 erf GELU: relative error under 1e-6 from -3 up (float32's own rounding is 6e-8), under
    3e-6 from -6 to -3 and 1e-5 from -10 to -6 (GELU(-6) = -6e-9), and no larger than 1e-20 in
    magnitude below (GELU(-10) = -7.6e-23): far below bfloat16's step (2^-8) and int8's everywhere."""
    assert host_kernels.kernels() is not None
    x = torch.arange(-(2**16), 2**16 + 1, dtype=torch.float64) / 2**12
    products = torch.zeros(1, x.numel(), dtype=torch.int32)
    got = host_kernels.rescale_rows(
        products, torch.ones(1, 1), torch.ones(x.numel()), x.float(), "gelu", torch.empty(1, x.numel())
    )[0].double()
    exact = x * torch.special.erfc(-x / 2**0.5) / 2
    relative = (got - exact).abs() / exact.abs().clamp(min=1e-300)
    for low, high, bound in ((-3, 16, 1e-6), (-6, -3, 3e-6), (-10, -6, 1e-5)):
        within = (x >= low) & (x <= high)
        assert relative[within].max() < bound, (low, high, relative[within].max().item())
    assert got[x < -10].abs().max() < 1e-20 and (got[x < -10] <= 0).all()
    assert got[x == 0].item() == 0 and torch.equal(got[x >= 8], x[x >= 8].float().double())
    infinite = torch.tensor([torch.inf, -1.0])
    assert host_kernels.rescale_rows(products[:, :2], torch.ones(1, 1), torch.ones(2), infinite, "gelu",
                                     torch.empty(1, 2))[0, 0] == torch.inf  # fmt: skip


@needs_compiler
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_int8_linear_serves_through_the_kernels_as_through_torch(dtype, fresh_kernel, one_thread):
    """An Int8Linear (SmoothQuant scale, bias, GELU) gives within its dtype's rounding what it gives on
    torch's operators, and calls each kernel once per forward (quantize, then the VNNI GEMM with its epilogue
    where the build has it, else rescale after torch._int_mm); on two threads torch's operators serve."""
    generator = torch.Generator().manual_seed(5)
    with torch.random.fork_rng():  # the same weights whatever ran before (they once held a quantization tie)
        torch.manual_seed(5)
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
        int8_linear_rows=counted("int8 linear", built.int8_linear_rows),
    )
    with mock.patch.object(host_kernels, "kernels", return_value=counting):
        got = layer(x, activation="gelu")
        assert calls == (["quantize", "int8 linear"] if built.int8_gemm else ["quantize", "rescale"])
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


needs_vnni_gemm = pytest.mark.skipif(
    not HAS_COMPILER or (host_kernels.kernels() is None or not host_kernels.kernels().int8_gemm),
    reason="the int8 GEMM kernel is built only for a CPU with avx512_vnni",
)


@needs_compiler
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("width", [5, 384])
def test_unsigned_quantization_is_the_signed_one_shifted(width, dtype, fresh_kernel, one_thread):
    """to_unsigned gives q + 128 as uint8 for every value (the VNNI GEMM's input) and the same token scales."""
    assert host_kernels.kernels() is not None
    rows = _int8_rows(40, width, dtype, seed=width)
    signed, signed_scale = host_kernels.quantize_rows(rows, None)
    unsigned, unsigned_scale = host_kernels.quantize_rows(rows, None, to_unsigned=True)
    assert unsigned.dtype == torch.uint8
    assert torch.equal(unsigned.int() - 128, signed.int()) and torch.equal(unsigned_scale, signed_scale)


def _int8_layer(rows: int, k: int, n: int, seed: int):
    generator = torch.Generator().manual_seed(seed)
    weight = torch.randint(-127, 128, (n, k), generator=generator, dtype=torch.int8)
    inputs = _int8_rows(rows, k, torch.float32, seed=seed)
    token_scale = torch.rand(rows, 1, generator=generator) * 1e-3
    weight_scale = torch.rand(n, generator=generator) * 1e-2
    return weight, inputs, token_scale, weight_scale, torch.randn(n, generator=generator)


@needs_vnni_gemm
@pytest.mark.parametrize(
    ("rows", "k", "n"),
    [(3, 384, 1152), (7, 4, 16), (9, 64, 40), (300, 384, 1536), (257, 1536, 384), (33, 100, 5)],
)
def test_vnni_gemm_products_equal_torch_int_mm(rows, k, n, fresh_kernel, one_thread):
    """The u8 x s8 GEMM with the weights' compensation gives exactly torch._int_mm's int32 products (read back
    through unit scales in float32, exact below 2^24): tiles of 1 to 8 rows, 1 to 3 vectors, a partial last
    vector, more rows than a row block (256), K from 4 to 1,536."""
    weight, inputs, *_ = _int8_layer(rows, k, n, seed=rows + k + n)
    packed = host_kernels.pack_int8(weight, torch.ones(n), None)
    assert packed is not None
    unsigned, _ = host_kernels.quantize_rows(inputs, None, to_unsigned=True)
    signed, _ = host_kernels.quantize_rows(inputs, None)
    out = torch.empty(rows, n)
    host_kernels.int8_linear(unsigned, torch.ones(rows, 1), packed, "none", out)
    want = torch._int_mm(signed, weight.t()) if rows > 16 else signed.int() @ weight.t().int()
    assert torch.equal(out, want.float())


@needs_vnni_gemm
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("activation", ["none", "gelu", "relu"])
@pytest.mark.parametrize(("k", "n"), [(384, 1536), (64, 40)])
def test_vnni_gemm_epilogue_equals_int_mm_then_rescale(k, n, activation, dtype, fresh_kernel, one_thread):
    """The GEMM's epilogue (token scale x channel scale + bias, GELU or ReLU, to float32 or bfloat16) gives
    what torch._int_mm then rescale_rows give: within float32's rounding, one bfloat16 step; no bias too."""
    weight, inputs, token_scale, weight_scale, bias = _int8_layer(100, k, n, seed=k + n)
    signed, _ = host_kernels.quantize_rows(inputs, None)
    unsigned, _ = host_kernels.quantize_rows(inputs, None, to_unsigned=True)
    products = torch._int_mm(signed, weight.t())
    for with_bias in (bias, None):
        packed = host_kernels.pack_int8(weight, weight_scale, with_bias)
        assert packed is not None
        got = host_kernels.int8_linear(unsigned, token_scale, packed, activation, torch.empty(100, n, dtype=dtype))
        want = host_kernels.rescale_rows(
            products, token_scale, weight_scale, with_bias, activation, torch.empty(100, n, dtype=dtype)
        )
        step = 2**-8 if dtype == torch.bfloat16 else 1e-6
        torch.testing.assert_close(got.float(), want.float(), rtol=step, atol=1e-6)


@needs_vnni_gemm
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("activation", ["none", "gelu"])
def test_an_int8_row_does_not_depend_on_the_rows_beside_it(activation, dtype, fresh_kernel, one_thread):
    """The same input row gives the same bits whatever the call's row count, and so whichever of the GEMM's
    paths computed it (AMX blocks of 32 rows, the VNNI tiles' 8-row and leftover tiles): a query's int8
    vector must not depend on the batch it rode in."""
    weight, inputs, token_scale, weight_scale, bias = _int8_layer(100, 384, 1536, seed=3)
    unsigned, _ = host_kernels.quantize_rows(inputs, None, to_unsigned=True)
    packed = host_kernels.pack_int8(weight, weight_scale, bias)
    assert packed is not None

    def rows(count: int) -> torch.Tensor:
        out = torch.empty(count, 1536, dtype=dtype)
        return host_kernels.int8_linear(unsigned[:count], token_scale[:count], packed, activation, out)

    every = rows(100)
    for count in (1, 7, 8, 23, 24, 31, 32, 33, 64):
        assert torch.equal(rows(count), every[:count]), count


@needs_vnni_gemm
def test_a_wrong_vnni_gemm_is_refused_at_build(fresh_kernel):
    """The load check compares the GEMM's integers with torch._int_mm's: a build whose compensation were
    off (here the packing's compensation doubled) is reported, so torch._int_mm would serve instead."""
    built = host_kernels.kernels()
    assert built is not None and host_kernels._check_int8_linear_rows(built) is None

    def doubled_compensation(weight, n, k, packed, compensation):
        built.pack_int8_weights(weight, n, k, packed, compensation)
        values = (ctypes.c_int32 * (-(-n // 16) * 16)).from_address(compensation)
        for j in range(len(values)):
            values[j] *= 2

    message = host_kernels._check_int8_linear_rows(dataclasses.replace(built, pack_int8_weights=doubled_compensation))
    assert message is not None and "differ from torch._int_mm's" in message


@needs_compiler
def test_an_odd_width_keeps_torch_int_mm(fresh_kernel, one_thread):
    """in_features not a multiple of 4 (the GEMM reads 4 bytes of a row at a time): no packed weights, and the
    layer serves by torch._int_mm as before."""
    linear = torch.nn.Linear(6, 8).requires_grad_(False)
    layer = int8_linear.Int8Linear.from_linear(linear)
    assert layer.packed is None
    x = _int8_rows(4, 6, torch.float32, seed=3)
    with mock.patch.object(host_kernels, "kernels", return_value=None):
        want = layer(x)
    torch.testing.assert_close(layer(x), want, rtol=1e-5, atol=1e-6)


needs_bf16_gemm = pytest.mark.skipif(
    not HAS_COMPILER or (host_kernels.kernels() is None or not host_kernels.kernels().bf16_gemm),
    reason="the few-row bfloat16 GEMM is built only for a CPU with avx512_bf16",
)


@needs_bf16_gemm
def test_bf16_packed_weights_are_in_huge_page_blocks():
    """A short query streams through the packed copies: they live in the arena's 2 MiB-page blocks."""
    packed = host_kernels.pack_bf16(torch.randn(64, 32).bfloat16(), None)
    assert packed is not None
    assert _in_arena_block(packed.packed)


@needs_vnni_gemm
def test_int8_packed_weights_are_in_huge_page_blocks():
    packed = host_kernels.pack_int8(torch.randint(-127, 128, (64, 32), dtype=torch.int8), torch.ones(64), None)
    assert packed is not None
    assert _in_arena_block(packed.packed) and _in_arena_block(packed.compensation)


def _in_arena_block(tensor: torch.Tensor) -> bool:
    found = mapping(tensor.data_ptr())
    return found is not None and found["start"] % huge_pages.PAGE == 0


def _bf16_linear(k: int, n: int, seed: int, bias: bool = True) -> torch.nn.Linear:
    torch.manual_seed(seed)
    return torch.nn.Linear(k, n, bias=bias).bfloat16().requires_grad_(False)


def _by_onednn(layer: packed_linear.PackedLinear, x: torch.Tensor, activation: str) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, layer.weight, layer.bias, activation, [], "none")


@needs_bf16_gemm
@pytest.mark.parametrize("activation", ["none", "gelu", "relu"])
@pytest.mark.parametrize(("k", "n"), [(384, 1152), (384, 1536), (1536, 384), (34, 100)])
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 8, 9, 10, 11, 12, 16, 24, 32, 40, 56, 64])
def test_bf16_gemm_is_onednns_linear_within_bfloat16_rounding(rows, k, n, activation, one_thread, monkeypatch):
    """The few-row GEMM against oneDNN's _linear_pointwise on the same packed layer (what serves these rows
    on the old code) and float32's linear on the same bfloat16 values: within one bfloat16 step of
    oneDNN's, no further from float32 than twice oneDNN's own error, and nearly every value bit-identical
    (both sum pairs of products in float32 and round once). Tiles of 1 to 8 rows (to 10 rows, in tiles of
    up to 8 that prefetch the next weights, 9 = 5 + 4; then 4-row tiles), every tile width, a partial last
    vector (n = 100) and an odd number of pairs (k = 34); MiniLM's four shapes.
    Past 32 rows, where AMX tiles serve (a group of 32 rows, then one or two blocks), k = 34 keeps oneDNN;
    elsewhere the vector products take every row count."""
    monkeypatch.setattr(host_kernels, "SMALL_LINEAR_ROWS", 64)  # every row count, whatever this CPU serves by it
    tiles_alone = rows > host_kernels.VECTOR_GEMM_ROWS and host_kernels.kernels().bf16_gemm_tiles
    if tiles_alone and k % host_kernels.TILE_DEPTH:
        x = torch.zeros(rows, k).bfloat16()
        assert (
            host_kernels.bf16_linear(x, packed_linear.PackedLinear(_bf16_linear(k, n, 0)).few_rows, activation) is None
        )
        return
    linear = _bf16_linear(k, n, seed=rows + k + n)
    layer = packed_linear.PackedLinear(linear)
    assert layer.few_rows is not None
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)).bfloat16()
    got = host_kernels.bf16_linear(x, layer.few_rows, activation)
    assert got is not None and got.dtype == torch.bfloat16 and got.shape == (rows, n)
    onednn = _by_onednn(layer, x, activation)
    exact = F.linear(x.float(), linear.weight.float(), linear.bias.float())
    exact = F.gelu(exact) if activation == "gelu" else exact.relu() if activation == "relu" else exact
    torch.testing.assert_close(got.float(), onednn.float(), atol=2**-8, rtol=2**-7)
    assert (got.float() - exact).abs().max() <= 2 * (onednn.float() - exact).abs().max() + 1e-6
    assert (got != onednn).float().mean() < 0.01


@needs_bf16_gemm
def test_packed_linear_runs_few_rows_by_the_kernel_and_more_by_onednn(fresh_kernel, one_thread):
    """PackedLinear.forward: up to few_row_limit() rows (of a 2-D or 3-D input) through the kernel, no
    bias too; more rows, more than one thread, or a float32 layer (no kernel weights) through oneDNN;
    each time equal to oneDNN's result within bfloat16's rounding, and as bf16_linear_serves says (what
    the packed forward asks before it rounds a batch's rows)."""
    layer = packed_linear.PackedLinear(_bf16_linear(384, 1536, seed=1, bias=False))
    served: list[bool] = []  # per call: whether the kernel computed it
    real = host_kernels.bf16_linear

    def recorded(*args):
        served.append((out := real(*args)) is not None)
        return out

    limit = host_kernels.few_row_limit()
    with mock.patch.object(host_kernels, "bf16_linear", recorded):
        for shape, kernel in (((limit, 384), True), ((2, limit // 2, 384), True), ((limit + 8, 384), False)):
            x = torch.randn(shape).bfloat16()
            got = layer(x, activation="gelu")
            assert served.pop() is kernel and not served
            assert host_kernels.bf16_linear_serves(x.numel() // 384, layer.few_rows) is kernel
            want = _by_onednn(layer, x, "gelu")
            assert got.shape == want.shape
            torch.testing.assert_close(got.float(), want.float(), atol=2**-8, rtol=2**-7)
        torch.set_num_threads(2)
        layer(torch.randn(8, 384).bfloat16())
        assert served == [False] and not host_kernels.bf16_linear_serves(8, layer.few_rows)
    assert packed_linear.PackedLinear(torch.nn.Linear(384, 384).requires_grad_(False)).few_rows is None


@needs_bf16_gemm
def test_few_row_copies_stay_within_their_budget_and_give_it_back(fresh_kernel, one_thread):
    """A process holds at most FEW_ROW_BUDGET_BYTES of few-row weight copies: a layer past it keeps oneDNN
    alone (and still computes), and a freed copy's bytes serve the next layer."""
    size = 1536 * 384 * 2  # one layer's copy
    gc.collect()  # earlier tests' copies freed now, not while this one counts
    with mock.patch.object(host_kernels, "FEW_ROW_BUDGET_BYTES", host_kernels._few_row_budget.held + 2 * size):
        layers = [packed_linear.PackedLinear(_bf16_linear(384, 1536, seed=s)) for s in range(3)]
        assert [layer.few_rows is not None for layer in layers] == [True, True, False]
        x = torch.randn(4, 384).bfloat16()
        assert torch.equal(layers[2](x), _by_onednn(layers[2], x, "none"))
        del layers[0]
        gc.collect()
        assert packed_linear.PackedLinear(_bf16_linear(384, 1536, seed=3)).few_rows is not None


@needs_bf16_gemm
def test_an_odd_width_keeps_onednn(fresh_kernel, one_thread):
    """in_features odd (the kernel reads a row's values in pairs): no kernel weights; oneDNN serves."""
    layer = packed_linear.PackedLinear(_bf16_linear(7, 16, seed=2))
    assert layer.few_rows is None
    x = torch.randn(4, 7).bfloat16()
    assert torch.equal(layer(x), _by_onednn(layer, x, "none"))


@needs_bf16_gemm
def test_a_wrong_bf16_gemm_is_refused_at_build(fresh_kernel):
    """The load check compares the few-row GEMM with float32's linear: a build whose packing swapped each
    pair's two values (products of the wrong inputs) is reported, so oneDNN would serve instead."""
    built = host_kernels.kernels()
    assert built is not None and host_kernels._check_bf16_linear_rows(built) is None

    def swapped_pairs(weight, n, k, packed):
        built.pack_bf16_weights(weight, n, k, packed)
        values = (ctypes.c_uint32 * (-(-n // 16) * 16 * k // 2)).from_address(packed)
        for j in range(len(values)):
            values[j] = (values[j] >> 16) | ((values[j] & 0xFFFF) << 16)

    message = host_kernels._check_bf16_linear_rows(dataclasses.replace(built, pack_bf16_weights=swapped_pairs))
    assert message is not None and "bfloat16 GEMM" in message


def _bert_layer_parts(hidden: int, heads: int, inner: int, seed: int) -> tuple[list, list]:
    """A BERT layer's modules as packed_bert builds them in bfloat16: PackedLinears (fused QKV, attention
    output, FFN up and down) with their few-row weights, and two LayerNorms of random parameters."""
    torch.manual_seed(seed)
    shapes = ((3 * hidden, hidden), (hidden, hidden), (inner, hidden), (hidden, inner))
    linears = [packed_linear.PackedLinear(torch.nn.Linear(k, n).bfloat16().requires_grad_(False)) for n, k in shapes]
    norms = [torch.nn.LayerNorm(hidden, eps=1e-12).bfloat16().requires_grad_(False) for _ in range(2)]
    for norm in norms:
        norm.weight.normal_(1, 0.2), norm.bias.normal_(0, 0.2)
    return linears, norms


def _layer_by_operators(x, batch, linears, norms, heads: int, activation: str) -> torch.Tensor:
    """The layer operator by operator, as BertPieces.layer computes it where no whole-layer call serves."""
    qkv, attention_out, up, down = linears
    q, k, v = qkv(x).view(x.shape[0], 3, heads, -1).unbind(1)
    context = packed_pieces.attend(q, k, v, batch).flatten(1)
    x = host_kernels.add_layer_norm(norms[0], attention_out(context), x)
    return host_kernels.add_layer_norm(norms[1], down(packed_pieces.activated(up, x, activation)), x)


def _whole_layer(linears, norms, heads: int, activation: str, scale=None):
    qkv, attention_out, up, down = (packed_pieces.layer_gemm(m) for m in linears)
    return host_kernels.bert_layer_weights(qkv, attention_out, norms[0], up, down, norms[1], heads, scale, activation)


def _int8_layer_parts(hidden: int, heads: int, inner: int, seed: int) -> tuple[list, list]:
    """The same layer with its linears in int8 (Int8Linear with the VNNI GEMM's weights), the QKV and up
    projections smoothed from random input ranges (SmoothQuant's input scale), as int8_linear.quantize
    leaves a model."""
    linears, norms = _bert_layer_parts(hidden, heads, inner, seed)
    generator = torch.Generator().manual_seed(seed)
    ranges = [torch.rand(m.in_features, generator=generator) * 4 + 0.1 for m in linears]
    smoothed = [ranges[0], None, ranges[2], None]
    return [int8_linear.Int8Linear.from_linear(m, input_range=r) for m, r in zip(linears, smoothed, strict=True)], norms


def _packed_batch(lengths: list[int]) -> packed_pieces.PackedBatch:
    cu_seqlens = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32)
    return packed_pieces.PackedBatch.of(torch.zeros(sum(lengths), dtype=torch.long), cu_seqlens)


@needs_bf16_gemm
@pytest.mark.parametrize(("hidden", "heads", "inner"), [(384, 12, 1536), (64, 4, 128)])
@pytest.mark.parametrize("activation", ["gelu", "relu"])
@pytest.mark.parametrize("lengths", [[1], [2], [5], [9], [13], [32], [3, 30], [33], [20, 20, 24], [64]])
def test_bert_layer_equals_its_kernels_one_by_one(lengths, activation, hidden, heads, inner, one_thread):
    """host_kernels.bert_layer, a whole BERT layer in one call, against the same layer computed operator by
    operator as BertPieces.layer computes it: equal bit for bit, from 1 to 64 rows, one sequence or several,
    MiniLM's sizes (12 heads of 32) and a tiny model's (4 heads of 16). Past few_row_limit() (or, where AMX
    tiles alone serve past 32 rows, a k not in whole tile rows) it answers None, as bf16_linear does."""
    linears, norms = _bert_layer_parts(hidden, heads, inner, seed=sum(lengths))
    weights = _whole_layer(linears, norms, heads, activation)
    assert weights is not None
    batch = _packed_batch(lengths)
    x = torch.randn(sum(lengths), hidden, generator=torch.Generator().manual_seed(len(lengths))).bfloat16()
    got = host_kernels.bert_layer(x, weights, batch)
    if not all(host_kernels.bf16_linear_serves(sum(lengths), m.few_rows) for m in linears):
        assert got is None
        return
    want = _layer_by_operators(x, batch, linears, norms, heads, activation)
    assert got is not None and got.dtype == torch.bfloat16 and got.shape == x.shape
    assert torch.equal(got, want), (got.float() - want.float()).abs().max()


@needs_bf16_gemm
@needs_vnni_gemm
@pytest.mark.parametrize("activation", ["gelu", "relu"])
@pytest.mark.parametrize("lengths", [[1], [5], [9], [13], [3, 30], [64], [65]])
def test_int8_bert_layer_equals_its_kernels_one_by_one(lengths, activation, one_thread):
    """An int8 layer (quantize_rows then the VNNI GEMM for each linear, attention and the norms in bfloat16)
    in one bert_layer call against the layer computed operator by operator: bit for bit, up to
    INT8_WHOLE_LAYER_ROWS rows; past them None (a bulk batch keeps int8_linear.py's passes)."""
    linears, norms = _int8_layer_parts(384, 12, 1536, seed=sum(lengths))
    weights = _whole_layer(linears, norms, 12, activation)
    assert weights is not None
    batch = _packed_batch(lengths)
    x = torch.randn(sum(lengths), 384, generator=torch.Generator().manual_seed(len(lengths))).bfloat16()
    got = host_kernels.bert_layer(x, weights, batch)
    if sum(lengths) > host_kernels.INT8_WHOLE_LAYER_ROWS:
        assert got is None
        return
    want = _layer_by_operators(x, batch, linears, norms, 12, activation)
    assert got is not None and torch.equal(got, want), (got.float() - want.float()).abs().max()


@needs_bf16_gemm
def test_bert_layer_leaves_other_cases_to_the_operators(one_thread):
    """What one call cannot compute as its kernels would, it refuses: bert_layer_weights gives None for a
    linear without few-row weights, a float32 norm, a head size that is not a multiple of 16, a scale that is
    not positive, another activation; bert_layer answers None for two threads, more rows than
    few_row_limit(), a float32 or strided input, int64 cu_seqlens or cu_seqlens that do not cover the rows."""
    linears, norms = _bert_layer_parts(64, 4, 128, seed=1)
    assert _whole_layer(linears, norms, 4, "gelu") is not None
    float32_norm = torch.nn.LayerNorm(64).requires_grad_(False)
    no_copy = packed_linear.PackedLinear(torch.nn.Linear(64, 64).requires_grad_(False))  # float32: no few-row weights
    refused = {
        "no few-row weights": _whole_layer([linears[0], no_copy, *linears[2:]], norms, 4, "gelu"),
        "float32 norm": _whole_layer(linears, [norms[0], float32_norm], 4, "gelu"),
        "head size 8": _whole_layer(linears, norms, 8, "gelu"),
        "scale 0": _whole_layer(linears, norms, 4, "gelu", scale=0.0),
        "silu": _whole_layer(linears, norms, 4, "silu"),
    }
    assert all(weights is None for weights in refused.values()), refused
    weights = _whole_layer(linears, norms, 4, "gelu")
    x, batch = torch.randn(6, 64).bfloat16(), _packed_batch([2, 4])
    assert host_kernels.bert_layer(x, weights, batch) is not None
    many = host_kernels.few_row_limit() + 1
    wide = torch.randn(6, 128).bfloat16()
    cases = {
        "more rows": (torch.randn(many, 64).bfloat16(), _packed_batch([many])),
        "float32": (x.float(), batch),
        "strided": (wide[:, :64], batch),
        "int64 cu_seqlens": (x, packed_pieces.PackedBatch.of(batch.ids, batch.cu_seqlens.long())),
        "short cu_seqlens": (x, _packed_batch([2, 3])),
    }
    assert all(host_kernels.bert_layer(rows, weights, b) is None for rows, b in cases.values())
    torch.set_num_threads(2)
    assert host_kernels.bert_layer(x, weights, batch) is None


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


@needs_compiler
def test_add_layer_norm_of_a_batch_equals_its_rows_one_by_one(one_thread):
    """The kernel widens the norm's weight and bias once per call for all its rows and normalises them two
    at a time (NORM_ROWS): a 300-row call, and a 299-row one (its last row alone), equal one-row calls bit
    for bit, also written over its own input (out is a), at widths with a tail."""
    assert host_kernels.kernels() is not None
    for width in (100, 384):
        norm, a, b = _norm_and_inputs(width, seed=width + 1)
        whole = host_kernels.add_layer_norm(norm, a, b)
        by_row = torch.cat([host_kernels.add_layer_norm(norm, a[i : i + 1], b[i : i + 1]) for i in range(len(a))])
        assert torch.equal(whole, by_row)
        assert torch.equal(host_kernels.add_layer_norm(norm, a[1:], b[1:]), by_row[1:])
        built = host_kernels.kernels()
        scratch = host_kernels._norm_scratch(built, width)
        pointers = (t.data_ptr() for t in (a, b, norm.weight, norm.bias, a))
        built.add_layer_norm(*pointers, len(a), width, norm.eps, scratch.data_ptr())
        assert torch.equal(a, whole)


def _embedding(width: int, seed: int):
    """BERT-like tables (50 words, 20 positions, 2 types), its norm, and 13 tokens' indices."""
    generator = torch.Generator().manual_seed(seed)
    tables = tuple(torch.randn(rows, width, generator=generator).bfloat16() for rows in (50, 20, 2))
    norm, _, _ = _norm_and_inputs(width, seed)
    ids, types = (torch.randint(0, high, (13,), generator=generator) for high in (50, 2))
    return tables, norm, ids, torch.arange(13), types


@needs_compiler
@pytest.mark.parametrize("width", [40, 384, 768])
def test_embed_equals_the_lookups_added_then_add_layer_norm(width, one_thread):
    """BERT's embeddings in one call: the lookups and the word + position sum as torch's operators give
    them, then add_layer_norm with the type rows, bit for bit; within a bfloat16 step of torch's norm.
    No types: type 0 for every token."""
    tables, norm, ids, positions, types = _embedding(width, seed=width)
    weights = host_kernels.embedding_weights(tables, norm)
    assert weights is not None
    word, position, type_table = tables
    for given in (types, None):
        kinds = given if given is not None else torch.zeros_like(ids)
        got = host_kernels.embed(weights, ids, positions, given)
        assert torch.equal(got, host_kernels.add_layer_norm(norm, word[ids] + position[positions], type_table[kinds]))
        by_torch = norm(word[ids] + position[positions] + type_table[kinds])
        torch.testing.assert_close(got.float(), by_torch.float(), atol=2**-6, rtol=2**-7)


@needs_compiler
def test_embed_refuses_an_index_out_of_its_table_as_torch_does(one_thread):
    tables, norm, ids, positions, types = _embedding(64, seed=1)
    weights = host_kernels.embedding_weights(tables, norm)
    for bad in ((ids.clone().fill_(50), positions, types), (ids, positions + 20, types), (ids, positions, types + 2)):
        with pytest.raises(IndexError):
            host_kernels.embed(weights, *bad)
    with pytest.raises(IndexError):
        torch.nn.functional.embedding(ids.clone().fill_(50), tables[0])


@needs_compiler
def test_embed_leaves_other_cases_to_the_operators(one_thread):
    """Two threads or int32 indices: None (the operators then); float32 tables or a norm the kernel does
    not serve: no weights at load."""
    tables, norm, ids, positions, types = _embedding(64, seed=2)
    weights = host_kernels.embedding_weights(tables, norm)
    assert host_kernels.embed(weights, ids.int(), positions, types) is None
    torch.set_num_threads(2)
    assert host_kernels.embed(weights, ids, positions, types) is None
    assert host_kernels.embedding_weights(tuple(t.float() for t in tables), norm) is None
    assert host_kernels.embedding_weights(tables, torch.nn.LayerNorm(64).bfloat16().requires_grad_(False)) is not None
    assert host_kernels.embedding_weights(tables, torch.nn.LayerNorm(64, bias=False).bfloat16()) is None


def _packed_states(width: int, lengths: list[int], seed: int):
    generator = torch.Generator().manual_seed(seed)
    hidden = (torch.randn(sum(lengths), width, generator=generator) * 3).bfloat16()
    return hidden, torch.tensor(np.concatenate([[0], np.cumsum(lengths)]), dtype=torch.int32)


@needs_compiler
@pytest.mark.parametrize("width", [8, 100, 384, 768])
def test_mean_tokens_equals_segment_reduce_bit_for_bit(width, one_thread):
    """Mean pooling from the bfloat16 states equals segment_reduce's float32 mean over them exactly (the
    same additions in the same order, the same division), one-token and 300-token sequences among them."""
    assert host_kernels.kernels() is not None
    hidden, cu_seqlens = _packed_states(width, [1, 7, 300, 16, 1, 45], seed=width)
    before = hidden.clone()
    got = host_kernels.mean_tokens(hidden, cu_seqlens)
    want = torch.segment_reduce(hidden.float(), "mean", lengths=cu_seqlens.diff(), axis=0)
    assert got is not None and got.dtype == torch.float32
    assert torch.equal(got, want)
    assert torch.equal(hidden, before)


@needs_compiler
def test_mean_pooling_takes_the_kernel_only_where_it_serves(one_thread):
    """PackedEncoder.pool: mean pooling alone of bfloat16 states on one thread goes through the kernel;
    two threads, float32 states or several modes keep segment_reduce; every way gives the same rows."""
    from encoderd.workers.backends.packed_encoder import PackedEncoder
    from encoderd.workers.contract.model_spec import Pooling

    hidden, cu_seqlens = _packed_states(384, [3, 50, 9], seed=4)
    want = torch.segment_reduce(hidden.float(), "mean", lengths=cu_seqlens.diff(), axis=0)
    built = host_kernels.kernels()
    assert built is not None
    calls = []

    def counted(*args):
        calls.append(args)
        built.mean_rows(*args)

    counting = dataclasses.replace(built, mean_rows=counted)
    with mock.patch.object(host_kernels, "kernels", return_value=counting):
        assert torch.equal(PackedEncoder.pool(hidden, cu_seqlens, Pooling.MEAN), want)
        assert len(calls) == 1
        assert torch.equal(PackedEncoder.pool(hidden.float(), cu_seqlens, Pooling.MEAN), want)
        twice = PackedEncoder.pool(hidden, cu_seqlens, (Pooling.MEAN, Pooling.MEAN))
        assert torch.equal(twice, torch.cat([want, want], dim=1))
        torch.set_num_threads(2)
        assert torch.equal(PackedEncoder.pool(hidden, cu_seqlens, Pooling.MEAN), want)
    assert len(calls) == 1
