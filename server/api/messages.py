"""Proto messages built from engine outputs, shared by the unary and streaming RPCs."""

from __future__ import annotations

from ...v1 import encoderd_pb2 as pb
from ..models import postprocess


def embeddings_message(vectors, output_dtype: str) -> list[pb.Embedding]:
    """`output_dtype`: float32 (values) or a postprocess.QUANTIZERS name (packed bytes)."""
    if output_dtype == "float32":
        return [pb.Embedding(values=v) for v in vectors.tolist()]
    return [pb.Embedding(data=row.tobytes()) for row in postprocess.quantize(vectors, output_dtype)]
