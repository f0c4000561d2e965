"""The float32 embeddings written from their wire format (server/api/messages.py) are the messages
protobuf itself builds from the same values, for every shape and value a model can give."""

from __future__ import annotations

import numpy as np
import pytest

from encoderd.server.api import handlers
from encoderd.server.api.messages import Serialized, embeddings_message, with_embeddings
from encoderd.v1 import encoderd_pb2 as pb


def built_by_protobuf(vectors: np.ndarray) -> pb.EmbedResponse:
    return pb.EmbedResponse(embeddings=[pb.Embedding(values=row) for row in vectors.tolist()])


@pytest.mark.parametrize("shape", [(2048, 384), (1, 1024), (3, 1), (0, 384), (2, 0), (2, 40_000)])
@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.float16])
def test_float_embeddings_are_the_messages_protobuf_builds(shape, dtype):
    vectors = np.random.default_rng(0).standard_normal(shape).astype(dtype)
    if vectors.size:
        vectors.flat[: min(4, vectors.size)] = [-0.0, np.inf, -np.inf, 1e-45][: min(4, vectors.size)]
    expected = built_by_protobuf(vectors)
    got = pb.EmbedResponse(embeddings=embeddings_message(vectors, "float32"))
    assert got.SerializeToString() == expected.SerializeToString()
    assert [list(e.values) for e in got.embeddings] == [list(e.values) for e in expected.embeddings]


def test_nan_survives_bit_for_bit_and_each_embedding_stands_alone():
    vectors = np.array([[np.nan, 1.5], [2.0, -3.25]], dtype=np.float32)
    embeddings = embeddings_message(vectors, "float32")
    assert len(embeddings) == 2
    # A streamed answer takes one embedding at a time (streaming.py): a copy with its own values.
    answer = pb.EmbedStreamResponse(id="7", embedding=embeddings[1])
    assert list(answer.embedding.values) == [2.0, -3.25]
    assert np.isnan(embeddings[0].values[0]) and embeddings[0].values[1] == 1.5
    assert embeddings[0].SerializeToString() == pb.Embedding(values=vectors[0].tolist()).SerializeToString()


def test_a_non_contiguous_view_is_written_row_by_row():
    vectors = np.arange(24, dtype=np.float32).reshape(4, 6)[:, ::2]  # strided columns
    got = pb.EmbedResponse(embeddings=embeddings_message(vectors, "float32"))
    assert got.SerializeToString() == built_by_protobuf(vectors).SerializeToString()


@pytest.mark.parametrize("response_type", [pb.EmbedResponse, pb.EmbedMultimodalResponse])
@pytest.mark.parametrize("output_dtype", ["float32", "int8", "binary"])
@pytest.mark.parametrize("usage", [pb.Usage(prompt_tokens=9, total_tokens=9), None])
def test_an_answer_with_embeddings_is_the_bytes_protobuf_sends(response_type, output_dtype, usage):
    """with_embeddings writes float32 vectors in wire format between the response's own fields and
    hands gRPC the bytes (Serialized, sent as they are: no copy into messages, no serializing back):
    the very bytes protobuf sends for the same response, fields in number order; quantized ones as
    messages, as before."""
    vectors = np.random.default_rng(1).standard_normal((5, 16)).astype(np.float32)
    fields = {"model": "m", "usage": usage} if usage else {"model": "m"}
    got = with_embeddings(response_type(**fields), vectors, output_dtype)
    expected = response_type(**fields, embeddings=embeddings_message(vectors, output_dtype))
    assert isinstance(got, Serialized) == (output_dtype == "float32")
    sent = handlers._serialize(got)
    assert sent == expected.SerializeToString() and response_type.FromString(sent) == expected
    if output_dtype == "float32":
        assert sent == response_type(**fields, embeddings=built_by_protobuf(vectors).embeddings).SerializeToString()
