"""Issue 18: the in-process API (`import encoderd`) gives the same outputs as the gRPC server for
the same models and inputs: the session server (tests/conftest.py) against an AsyncEngine over
the same three models, started in the test's own event loop."""

from __future__ import annotations

import multiprocessing
import shutil

import numpy as np
import pytest

import encoderd
from encoderd.server.base.errors import ModelNotFound, WrongModelKind
from encoderd.server.scheduling.worker_client import WorkerStartError
from encoderd.v1 import encoderd_pb2 as pb
from encoderd.workers.contract.model_files import DEFAULT_MODEL_NAME, default_model_path

# The module's engine starts three workers beside the session server's: minutes on a loaded 2-core host.
pytestmark = pytest.mark.timeout(600)

TEXTS = ["first text", "a second, longer text about encoder models and how they are served", "third"]
DOCUMENTS = ["dogs", "cats are great pets", "quarterly finance report", "a cat sat on the mat"]


@pytest.fixture(scope="module")
async def engine(reranker_path, classifier_path):
    async with encoderd.AsyncEngine(
        f"{DEFAULT_MODEL_NAME}={default_model_path()}", f"reranker={reranker_path}", f"classifier={classifier_path}"
    ) as engine:
        yield engine


async def test_embeddings_equal_the_servers(engine, stub):
    got = await engine.embed(TEXTS, model=DEFAULT_MODEL_NAME)
    reply = stub.Embed(pb.EmbedRequest(model=DEFAULT_MODEL_NAME, inputs=TEXTS))
    want = np.array([e.values for e in reply.embeddings], dtype=np.float32)
    assert got.dtype == np.float32 and got.shape == (3, 384)
    np.testing.assert_array_equal(got, want)
    np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1, atol=1e-6)  # normalized, as the server's default
    packed = await engine.embed(TEXTS, model=DEFAULT_MODEL_NAME, output_dtype="int8", dimensions=128)
    reply = stub.Embed(
        pb.EmbedRequest(model=DEFAULT_MODEL_NAME, inputs=TEXTS, dimensions=128, output_dtype=pb.OUTPUT_DTYPE_INT8)
    )
    assert [row.tobytes() for row in packed] == [e.data for e in reply.embeddings]


async def test_rerank_classify_and_tokenize_equal_the_servers(engine, stub):
    ranked = await engine.rerank("cats", DOCUMENTS, model="reranker", top_n=3, return_documents=True)
    reply = stub.Rerank(pb.RerankRequest(model="reranker", query="cats", documents=DOCUMENTS, top_n=3))
    assert [(r.index, np.float32(r.score)) for r in ranked] == [(r.index, r.relevance_score) for r in reply.results]
    assert ranked[0].document == DOCUMENTS[ranked[0].index]

    classes = await engine.classify(TEXTS, model="classifier")
    reply = stub.Classify(pb.ClassifyRequest(model="classifier", inputs=TEXTS))
    assert [[(label, np.float32(score)) for label, score in row] for row in classes] == [
        [(s.label, s.score) for s in c.labels] for c in reply.results
    ]

    tokens = await engine.tokenize(TEXTS, model=DEFAULT_MODEL_NAME)
    reply = stub.Tokenize(pb.TokenizeRequest(model=DEFAULT_MODEL_NAME, inputs=TEXTS))
    assert [(t.ids, t.tokens, t.offsets) for t in tokens] == [
        (list(r.ids), list(r.tokens), [(o.start, o.end) for o in r.offsets]) for r in reply.results
    ]


async def test_errors_are_the_servers(engine):
    assert engine.models == {DEFAULT_MODEL_NAME: "embedding", "reranker": "reranker", "classifier": "classifier"}
    with pytest.raises(ModelNotFound, match="model 'nope' is not served here"):
        await engine.embed(TEXTS, model="nope")
    with pytest.raises(WrongModelKind, match="is a reranker model"):
        await engine.embed(TEXTS, model="reranker")


def test_bad_settings_raise_value_error_before_anything_starts():
    with pytest.raises(ValueError, match="bad --dtype 'float64'"):
        encoderd.AsyncEngine(dtype="float64")
    with pytest.raises(ValueError, match="unrecognized arguments: --no-such-option"):
        encoderd.AsyncEngine(no_such_option=1)


async def test_a_failed_start_leaves_no_worker_running(tmp_path, reranker_path):
    # A copy of the bundled model with its weights cut short: the frontend reads its files, its worker fails.
    broken = tmp_path / "broken"
    shutil.copytree(default_model_path(), broken)
    weights = broken / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:4096])
    running = set(multiprocessing.active_children())  # the module's engine's workers
    engine = encoderd.AsyncEngine(f"broken={broken}", f"reranker={reranker_path}", worker_stall_timeout=0)
    with pytest.raises(WorkerStartError, match="broken@cpu"):
        await engine.start()
    assert set(multiprocessing.active_children()) <= running
