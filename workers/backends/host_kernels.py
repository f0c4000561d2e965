"""bfloat16 kernels for the packed forward on CPU, built for this host at model load (host_kernels.c).

* softmax_: attention's softmax (packed_pieces._attend_by_products). torch's bfloat16 softmax was
  14.6 % of MiniLM's packed forward on one thread (Zen 5), twice attention's whole FLOP share: each
  element converted, exponentiated by a 1-ulp exp, converted back. host_kernels.c exponentiates in
  float32 by a polynomial accurate to 2e-7 (bfloat16 keeps 4e-3): 1.8x torch.softmax over the bench
  corpus's lengths.
* add_layer_norm: LayerNorm(a + b), a BERT layer's residual add and norm in one pass over the tokens
  instead of two (1.4-1.6x torch's add then layer_norm at hidden sizes 384 and 768).

Both equal torch's operators but for an occasional last-bit rounding (tests/unit/test_host_kernels.py).

The library is compiled when a bfloat16 packed model loads, by the host's C compiler (`$CC`, the one
Python was built with, else cc, gcc or clang), for the instruction sets of the CPU it runs on
(-march=native), then each kernel is checked against torch's operator on random input. No compiler, a
compiler that cannot target this CPU, or a check that fails: torch's operators serve, and the log says
why. The library is built in a temporary folder, loaded, and deleted (dlopen keeps it mapped), so
nothing built for one CPU is ever reused on another.

ENCODERD_BUILD_KERNELS=0 skips the build (torch's operators serve): to compare the two, or to rule the
kernels out when diagnosing.

One thread: the kernels run only where torch would run on one thread (a single-thread worker, the
default on hosts of up to 4 cores, or a batch small enough to run on one); elsewhere torch's.
"""

from __future__ import annotations

import ctypes
import functools
import itertools
import logging
import os
import shlex
import shutil
import subprocess
import sysconfig
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

if TYPE_CHECKING:  # packed_pieces imports this module
    from .packed_pieces import PackedBatch

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("host_kernels.c")
SWITCH_ENV = "ENCODERD_BUILD_KERNELS"
FLAGS = ("-O3", "-march=native", "-shared", "-fPIC")
LANES = 16  # host_kernels.c's vector width: its scratch rows are this much longer than a row
MAX_HEAD_SIZE = 256  # attention's head size: a tile's spare output rows live on the C stack (8 x 256 x 2 bytes)
_pointer, _size = ctypes.c_void_p, ctypes.c_int64


@dataclass(frozen=True)
class Kernels:
    """host_kernels.c's functions (ctypes: each call releases the GIL)."""

    softmax_rows: Any
    add_layer_norm: Any
    attend_full: Any
    attention_scratch_bytes: Any
    attention_products: str  # "avx512_bf16" (vdpbf16ps) or "float32" (multiply-adds): what this build targets


def softmax_(scores: torch.Tensor) -> torch.Tensor:
    """softmax over the last dimension; in place through the kernel where it serves, else torch's."""
    built = _serving(scores)
    if built is None or not scores.is_contiguous():
        return torch.softmax(scores, dim=-1)
    cols = scores.shape[-1]
    scratch = torch.empty(cols + LANES, dtype=torch.float32)
    rows = scores.numel() // cols
    _run("encoderd::softmax", built.softmax_rows, scores.data_ptr(), rows, cols, cols, scratch.data_ptr())
    return scores


def add_layer_norm(norm: torch.nn.Module, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """norm(a + b) for a torch.nn.LayerNorm over the last dimension; in one pass where the kernel serves.
    Called twice per layer: the norm's parameters are read once (each read goes through
    nn.Module.__getattr__), ~10 us of Python a call on a 10-token query before, where the kernel runs 2 us."""
    built = _serving(a)
    if built is None or not isinstance(norm, torch.nn.LayerNorm):
        return norm(a + b)
    weight, bias = norm.weight, norm.bias
    if not _one_pass(norm, weight, bias, a, b):
        return norm(a + b)
    out = torch.empty_like(a)
    cols = a.shape[-1]
    scratch = torch.empty(cols + LANES, dtype=torch.float32)
    rows = a.numel() // cols
    pointers = (a.data_ptr(), b.data_ptr(), weight.data_ptr(), bias.data_ptr(), out.data_ptr())
    _run("encoderd::add_layer_norm", built.add_layer_norm, *pointers, rows, cols, norm.eps, scratch.data_ptr())
    return out


def attend_full(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: PackedBatch, scale: float | None
) -> torch.Tensor | None:
    """Attention within each sequence of a packed batch, every key visible to every query of its sequence
    (BERT's window), in one call for the whole batch: q, k, v (tokens, heads, dim) read in place (strided
    views of the fused QKV projection serve as they are), scores and softmax in float32, the context
    (tokens, heads, dim) a new dense tensor. None where the kernel does not serve (then packed_pieces'
    per-sequence operators): not built, not one thread, not bfloat16, grouped-query heads, q, k and v
    laid out differently, or a head size that is not a multiple of 16 (or past MAX_HEAD_SIZE)."""
    built = _serving(q)
    if built is None or not _kernel_attention(q, k, v, batch):
        return None
    tokens, heads, dim = q.shape
    out = torch.empty(tokens, heads, dim, dtype=q.dtype)
    scratch = torch.empty(built.attention_scratch_bytes(batch.longest, dim), dtype=torch.uint8)
    cu_seqlens = batch.cu_seqlens
    sequences = cu_seqlens.shape[0] - 1
    pointers = (t.data_ptr() for t in (q, k, v))
    strides = q.stride()[:2]
    scaling = dim**-0.5 if scale is None else scale
    arguments = (*strides, out.data_ptr(), cu_seqlens.data_ptr(), sequences, heads, dim, scaling, scratch.data_ptr())
    _run("encoderd::attention", built.attend_full, *pointers, *arguments)
    return out


def _kernel_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: PackedBatch) -> bool:
    """The attention kernel's case: bfloat16 q, k, v of one shape and one layout (the head size dense and
    a multiple of 16 up to MAX_HEAD_SIZE), int32 cu_seqlens covering every token (the kernel reads the
    tokens they name)."""
    if not (q.dim() == 3 and q.shape == k.shape == v.shape and q.stride() == k.stride() == v.stride()):
        return False
    if k.dtype != torch.bfloat16 or v.dtype != torch.bfloat16 or q.stride(2) != 1:
        return False
    if q.shape[2] % LANES != 0 or q.shape[2] > MAX_HEAD_SIZE:
        return False
    cu_seqlens = batch.cu_seqlens
    if cu_seqlens.dtype != torch.int32 or cu_seqlens.device.type != "cpu" or not cu_seqlens.is_contiguous():
        return False
    return batch.bounds[0] == 0 and batch.bounds[-1] == q.shape[0]  # Python ints, read once per batch


def _one_pass(norm: torch.nn.LayerNorm, weight, bias, a: torch.Tensor, b: torch.Tensor) -> bool:
    """The kernel's case: bfloat16 a, b, weight and bias, alike and dense, normalized over the last dimension."""
    if weight is None or bias is None or len(norm.normalized_shape) != 1:
        return False
    if weight.dtype != torch.bfloat16 or bias.dtype != torch.bfloat16 or b.dtype != torch.bfloat16:
        return False
    return a.shape == b.shape and a.is_contiguous() and b.is_contiguous()


def _serving(x: torch.Tensor) -> Kernels | None:
    if x.dtype != torch.bfloat16 or x.device.type != "cpu" or torch.get_num_threads() != 1:
        return None
    return kernels()


def _run(name: str, function, *args) -> None:
    if torch._C._autograd._profiler_enabled():  # named for bench.breakdown (else counted as Python); 10 us a call
        with torch.profiler.record_function(name):
            function(*args)
    else:
        function(*args)


@functools.cache
def kernels() -> Kernels | None:
    """host_kernels.c built here for this CPU, or None (logged) where it cannot be."""
    if os.environ.get(SWITCH_ENV, "1") == "0":
        log.info("bfloat16 kernels: torch's operators (%s=0)", SWITCH_ENV)
        return None
    started = time.perf_counter()
    compiler = find_compiler()
    if compiler is None:
        log.info("bfloat16 kernels: torch's operators (no C compiler found: $CC, cc, gcc, clang)")
        return None
    try:
        built = _build(compiler)
    except (OSError, subprocess.SubprocessError) as exc:
        why = _first_line(exc)
        log.info("bfloat16 kernels: torch's operators (%s could not build them for this CPU: %s)", compiler[0], why)
        return None
    if (difference := _check_softmax(built) or _check_add_layer_norm(built) or _check_attention(built)) is not None:
        log.warning("bfloat16 kernels: torch's operators (%s's build differs from torch: %s)", compiler[0], difference)
        return None
    elapsed = time.perf_counter() - started
    flags = " ".join(FLAGS)
    products = built.attention_products
    log.info(
        "bfloat16 kernels (softmax, add + LayerNorm, attention by %s products): built by %s %s in %.1f s",
        *(products, compiler[0], flags, elapsed),
    )
    return built


def find_compiler() -> list[str] | None:
    """The C compiler command: $CC, else the one Python was built with, else cc, gcc, clang on PATH."""
    for candidate in (os.environ.get("CC"), sysconfig.get_config_var("CC"), "cc", "gcc", "clang"):
        command = shlex.split(candidate) if candidate else []
        if command and shutil.which(command[0]):
            return command
    return None


def _build(compiler: list[str], flags: tuple[str, ...] = FLAGS) -> Kernels:
    """The library built by `compiler` with `flags` (the tests build it for older targets too)."""
    with tempfile.TemporaryDirectory(prefix="encoderd-kernels-") as folder:
        path = Path(folder) / "host_kernels.so"
        command = [*compiler, *flags, "-o", str(path), str(SOURCE)]
        subprocess.run(command, check=True, capture_output=True, text=True, timeout=120)
        library = ctypes.CDLL(str(path))
    softmax_rows = library.softmax_rows_bf16
    softmax_rows.argtypes = [_pointer, _size, _size, _size, _pointer]
    add_layer_norm = library.add_layer_norm_bf16
    add_layer_norm.argtypes = [*[_pointer] * 5, _size, _size, ctypes.c_float, _pointer]
    attend = library.attend_full_bf16
    attend.argtypes = [*[_pointer] * 3, _size, _size, _pointer, _pointer, _size, _size, _size, ctypes.c_float, _pointer]
    softmax_rows.restype = add_layer_norm.restype = attend.restype = None
    scratch_bytes = library.attention_scratch_bytes
    scratch_bytes.argtypes, scratch_bytes.restype = [_size, _size], _size
    library.attention_products.restype = ctypes.c_char_p
    return Kernels(softmax_rows, add_layer_norm, attend, scratch_bytes, library.attention_products().decode())


def _check_softmax(built: Kernels) -> str | None:
    """None when the softmax agrees with the float32 softmax as closely as torch's own bfloat16 softmax
    does (twice its error), over lengths with and without a vector tail and with masked (-inf) scores;
    else what differs."""
    generator = torch.Generator().manual_seed(0)
    for length in (1, 7, 16, 33, 200):
        scores = (torch.randn(3, length, length, generator=generator) * 6).bfloat16()
        scores[0, :, length // 2 + 1 :] = -torch.inf
        reference = torch.softmax(scores.float(), dim=-1)
        mine, scratch = scores.clone(), torch.empty(length + LANES)  # held: the kernel writes into scratch
        built.softmax_rows(mine.data_ptr(), 3 * length, length, length, scratch.data_ptr())
        error = (mine.float() - reference).abs().max().item()
        allowed = 2 * (torch.softmax(scores, dim=-1).float() - reference).abs().max().item() + 1e-6
        if not error <= allowed:  # NaN fails too
            return f"softmax of {length}-token scores off by {error:.3g} (torch's bfloat16: {allowed / 2:.3g})"
    return None


def _check_add_layer_norm(built: Kernels) -> str | None:
    """The same for LayerNorm(a + b), at widths with and without a vector tail."""
    generator = torch.Generator().manual_seed(1)
    for width in (5, 64, 100):
        sizes = ((9, width), (9, width), width, width)
        a, b, weight, bias = (torch.randn(size, generator=generator).bfloat16() for size in sizes)
        reference = torch.nn.functional.layer_norm((a + b).float(), (width,), weight.float(), bias.float(), 1e-12)
        mine, scratch = torch.empty_like(a), torch.empty(width + LANES)
        pointers = (t.data_ptr() for t in (a, b, weight, bias, mine))
        built.add_layer_norm(*pointers, 9, width, 1e-12, scratch.data_ptr())
        error = (mine.float() - reference).abs().max().item()
        torch_norm = torch.nn.functional.layer_norm(a + b, (width,), weight, bias, 1e-12)
        torch_error = (torch_norm.float() - reference).abs().max().item()
        if not error <= 2 * torch_error + 1e-6:
            return f"add + LayerNorm of width {width} off by {error:.3g} (torch's bfloat16: {torch_error:.3g})"
    return None


def _check_attention(built: Kernels) -> str | None:
    """The same for attend_full against float32 SDPA on each sequence: q, k, v strided views of one fused
    projection, sequences of 1 token to past two tiles of keys, head sizes 32 and 64; within twice the
    error of torch's own bfloat16 SDPA."""
    generator = torch.Generator().manual_seed(2)
    lengths = [1, 5, 16, 33, 70]
    cu_seqlens = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32)
    for dim in (32, 64):
        fused = torch.randn(sum(lengths), 3, 2, dim, generator=generator).bfloat16()
        q, k, v = fused.unbind(1)
        out = torch.empty(q.shape, dtype=torch.bfloat16)
        scratch = torch.empty(built.attention_scratch_bytes(max(lengths), dim), dtype=torch.uint8)
        pointers = (t.data_ptr() for t in (q, k, v))
        arguments = (*q.stride()[:2], out.data_ptr(), cu_seqlens.data_ptr(), len(lengths), 2, dim, dim**-0.5)
        built.attend_full(*pointers, *arguments, scratch.data_ptr())
        mine, reference, torch_own = out.float(), torch.empty(q.shape), torch.empty(q.shape)
        for a, b in itertools.pairwise(cu_seqlens.tolist()):
            queries, keys, values = (t[a:b].transpose(0, 1) for t in (q, k, v))
            exact = F.scaled_dot_product_attention(queries.float(), keys.float(), values.float())
            reference[a:b] = exact.transpose(0, 1)
            torch_own[a:b] = F.scaled_dot_product_attention(queries, keys, values).float().transpose(0, 1)
        error = (mine - reference).abs().max().item()
        allowed = 2 * (torch_own - reference).abs().max().item() + 1e-6
        if not error <= allowed:
            return f"attention with {dim}-wide heads off by {error:.3g} (torch's bfloat16 SDPA: {allowed / 2:.3g})"
    return None


def _first_line(exc: BaseException) -> str:
    text = getattr(exc, "stderr", None) or str(exc)
    return text.strip().splitlines()[0] if text.strip() else type(exc).__name__
