"""Pooling over a padded batch in numpy, for engines whose graph ends at the
encoder's hidden states (ONNX Runtime, CTranslate2, TensorRT).

Same semantics as sentence-transformers' Pooling module and the torch
engine's `torch_backend.pool`, which keeps its own copy only because it
pools on the device before a single copy back to the host.
"""

from __future__ import annotations

import numpy as np

from .model_spec import Pooling


def pool(hidden: np.ndarray, mask: np.ndarray, pooling: Pooling) -> np.ndarray:
    """(n, L, d) hidden states and an (n, L) 0/1 mask -> (n, d) float32, unnormalized."""
    hidden = hidden.astype(np.float32, copy=False)
    if pooling == Pooling.CLS:
        return np.ascontiguousarray(hidden[:, 0])
    valid = mask.astype(bool)
    if pooling == Pooling.LAST_TOKEN:
        # Batches are right-padded (base.padded), so the last real token sits at length - 1.
        last = valid.sum(axis=1) - 1
        return np.ascontiguousarray(hidden[np.arange(hidden.shape[0]), last])
    if pooling == Pooling.MAX:
        return np.where(valid[:, :, None], hidden, np.finfo(np.float32).min).max(axis=1)
    weights = valid[:, :, None].astype(np.float32)
    return (hidden * weights).sum(axis=1) / np.maximum(weights.sum(axis=1), 1e-9)
