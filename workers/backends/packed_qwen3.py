"""Packed pieces of Qwen3 decoders used as embedders (Qwen3-Embedding: last-token pooling) and
scorers (Qwen3ForSequenceClassification), see packed_encoder.py: causal attention within each
sequence, rotary positions, grouped-query attention with per-head RMSNorm on queries and keys,
a gated SiLU MLP. The query, key and value projections are fused into one GEMM; norms and the
MLP are the model's own modules, run on the packed tokens.
"""

from __future__ import annotations

from typing import ClassVar

import torch

from ..contract.model_spec import ModelKind
from .packed_pieces import CAUSAL, HFModule, PackedBatch, attend, fuse_linears, rotate


class Qwen3Pieces:
    """Qwen3Model / Qwen3ForSequenceClassification with global attention in every layer (a sliding
    window, use_sliding_window, keeps the padded forward)."""

    model_types = ("qwen3",)
    classes: ClassVar[dict[ModelKind, tuple[str, ...]]] = {
        ModelKind.EMBEDDING: ("Qwen3Model",),
        ModelKind.RERANKER: ("Qwen3ForSequenceClassification",),
        ModelKind.CLASSIFIER: ("Qwen3ForSequenceClassification",),
    }

    @classmethod
    def covers(cls, model: HFModule, kind: ModelKind) -> bool:
        config = model.config
        return type(model).__name__ in cls.classes.get(kind, ()) and all(
            t == "full_attention" for t in config.layer_types
        )

    def __init__(self, model: HFModule, kind: ModelKind):
        self.head: HFModule = model if kind != ModelKind.EMBEDDING else None  # None: an embedder
        self.decoder = model.model if self.head is not None else model
        config = self.decoder.config
        self.pad = config.pad_token_id
        self.layers = list(self.decoder.layers)
        self.layer_count = len(self.layers)
        first = self.layers[0].self_attn
        self.heads, self.kv_heads, self.head_dim = (
            config.num_attention_heads,
            config.num_key_value_heads,
            first.head_dim,
        )
        self.sizes = (self.heads * self.head_dim, self.kv_heads * self.head_dim, self.kv_heads * self.head_dim)
        self.qkv = [_fuse_projections(layer.self_attn) for layer in self.layers]

    def embed(self, batch: PackedBatch) -> torch.Tensor:
        return self.decoder.embed_tokens(batch.ids)

    def tables(self, x: torch.Tensor, batch: PackedBatch) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = self.decoder.rotary_emb(x, batch.offsets[None])
        return cos[0], sin[0]

    def layer(self, index: int, x: torch.Tensor, batch: PackedBatch, tables) -> torch.Tensor:
        layer = self.layers[index]
        attention = layer.self_attn
        tokens = x.shape[0]
        q, k, v = self.qkv[index](layer.input_layernorm(x)).split(self.sizes, dim=-1)
        q = attention.q_norm(q.reshape(tokens, self.heads, self.head_dim))
        k = attention.k_norm(k.reshape(tokens, self.kv_heads, self.head_dim))
        v = v.reshape(tokens, self.kv_heads, self.head_dim)
        cos, sin = tables
        context = attend(rotate(q, cos, sin), rotate(k, cos, sin), v, batch, CAUSAL, scale=attention.scaling)
        x = x + attention.o_proj(context.flatten(1))
        return x + layer.mlp(layer.post_attention_layernorm(x))

    def finish(self, x: torch.Tensor) -> torch.Tensor:
        return self.decoder.norm(x)

    def logits(self, hidden: torch.Tensor, batch: PackedBatch) -> torch.Tensor:
        return self.head.score(hidden[self._scored_tokens(batch)])

    def _scored_tokens(self, batch: PackedBatch) -> torch.Tensor:
        """transformers scores each row's rightmost token that is not the pad token (its first token
        when all are; the last one when the model has no pad token)."""
        if self.pad is None:
            return batch.lasts
        sequence = torch.repeat_interleave(
            torch.arange(len(batch.firsts), device=batch.ids.device), batch.cu_seqlens.diff().long()
        )
        offsets = batch.offsets * (batch.ids != self.pad)
        rightmost = torch.zeros_like(batch.firsts).scatter_reduce(0, sequence, offsets, "amax")
        return batch.firsts + rightmost


def _fuse_projections(attention) -> torch.nn.Module:
    """q, k and v projections as one linear (the module then drops its own: held once)."""
    fused = fuse_linears([attention.q_proj, attention.k_proj, attention.v_proj])
    for name in ("q_proj", "k_proj", "v_proj"):
        setattr(attention, name, None)
    return fused
