"""Issue 20: options and models resolved the same way on every route, on a server that
serves one ColBERT model only (so a call naming no model can only mean it) and has a
--bulk-api-key: the drift bugs the issue found, over gRPC and REST through Envoy."""

from __future__ import annotations

import re
import urllib.request

import grpc
import httpx
import numpy as np
import pytest
from support.multimodal_models import build_colbert
from support.server import ServerProcess

from encoderd.v1 import encoderd_pb2 as pb

USER, INGEST = "user-key", "ingest-key"
NONE_FITS = "needs an embedding or clip or clap model, and none is served here (served: colbert (colbert))"


@pytest.fixture(scope="module")
def server(tmp_path_factory, models_dir):
    proc = ServerProcess(
        "--model",
        f"colbert={build_colbert(models_dir / 'mm-colbert')}",
        "--cpu-threads",
        "1",
        "--api-key",
        USER,
        "--bulk-api-key",
        INGEST,
        rest=True,
        log_path=tmp_path_factory.mktemp("options") / "server.log",
    ).start()
    yield proc
    assert proc.stop() == 0, proc.log_text()


@pytest.fixture(scope="module")
def stub(server):
    return server.stub()


def http(server, key: str) -> httpx.Client:
    return httpx.Client(
        base_url=server.rest_url, timeout=60, trust_env=False, headers={"Authorization": f"Bearer {key}"}
    )


def auth(key: str) -> tuple:
    return (("authorization", f"Bearer {key}"),)


def queued(server, priority: str) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=5).read().decode()
    series = f'encoderd_queued_inputs_total{{model="colbert",priority="{priority}"}}'
    return sum(float(v) for v in re.findall(rf"^{re.escape(series)} (\S+)$", text, re.M))


# ------------------------------------------------------ a call naming no model
def test_embeddings_naming_no_model_are_the_colbert_token_vectors(server, stub):
    """Was: 400 "model 'colbert' is a colbert model; this call needs a embedding ... model"."""
    with http(server, USER) as client:
        for path, body in (
            ("/v1/embeddings", {"input": ["one unnamed call"]}),
            ("/embeddings", {"input": ["one unnamed call"], "model": "default/not-specified"}),  # Infinity's client
        ):
            response = client.post(path, json=body)
            assert response.status_code == 200, response.text
            assert response.json()["model"] == "colbert"
            got = np.array(response.json()["data"][0]["embedding"], dtype=np.float32)
            named = stub.EmbedMultiVector(
                pb.EmbedMultiVectorRequest(model="colbert", inputs=[pb.Content(text="one unnamed call")]),
                metadata=auth(USER),
            ).embeddings[0]
            np.testing.assert_allclose(got.reshape(-1), named.values, atol=1e-6)


def test_a_route_no_served_model_fits_says_what_it_needs_and_what_is_served(server, stub):
    with pytest.raises(grpc.RpcError) as err:
        stub.Embed(pb.EmbedRequest(inputs=["x"]), metadata=auth(USER))
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert NONE_FITS in err.value.details()
    with http(server, USER) as client:
        for path in ("/v1/encoderd/embed", "/embed"):  # the Encoder API over REST, TEI's /embed
            response = client.post(path, json={"inputs": ["x"]})
            assert response.status_code == 400, response.text
            assert NONE_FITS in response.json()["error"]["message"]
        reranking = client.post("/v1/rerank", json={"query": "q", "documents": ["d"]})
        assert reranking.status_code == 400 and "needs a reranker model" in reranking.text


# ---------------------------------------------------------- the bulk key's priority
def calls(server, stub, key: str, tag: str):
    """Multi-vector calls on each route, each with its own text (a repeated one would come from the cache)."""
    with http(server, key) as client:
        for path, body in (
            ("/v1/embeddings", {"model": "colbert", "input": [f"openai {tag}"]}),
            ("/embeddings", {"model": "colbert", "input": f"infinity {tag}"}),
            ("/embed_all", {"model": "colbert", "inputs": f"tei {tag}"}),
        ):
            response = client.post(path, json=body)
            assert response.status_code == 200, response.text
    request = pb.EmbedMultiVectorRequest(model="colbert", inputs=[pb.Content(text=f"grpc {tag}")])
    stub.EmbedMultiVector(request, metadata=auth(key))


def test_every_multi_vector_route_takes_the_bulk_keys_priority(server, stub):
    """Was: the OpenAI / Infinity /embeddings routes queued a bulk key's multi-vector calls as interactive."""
    bulk, interactive = queued(server, "bulk"), queued(server, "interactive")
    calls(server, stub, INGEST, "from the ingestion job")
    assert (queued(server, "bulk"), queued(server, "interactive")) == (bulk + 4, interactive)
    calls(server, stub, USER, "from a user")
    assert (queued(server, "bulk"), queued(server, "interactive")) == (bulk + 4, interactive + 4)
