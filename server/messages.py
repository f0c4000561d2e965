"""Proto messages built from engine outputs, shared by the unary and streaming RPCs."""

from __future__ import annotations

from ..v1 import encoderd_pb2 as pb
from . import postprocess
from .errors import InvalidInput

_OUTPUT_DTYPES: dict[int, str] = {
    pb.OUTPUT_DTYPE_FLOAT16: "float16",
    pb.OUTPUT_DTYPE_INT8: "int8",
    pb.OUTPUT_DTYPE_UINT8: "uint8",
    pb.OUTPUT_DTYPE_BINARY: "binary",
    pb.OUTPUT_DTYPE_UBINARY: "ubinary",
}


def embeddings_message(vectors, output_dtype: int) -> list[pb.Embedding]:
    dtype = _OUTPUT_DTYPES.get(output_dtype)
    if dtype is None:
        if output_dtype not in (pb.OUTPUT_DTYPE_UNSPECIFIED, pb.OUTPUT_DTYPE_FLOAT32):
            raise InvalidInput(f"unknown output_dtype {output_dtype}")
        return [pb.Embedding(values=v) for v in vectors.tolist()]
    return [pb.Embedding(data=row.tobytes()) for row in postprocess.quantize(vectors, dtype)]
