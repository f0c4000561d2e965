"""Vectorized output post-processing: normalization, matryoshka, activations."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from ..base.errors import InvalidInput

if TYPE_CHECKING:
    from ...workers.contract.model_spec import ModelSpec
    from .request_options import EmbedOptions


def check_dimensions(dimensions: int, width: int, field: str = "dimensions") -> None:
    """`dimensions` (0: all) within the model's `width`; `field`: what the caller's API calls it."""
    if dimensions < 0 or dimensions > width:
        raise InvalidInput(f"`{field}` must be between 1 and {width} for this model, not {dimensions}")


def finish_embeddings(
    pooled: np.ndarray, *, normalize: bool, dimensions: int = 0, field: str = "dimensions", truncate_dim: int = 0
) -> np.ndarray:
    """A request's `dimensions`: truncate first, then L2-normalize (truncated vectors stay unit length).
    Without it, a model's own `truncate_dim` (config_sentence_transformers.json) cuts after the
    normalization, which is not redone: sentence-transformers' vectors, whose length is then below 1.
    `dimensions` may narrow a truncate_dim model further, as on any model."""
    width = min(truncate_dim, pooled.shape[1]) if truncate_dim else pooled.shape[1]
    check_dimensions(dimensions, width, field)
    out = pooled[:, :dimensions] if dimensions else pooled
    if normalize:
        norms = np.linalg.norm(out, axis=1, keepdims=True)
        out = out / np.maximum(norms, 1e-12)
    return np.ascontiguousarray(out[:, :width], dtype=np.float32)


def finish_requested(pooled: np.ndarray, spec: ModelSpec, options: EmbedOptions) -> np.ndarray:
    """finish_embeddings as a request's EmbedOptions ask (server/models/request_options.py) of `spec`'s model."""
    return finish_embeddings(
        pooled,
        normalize=options.normalizes(spec.normalize),
        dimensions=options.dimensions,
        field=options.dimensions_field,
        truncate_dim=spec.truncate_dim,
    )


def sigmoid(logits: np.ndarray) -> np.ndarray:
    return (1.0 / (1.0 + np.exp(-logits.astype(np.float64)))).astype(np.float32)


def softmax(logits: np.ndarray) -> np.ndarray:
    shifted = logits.astype(np.float64) - logits.max(axis=1, keepdims=True)
    exp = np.exp(shifted)
    return (exp / exp.sum(axis=1, keepdims=True)).astype(np.float32)


def scores(logits: np.ndarray, activation: str, raw: bool = False) -> np.ndarray:
    """Reranker (n,) or classifier (n, labels) logits -> scores by the model's ScoreActivation
    (softmax over labels, sigmoid per label, or identity); `raw` asks for the logits as they are."""
    if raw or activation == "identity":
        return logits.astype(np.float32, copy=False)
    if activation == "sigmoid":
        return sigmoid(logits)
    if activation == "softmax":
        return softmax(logits)
    raise ValueError(f"unknown score activation {activation!r}")


def rank(scores: np.ndarray, top_n: int) -> np.ndarray:
    """Indices of the best `top_n` scores (all when 0), best first; ties keep input order."""
    order = np.argsort(-scores, kind="stable")
    return order[:top_n] if top_n else order


# Output dtypes other than float32, packed little-endian (see OutputDtype in the proto). The integer
# scales run in float64, where they are exact for float32 inputs: in float32 the product itself rounds
# and lands a step off the proto's formula on about 1 value in 170,000.
def _int8(v: np.ndarray) -> np.ndarray:
    return np.round(np.clip(v.astype(np.float64), -1, 1) * 127).astype(np.int8)


def _uint8(v: np.ndarray) -> np.ndarray:
    return np.round((np.clip(v.astype(np.float64), -1, 1) + 1) * 127.5).astype(np.uint8)


def _ubinary(v: np.ndarray) -> np.ndarray:
    return np.packbits(v > 0, axis=-1)


def _binary(v: np.ndarray) -> np.ndarray:
    return (_ubinary(v).astype(np.int16) - 128).astype(np.int8)


QUANTIZERS = {
    "float16": lambda v: v.astype("<f2"),
    "int8": _int8,
    "uint8": _uint8,
    "binary": _binary,
    "ubinary": _ubinary,
}


def quantize(vectors: np.ndarray, dtype: str) -> np.ndarray:
    """(n, dim) float32 -> (n, k) array of `dtype`'s packed representation."""
    return QUANTIZERS[dtype](vectors)
