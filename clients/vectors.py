"""Decoding of the vectors in responses, for every OutputDtype."""

from __future__ import annotations

import numpy as np

from ..v1 import encoderd_pb2 as pb

# Packed dtypes arrive in Embedding.data as little-endian bytes (see OutputDtype in the proto).
_NUMPY: dict[int, str] = {
    pb.OUTPUT_DTYPE_FLOAT16: "<f2",
    pb.OUTPUT_DTYPE_INT8: "i1",
    pb.OUTPUT_DTYPE_UINT8: "u1",
    pb.OUTPUT_DTYPE_BINARY: "i1",
    pb.OUTPUT_DTYPE_UBINARY: "u1",
}


def output_dtype(value: str | pb.OutputDtype) -> pb.OutputDtype:
    """The OutputDtype enum for "float32", "float16", "int8", "uint8", "binary", "ubinary" (or the enum)."""
    if isinstance(value, int):
        return value
    try:
        return pb.OutputDtype.Value(f"OUTPUT_DTYPE_{value.upper()}")
    except ValueError:
        raise ValueError(f"unknown output dtype {value!r}") from None


def decode(embedding: pb.Embedding, dtype: int) -> np.ndarray:
    """One vector: float32 values, or the packed bytes as their numpy dtype (bits stay packed)."""
    if dtype in _NUMPY:
        return np.frombuffer(embedding.data, dtype=_NUMPY[dtype])
    return np.asarray(embedding.values, dtype=np.float32)


def stack(embeddings, dtype: int) -> np.ndarray:
    """(n, dim) array of a response's vectors, in input order."""
    if not embeddings:
        return np.zeros((0, 0), dtype=np.float32)
    return np.stack([decode(e, dtype) for e in embeddings])
