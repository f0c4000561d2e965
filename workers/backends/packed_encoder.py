"""Padding-free forward: a batch's tokens as one (tokens, hidden) matrix, for every family it covers.

Embeddings, linear layers, activations and norms act on each token alone, so they run
on the packed tokens and no padding is ever computed; only attention sees where
sequences begin and end: on CUDA one variable-length FlashAttention call over
`cu_seqlens` (float16/bfloat16), elsewhere each sequence alone: SDPA, or in bfloat16/float16
past a few tokens its three products (faster than the CPU flash kernel). The weights are the
loaded transformers module's own, so the outputs equal its padded forward.

This module is the skeleton every family shares (the layer loop that pauses between
layers for urgent work, pooling) and the table of families; each family supplies its
pieces (embeddings and positions, one layer, the classification head):

  packed_bert.py        BERT; RoBERTa, XLM-RoBERTa, CamemBERT (same layers, other positions and head);
                        DistilBERT
  packed_modernbert.py  ModernBERT (RoPE, gated MLP, global and sliding-window layers)
  packed_qwen3.py       Qwen3 decoder embedders and scorers (causal, RoPE, grouped-query attention)

Skeleton and families are built from packed_pieces.py (batch layout, attention, the layers' shared
operations), which imports neither: the arrows point skeleton -> families -> pieces.
"""

from __future__ import annotations

import contextlib
from collections.abc import Generator, Iterator

import torch

from ..contract.model_spec import ModelKind, Pooling, pooling_modes
from . import float8_linear, host_kernels, int8_linear, packed_linear
from .packed_bert import BertPieces, DistilBertPieces, RobertaPieces
from .packed_modernbert import ModernBertPieces
from .packed_pieces import HFModule, PackedBatch, mean_tokens, varlen_kernel
from .packed_qwen3 import Qwen3Pieces

# On CPU the layers run on a batch whose token count (every linear's GEMM M) is rounded up to a
# multiple (gemm_rows_multiple) by a filler sequence (PackedBatch.with_filler) whose rows are dropped
# after the last layer. oneDNN builds (JIT-compiles) a GEMM primitive per M and keeps a few dozen
# (workers/memory.py). A stream of live queries of ~50 different lengths rebuilt one on nearly every
# linear: MiniLM, bfloat16, one thread, queries of 8-62 tokens in turn, 4.8-5.2 ms of CPU per query
# against 3.5-3.7 with the same queries sorted by length; rounded to 8, 3.2-4.0 ms in turn. Bigger
# batches (bulk, a rerank call's pieces) had a new M nearly every time too, and on a Xeon with AMX a
# new M costs MiniLM's four linears 18-37 ms once, more than the 21 ms they take at 7,000 rows: so the
# multiple grows with the batch, keeping the filler under 1/GEMM_ROWS_FILLER_SHARE of its rows (32 row
# counts per doubling; `python -m encoderd.bench.gemm_rows` times both roundings).
# Each row of a GEMM is computed from its own input row alone, so the real rows do not depend on the
# filler (tests/integration/test_packed_forward.py checks them bit-identical with fillers to twice the
# multiple); the filler costs little, since a small batch's GEMMs are bound by reading the weights,
# not by their rows. On CPUs with AMX, oneDNN computes a last block of under 8 rows with another kernel
# (MiniLM's down projection, 34 rows: rows 32-33 a bfloat16 step off the same rows of a 40-row GEMM):
# whole multiples of 8 also keep a row's bits independent of the batch it runs in.
# Where every layer GEMM runs on a host kernel instead (the few-row bfloat16 GEMM: a short query's rows
# on a CPU with avx512_bf16 or AMX; the int8 GEMM: every batch; PackedEncoder.rows_multiple), there is
# nothing to compile or cache and the kernel computes each row alone, in the same order whatever the
# count: no filler. A 9-token query had run its linears on 16 rows, 1.8x the time of 8 (MiniLM,
# bfloat16, Zen 4, one thread).
GEMM_ROWS_MULTIPLE = 8  # the least multiple: a short query's
GEMM_ROWS_FILLER_SHARE = 32
GEMM_ROWS_MAX_MULTIPLE = 128  # the filler is one sequence: under 128 tokens, within every family's positions


def gemm_rows_multiple(tokens: int) -> int:
    """What a batch of `tokens` rows is rounded up to a multiple of: GEMM_ROWS_MULTIPLE, doubled while the
    filler stays under 1/GEMM_ROWS_FILLER_SHARE of the rows (8 up to 511 tokens, 16 from 512, ... 128
    from 4,096 on)."""
    multiple = GEMM_ROWS_MULTIPLE
    while 2 * multiple * GEMM_ROWS_FILLER_SHARE <= tokens and multiple < GEMM_ROWS_MAX_MULTIPLE:
        multiple *= 2
    return multiple


# The modules a layer's GEMMs run in (linears_final).
LINEAR_KINDS = (torch.nn.Linear, packed_linear.PackedLinear, int8_linear.Int8Linear, float8_linear.Float8Linear)

# The families the packed forward covers, tried in this order.
FAMILIES = (BertPieces, RobertaPieces, DistilBertPieces, ModernBertPieces, Qwen3Pieces)


def usable(model: HFModule, kind: ModelKind, device: torch.device, dtype: torch.dtype) -> bool:
    """A family with packed pieces, loaded as transformers' own class of that family and kind; on CUDA
    only where a varlen kernel runs (float16/bfloat16): a per-sequence loop there would cost more
    kernel launches than padding costs FLOPs."""
    if device.type == "cuda" and (dtype == torch.float32 or varlen_kernel() is None):
        return False
    if not type(model).__module__.startswith("transformers."):
        return False  # the model repository's own class (--trust-remote-code), whatever its name: its forward runs
    return _pieces_for(model, kind) is not None


def _pieces_for(model: HFModule, kind: ModelKind):
    for pieces in FAMILIES:
        if model.config.model_type in pieces.model_types and pieces.covers(model, kind):
            return pieces
    return None


class PackedEncoder:
    """The packed forward of one loaded model. The family's pieces may take over some of the
    model's modules (fused projections): build it before pre-packing the model's other linears."""

    def __init__(self, model: HFModule, kind: ModelKind):
        self.pieces = _pieces_for(model, kind)(model, kind)
        self.round_rows = True  # see real_rows_only
        # see linears_final: the host kernel that computes every layer GEMM, if one does
        self.few_row_weights: list[host_kernels.PackedBf16Weights] = []
        self.int8_gemms = False

    def linears_final(self) -> None:
        """Called once the model's linears are what its forward runs (packed, quantized): the few-row
        kernel's weights of every layer GEMM where each has them (bfloat16 PackedLinears with their copy),
        or whether each is an Int8Linear with the VNNI GEMM's weights (rows_multiple)."""
        modules = [m for layer in self.pieces.layers for m in layer.modules()] + list(getattr(self.pieces, "qkv", []))
        linears = [m for m in modules if isinstance(m, LINEAR_KINDS)]
        few_rows = [m.few_rows for m in linears if type(m) is packed_linear.PackedLinear and m.few_rows is not None]
        self.few_row_weights = few_rows if len(few_rows) == len(linears) else []
        int8_gemms = [m for m in linears if type(m) is int8_linear.Int8Linear and m.packed is not None]
        self.int8_gemms = bool(linears) and len(int8_gemms) == len(linears)
        weights_final = getattr(self.pieces, "weights_final", None)  # BERT's embeddings: one C call
        if weights_final is not None:
            weights_final()
        # BERT's families also compute a short query's layers one C call each (host_kernels.bert_layer)
        whole_layers_final = getattr(self.pieces, "whole_layers_final", None)
        if (self.few_row_weights or self.int8_gemms) and whole_layers_final is not None:
            whole_layers_final()

    def rows_multiple(self, tokens: int) -> int:
        """What a CPU batch of `tokens` rows is rounded up to a multiple of: 1 where a host kernel computes
        every layer GEMM on that many rows (the few-row bfloat16 GEMM up to its limit, the int8 GEMM at
        any count), else gemm_rows_multiple(tokens)."""
        return 1 if self._host_kernels_compute(tokens) else gemm_rows_multiple(tokens)

    def _host_kernels_compute(self, tokens: int) -> bool:
        """Whether host kernels compute every layer GEMM of a batch of `tokens` rows now (linears_final)."""
        if self.int8_gemms:
            return host_kernels.int8_gemm_serves()
        weights = self.few_row_weights
        return bool(weights) and all(host_kernels.bf16_linear_serves(tokens, w) for w in weights)

    @contextlib.contextmanager
    def real_rows_only(self) -> Iterator[None]:
        """No filler rows within (gemm_rows_multiple): int8 calibration records the linears' input
        ranges there, and the filler's rows are not the model's inputs; the ranges (so every int8
        vector) must not depend on how rows are rounded."""
        self.round_rows = False
        try:
            yield
        finally:
            self.round_rows = True

    @property
    def family(self) -> str:
        return type(self.pieces).__name__.removesuffix("Pieces")

    def hidden_states(self, batch: PackedBatch) -> Generator[None, None, torch.Tensor]:
        """Last hidden states, (tokens, hidden), as a generator that pauses after each layer (see
        Backend.forward_in_steps)."""
        tokens = batch.ids.shape[0]
        if batch.ids.device.type == "cpu" and self.round_rows:  # see gemm_rows_multiple
            batch, _ = batch.with_filler(self.rows_multiple(tokens))
        x = self.pieces.embed(batch)
        # Per-batch tables (rotary cos/sin): held here, not by the pieces, because an urgent batch
        # may run its whole forward during one of this batch's pauses.
        tables = self.pieces.tables(x, batch)
        for index in range(self.pieces.layer_count):
            x = self.pieces.layer(index, x, batch, tables)
            yield
        return self.pieces.finish(x[:tokens])

    def logits(self, hidden: torch.Tensor, batch: PackedBatch) -> torch.Tensor:
        return self.pieces.logits(hidden, batch)

    @staticmethod
    def pool(hidden: torch.Tensor, cu_seqlens: torch.Tensor, pooling: Pooling | tuple[Pooling, ...]) -> torch.Tensor:
        """sentence-transformers Pooling over packed sequences, in float32; several modes concatenated."""
        if pooling_modes(pooling) == (Pooling.MEAN,):
            mean = host_kernels.mean_tokens(hidden, cu_seqlens)  # from bfloat16 states: no float32 copy of them
            if mean is not None:
                return mean
        hidden = hidden.float()  # see mean_tokens: a bfloat16 sum drifts over a long input
        return torch.cat([_pool_one(hidden, cu_seqlens, mode) for mode in pooling_modes(pooling)], dim=1)


def _pool_one(hidden: torch.Tensor, cu_seqlens: torch.Tensor, mode: Pooling) -> torch.Tensor:
    if mode == Pooling.CLS:
        return hidden[cu_seqlens[:-1].long()]
    if mode == Pooling.LAST_TOKEN:
        return hidden[cu_seqlens[1:].long() - 1]
    lengths = cu_seqlens.diff()
    if mode == Pooling.MAX:
        return torch.segment_reduce(hidden, "max", lengths=lengths, axis=0)
    if mode == Pooling.MEAN:
        return mean_tokens(hidden, cu_seqlens)
    if mode == Pooling.MEAN_SQRT_LEN:
        total = torch.segment_reduce(hidden, "sum", lengths=lengths, axis=0)
        return total / lengths.to(hidden.dtype).sqrt()[:, None]
    # WEIGHTED_MEAN: weights 1, 2, 3... by position within each sequence.
    starts = torch.repeat_interleave(cu_seqlens[:-1].long(), lengths.long())
    weights = (torch.arange(hidden.shape[0], device=hidden.device) - starts + 1).to(hidden.dtype)[:, None]
    total = torch.segment_reduce(hidden * weights, "sum", lengths=lengths, axis=0)
    return total / torch.segment_reduce(weights, "sum", lengths=lengths, axis=0)
