"""What the packed forward is built from (see packed_encoder.py): the batch layout, attention within
each sequence, and the layers' shared operations. The skeleton (packed_encoder.py) and each family's
pieces (packed_bert.py, packed_modernbert.py, packed_qwen3.py) import this module; it imports none of them.
"""

from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from . import host_kernels, int8_linear, packed_linear

# A transformers model or one of its submodules: which attributes it has (model.bert.encoder.layer,
# model.layers, config.layer_types) depends on the architecture, which a type checker cannot see.
HFModule = Any

# Attention windows: (tokens before, tokens after) each query sees; -1 = unbounded.
FULL = (-1, -1)
CAUSAL = (-1, 0)


@dataclass(frozen=True)
class PackedBatch:
    """Token ids (tokens,) int64, cu_seqlens (n + 1,) int32, optional token type ids, each token's
    offset in its sequence (0, 1, ...), and the longest sequence, all on the model's device."""

    ids: torch.Tensor
    cu_seqlens: torch.Tensor
    types: torch.Tensor | None
    offsets: torch.Tensor
    longest: int

    @classmethod
    def of(cls, ids: torch.Tensor, cu_seqlens: torch.Tensor, types: torch.Tensor | None = None) -> PackedBatch:
        """The batch of `ids` packed as `cu_seqlens` says, which starts at 0 (as every TokenBatch's does)."""
        if len(cu_seqlens) == 2:  # one sequence (a live query): offsets 0..n-1 without four operators
            return cls(ids, cu_seqlens, types, torch.arange(ids.shape[0], device=ids.device), ids.shape[0])
        lengths = cu_seqlens.diff()
        starts = torch.repeat_interleave(cu_seqlens[:-1].long(), lengths.long())
        offsets = torch.arange(ids.shape[0], device=ids.device) - starts
        return cls(ids, cu_seqlens, types, offsets, int(lengths.max()))

    def with_filler(self, multiple: int) -> tuple[PackedBatch, int]:
        """This batch with its token count rounded up to a multiple of `multiple` by one more sequence
        of filler tokens (id 0, offsets 0, 1, ...), and how many filler tokens that is (0: `self`).
        The filler attends only to itself, as any sequence does, so it changes no other sequence's
        rows: see packed_encoder.gemm_rows_multiple for why."""
        tokens = self.ids.shape[0]
        filler = -tokens % multiple
        if filler == 0:
            return self, 0
        ids = torch.cat([self.ids, self.ids.new_zeros(filler)])
        cu_seqlens = torch.cat([self.cu_seqlens, self.cu_seqlens.new_full((1,), tokens + filler)])
        types = None if self.types is None else torch.cat([self.types, self.types.new_zeros(filler)])
        offsets = torch.cat([self.offsets, torch.arange(filler, device=self.ids.device)])
        return PackedBatch(ids, cu_seqlens, types, offsets, max(self.longest, filler)), filler

    @functools.cached_property
    def bounds(self) -> list[int]:
        """cu_seqlens as Python ints, read once per batch rather than once per layer (the per-sequence
        attention loops over them); never on CUDA, whose varlen kernel takes cu_seqlens itself."""
        return self.cu_seqlens.tolist()

    @property
    def firsts(self) -> torch.Tensor:
        return self.cu_seqlens[:-1].long()

    @property
    def lasts(self) -> torch.Tensor:
        return self.cu_seqlens[1:].long() - 1


def mean_tokens(hidden: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """Each sequence's mean token, summed in float32 whatever the hidden states' dtype, returned in
    theirs. `segment_reduce` adds in the input's dtype, one token after another: in bfloat16 (8
    significant bits) that drifts as a sequence grows, most on repetitive text whose tokens' states
    are alike (a 600-dash markdown rule pooled to cosine 0.9977 against float32; 0.9999 summed in
    float32, as sentence-transformers' padded sum does)."""
    mean = torch.segment_reduce(hidden.float(), "mean", lengths=cu_seqlens.diff(), axis=0)
    return mean.to(hidden.dtype)


# ------------------------------------------------------------------ attention
def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    batch: PackedBatch,
    window: tuple[int, int] = FULL,
    scale: float | None = None,
) -> torch.Tensor:
    """Attention within each sequence: q (tokens, heads, d), k and v (tokens, kv_heads, d), kv_heads
    dividing heads (grouped-query). `window`: FULL, CAUSAL, or (before, after) tokens each query sees.
    On CUDA one variable-length FlashAttention call; on CPU in bfloat16 on one thread, BERT's full
    window, one call of host_kernels.attend_full for the whole batch (scores in float32); else
    attention one sequence at a time (attend_each_sequence)."""
    kernel = varlen_kernel() if q.is_cuda and q.dtype in (torch.float16, torch.bfloat16) else None
    if kernel is not None:
        return kernel(q, k, v, batch.cu_seqlens, batch.longest, window, scale)
    context = host_kernels.attend_full(q, k, v, batch, scale) if window == FULL else None
    if context is not None:
        return context
    return attend_each_sequence(q, k, v, batch, window, scale)


def attend_each_sequence(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    batch: PackedBatch,
    window: tuple[int, int] = FULL,
    scale: float | None = None,
) -> torch.Tensor:
    """attend() on CPU by torch's operators, a few per sequence: SDPA, or three products in bfloat16
    and float16 past FLASH_UP_TO tokens (_attend_by_products)."""
    out = torch.empty_like(q)
    by_products = q.device.type == "cpu" and q.dtype in (torch.float16, torch.bfloat16)  # see _attend_by_products
    for a, b in itertools.pairwise(batch.bounds):
        if by_products and b - a > FLASH_UP_TO:
            _attend_by_products(q[a:b], k[a:b], v[a:b], out[a:b], window, scale)
        else:
            _attend_by_sdpa(q[a:b], k[a:b], v[a:b], out[a:b], window, scale)
    return out


# Sequences up to this many tokens keep SDPA in bfloat16/float16 too: a short text's scores are little
# work, so the operator calls dominate, and SDPA's one costs less than _attend_by_products' three.
FLASH_UP_TO = 32


def _attend_by_sdpa(q, k, v, out, window, scale) -> None:
    """One sequence, q (L, heads, d), through SDPA (on CPU its flash kernel) into out (L, heads, d)."""
    length = q.shape[0]
    seq = [t.transpose(0, 1).unsqueeze(0) for t in (q, k, v)]  # (1, heads, L, d): no padding mask needed
    causal, mask = window == CAUSAL, None if window in (FULL, CAUSAL) else _band(length, window, q.device)
    grouped = k.shape[1] != q.shape[1]
    out.copy_(
        F.scaled_dot_product_attention(
            seq[0], seq[1], seq[2], attn_mask=mask, is_causal=causal, scale=scale, enable_gqa=grouped
        )[0].transpose(0, 1)
    )


def _attend_by_products(q, k, v, out, window, scale) -> None:
    """One sequence in bfloat16/float16 on CPU as three operators: scores = scale * q k^T (one batched
    GEMM over the heads), softmax, scores v. On CPUs without AMX this runs 1.5-2x faster than SDPA's
    flash kernel, whose per-block products are slow there (a 256-token text, 12 heads: 0.5 G scores/s
    against 1.2 G here, Zen 5, one thread). The cost: the scores are rounded to the dtype before the
    softmax, as transformers' eager attention rounds them (the flash kernel keeps them in float32);
    the fidelity self-check's bfloat16 floors hold (see tests/integration/test_packed_forward.py).
    Grouped-query attention: the heads sharing a key/value head are stacked as more query rows. The
    bfloat16 softmax is host_kernels.py's, built for this CPU at load where a C compiler is found."""
    length, heads, dim = q.shape
    kv_heads = k.shape[1]
    queries = q.transpose(0, 1).reshape(kv_heads, heads // kv_heads * length, dim)
    scores = torch.baddbmm(
        q.new_empty(1, 1, 1), queries, k.permute(1, 2, 0), beta=0, alpha=dim**-0.5 if scale is None else scale
    )
    if window != FULL:
        hidden = ~_band(length, window, q.device)
        scores.view(kv_heads, -1, length, length).masked_fill_(hidden, -torch.inf)
    context = torch.bmm(host_kernels.softmax_(scores), v.transpose(0, 1))  # (kv_heads, group * L, d)
    out.copy_(context.view(heads, length, dim).transpose(0, 1))


def _band(length: int, window: tuple[int, int], device: torch.device) -> torch.Tensor:
    """(L, L) boolean mask: key j visible to query i when i - before <= j <= i + after."""
    before, after = window
    distance = torch.arange(length, device=device)[None, :] - torch.arange(length, device=device)[:, None]
    visible = torch.ones(length, length, dtype=torch.bool, device=device)
    if before >= 0:
        visible &= distance >= -before
    if after >= 0:
        visible &= distance <= after
    return visible


@functools.cache  # a failed import is not remembered: each attempt searches sys.path again
def varlen_kernel():
    """Variable-length FlashAttention (CUDA): flash-attn when installed, else PyTorch's own; None if
    neither. Either is called as kernel(q, k, v, cu_seqlens, longest, window, scale)."""
    try:
        from flash_attn import flash_attn_varlen_func
    except ImportError:
        flash_attn_varlen_func = None
    if flash_attn_varlen_func is not None:

        def flash_attn(q, k, v, cu, longest, window, scale):
            # q, k, v may be strided views into a fused projection: the kernels want them dense.
            q, k, v = (t.contiguous() for t in (q, k, v))
            return flash_attn_varlen_func(
                q, k, v, cu, cu, longest, longest, softmax_scale=scale, causal=window == CAUSAL, window_size=window
            )

        return flash_attn
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None

    def torch_varlen(q, k, v, cu, longest, window, scale):
        q, k, v = (t.contiguous() for t in (q, k, v))
        return varlen_attn(
            q, k, v, cu, cu, longest, longest, scale=scale, window_size=window, enable_gqa=k.shape[1] != q.shape[1]
        )

    return torch_varlen


# ------------------------------------------------------------------ shared pieces
def fuse_linears(linears: list[HFModule]) -> torch.nn.Module:
    """One linear whose output is the given linears' outputs side by side (one larger GEMM instead
    of several: on CPU fewer OpenMP parallel regions). Packed for oneDNN where the model's are."""
    weight = torch.cat([p.weight.detach() for p in linears])
    has_bias = linears[0].bias is not None
    fused = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=has_bias, device=weight.device, dtype=weight.dtype)
    fused.weight.data = weight
    if has_bias:
        fused.bias.data = torch.cat([p.bias.detach() for p in linears])
    if weight.device.type == "cpu" and packed_linear.available(weight.dtype):
        return packed_linear.PackedLinear(fused)
    return fused.requires_grad_(False)


def activated(dense: torch.nn.Module, x: torch.Tensor, activation: str) -> torch.Tensor:
    """dense(x) then the activation ("gelu": exact erf GELU, or "relu"): in the GEMM's epilogue when
    the linear is pre-packed for oneDNN or int8 (no second pass over the (tokens, intermediate) matrix)."""
    if isinstance(dense, (packed_linear.PackedLinear, int8_linear.Int8Linear)):
        return dense(x, activation=activation)
    return (F.gelu if activation == "gelu" else F.relu)(dense(x))


def layer_gemm(linear: torch.nn.Module) -> host_kernels.LayerGemm | None:
    """How host_kernels.bert_layer computes `linear`: by its few-row bfloat16 GEMM (a PackedLinear with its
    copy) or its int8 GEMM (an Int8Linear with the VNNI kernel's weights); None where neither."""
    if type(linear) is packed_linear.PackedLinear and linear.few_rows is not None:
        return host_kernels.LayerGemm(bf16=linear.few_rows)
    if type(linear) is int8_linear.Int8Linear and linear.packed is not None:
        return host_kernels.LayerGemm(int8=linear.packed, input_scale=linear.input_scale)
    return None


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary position embedding (the half-split rotation of transformers' apply_rotary_pos_emb):
    x (tokens, heads, d), cos and sin (tokens, d) from the model's own rotary module."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]
