"""The Python clients against the shared live server."""

import numpy as np
import pytest

from encoderd.clients import AsyncEncoderClient, EncoderClient, FailedPrecondition, InvalidArgument, NotFound
from encoderd.v1 import encoderd_pb2 as pb
from encoderd.workers.contract.model_files import DEFAULT_MODEL_NAME


def test_sync_client(server, stub):
    texts = ["first text", "second, longer text about something"]
    want = np.array([e.values for e in stub.Embed(pb.EmbedRequest(model=DEFAULT_MODEL_NAME, inputs=texts)).embeddings])
    with EncoderClient(server.address) as client:
        got = client.embed(texts, model=DEFAULT_MODEL_NAME)
        assert got.vectors.dtype == np.float32 and got.vectors.shape == (2, 384)
        np.testing.assert_array_equal(got.vectors, want.astype(np.float32))
        ranked = client.rerank("cats", ["dogs", "cats are great", "finance"], model="reranker", return_documents=True)
        assert sorted(r.index for r in ranked) == [0, 1, 2] and ranked[0].document
        labels = client.classify(["good"], model="classifier")[0]
        assert labels.top in ("negative", "neutral", "positive") and len(labels.labels) == 3
        assert {m.id for m in client.models()} == {DEFAULT_MODEL_NAME, "reranker", "classifier"}


async def test_async_client(server):
    async with AsyncEncoderClient(server.address) as client:
        got = await client.embed(["hello"], model=DEFAULT_MODEL_NAME, dimensions=32)
        assert got.vectors.shape == (1, 32)
        assert abs(np.linalg.norm(got.vectors[0]) - 1) < 1e-5
        assert len(await client.rerank("q", ["a", "b"], model="reranker", top_n=1)) == 1


def test_output_dtypes_tokenize_and_typed_errors(server):
    texts = ["quantize this sentence", "and this other one, a bit longer"]
    with EncoderClient(server.address) as client:
        ref = client.embed(texts, model=DEFAULT_MODEL_NAME).vectors
        half = client.embed(texts, model=DEFAULT_MODEL_NAME, output_dtype="float16").vectors
        np.testing.assert_array_equal(half, ref.astype(np.float16))
        int8 = client.embed(texts, model=DEFAULT_MODEL_NAME, output_dtype="int8").vectors
        assert int8.dtype == np.int8
        np.testing.assert_array_equal(int8, np.round(np.clip(ref.astype(np.float64), -1, 1) * 127).astype(np.int8))
        ubinary = client.embed(texts, model=DEFAULT_MODEL_NAME, output_dtype="ubinary").vectors
        np.testing.assert_array_equal(ubinary, np.packbits(ref > 0, axis=-1))
        tokens = client.tokenize(["hello world"], model=DEFAULT_MODEL_NAME)[0]
        assert tokens.tokens == ["[CLS]", "hello", "world", "[SEP]"] and tokens.offsets[1:3] == [(0, 5), (6, 11)]
        assert client.tokenize(["hello"], model=DEFAULT_MODEL_NAME, add_special_tokens=False)[0].tokens == ["hello"]
        with pytest.raises(NotFound, match="nope"):
            client.embed(["a"], model="nope")
        with pytest.raises(FailedPrecondition):
            client.rerank("q", ["a"], model=DEFAULT_MODEL_NAME)
        with pytest.raises(InvalidArgument) as err:
            client.embed([""], model=DEFAULT_MODEL_NAME)
        assert err.value.attempts == 1 and err.value.message


async def test_async_bulk_stream_matches_the_sync_one(server):
    items = [(f"id-{i}", f"text number {i}") for i in range(20)]
    with EncoderClient(server.address) as client:
        want = {r.id: r.vector for r in client.embed_stream(items, model=DEFAULT_MODEL_NAME)}
    async with AsyncEncoderClient(server.address) as client:
        got = {r.id: r.vector async for r in client.embed_stream(items, model=DEFAULT_MODEL_NAME)}
    assert got.keys() == want.keys()
    for key, vector in got.items():
        np.testing.assert_allclose(vector, want[key], atol=1e-6)
