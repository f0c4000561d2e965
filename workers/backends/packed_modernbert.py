"""Packed pieces of ModernBERT (see packed_encoder.py): pre-norm layers with a fused QKV projection,
rotary positions and a gated MLP; layers alternate between global attention and a local
sliding window (a token sees those within local_attention / 2 on either side), each kind with
its own RoPE base. Norms and the MLP act per token, so the model's own modules run on the
packed tokens; only attention needs the sequence bounds (and, for local layers, the window).
"""

from __future__ import annotations

from typing import ClassVar

import torch

from ..contract.model_spec import ModelKind
from .packed_pieces import FULL, HFModule, PackedBatch, attend, mean_tokens, rotate

_LAYER_TYPES = ("full_attention", "sliding_attention")


class ModernBertPieces:
    """ModernBertModel / ModernBertForSequenceClassification (its head pools by CLS or by the mean
    over the sequence, then dense + activation + norm, then the classifier)."""

    model_types = ("modernbert",)
    classes: ClassVar[dict[ModelKind, tuple[str, ...]]] = {
        ModelKind.EMBEDDING: ("ModernBertModel",),
        ModelKind.RERANKER: ("ModernBertForSequenceClassification",),
        ModelKind.CLASSIFIER: ("ModernBertForSequenceClassification",),
    }

    @classmethod
    def covers(cls, model: HFModule, kind: ModelKind) -> bool:
        config = model.config
        if type(model).__name__ not in cls.classes.get(kind, ()):
            return False
        if kind != ModelKind.EMBEDDING and config.classifier_pooling not in ("cls", "mean"):
            return False
        return set(config.layer_types) <= set(_LAYER_TYPES)

    def __init__(self, model: HFModule, kind: ModelKind):
        self.head: HFModule = model if kind != ModelKind.EMBEDDING else None  # None: an embedder
        self.encoder = model.model if self.head is not None else model
        config = self.encoder.config
        self.heads = config.num_attention_heads
        self.layers = list(self.encoder.layers)
        self.layer_count = len(self.layers)
        self.types = list(config.layer_types)
        half = config.sliding_window  # local_attention // 2: transformers' mask keeps |i - j| <= half
        self.windows = {"full_attention": FULL, "sliding_attention": (half, half)}

    def embed(self, batch: PackedBatch) -> torch.Tensor:
        e = self.encoder.embeddings
        return e.norm(e.tok_embeddings(batch.ids))

    def tables(self, x: torch.Tensor, batch: PackedBatch) -> dict:
        """Rotary cos/sin per layer type (global and local layers use different bases), (tokens, d) each."""
        positions = batch.offsets[None]
        return {kind: tuple(t[0] for t in self.encoder.rotary_emb(x, positions, kind)) for kind in set(self.types)}

    def layer(self, index: int, x: torch.Tensor, batch: PackedBatch, tables: dict) -> torch.Tensor:
        layer, kind = self.layers[index], self.types[index]
        attention = layer.attn
        q, k, v = attention.Wqkv(layer.attn_norm(x)).view(x.shape[0], 3, self.heads, -1).unbind(1)
        cos, sin = tables[kind]
        context = attend(
            rotate(q, cos, sin), rotate(k, cos, sin), v, batch, self.windows[kind], scale=attention.head_dim**-0.5
        )
        x = x + attention.Wo(context.flatten(1))
        return x + layer.mlp(layer.mlp_norm(x))

    def finish(self, x: torch.Tensor) -> torch.Tensor:
        return self.encoder.final_norm(x)

    def logits(self, hidden: torch.Tensor, batch: PackedBatch) -> torch.Tensor:
        if self.head.config.classifier_pooling == "cls":
            pooled = hidden[batch.firsts]
        else:
            pooled = mean_tokens(hidden, batch.cu_seqlens)
        return self.head.classifier(self.head.head(pooled))
