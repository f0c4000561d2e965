"""The Python clients against the shared live server."""

import numpy as np

from encoderd.clients import AsyncEncoderClient, EncoderClient
from encoderd.v1 import encoderd_pb2 as pb
from encoderd.workers.model_spec import DEFAULT_MODEL_NAME


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
