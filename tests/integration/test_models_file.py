"""Issue 18: one server, two models from a models file (ENCODERD_CONFIG), each with its own engine
and dtype: an ONNX int8 embedder beside a torch float32 reranker, while the bare --dtype flag
asks for something else that neither model takes."""

from __future__ import annotations

import numpy as np
import pytest
from support.server import ServerProcess

from encoderd.v1 import encoderd_pb2 as pb
from encoderd.workers.contract.model_files import DEFAULT_MODEL_NAME, default_model_path

# The server exports MiniLM to ONNX int8 and self-checks it at start: minutes on a loaded 2-core host.
pytestmark = pytest.mark.timeout(600)

TEXTS = ["first text", "a second, longer text about encoder models and how they are served", "third"]
DOCUMENTS = ["dogs", "cats are great pets", "quarterly finance report"]


@pytest.fixture(scope="module")
def file_server(tmp_path_factory, reranker_path):
    pytest.importorskip("onnxruntime")
    root = tmp_path_factory.mktemp("models-file")
    models = root / "models.toml"
    models.write_text(f"""\
[models.mini]                 # int8 through ONNX Runtime
source = "{default_model_path()}"
engine = "onnx"
dtype = "int8"
batch-size = 8

[models.reranker]             # float32 through torch
source = "{reranker_path}"
kind = "reranker"
engine = "torch"
dtype = "float32"
""")
    with ServerProcess(
        "--dtype",
        "bfloat16",
        "--cache-dir",
        str(root / "cache"),
        env={"ENCODERD_CONFIG": str(models)},
        log_path=root / "server.log",
    ) as server:
        yield server


def test_each_model_runs_with_its_own_engine_and_dtype(file_server, stub):
    listed = {m.id: m for m in file_server.stub().ListModels(pb.ListModelsRequest()).models}
    assert sorted(listed) == ["mini", "reranker"]
    assert (listed["mini"].engine, listed["mini"].dtype) == ("onnx", "int8")
    assert (listed["reranker"].engine, listed["reranker"].dtype) == ("torch", "float32")

    # The reranker computes exactly what the session server's default torch float32 reranker does...
    mine = file_server.stub().Rerank(pb.RerankRequest(model="reranker", query="cats", documents=DOCUMENTS))
    reference = stub.Rerank(pb.RerankRequest(model="reranker", query="cats", documents=DOCUMENTS))
    assert [(r.index, r.relevance_score) for r in mine.results] == [
        (r.index, r.relevance_score) for r in reference.results
    ]
    # ...and the int8 embedder stays close to the float32 one.
    got = file_server.stub().Embed(pb.EmbedRequest(model="mini", inputs=TEXTS))
    want = stub.Embed(pb.EmbedRequest(model=DEFAULT_MODEL_NAME, inputs=TEXTS))
    cosines = [np.dot(a.values, b.values) for a, b in zip(got.embeddings, want.embeddings, strict=True)]
    assert min(cosines) > 0.98, cosines
