"""Pooling over a padded batch in numpy, for engines whose graph ends at the
encoder's hidden states (ONNX Runtime, CTranslate2, TensorRT).

Same semantics as sentence-transformers' Pooling module and the torch
engine's `torch_backend.pool` / `packed_encoder.PackedEncoder.pool`, which keep their
own copies only because they pool on the device before a single copy back to the host.
"""

from __future__ import annotations

import numpy as np

from .contract.model_spec import Pooling, pooling_modes


def pool(hidden: np.ndarray, mask: np.ndarray, pooling: Pooling | tuple[Pooling, ...]) -> np.ndarray:
    """(n, L, d) hidden states and an (n, L) 0/1 mask -> (n, d x modes) float32, unnormalized;
    several modes are concatenated in their order, as sentence-transformers does."""
    hidden = hidden.astype(np.float32, copy=False)
    valid = mask.astype(bool)
    return np.concatenate([_pool_one(hidden, valid, mode) for mode in pooling_modes(pooling)], axis=1)


def _pool_one(hidden: np.ndarray, valid: np.ndarray, mode: Pooling) -> np.ndarray:
    if mode == Pooling.CLS:
        return np.ascontiguousarray(hidden[:, 0])
    if mode == Pooling.LAST_TOKEN:
        # Batches are right-padded (base.padded), so the last real token sits at length - 1.
        last = valid.sum(axis=1) - 1
        return np.ascontiguousarray(hidden[np.arange(hidden.shape[0]), last])
    if mode == Pooling.MAX:
        return np.where(valid[:, :, None], hidden, np.finfo(np.float32).min).max(axis=1)
    weights = valid[:, :, None].astype(np.float32)
    if mode == Pooling.WEIGHTED_MEAN:  # position weights 1, 2, 3... (right padding: from the first token)
        weights = weights * np.arange(1, hidden.shape[1] + 1, dtype=np.float32)[None, :, None]
    total = (hidden * weights).sum(axis=1)
    count = np.maximum(weights.sum(axis=1), 1e-9)
    return total / (np.sqrt(count) if mode == Pooling.MEAN_SQRT_LEN else count)
