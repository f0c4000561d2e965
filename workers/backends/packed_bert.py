"""Packed pieces of BERT-layout encoders (see packed_encoder.py): BERT; RoBERTa, XLM-RoBERTa
and CamemBERT, whose layers are BERT's and which differ in positions and head only; DistilBERT,
BERT's layers under other names.

Each layer's query, key and value projections are fused into one GEMM (fewer, larger
matrix products; on CPU two fewer OpenMP parallel regions). On CPU, with the linears
pre-packed for oneDNN (packed_linear.py), the FFN's activation runs in the GEMM's
epilogue. Together: +5% tokens/s on one thread, +7% on two (MiniLM). In bfloat16 on one thread the
residual add and LayerNorm run as one pass (host_kernels.add_layer_norm), and where the few-row GEMM
(or, in int8, the VNNI GEMM) serves a short query's linears, each whole layer is one host-kernel call
(host_kernels.bert_layer).
"""

from __future__ import annotations

from typing import ClassVar

import torch

from ..contract.model_spec import ModelKind
from . import host_kernels
from .host_kernels import add_layer_norm
from .packed_pieces import HFModule, PackedBatch, activated, attend, fuse_linears, layer_gemm


class BertPieces:
    """BertModel / BertForSequenceClassification with absolute positions (0, 1, ... per sequence);
    the head is BERT's pooler (dense + tanh on [CLS]) then the classifier."""

    model_types: ClassVar[tuple[str, ...]] = ("bert",)
    classes: ClassVar[dict[ModelKind, tuple[str, ...]]] = {
        ModelKind.EMBEDDING: ("BertModel",),
        ModelKind.RERANKER: ("BertForSequenceClassification",),
        ModelKind.CLASSIFIER: ("BertForSequenceClassification",),
    }
    encoder_attribute = "bert"

    @classmethod
    def covers(cls, model: HFModule, kind: ModelKind) -> bool:
        config = model.config
        if config.is_decoder or config.hidden_act not in ("gelu", "relu"):
            return False
        if getattr(config, "position_embedding_type", "absolute") != "absolute":
            return False
        return type(model).__name__ in cls.classes.get(kind, ())

    def __init__(self, model: HFModule, kind: ModelKind):
        self.head: HFModule = model if kind != ModelKind.EMBEDDING else None  # None: an embedder
        self.encoder = getattr(model, self.encoder_attribute) if self.head is not None else model
        config = self.encoder.config
        self.heads = config.num_attention_heads
        self.activation = config.hidden_act  # "gelu" (exact, erf) or "relu": see covers()
        self.layers = list(self.encoder.encoder.layer)
        self.layer_count = len(self.layers)
        self.qkv = [_fuse_projections(layer.attention.self) for layer in self.layers]
        self.whole_layers: list[host_kernels.BertLayerWeights] = []  # see whole_layers_final
        self.embedding: host_kernels.EmbeddingWeights | None = None  # see weights_final

    def weights_final(self) -> None:
        """Called once the weights are what the forward runs (PackedEncoder.linears_final; int8 converts the
        rest to bfloat16 late): the embedding tables and norm for host_kernels.embed, where it serves them."""
        e = self.encoder.embeddings
        tables = (e.word_embeddings.weight, e.position_embeddings.weight, e.token_type_embeddings.weight)
        self.embedding = host_kernels.embedding_weights(tables, e.LayerNorm)

    def whole_layers_final(self) -> None:
        """Called once the linears are final (PackedEncoder.linears_final): where host kernels can compute
        every layer whole (bfloat16 PackedLinears with their few-row weights, or Int8Linears with the VNNI
        GEMM's; the kernels' norms and head size), each layer's weights for host_kernels.bert_layer, which
        then computes a short query's layers in one call each; else none, and every layer runs operator by
        operator."""
        whole = [host_kernels.bert_layer_weights(*self._layer_parts(index)) for index in range(self.layer_count)]
        self.whole_layers = [w for w in whole if w is not None]
        if len(self.whole_layers) != self.layer_count:
            self.whole_layers = []

    def _layer_parts(self, index: int) -> tuple:
        """bert_layer_weights' arguments for layer `index`."""
        layer = self.layers[index]
        output = layer.attention.output
        linears = (self.qkv[index], output.dense, layer.intermediate.dense, layer.output.dense)
        qkv, attention_out, up, down = (layer_gemm(m) for m in linears)
        return qkv, attention_out, output.LayerNorm, up, down, layer.output.LayerNorm, self.heads, None, self.activation

    def positions(self, batch: PackedBatch) -> torch.Tensor:
        return batch.offsets

    def embed(self, batch: PackedBatch) -> torch.Tensor:
        positions = self.positions(batch)
        if self.embedding is not None:
            fused = host_kernels.embed(self.embedding, batch.ids, positions, batch.types)
            if fused is not None:
                return fused
        e = self.encoder.embeddings
        x = e.word_embeddings(batch.ids) + e.position_embeddings(positions)
        types = batch.types if batch.types is not None else torch.zeros_like(batch.ids)
        return e.LayerNorm(x + e.token_type_embeddings(types))

    def tables(self, x: torch.Tensor, batch: PackedBatch) -> None:
        return None  # absolute positions: added once, in embed()

    def layer(self, index: int, x: torch.Tensor, batch: PackedBatch, tables: None) -> torch.Tensor:
        """A short query's layer in one host-kernel call where it serves (whole_layers_final), else operator
        by operator: the same kernels, the same output."""
        if self.whole_layers and (out := host_kernels.bert_layer(x, self.whole_layers[index], batch)) is not None:
            return out
        return self._layer_by_operators(index, x, batch)

    def _layer_by_operators(self, index: int, x: torch.Tensor, batch: PackedBatch) -> torch.Tensor:
        layer = self.layers[index]
        attention = layer.attention
        q, k, v = self.qkv[index](x).view(x.shape[0], 3, self.heads, -1).unbind(1)  # each (tokens, heads, head_dim)
        context = attend(q, k, v, batch).flatten(1)
        x = add_layer_norm(attention.output.LayerNorm, attention.output.dense(context), x)
        inner = activated(layer.intermediate.dense, x, self.activation)
        return add_layer_norm(layer.output.LayerNorm, layer.output.dense(inner), x)

    def finish(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def logits(self, hidden: torch.Tensor, batch: PackedBatch) -> torch.Tensor:
        pooled = self.encoder.pooler(hidden[batch.firsts].unsqueeze(1))
        return self.head.classifier(pooled)


class RobertaPieces(BertPieces):
    """RoBERTa, XLM-RoBERTa (bge-m3, bge-reranker, multilingual-e5) and CamemBERT: fairseq positions,
    counted from padding_idx + 1 over the tokens that are not the pad token; the head is
    RobertaClassificationHead (dense + tanh + out_proj on <s>), with no pooler."""

    model_types = ("roberta", "xlm-roberta", "camembert")
    classes: ClassVar[dict[ModelKind, tuple[str, ...]]] = {
        ModelKind.EMBEDDING: ("RobertaModel", "XLMRobertaModel", "CamembertModel"),
        ModelKind.RERANKER: (
            "RobertaForSequenceClassification",
            "XLMRobertaForSequenceClassification",
            "CamembertForSequenceClassification",
        ),
        ModelKind.CLASSIFIER: (
            "RobertaForSequenceClassification",
            "XLMRobertaForSequenceClassification",
            "CamembertForSequenceClassification",
        ),
    }
    encoder_attribute = "roberta"

    def positions(self, batch: PackedBatch) -> torch.Tensor:
        # transformers: cumsum(ids != pad) * (ids != pad) + pad, per row; a pad-id token inside a text
        # takes position pad and does not advance the count. Here the cumsum restarts at each sequence.
        pad = self.encoder.embeddings.padding_idx
        real = (batch.ids != pad).long()
        counted = real.cumsum(0)
        before = torch.cat([counted.new_zeros(1), counted])[batch.cu_seqlens[:-1].long()]
        lengths = batch.cu_seqlens.diff().long()
        return (counted - torch.repeat_interleave(before, lengths)) * real + pad

    def logits(self, hidden: torch.Tensor, batch: PackedBatch) -> torch.Tensor:
        head = self.head.classifier
        return head.out_proj(torch.tanh(head.dense(hidden[batch.firsts])))


class DistilBertPieces(BertPieces):
    """DistilBERT (msmarco-distilbert, multi-qa-distilbert): BERT's post-norm layers under other names,
    no token types; the head is pre_classifier + ReLU + classifier on [CLS]."""

    model_types = ("distilbert",)
    classes: ClassVar[dict[ModelKind, tuple[str, ...]]] = {
        ModelKind.EMBEDDING: ("DistilBertModel",),
        ModelKind.RERANKER: ("DistilBertForSequenceClassification",),
        ModelKind.CLASSIFIER: ("DistilBertForSequenceClassification",),
    }
    encoder_attribute = "distilbert"

    @classmethod
    def covers(cls, model: HFModule, kind: ModelKind) -> bool:
        return model.config.activation in ("gelu", "relu") and type(model).__name__ in cls.classes.get(kind, ())

    def __init__(self, model: HFModule, kind: ModelKind):
        self.head: HFModule = model if kind != ModelKind.EMBEDDING else None  # None: an embedder
        self.encoder = model.distilbert if self.head is not None else model
        config = self.encoder.config
        self.heads = config.n_heads
        self.activation = config.activation
        self.layers = list(self.encoder.transformer.layer)
        self.layer_count = len(self.layers)
        self.qkv = [_fuse_named(layer.attention, ("q_lin", "k_lin", "v_lin")) for layer in self.layers]
        self.whole_layers = []
        self.embedding = None

    def weights_final(self) -> None:
        """Its embed() keeps torch's operators (no token type table)."""

    def _layer_parts(self, index: int) -> tuple:
        layer = self.layers[index]
        linears = (self.qkv[index], layer.attention.out_lin, layer.ffn.lin1, layer.ffn.lin2)
        qkv, attention_out, up, down = (layer_gemm(m) for m in linears)
        norms = (layer.sa_layer_norm, layer.output_layer_norm)
        return qkv, attention_out, norms[0], up, down, norms[1], self.heads, layer.attention.scaling, self.activation

    def embed(self, batch: PackedBatch) -> torch.Tensor:
        e = self.encoder.embeddings
        return e.LayerNorm(e.word_embeddings(batch.ids) + e.position_embeddings(batch.offsets))

    def _layer_by_operators(self, index: int, x: torch.Tensor, batch: PackedBatch) -> torch.Tensor:
        layer = self.layers[index]
        q, k, v = self.qkv[index](x).view(x.shape[0], 3, self.heads, -1).unbind(1)
        context = attend(q, k, v, batch, scale=layer.attention.scaling).flatten(1)
        x = add_layer_norm(layer.sa_layer_norm, layer.attention.out_lin(context), x)
        inner = activated(layer.ffn.lin1, x, self.activation)
        return add_layer_norm(layer.output_layer_norm, layer.ffn.lin2(inner), x)

    def logits(self, hidden: torch.Tensor, batch: PackedBatch) -> torch.Tensor:
        return self.head.classifier(torch.relu(self.head.pre_classifier(hidden[batch.firsts])))


def _fuse_projections(self_attention) -> torch.nn.Module:
    return _fuse_named(self_attention, ("query", "key", "value"))


def _fuse_named(attention, names: tuple[str, str, str]) -> torch.nn.Module:
    """One (hidden -> 3 x hidden) linear from the query, key and value projections, which the module
    then drops: their weights would otherwise be held twice."""
    fused = fuse_linears([getattr(attention, name) for name in names])
    for name in names:
        setattr(attention, name, None)
    return fused
