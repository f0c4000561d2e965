"""Kernels for the packed forward on CPU, built for this host at model load (host_kernels.c).

* softmax_: attention's softmax (packed_pieces._attend_by_products). torch's bfloat16 softmax was
  14.6 % of MiniLM's packed forward on one thread (Zen 5), twice attention's whole FLOP share: each
  element converted, exponentiated by a 1-ulp exp, converted back. host_kernels.c exponentiates in
  float32 by a polynomial accurate to 2e-7 (bfloat16 keeps 4e-3): 1.8x torch.softmax over the bench
  corpus's lengths.
* add_layer_norm: LayerNorm(a + b), a BERT layer's residual add and norm in one pass over the tokens
  instead of two (1.4-1.6x torch's add then layer_norm at hidden sizes 384 and 768).
* embed: BERT's embeddings (word, position and type rows added, then the norm) in one call instead of
  seven operators; the norm is add_layer_norm's.
* mean_tokens: mean pooling over a packed batch's sequences from the bfloat16 states, summed in float32
  row after row as segment_reduce sums them, but along the row's vectors: segment_reduce walks the
  batch once per column (and the states were first copied to float32), 4.4 ms for an 8,300-token
  MiniLM batch, ~0.9 % of its forward.
* attend_full: a layer's attention over the whole packed batch in one call where every key is visible
  to every query of its sequence (BERT's full window): scores and softmax in float32, avx512_bf16
  products where the CPU has them (2.1-8.7x the per-sequence operators over 256 down to 16 tokens,
  MiniLM's heads; bench/attention.py); as close to float32 SDPA as torch's bfloat16 SDPA is. Where
  the CPU has AMX (amx_bf16) and the head size is a multiple of 32, the two products run as AMX tiles:
  the vector products fell behind torch's per-sequence operators (oneDNN's AMX GEMMs) from 128 tokens
  on there; by tiles the kernel took 1.1-2.5x less time than by vectors over 16-512 tokens and 1.6-5.8x
  less than the operators (MiniLM and bge-base heads, Xeon with AMX, one thread, bench.attention).
* quantize_rows, rescale_rows: an int8 linear's (int8_linear.py) passes around torch._int_mm, in
  bfloat16 or float32. Its input times the SmoothQuant scale, each token's max |x|, and the int8 values,
  in one pass over the row instead of five torch operators; its output, int32 x token scale x channel
  scale + bias (+ the exact GELU where the next operator is the activation), in one instead of three
  or four. In torch these passes (aten::mul, copy_, gelu, ...) took over twice the time of the int8
  GEMMs themselves (MiniLM, one thread, Zen 5: bench.breakdown, 43 % of the forward against 19 %).

* pack_int8, int8_linear: where the build targets avx512_vnni, an int8 linear's GEMM (u8 x s8 vpdpbusd,
  8 rows x 48 columns of int32 sums in registers over the whole K) with rescale_rows' epilogue applied to
  those registers (GELU 8 rows at a time): the int32 products are never stored; they equal torch._int_mm's.
  MiniLM shapes, 512 rows, one thread (Zen 5): 900-990 GOPS without GELU (_int_mm + rescale 860-935),
  660 with it (475). Where the build also targets amx_int8 and Linux grants the process AMX's tile state,
  32 x 32 blocks of the same products by AMX tiles (tdpbusd) with the same epilogue, the VNNI tiles for
  what is left over (host_kernels.c says which: Kernels.int8_products): see int8_linear.py for the rates.

* pack_bf16, bf16_linear: where the build targets avx512_bf16, a bfloat16 linear of up to few_row_limit()
  rows (a short query's tokens; packed_linear.PackedLinear picks it), by vdpbf16ps on weights packed once
  at load into the pairs it reads, bias and GELU or ReLU applied to the float32 sums in registers, rounded
  to bfloat16 as oneDNN rounds: equal to oneDNN's _linear_pointwise but for under 0.05 % of values (one
  bfloat16 step). oneDNN costs ~19 us a call at these sizes whatever the rows; MiniLM's four linears of a
  layer took 1.15-1.7x less CPU at 1-32 rows, even at 40-64 (bench.small_linear, Zen 5, one thread,
  shared host), and a 10-30-token query's forward 1.15-1.24x less; it serves up to 64 rows, where the
  packed forward rounds no row count for it (packed_encoder.rows_multiple). Its tiles of 5 to 8 rows
  prefetch the next weights into L2 as they compute: 0.80-0.85x the time without at those rows (Zen 4). Where the CPU
  has AMX, oneDNN's GEMMs run on its tiles and overtook the vector products from 8 rows on (0.21x at 32);
  the kernel's products run on the tiles there too, up to 64 rows: 1.27-1.47x less CPU than oneDNN at 1-32
  rows, 1.04-1.19x at 40-64 (Xeon with AMX, same bench), and no GEMM compiled per row count (host_kernels.c,
  BF16_TILES_ROWS).

* bert_layer: a whole post-norm BERT layer (BERT, RoBERTa and its kin, DistilBERT) of a few rows in one
  call, where the few-row GEMM (or, in int8, quantize_rows and the VNNI GEMM) serves each of its linears:
  the kernels above (the fused QKV projection, attention, the output projection, add + LayerNorm, the FFN
  with its activation, add + LayerNorm) one after another in C, so its output equals the layer computed
  call by call, bit for bit. Between those seven (int8: eleven) calls a lone query's forward spent ~35 %
  (int8: ~55 %) of its CPU in Python (argument checks, tensor allocations, module lookups): MiniLM's
  forward took 1.32-1.59x less CPU at 3-12 tokens, 1.10-1.27x at 16-64; int8 1.78-2.56x and 1.20-1.69x
  (Zen 4, one thread).

All equal torch's operators but for an occasional last-bit rounding (tests/unit/test_host_kernels.py);
GELU's erfc is a Chebyshev fit within 1.2e-7 of it, relative.

The library is compiled when a bfloat16 packed model or an int8 model loads, by the host's C compiler
(`$CC`, the one Python was built with, else cc, gcc or clang), for the instruction sets of the CPU it runs on
(-march=native), then each kernel is checked against torch's operator on random input. No compiler, a
compiler that cannot target this CPU, or a check that fails: torch's operators serve, and the log says
why. The built library is kept in the cache (`--cache-dir`, by default ~/.cache/encoderd, its kernels/
entries: workers/model_cache.py) under a key of the source, the flags and the compiler's predefined macros
for them (its version and every instruction set -march=native turns on here): a worker that starts later (a
restart, another model, the next server) loads it instead of compiling again, which took 9-35 s of a worker's
start on a 2-core Xeon; another CPU's instruction sets, another compiler or a changed source build their own,
so nothing built for one CPU runs on another. The checks run at every load. Where the cache cannot be
written, the library is built in a temporary folder for the process alone.

ENCODERD_BUILD_KERNELS=0 skips the build (torch's operators serve): to compare the two, or to rule the
kernels out when diagnosing.

One thread: the kernels run only where torch would run on one thread (a single-thread worker, the
default on hosts of up to 4 cores, or a batch small enough to run on one); elsewhere torch's.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import itertools
import logging
import os
import shlex
import shutil
import subprocess
import sysconfig
import tempfile
import time
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.nn.functional as F

from ..contract.config import default_cache_dir
from ..model_cache import cached_build
from . import huge_pages


class PackedSequences(Protocol):
    """What attend_full reads of a packed batch (packed_pieces.PackedBatch, which imports this module)."""

    @property
    def cu_seqlens(self) -> torch.Tensor: ...  # int32, sequences + 1

    @property
    def longest(self) -> int: ...

    @property
    def bounds(self) -> list[int]: ...  # cu_seqlens as Python ints


log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("host_kernels.c")
SWITCH_ENV = "ENCODERD_BUILD_KERNELS"
FLAGS = ("-O3", "-march=native", "-shared", "-fPIC")
LIBRARY = "host_kernels.so"
CACHE_DIR = ""  # where built libraries are kept (a worker sets its --cache-dir); "" = default_cache_dir()
LANES = 16  # host_kernels.c's vector width: its scratch rows are this much longer than a row
MAX_HEAD_SIZE = 256  # attention's head size: a tile's spare output rows live on the C stack (8 x 256 x 2 bytes)
_pointer, _size = ctypes.c_void_p, ctypes.c_int64


@dataclass(frozen=True)
class Kernels:
    """host_kernels.c's functions (ctypes: each call releases the GIL)."""

    softmax_rows: Any
    add_layer_norm: Any
    norm_work_floats: Any  # (cols) -> the floats of add_layer_norm's work
    mean_rows: Any
    attend_full: Any
    attention_scratch_bytes: Any
    attention_products: str  # "avx512_bf16" (vdpbf16ps) or "float32" (multiply-adds): what this build targets
    attention_tiles: str  # "amx_bf16" where head sizes of a multiple of 32 run by AMX tiles instead, else ""
    quantize_rows: Any
    rescale_rows: Any
    pack_int8_weights: Any
    int8_linear_rows: Any
    int8_gemm: bool  # int8_linear_rows computes (built for avx512_vnni); else int8 linears keep torch._int_mm
    int8_products: str  # by what int8_linear_rows multiplies: "amx_int8" (AMX tiles), "avx512_vnni", or ""
    pack_bf16_weights: Any
    bf16_linear_rows: Any
    bf16_gemm_rows: int  # bf16_linear_rows serves up to this many rows (0: no avx512_bf16: oneDNN serves all)
    bert_layer: Any  # bert_layer_bf16; None in an older commit's source (bench --compare-ref builds one)
    embed: Any  # embed_bf16; None in an older commit's source, as bert_layer

    @property
    def bf16_gemm(self) -> bool:
        return self.bf16_gemm_rows > 0

    @property
    def bf16_gemm_tiles(self) -> bool:
        """bf16_linear_rows multiplies by AMX tiles (the same build and Linux permission as attention's)."""
        return self.bf16_gemm and bool(self.attention_tiles)


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
    if built is None or (parameters := _kernel_norm(norm, a.shape[-1])) is None or not _one_pass(a, b):
        return norm(a + b)
    weight, bias, eps = parameters
    out = torch.empty_like(a)
    cols = a.shape[-1]
    scratch = _norm_scratch(built, cols)
    rows = a.numel() // cols
    pointers = (a.data_ptr(), b.data_ptr(), weight.data_ptr(), bias.data_ptr(), out.data_ptr())
    _run("encoderd::add_layer_norm", built.add_layer_norm, *pointers, rows, cols, eps, scratch.data_ptr())
    return out


@dataclass(frozen=True)
class EmbeddingWeights:
    """BERT's embedding tables (word, position, type; bfloat16, one width) and their norm, for embed()."""

    tables: tuple[torch.Tensor, torch.Tensor, torch.Tensor]
    weight: torch.Tensor
    bias: torch.Tensor
    eps: float


def embedding_weights(tables: tuple[torch.Tensor, ...], norm: torch.nn.Module) -> EmbeddingWeights | None:
    """The (word, position, type) tables and norm as embed() reads them, read once at load (every module
    attribute read goes through nn.Module.__getattr__); None where the kernel cannot serve them: not built,
    tables not dense bfloat16 of one width, a norm add_layer_norm does not serve."""
    built = kernels()
    if built is None or built.embed is None or len(tables) != 3:
        return None
    width = tables[0].shape[-1]
    dense = (t.dtype == torch.bfloat16 and t.dim() == 2 and t.shape[1] == width and t.is_contiguous() for t in tables)
    if not all(dense):
        return None
    if (parameters := _kernel_norm(norm, width)) is None:
        return None
    return EmbeddingWeights(tables, *parameters)


def embed(
    weights: EmbeddingWeights, ids: torch.Tensor, positions: torch.Tensor, types: torch.Tensor | None
) -> torch.Tensor | None:
    """BERT's embeddings in one call: norm(word[ids] + position[positions] + type[types]), types None
    meaning type 0, with torch's roundings and add_layer_norm's norm. None where the kernel does not serve
    (not one thread, indices not dense int64 of one length). An index out of its table raises IndexError,
    as torch's lookup does. MiniLM, a 10-token query, one thread (Zen 4): the seven operators took 33-49 us
    in a loop and ~200 us 10 ms after the previous query; BertPieces.embed through this call 11 us in a
    loop."""
    word, position, type_table = weights.tables
    built = _serving(word)
    indices = (ids, positions) if types is None else (ids, positions, types)
    if built is None or any(i.dtype != torch.int64 or i.dim() != 1 or not i.is_contiguous() for i in indices):
        return None
    rows, cols = ids.shape[0], word.shape[1]
    if positions.shape[0] != rows or (types is not None and types.shape[0] != rows):
        return None
    out = torch.empty(rows, cols, dtype=torch.bfloat16)
    scratch = _norm_scratch(built, cols)
    pointers = (ids.data_ptr(), positions.data_ptr(), 0 if types is None else types.data_ptr())
    lookups = (word.data_ptr(), word.shape[0], position.data_ptr(), position.shape[0], type_table.data_ptr())
    norm = (type_table.shape[0], weights.weight.data_ptr(), weights.bias.data_ptr(), out.data_ptr())
    if _run("encoderd::embed", built.embed, *pointers, *lookups, *norm, rows, cols, weights.eps, scratch.data_ptr()):
        raise IndexError("index out of range in self")
    return out


def mean_tokens(hidden: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor | None:
    """Each sequence's mean row of the bfloat16 `hidden` (tokens, width), in float32: equal to
    torch.segment_reduce(hidden.float(), "mean", lengths=cu_seqlens.diff(), axis=0), bit for bit.
    None where the kernel does not serve (not built, not one thread, not bfloat16 dense rows)."""
    built = _serving(hidden)
    if built is None or hidden.dim() != 2 or not hidden.is_contiguous() or cu_seqlens.dtype != torch.int32:
        return None
    sequences, cols = cu_seqlens.shape[0] - 1, hidden.shape[1]
    out = torch.empty(sequences, cols, dtype=torch.float32)
    bounds = cu_seqlens.contiguous()  # held: the kernel reads it
    pointers = (hidden.data_ptr(), bounds.data_ptr())
    _run("encoderd::mean_tokens", built.mean_rows, *pointers, sequences, cols, out.data_ptr())
    return out


def _older_norm_work_floats(cols: int) -> int:
    """norm_work_floats of a source from before it (one row's sums, the weight and the bias)."""
    return 3 * (-(-cols // LANES) * LANES)


def _norm_scratch(built: Kernels, cols: int) -> torch.Tensor:
    """add_layer_norm_bf16's work for rows of `cols` values (its size is the C side's: norm_work_floats)."""
    return torch.empty(built.norm_work_floats(cols), dtype=torch.float32)


def attend_full(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: PackedSequences, scale: float | None
) -> torch.Tensor | None:
    """Attention within each sequence of a packed batch, every key visible to every query of its sequence
    (BERT's window), in one call for the whole batch: q, k, v (tokens, heads, dim) read in place (strided
    views of the fused QKV projection serve as they are), scores and softmax in float32, the context
    (tokens, heads, dim) a new dense tensor. None where the kernel does not serve (then packed_pieces'
    per-sequence operators): not built, not one thread, not bfloat16, grouped-query heads, q, k and v
    laid out differently, a head size that is not a multiple of 16 (or past MAX_HEAD_SIZE), or a scale
    that is not positive."""
    built = _serving(q)
    if built is None or not _kernel_attention(q, k, v, batch):
        return None
    tokens, heads, dim = q.shape
    scaling = dim**-0.5 if scale is None else scale
    if not scaling > 0:  # the kernel takes each row's largest unscaled score for the largest scaled one
        return None
    out = torch.empty(tokens, heads, dim, dtype=q.dtype)
    scratch = torch.empty(built.attention_scratch_bytes(batch.longest, dim), dtype=torch.uint8)
    cu_seqlens = batch.cu_seqlens
    sequences = cu_seqlens.shape[0] - 1
    pointers = (t.data_ptr() for t in (q, k, v))
    strides = q.stride()[:2]
    arguments = (*strides, out.data_ptr(), cu_seqlens.data_ptr(), sequences, heads, dim, scaling, scratch.data_ptr())
    _run("encoderd::attention", built.attend_full, *pointers, *arguments)
    return out


def _kernel_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: PackedSequences) -> bool:
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


def _one_pass(a: torch.Tensor, b: torch.Tensor) -> bool:
    """The kernel's inputs (the norm's case: _kernel_norm): bfloat16 a and b (a's dtype: _serving), alike and dense."""
    return b.dtype == torch.bfloat16 and a.shape == b.shape and a.is_contiguous() and b.is_contiguous()


INT8_ACTIVATIONS = {"none": 0, "gelu": 1, "relu": 2}  # rescale_rows' `activation` codes
INT8_LEVELS = 127.0  # int8 activations are symmetric: -127..127


def quantize_rows(
    rows: torch.Tensor, input_scale: torch.Tensor | None, to_unsigned: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 values, token scales (rows, 1) float32) of a (rows, features) bfloat16 or float32 matrix
    times `input_scale` (features,) float32 if given: each row by its own symmetric scale, max |x| / 127.
    Through the kernel where it serves, else torch's operators, in float32 either way. to_unsigned: the
    values + 128 as uint8 (int8_linear's input; the kernel only, which must then serve)."""
    built = _serving_int8(rows)
    if built is None:
        if to_unsigned:
            raise RuntimeError("unsigned int8 rows come from the host kernel only")
        return _quantize_by_torch(rows, input_scale)
    count, features = rows.shape
    quantized = torch.empty(count, features, dtype=torch.uint8 if to_unsigned else torch.int8)
    token_scale = torch.empty(count, 1, dtype=torch.float32)
    scale = input_scale.data_ptr() if input_scale is not None else None
    arguments = (rows.data_ptr(), rows.dtype == torch.bfloat16, scale, count, features)
    pointers = (quantized.data_ptr(), token_scale.data_ptr(), to_unsigned)
    _run("encoderd::int8_quantize", built.quantize_rows, *arguments, *pointers)
    return quantized, token_scale


def rescale_rows(
    products: torch.Tensor,
    token_scale: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: torch.Tensor | None,
    activation: str,
    out: torch.Tensor,
) -> torch.Tensor:
    """products (rows, out) int32 x token_scale (rows, 1) x weight_scale (out,) + bias (out,), all
    float32, then `activation` ("none", "gelu": exact erf GELU, "relu"), written into `out` (rows, out),
    dense, of the layer's dtype; returns it. Through the kernel where it serves (bfloat16 or float32),
    else torch's operators."""
    built = _serving_int8(products)
    dtype = out.dtype
    if built is None or activation not in INT8_ACTIVATIONS or dtype not in (torch.bfloat16, torch.float32):
        return out.copy_(_rescale_by_torch(products, token_scale, weight_scale, bias, activation))
    rows, features = products.shape
    pointers = (t.data_ptr() if t is not None else None for t in (products, token_scale, weight_scale, bias))
    code, is_bf16 = INT8_ACTIVATIONS[activation], dtype == torch.bfloat16
    _run("encoderd::int8_rescale", built.rescale_rows, *pointers, rows, features, code, out.data_ptr(), is_bf16)
    return out


@dataclass(frozen=True)
class PackedInt8Weights:
    """An int8 weight (out x in) laid out for int8_linear_rows, with what its epilogue reads, each padded
    to whole 16-column vectors: the columns' compensation (128 x their sums), scales and bias."""

    packed: torch.Tensor  # int8, (out / 16 panels) x in / 4 x 64
    compensation: torch.Tensor  # int32
    weight_scale: torch.Tensor  # float32
    bias: torch.Tensor | None  # float32
    in_features: int
    out_features: int


def pack_int8(weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None) -> PackedInt8Weights | None:
    """weight (out, in) int8 with its per-channel scales and bias packed for int8_linear; None where the
    kernel does not compute here (no kernels, a build without avx512_vnni, in_features not a multiple of 4):
    the layer keeps torch._int_mm."""
    built = kernels()
    out_features, in_features = weight.shape
    if built is None or not built.int8_gemm or in_features % 4:
        return None
    width = -(-out_features // LANES) * LANES
    packed = huge_pages.weights.empty(width * in_features, torch.int8)
    compensation = huge_pages.weights.empty(width, torch.int32)
    weight = weight.contiguous()
    built.pack_int8_weights(weight.data_ptr(), out_features, in_features, packed.data_ptr(), compensation.data_ptr())

    def padded(values: torch.Tensor) -> torch.Tensor:
        return torch.cat([values.float(), values.new_zeros(width - out_features, dtype=torch.float32)])

    bias = None if bias is None else padded(bias)
    return PackedInt8Weights(packed, compensation, padded(weight_scale), bias, in_features, out_features)


def int8_linear_serves(rows: torch.Tensor, activation: str) -> bool:
    """Whether int8_linear computes a layer on `rows` (its input, dense): one CPU thread, the kernels
    built with the VNNI GEMM, bfloat16 or float32, an activation it knows."""
    built = _serving_int8(rows)
    return built is not None and built.int8_gemm and rows.dtype != torch.int32 and activation in INT8_ACTIVATIONS


def int8_gemm_serves() -> bool:
    """Whether int8_linear computes the int8 layers of a CPU forward now, at any row count (one torch
    thread, the kernels built with the VNNI GEMM): packed_encoder.rows_multiple asks."""
    built = kernels()
    return built is not None and built.int8_gemm and torch.get_num_threads() == 1


def int8_linear(
    quantized: torch.Tensor, token_scale: torch.Tensor, weights: PackedInt8Weights, activation: str, out: torch.Tensor
) -> torch.Tensor:
    """out (rows, out_features) bfloat16 or float32 = activation(rows x weights, rescaled by token_scale (rows, 1)
    and the weights' channel scales, + bias): the int8 GEMM and rescale_rows' epilogue in one kernel call.
    quantized: quantize_rows(..., to_unsigned=True). Only where pack_int8 gave the weights and the kernels serve."""
    built = _serving_int8(out)
    if built is None or activation not in INT8_ACTIVATIONS or quantized.dtype != torch.uint8:
        raise RuntimeError("int8_linear runs on the host kernel only (int8_linear.py checks where it serves)")
    rows = quantized.shape[0]
    bias = weights.bias.data_ptr() if weights.bias is not None else None
    arguments = (quantized.data_ptr(), rows, weights.in_features, weights.packed.data_ptr())
    epilogue = (weights.compensation.data_ptr(), weights.out_features, token_scale.data_ptr())
    scales = (weights.weight_scale.data_ptr(), bias, INT8_ACTIVATIONS[activation])
    _run(
        "encoderd::int8_linear",
        built.int8_linear_rows,
        *arguments,
        *epilogue,
        *scales,
        out.data_ptr(),
        out.dtype == torch.bfloat16,
    )
    return out


# bf16_linear serves inputs of up to this many rows (tokens), oneDNN larger ones; None: the build's own
# bf16_gemm_rows (host_kernels.c: where the few-row kernel measured faster on this kind of CPU). The bench
# (bench.small_linear) sets a number to time the kernel past it.
SMALL_LINEAR_ROWS: int | None = None
# host_kernels.c's: where its AMX tiles serve (Kernels.bf16_gemm_tiles), past VECTOR_GEMM_ROWS rows they alone
# do (the vector products fell far behind oneDNN's tile GEMMs there), and they take k in whole tile rows of
# TILE_DEPTH; a linear of another k keeps oneDNN past it. Elsewhere the vectors serve every row count.
VECTOR_GEMM_ROWS, TILE_DEPTH = 32, 32


def few_row_limit() -> int:
    """The most rows bf16_linear serves here (0 where no kernel does)."""
    built = kernels()
    if built is None or not built.bf16_gemm:
        return 0
    return built.bf16_gemm_rows if SMALL_LINEAR_ROWS is None else SMALL_LINEAR_ROWS


# The few-row copies are a second copy of a model's linear weights beside oneDNN's: this much of them per
# worker process (MiniLM's are 21 MiB, a bge-base-sized model's 170 MiB). Past it, the layers packed later
# keep oneDNN alone, so a large model's worker does not hold all its weights twice for its short queries.
FEW_ROW_BUDGET_BYTES = 256 << 20


@dataclass
class _CopyBudget:
    held: int = 0  # bytes of this process's live few-row copies (a freed copy gives its bytes back)
    spent: bool = False  # a layer was refused a copy (said once in the log)

    def take(self, size: int) -> bool:
        if self.held + size <= FEW_ROW_BUDGET_BYTES:
            self.held += size
            return True
        if not self.spent:
            log.info("few-row bf16 GEMM: its weight copies reached %d MiB; later linears keep oneDNN", self.held >> 20)
            self.spent = True
        return False

    def give_back(self, size: int) -> None:
        self.held -= size


_few_row_budget = _CopyBudget()


@dataclass(frozen=True)
class PackedBf16Weights:
    """A bfloat16 weight (out x in) laid out for bf16_linear_rows, and its bias as float32, padded to whole
    16-column vectors."""

    packed: torch.Tensor  # bfloat16, (out / 16 panels) x in / 2 x 16 x 2
    bias: torch.Tensor | None  # float32
    in_features: int
    out_features: int


def pack_bf16(weight: torch.Tensor, bias: torch.Tensor | None) -> PackedBf16Weights | None:
    """weight (out, in) bfloat16 and its bias packed for bf16_linear; None where the kernel does not
    compute here (no kernels, a build without avx512_bf16, in_features odd): the layer keeps oneDNN."""
    out_features, in_features = weight.shape
    if weight.dtype != torch.bfloat16 or in_features % 2 or (built := kernels()) is None or not built.bf16_gemm:
        return None
    width = -(-out_features // LANES) * LANES
    if not _few_row_budget.take(size := width * in_features * 2):
        return None
    packed = huge_pages.weights.empty(width * in_features, torch.bfloat16)
    weakref.finalize(packed, _few_row_budget.give_back, size)
    weight = weight.detach().contiguous()
    built.pack_bf16_weights(weight.data_ptr(), out_features, in_features, packed.data_ptr())
    if bias is not None:
        bias = torch.cat([bias.detach().float(), torch.zeros(width - out_features)])
    return PackedBf16Weights(packed, bias, in_features, out_features)


def bf16_linear_serves(rows: int, weights: PackedBf16Weights) -> bool:
    """Whether bf16_linear computes a layer of these weights on a dense bfloat16 CPU input of `rows` rows
    now (one torch thread, at most few_row_limit() rows): packed_encoder.rows_multiple asks it too."""
    built = kernels()
    if built is None or rows == 0 or rows > few_row_limit() or torch.get_num_threads() != 1:
        return False
    tiles_alone = rows > VECTOR_GEMM_ROWS and built.bf16_gemm_tiles
    return not tiles_alone or weights.in_features % TILE_DEPTH == 0


def bf16_linear(x: torch.Tensor, weights: PackedBf16Weights, activation: str) -> torch.Tensor | None:
    """activation(x @ weight.T + bias) for x (..., in) bfloat16 of at most few_row_limit() rows, in one
    kernel call (activation "none", "gelu": exact erf GELU, "relu"); None where the kernel does not serve
    (more rows, not one thread, not bfloat16 or not dense, an unknown activation): then oneDNN's."""
    rows = x.numel() // weights.in_features
    if activation not in INT8_ACTIVATIONS or x.dtype != torch.bfloat16 or x.device.type != "cpu":
        return None
    if not x.is_contiguous() or not bf16_linear_serves(rows, weights) or (built := kernels()) is None:
        return None
    out = torch.empty(*x.shape[:-1], weights.out_features, dtype=torch.bfloat16)
    bias = weights.bias.data_ptr() if weights.bias is not None else None
    arguments = (x.data_ptr(), rows, weights.in_features, weights.packed.data_ptr(), weights.out_features, bias)
    _run("encoderd::bf16_linear", built.bf16_linear_rows, *arguments, INT8_ACTIVATIONS[activation], out.data_ptr())
    return out


class LayerGemmStruct(ctypes.Structure):
    """host_kernels.c's struct layer_gemm: one GEMM of a whole layer, bfloat16 or int8."""

    _fields_ = [
        *((name, _pointer) for name in ("packed", "bias", "compensation", "weight_scale", "input_scale")),
        ("k", _size),
        ("n", _size),
        ("int8", ctypes.c_int),
    ]


class BertLayerStruct(ctypes.Structure):
    """host_kernels.c's struct bert_layer: one layer's GEMMs, norms and shape."""

    _fields_ = [
        *((name, LayerGemmStruct) for name in ("qkv", "attention_out", "up", "down")),
        *((name, _pointer) for name in ("norm1_weight", "norm1_bias", "norm2_weight", "norm2_bias")),
        ("heads", _size),
        ("norm1_eps", ctypes.c_float),
        ("norm2_eps", ctypes.c_float),
        ("scale", ctypes.c_float),
        ("activation", ctypes.c_int),
    ]


# bert_layer computes int8 layers of up to this many rows (a short query's): the Python between a layer's
# eleven kernel calls weighs on a short input alone; a bulk batch keeps int8_linear.py's 512-row passes.
INT8_WHOLE_LAYER_ROWS = 64


@dataclass(frozen=True)
class LayerGemm:
    """One GEMM of a layer as bert_layer computes it: a few-row bfloat16 GEMM's weights (PackedLinear's
    few_rows), or an int8 linear's (Int8Linear's packed weights and SmoothQuant input scale)."""

    bf16: PackedBf16Weights | None = None
    int8: PackedInt8Weights | None = None
    input_scale: torch.Tensor | None = None  # int8: float32, in_features

    @property
    def shape(self) -> tuple[int, int]:
        weights = self.bf16 or self.int8
        assert weights is not None
        return weights.in_features, weights.out_features

    def serves(self, rows: int) -> bool:
        """Whether its kernel computes `rows` rows now, as the Python layer's would (bf16_linear_serves;
        for int8, one thread and the VNNI GEMM built: int8_linear.Int8Linear)."""
        if self.bf16 is not None:
            return bf16_linear_serves(rows, self.bf16)
        return 0 < rows <= INT8_WHOLE_LAYER_ROWS and int8_gemm_serves()

    def struct(self) -> LayerGemmStruct:
        def pointer(t: torch.Tensor | None) -> int | None:
            return t.data_ptr() if t is not None else None

        k, n = self.shape
        if self.bf16 is not None:
            return LayerGemmStruct(self.bf16.packed.data_ptr(), pointer(self.bf16.bias), None, None, None, k, n, 0)
        w = self.int8
        assert w is not None
        tensors = (w.packed, w.bias, w.compensation, w.weight_scale, self.input_scale)
        return LayerGemmStruct(*(pointer(t) for t in tensors), k, n, 1)


@dataclass(frozen=True)
class BertLayerWeights:
    """What bert_layer computes a post-norm BERT layer from: its struct, and what it points into (held
    here, so they live as long as it does)."""

    layer: BertLayerStruct
    gemms: tuple[LayerGemm, ...]  # the four GEMMs' (each decides where it serves)
    norms: tuple[torch.Tensor, ...]
    hidden: int


def bert_layer_weights(
    qkv: LayerGemm | None,
    attention_out: LayerGemm | None,
    norm1: torch.nn.Module,
    up: LayerGemm | None,
    down: LayerGemm | None,
    norm2: torch.nn.Module,
    heads: int,
    scale: float | None,
    activation: str,
) -> BertLayerWeights | None:
    """A BERT layer's pieces for bert_layer: the fused QKV projection, the attention's output projection,
    its LayerNorm, the FFN's up projection (then `activation`) and down projection, its LayerNorm (each GEMM
    as packed_pieces.layer_gemm gives it). `scale` multiplies q k^T (None: head size ** -0.5). None where one
    call cannot compute the layer as its kernels would one by one: the build has no bert_layer, a GEMM no
    host kernel computes, a norm the add_layer_norm kernel does not serve, a head size the attention kernel
    does not (a multiple of 16 up to MAX_HEAD_SIZE), a scale that is not positive, another activation."""
    built = kernels()
    if built is None or built.bert_layer is None or activation not in ("gelu", "relu"):
        return None
    if qkv is None or attention_out is None or up is None or down is None:
        return None
    gemms = (qkv, attention_out, up, down)
    hidden, inner = attention_out.shape[0], up.shape[1]
    shapes = (qkv.shape, attention_out.shape, up.shape, down.shape)
    if shapes != ((hidden, 3 * hidden), (hidden, hidden), (hidden, inner), (inner, hidden)):
        return None
    dim = hidden // heads
    if dim * heads != hidden or dim % LANES or dim > MAX_HEAD_SIZE:
        return None
    if not (scaling := dim**-0.5 if scale is None else scale) > 0:
        return None
    first, second = _kernel_norm(norm1, hidden), _kernel_norm(norm2, hidden)
    if first is None or second is None:
        return None
    norms = (*first[:2], *second[:2])
    layer = BertLayerStruct(
        *(g.struct() for g in gemms),
        *(t.data_ptr() for t in norms),
        heads,
        first[2],
        second[2],
        scaling,
        INT8_ACTIVATIONS[activation],
    )
    return BertLayerWeights(layer, gemms, norms, hidden)


def _kernel_norm(norm: torch.nn.Module, width: int) -> tuple[torch.Tensor, torch.Tensor, float] | None:
    """add_layer_norm's kernel case (bert_layer's too): a LayerNorm over the last `width` values with bfloat16
    weight and bias; those and its eps (each read once: every read goes through nn.Module.__getattr__),
    else None."""
    if not isinstance(norm, torch.nn.LayerNorm) or tuple(norm.normalized_shape) != (width,):
        return None
    weight, bias = norm.weight, norm.bias
    if weight is None or bias is None or weight.dtype != torch.bfloat16 or bias.dtype != torch.bfloat16:
        return None
    return weight, bias, norm.eps


def bert_layer(x: torch.Tensor, weights: BertLayerWeights, batch: PackedSequences) -> torch.Tensor | None:
    """The BERT layer of `weights` over the packed batch x (tokens, hidden) bfloat16 in one call: its kernels
    one after another in C, equal bit for bit to the layer computed call by call (bf16_linear or
    quantize_rows + int8_linear, attend_full, add_layer_norm). None where a kernel would not serve the
    batch: not one thread, more rows than a GEMM takes (few_row_limit(); INT8_WHOLE_LAYER_ROWS; where AMX
    tiles alone serve them, a k not in whole tile rows), x not dense bfloat16, cu_seqlens not int32 or not
    covering the tokens."""
    rows = x.shape[0]
    if x.dtype != torch.bfloat16 or not x.is_cpu or x.dim() != 2 or x.shape[1] != weights.hidden:
        return None
    if not x.is_contiguous() or not all(gemm.serves(rows) for gemm in weights.gemms):
        return None
    cu_seqlens = batch.cu_seqlens
    if cu_seqlens.dtype != torch.int32 or not cu_seqlens.is_cpu or not cu_seqlens.is_contiguous():
        return None
    bounds = batch.bounds
    if bounds[0] != 0 or bounds[-1] != rows or (built := kernels()) is None:
        return None
    out = torch.empty_like(x)
    arguments = (x.data_ptr(), rows, cu_seqlens.data_ptr(), len(bounds) - 1, batch.longest)
    if _run("encoderd::bert_layer", built.bert_layer, *arguments, ctypes.byref(weights.layer), out.data_ptr()):
        raise MemoryError(f"out of memory for a BERT layer's buffers ({rows} tokens)")
    return out


def _quantize_by_torch(rows: torch.Tensor, input_scale: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    rows = rows.float()
    if input_scale is not None:
        rows = rows * input_scale
    # max |x| per row from two read-only passes (x.abs() would write a copy of x)
    peak = torch.maximum(rows.amax(1, keepdim=True), rows.amin(1, keepdim=True).neg_()).clamp_(min=1e-12)
    # 127 / peak as one division, as the kernel computes it (a number over a tensor is its reciprocal times 127:
    # two roundings, and now and then a value one level off the kernel's)
    quantized = torch.mul(rows, peak.new_tensor(INT8_LEVELS) / peak).round_().to(torch.int8)
    return quantized, peak.mul_(1 / INT8_LEVELS)


def _rescale_by_torch(
    products: torch.Tensor,
    token_scale: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: torch.Tensor | None,
    activation: str,
) -> torch.Tensor:
    out = products.float().mul_(token_scale)
    if bias is None:
        out.mul_(weight_scale)
    else:
        torch.addcmul(bias, out, weight_scale, out=out)
    if activation == "gelu":
        out = torch.nn.functional.gelu(out)
    elif activation == "relu":
        out.relu_()
    return out


def _serving_int8(x: torch.Tensor) -> Kernels | None:
    """The kernels for an int8 linear's passes: bfloat16 or float32 (int32 products) dense on one CPU thread."""
    if x.dtype not in (torch.bfloat16, torch.float32, torch.int32) or not x.is_contiguous():
        return None
    if x.device.type != "cpu" or torch.get_num_threads() != 1:
        return None
    return kernels()


def _serving(x: torch.Tensor) -> Kernels | None:
    if x.dtype != torch.bfloat16 or x.device.type != "cpu" or torch.get_num_threads() != 1:
        return None
    return kernels()


def _run(name: str, function, *args) -> Any:
    if torch._C._autograd._profiler_enabled():  # named for bench.breakdown (else counted as Python); 10 us a call
        with torch.profiler.record_function(name):
            return function(*args)
    return function(*args)


@functools.cache
def kernels() -> Kernels | None:
    """host_kernels.c built here for this CPU, or None (logged) where it cannot be."""
    if os.environ.get(SWITCH_ENV, "1") == "0":
        log.info("host kernels: torch's operators (%s=0)", SWITCH_ENV)
        return None
    started = time.perf_counter()
    compiler = find_compiler()
    if compiler is None:
        log.info("host kernels: torch's operators (no C compiler found: $CC, cc, gcc, clang)")
        return None
    try:
        built = _build(compiler)
    except (OSError, subprocess.SubprocessError) as exc:
        why = _first_line(exc)
        log.info("host kernels: torch's operators (%s could not build them for this CPU: %s)", compiler[0], why)
        return None
    checks = (
        _check_softmax,
        _check_add_layer_norm,
        _check_mean_rows,
        _check_attention,
        _check_quantize_rows,
        _check_rescale_rows,
        _check_int8_linear_rows,
        _check_bf16_linear_rows,
    )
    if (difference := next(filter(None, (check(built) for check in checks)), None)) is not None:
        log.warning("host kernels: torch's operators (%s's build differs from torch: %s)", compiler[0], difference)
        return None
    elapsed = time.perf_counter() - started
    flags = " ".join(FLAGS)
    products = built.attention_products
    if built.attention_tiles:
        products = f"{built.attention_tiles} tiles (head sizes a multiple of 32; else {products})"
    gemm = f"GEMM by {built.int8_products}" if built.int8_gemm else "torch's GEMM (no avx512_vnni)"
    few = f"GEMM of up to {built.bf16_gemm_rows} rows by {built.attention_tiles or 'avx512_bf16'}"
    few = few if built.bf16_gemm else "oneDNN's GEMM at every size (no avx512_bf16)"
    bf16 = f"bfloat16 softmax, add + LayerNorm, mean pooling, attention by {products} products, {few}"
    names = f"{bf16}; int8 quantize, rescale, {gemm}"
    log.info("host kernels (%s): %s %s, built or loaded and checked in %.1f s", names, compiler[0], flags, elapsed)
    return built


def find_compiler() -> list[str] | None:
    """The C compiler command: $CC, else the one Python was built with, else cc, gcc, clang on PATH."""
    for candidate in (os.environ.get("CC"), sysconfig.get_config_var("CC"), "cc", "gcc", "clang"):
        command = shlex.split(candidate) if candidate else []
        if command and shutil.which(command[0]):
            return command
    return None


def _build(compiler: list[str], flags: tuple[str, ...] = FLAGS, source: Path = SOURCE) -> Kernels:
    """The library built by `compiler` with `flags` (the tests build it for older targets too) from
    `source` (bench.attention builds an older commit's beside this one's)."""
    library = _load_library(compiler, flags, source)
    softmax_rows = library.softmax_rows_bf16
    softmax_rows.argtypes = [_pointer, _size, _size, _size, _pointer]
    add_layer_norm = library.add_layer_norm_bf16
    add_layer_norm.argtypes = [*[_pointer] * 5, _size, _size, ctypes.c_float, _pointer]
    norm_work_floats = getattr(library, "norm_work_floats", None)
    if norm_work_floats is not None:
        norm_work_floats.argtypes, norm_work_floats.restype = [_size], _size
    else:  # an older commit's source (bench --compare-ref): a row's sums, the weight and the bias
        norm_work_floats = _older_norm_work_floats
    mean_rows = library.mean_rows_bf16
    mean_rows.argtypes = [_pointer, _pointer, _size, _size, _pointer]
    attend = library.attend_full_bf16
    attend.argtypes = [*[_pointer] * 3, _size, _size, _pointer, _pointer, _size, _size, _size, ctypes.c_float, _pointer]
    scratch_bytes = library.attention_scratch_bytes
    scratch_bytes.argtypes, scratch_bytes.restype = [_size, _size], _size
    library.attention_products.restype = ctypes.c_char_p
    quantize = library.quantize_rows
    quantize.argtypes = [_pointer, ctypes.c_int, _pointer, _size, _size, _pointer, _pointer, ctypes.c_int]
    rescale = library.rescale_rows
    rescale.argtypes = [*[_pointer] * 4, _size, _size, ctypes.c_int, _pointer, ctypes.c_int]
    pack = library.pack_int8_weights
    pack.argtypes = [_pointer, _size, _size, _pointer, _pointer]
    gemm = library.int8_linear_rows
    gemm.argtypes = [
        _pointer,
        _size,
        _size,
        _pointer,
        _pointer,
        _size,
        *[_pointer] * 3,
        ctypes.c_int,
        _pointer,
        ctypes.c_int,
    ]
    pack_bf16_weights = library.pack_bf16_weights
    pack_bf16_weights.argtypes = [_pointer, _size, _size, _pointer]
    bf16_rows = library.bf16_linear_rows
    bf16_rows.argtypes = [_pointer, _size, _size, _pointer, _size, _pointer, ctypes.c_int, _pointer]
    bert_layer = getattr(library, "bert_layer_bf16", None)
    if bert_layer is not None:
        bert_layer.argtypes = [_pointer, _size, _pointer, _size, _size, ctypes.POINTER(BertLayerStruct), _pointer]
        bert_layer.restype = ctypes.c_int
    embed = getattr(library, "embed_bf16", None)
    if embed is not None:
        embed.argtypes = [*[_pointer] * 4, _size, _pointer, _size, _pointer, _size, *[_pointer] * 3, _size, _size]
        embed.argtypes += [ctypes.c_float, _pointer]
        embed.restype = ctypes.c_int
    functions = (softmax_rows, add_layer_norm, mean_rows, attend, quantize, rescale, pack, gemm)
    for function in (*functions, pack_bf16_weights, bf16_rows):
        function.restype = None
    products, tiles = library.attention_products().decode(), ""
    if hasattr(library, "attention_tiles"):  # not in an older commit's source (bench --compare-ref builds one)
        library.attention_tiles.restype = ctypes.c_char_p
        tiles = library.attention_tiles().decode()
    int8_gemm = bool(library.int8_gemm_available())
    int8_products = _int8_products(library, int8_gemm)
    if hasattr(library, "bf16_gemm_rows"):
        bf16_gemm_rows = library.bf16_gemm_rows()
    else:  # an older commit's source, as above: its kernel served up to 32 rows where it was built
        bf16_gemm_rows = 32 * library.bf16_gemm_available()
    return Kernels(
        softmax_rows, add_layer_norm, norm_work_floats, mean_rows, attend, scratch_bytes, products, tiles, quantize,
        rescale, pack, gemm, int8_gemm, int8_products, pack_bf16_weights, bf16_rows, bf16_gemm_rows, bert_layer, embed,
    )  # fmt: skip


def _load_library(compiler: list[str], flags: tuple[str, ...], source: Path) -> ctypes.CDLL:
    """The library from the cache, built into it first where no process has; built in a temporary folder
    (deleted once loaded: dlopen keeps it mapped) where the cache cannot be written."""
    try:
        return ctypes.CDLL(str(cached_library(compiler, flags, source, CACHE_DIR or default_cache_dir())))
    except OSError as exc:  # a read-only or full folder, a path through a file (a failed compile is not one)
        log.info("host kernels: not cached (%s), built for this process alone", exc)
    with tempfile.TemporaryDirectory(prefix="encoderd-kernels-") as temporary:
        path = Path(temporary) / LIBRARY
        _compile(compiler, flags, source, path)
        return ctypes.CDLL(str(path))


def cached_library(compiler: list[str], flags: tuple[str, ...], source: Path, cache_dir: str) -> Path:
    """The library `compiler` `flags` builds from `source`, from the cache's "kernels" entries (model_cache:
    built by one process at a time, published whole, the others wait and load it)."""
    key = build_key(compiler, flags, source)
    entry = cached_build(
        cache_dir, "kernels", source.name, key, lambda folder: _compile(compiler, flags, source, folder / LIBRARY)
    )
    return entry.path / LIBRARY


def build_key(compiler: list[str], flags: tuple[str, ...], source: Path) -> dict[str, Any]:
    """What the built library depends on: the source, the command, and the compiler's predefined macros for
    those flags (its version, and each instruction set -march=native selects on this CPU)."""
    probe = [*compiler, *flags, "-dM", "-E", "-x", "c", os.devnull]
    macros = subprocess.run(probe, check=True, capture_output=True, timeout=60).stdout
    digest = hashlib.sha256
    return {
        "source": digest(source.read_bytes()).hexdigest(),
        "command": [*compiler, *flags],
        "macros": digest(macros).hexdigest(),
    }


def _compile(compiler: list[str], flags: tuple[str, ...], source: Path, path: Path) -> None:
    command = [*compiler, *flags, "-o", str(path), str(source)]
    subprocess.run(command, check=True, capture_output=True, text=True, timeout=120)


def _int8_products(library: ctypes.CDLL, int8_gemm: bool) -> str:
    """By what the library's int8 GEMM multiplies: the C side says ("amx_int8" only where it was built for
    AMX and Linux granted this process the tile state, which this asks for). A source from before AMX
    (bench --compare-ref) has only the VNNI tiles."""
    products = getattr(library, "int8_gemm_products", None)
    if products is None:
        return "avx512_vnni" if int8_gemm else ""
    products.restype = ctypes.c_char_p
    return products().decode()


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


def _check_mean_rows(built: Kernels) -> str | None:
    """The mean of each sequence's rows equals segment_reduce's over the rows in float32, bit for bit, at
    widths with and without a vector tail and past one group of columns, for one-row sequences too."""
    generator = torch.Generator().manual_seed(2)
    cu_seqlens = torch.tensor([0, 1, 4, 40, 41], dtype=torch.int32)
    for width in (5, 64, 100):
        rows = (torch.randn(41, width, generator=generator) * 4).bfloat16()
        want = torch.segment_reduce(rows.float(), "mean", lengths=cu_seqlens.diff(), axis=0)
        mine = torch.empty(4, width)
        built.mean_rows(rows.data_ptr(), cu_seqlens.data_ptr(), 4, width, mine.data_ptr())
        if not torch.equal(mine, want):
            return f"mean of {width}-wide rows off by {(mine - want).abs().max().item():.3g}"
    return None


def _check_add_layer_norm(built: Kernels) -> str | None:
    """The same for LayerNorm(a + b), at widths with and without a vector tail."""
    generator = torch.Generator().manual_seed(1)
    for width in (5, 64, 100):
        sizes = ((9, width), (9, width), width, width)
        a, b, weight, bias = (torch.randn(size, generator=generator).bfloat16() for size in sizes)
        reference = torch.nn.functional.layer_norm((a + b).float(), (width,), weight.float(), bias.float(), 1e-12)
        mine, scratch = torch.empty_like(a), _norm_scratch(built, width)
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


def _check_quantize_rows(built: Kernels) -> str | None:
    """None when the kernel quantizes as torch does (each value within one int8 level, the token scales
    to float32's rounding), from bfloat16 and float32, with and without an input scale, at widths with
    and without a vector tail; else what differs."""
    generator = torch.Generator().manual_seed(2)
    for width, dtype, smoothed in ((5, torch.float32, True), (64, torch.bfloat16, False), (100, torch.bfloat16, True)):
        rows = (torch.randn(9, width, generator=generator) * 3).to(dtype)
        rows[0] = 0  # an all-zero row: the scale's floor, no division by zero
        input_scale = torch.rand(width, generator=generator) + 0.5 if smoothed else None
        want, want_scale = _quantize_by_torch(rows, input_scale)
        got, got_scale = torch.empty_like(want), torch.empty_like(want_scale)
        scale = input_scale.data_ptr() if input_scale is not None else None
        arguments = (rows.data_ptr(), dtype == torch.bfloat16, scale, 9, width, got.data_ptr(), got_scale.data_ptr())
        built.quantize_rows(*arguments, False)
        levels = (got.int() - want.int()).abs().max().item()
        if levels > 1 or not torch.allclose(got_scale, want_scale, rtol=1e-6, atol=0):
            return f"int8 quantization of width {width} off by {levels} levels (scales: {got_scale.flatten()})"
    return None


def _check_rescale_rows(built: Kernels) -> str | None:
    """The same for the rescale (+ GELU or ReLU) against torch's float32, to float32's rounding (1e-5) and,
    in bfloat16, to one bfloat16 step."""
    generator = torch.Generator().manual_seed(3)
    cases = (
        (5, torch.float32, "gelu"),
        (64, torch.bfloat16, "none"),
        (100, torch.bfloat16, "gelu"),
        (17, torch.float32, "relu"),
    )
    for width, dtype, activation in cases:
        products = torch.randint(-20000, 20000, (9, width), generator=generator, dtype=torch.int32)
        token_scale = torch.rand(9, 1, generator=generator) * 1e-2
        weight_scale = torch.rand(width, generator=generator) * 1e-2
        bias = torch.randn(width, generator=generator) if activation != "none" else None
        want = _rescale_by_torch(products, token_scale, weight_scale, bias, activation)
        got = torch.empty(9, width, dtype=dtype)
        pointers = (t.data_ptr() if t is not None else None for t in (products, token_scale, weight_scale, bias))
        code = INT8_ACTIVATIONS[activation]
        built.rescale_rows(*pointers, 9, width, code, got.data_ptr(), dtype == torch.bfloat16)
        step = 2**-8 if dtype == torch.bfloat16 else 1e-5
        error = ((got.float() - want).abs() / (want.abs() + 1)).max().item()
        if not error <= step:  # NaN fails too
            return f"int8 rescale ({activation}) of width {width} to {dtype} off by {error:.3g} (allowed {step:.3g})"
    return None


def _check_int8_linear_rows(built: Kernels) -> str | None:
    """Where the build has the VNNI GEMM: None when its integer products equal torch._int_mm's exactly
    (read back with unit scales, float32, no activation: exact below 2^24) and its epilogue (bias, GELU,
    ReLU, to bfloat16 or float32) rescales them as _check_rescale_rows allows, over row counts and widths
    with and without a partial tile or vector, and (40 x 128 x 48) AMX's 32 x 32 blocks beside the VNNI
    tiles for the rows and the odd panel past them; else what differs."""
    if not built.int8_gemm:
        return None
    generator = torch.Generator().manual_seed(4)
    for rows, k, n, dtype, activation in (
        (9, 64, 40, torch.float32, "none"),
        (17, 128, 100, torch.bfloat16, "gelu"),
        (3, 32, 16, torch.float32, "relu"),
        (40, 128, 48, torch.bfloat16, "gelu"),
    ):
        weight = torch.randint(-127, 128, (n, k), generator=generator, dtype=torch.int8)
        signed = torch.randint(-127, 128, (rows, k), generator=generator, dtype=torch.int8)
        unsigned = (signed.view(torch.uint8) ^ 0x80).contiguous()
        width = -(-n // LANES) * LANES
        packed, compensation = torch.empty(width * k, dtype=torch.int8), torch.empty(width, dtype=torch.int32)
        built.pack_int8_weights(weight.data_ptr(), n, k, packed.data_ptr(), compensation.data_ptr())
        products = torch._int_mm(signed, weight.t())
        for exact in (True, False):
            token_scale = torch.ones(rows, 1) if exact else torch.rand(rows, 1, generator=generator) * 1e-3
            weight_scale = torch.ones(width) if exact else torch.rand(width, generator=generator) * 1e-3
            bias = None if exact else torch.randn(width, generator=generator)
            act, out_dtype = ("none", torch.float32) if exact else (activation, dtype)
            got = torch.empty(rows, n, dtype=out_dtype)
            pointers = (token_scale.data_ptr(), weight_scale.data_ptr(), bias.data_ptr() if bias is not None else None)
            arguments = (unsigned.data_ptr(), rows, k, packed.data_ptr(), compensation.data_ptr(), n, *pointers)
            built.int8_linear_rows(*arguments, INT8_ACTIVATIONS[act], got.data_ptr(), out_dtype == torch.bfloat16)
            if exact and not torch.equal(got, products.float()):
                return f"int8 GEMM {rows} x {k} x {n}: integer products differ from torch._int_mm's"
            want = _rescale_by_torch(products, token_scale, weight_scale[:n], bias if bias is None else bias[:n], act)
            step = 2**-8 if out_dtype == torch.bfloat16 else 1e-5
            error = ((got.float() - want).abs() / (want.abs() + 1)).max().item()
            if not error <= step:  # NaN fails too
                return f"int8 GEMM {rows} x {k} x {n} ({act}) to {out_dtype} off by {error:.3g} (allowed {step:.3g})"
    return None


def _check_bf16_linear_rows(built: Kernels) -> str | None:
    """Where the build has the small-batch bfloat16 GEMM: None when its output (bias, then no activation,
    GELU or ReLU) is within one bfloat16 step of float32's linear on the same bfloat16 values (relative to
    |value| + 1, as _check_rescale_rows allows), over tiles of 1 to 8 rows, split row counts, every tile
    width, a partial last vector and an odd number of pairs (and AMX tiles' one and two blocks of rows,
    where the build has them); else what differs."""
    if not built.bf16_gemm:
        return None
    generator = torch.Generator().manual_seed(5)
    for rows, k, n, activation, has_bias in (
        (1, 64, 200, "none", True),
        (3, 34, 100, "gelu", True),
        (9, 34, 100, "none", True),  # tiles of 5 and 4 rows, both prefetching
        (12, 96, 40, "relu", False),
        (16, 128, 16 * 19 + 5, "gelu", True),
        (24, 64, 40, "gelu", True),  # AMX builds: two blocks of tile rows, an odd number of panels
        (40, 96, 40, "none", True),  # AMX builds: a group of 32 rows, then one block of 8
        (50, 64, 24, "relu", True),  # ... then two blocks again (16 + 2)
    ):
        weight = (torch.randn(n, k, generator=generator) * 0.2).bfloat16()
        x = torch.randn(rows, k, generator=generator).bfloat16()
        bias = torch.randn(n, generator=generator).bfloat16() if has_bias else None
        width = -(-n // LANES) * LANES
        packed = torch.empty(width * k, dtype=torch.bfloat16)
        built.pack_bf16_weights(weight.data_ptr(), n, k, packed.data_ptr())
        padded = None if bias is None else torch.cat([bias.float(), torch.zeros(width - n)])
        got = torch.empty(rows, n, dtype=torch.bfloat16)
        pointer = padded.data_ptr() if padded is not None else None
        code = INT8_ACTIVATIONS[activation]
        built.bf16_linear_rows(x.data_ptr(), rows, k, packed.data_ptr(), n, pointer, code, got.data_ptr())
        want = F.linear(x.float(), weight.float(), None if bias is None else bias.float())
        want = F.gelu(want) if activation == "gelu" else want.relu() if activation == "relu" else want
        error = ((got.float() - want).abs() / (want.abs() + 1)).max().item()
        if not error <= 2**-8:  # NaN fails too
            return f"bfloat16 GEMM {rows} x {k} x {n} ({activation}) off by {error:.3g} (allowed {2**-8:.3g})"
    return None


def _first_line(exc: BaseException) -> str:
    text = getattr(exc, "stderr", None) or str(exc)
    return text.strip().splitlines()[0] if text.strip() else type(exc).__name__
