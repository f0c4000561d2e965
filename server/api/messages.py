"""Proto messages built from engine outputs, shared by the unary and streaming RPCs."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from google.api import httpbody_pb2

from ...v1 import encoderd_pb2 as pb
from ..models import postprocess

# Field numbers of what float32 vectors are written into (read from the schema, not copied).
_EMBEDDINGS_FIELD = pb.EmbedResponse.DESCRIPTOR.fields_by_name["embeddings"].number
_VALUES_FIELD = pb.Embedding.DESCRIPTOR.fields_by_name["values"].number
_LENGTH_DELIMITED = 2  # the wire type of messages and packed repeated fields
_CONTENT_TYPE_FIELD = httpbody_pb2.HttpBody.DESCRIPTOR.fields_by_name["content_type"].number
_DATA_FIELD = httpbody_pb2.HttpBody.DESCRIPTOR.fields_by_name["data"].number


def embeddings_message(vectors, output_dtype: str) -> Sequence[pb.Embedding]:
    """`output_dtype`: float32 (values) or a postprocess.QUANTIZERS name (packed bytes)."""
    if output_dtype == "float32":
        return float_embeddings(np.asarray(vectors))
    return [pb.Embedding(data=row.tobytes()) for row in postprocess.quantize(vectors, output_dtype)]


class Serialized:
    """A response already in its wire format: the gRPC handlers send `wire` as it is (handlers._serialize;
    gRPC takes exactly bytes, no subclass)."""

    __slots__ = ("wire",)

    def __init__(self, wire: bytes):
        self.wire = wire


def with_embeddings(response, vectors, output_dtype: str):
    """`response` (an EmbedResponse or EmbedMultimodalResponse: `repeated Embedding embeddings`) with
    the vectors added. Float32 ones are written in wire format between the response's own fields
    (the bytes protobuf would send: fields in number order) and the answer goes as Serialized:
    built as messages, 2,048 x 384 of them were copied into the response (~1.5 ms), then
    serialized back by gRPC (~2-3 ms), on the event loop other callers' queries wait for
    (bench.answer). Quantized ones as messages."""
    if output_dtype != "float32":
        response.embeddings.extend(embeddings_message(vectors, output_dtype))
        return response
    number = response.DESCRIPTOR.fields_by_name["embeddings"].number
    before, after = type(response)(), type(response)()
    before.CopyFrom(response)
    after.CopyFrom(response)
    for field in response.DESCRIPTOR.fields:
        if field.number > number:
            before.ClearField(field.name)
        elif field.number < number:
            after.ClearField(field.name)
    wire = _float_embeddings_wire(np.asarray(vectors), number)
    return Serialized(b"".join((before.SerializeToString(), wire, after.SerializeToString())))


def float_embeddings(vectors: np.ndarray) -> Sequence[pb.Embedding]:
    """One Embedding of `values` per row, parsed from its wire format written with numpy: the same
    messages as pb.Embedding(values=row.tolist()), without a Python float per value. Built on the
    event loop, the slow way held it 57-70 ms for a 2,048 x 384 answer (every other caller's query
    waited behind it, bench/fair.py); this way 1-3 ms."""
    return pb.EmbedResponse.FromString(_float_embeddings_wire(vectors, _EMBEDDINGS_FIELD)).embeddings


def _float_embeddings_wire(vectors: np.ndarray, field: int) -> memoryview:
    """The rows as repeated Embedding messages of a response's field `field`, in wire format."""
    rows, width = vectors.shape
    inner = _tag(_VALUES_FIELD) + _varint(4 * width)  # the packed `values` field's header
    head = _tag(field) + _varint(len(inner) + 4 * width) + inner  # an Embedding's, before it
    wire = np.empty((rows, len(head) + 4 * width), dtype=np.uint8)
    wire[:, : len(head)] = np.frombuffer(head, dtype=np.uint8)
    wire[:, len(head) :] = np.ascontiguousarray(vectors, dtype="<f4").view(np.uint8).reshape(rows, 4 * width)
    return wire.reshape(-1).data


def _tag(field: int) -> bytes:
    return _varint(field << 3 | _LENGTH_DELIMITED)


def _varint(value: int) -> bytes:
    out = bytearray()
    while value > 0x7F:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def http_body(content_type: str, chunks: list[bytes]) -> Serialized:
    """An HttpBody of `chunks` joined, in wire format: a 10 MB REST answer is copied once here, where
    the message built from it and then serialized copied it twice more on the event loop."""
    kind = content_type.encode()
    size = sum(len(chunk) for chunk in chunks)
    head = _tag(_CONTENT_TYPE_FIELD) + _varint(len(kind)) + kind + _tag(_DATA_FIELD) + _varint(size)
    return Serialized(b"".join([head, *chunks]))
