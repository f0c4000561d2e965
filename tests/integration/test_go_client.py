"""Generated stubs in another language: Go stubs that protoc-gen-go and protoc-gen-go-grpc make from
protos/encoderd/v1 (the protoc command of docs/api/grpc.md), a client on them (tests/support/go/client), against
the live server. Its answers must be the Python client's, to the bit where the computation is the same.

Built offline from Debian's packages (.ci/run installs them; GOPATH mode, no Go module proxy)."""

from __future__ import annotations

import base64
import json
import os
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
from support.node import googleapis_include

from encoderd.v1 import encoderd_pb2 as pb
from encoderd.workers.contract.model_files import DEFAULT_MODEL_NAME

REPO = Path(__file__).resolve().parents[2]
TOOLS = ("go", "protoc", "protoc-gen-go", "protoc-gen-go-grpc")
GO_LIBRARIES = Path("/usr/share/gocode")  # Debian's golang-google-grpc-dev and friends
GO_PACKAGE = "github.com/encoderd/encoderd/gen/go/encoderd/v1"  # the protos' go_package
TEXTS = ["The quick brown fox jumps over the lazy dog.", "encoderd serves encoder models.", "Umlaute: äöü ß."]
QUERY = "what does a fox do?"


@pytest.fixture(scope="module")
def go_client(tmp_path_factory) -> Path:
    missing = [tool for tool in TOOLS if not shutil.which(tool)]
    if missing or not (GO_LIBRARIES / "src/google.golang.org/grpc").is_dir():
        pytest.skip(f"Go toolchain or Debian's Go gRPC packages missing ({', '.join(missing) or GO_LIBRARIES})")
    root = tmp_path_factory.mktemp("go")
    generated = root / "generated"
    generated.mkdir()
    protoc = ["protoc", "-I", str(REPO / "protos"), "-I", googleapis_include()]
    protoc += [f"--go_out={generated}", "--go_opt=paths=source_relative"]
    protoc += [f"--go-grpc_out={generated}", "--go-grpc_opt=paths=source_relative"]
    _run([*protoc, "encoderd/v1/encoderd.proto", "encoderd/v1/compat.proto"])
    package = root / "gopath/src" / GO_PACKAGE
    shutil.copytree(generated / "encoderd/v1", package)
    shutil.copytree(REPO / "tests/support/go/client", root / "gopath/src/encoderdclient")
    env = {**os.environ, "GO111MODULE": "off", "GOPATH": f"{root / 'gopath'}:{GO_LIBRARIES}"}
    _run(["go", "build", "-o", str(root / "client"), "encoderdclient"], env=env, timeout=600)
    return root / "client"


def _run(command: list[str], timeout: float = 120, **kwargs) -> str:
    result = subprocess.run(command, capture_output=True, text=True, timeout=timeout, check=False, **kwargs)
    assert result.returncode == 0, f"{command[:3]} failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    return result.stdout


def test_a_go_client_on_generated_stubs_gets_the_python_clients_answers(go_client, server, stub):
    request = {"address": server.address, "embedder": DEFAULT_MODEL_NAME, "reranker": "reranker"}
    got = json.loads(_run([str(go_client)], input=json.dumps({**request, "texts": TEXTS, "query": QUERY})))

    assert got["models"][DEFAULT_MODEL_NAME] == "embedding" and got["models"]["reranker"] == "reranker"
    embedded = stub.Embed(pb.EmbedRequest(model=DEFAULT_MODEL_NAME, inputs=TEXTS))
    vectors = np.array([e.values for e in embedded.embeddings], np.float32)
    np.testing.assert_array_equal(np.array(got["vectors"], np.float32), vectors)
    assert got["prompt_tokens"] == embedded.usage.prompt_tokens

    packed = stub.Embed(
        pb.EmbedRequest(model=DEFAULT_MODEL_NAME, inputs=TEXTS[:1], normalize=False, output_dtype=pb.OUTPUT_DTYPE_INT8)
    )
    assert base64.b64decode(got["int8"]) == packed.embeddings[0].data  # Go's JSON writes []byte as base64

    # EmbedStream: one answer per input, the empty one an INVALID_ARGUMENT of its own.
    streamed = {answer["id"]: answer for answer in got["stream"]}
    assert sorted(streamed) == ["a", "b", "c", "d"]
    assert streamed["d"]["error_code"] == 3 and not streamed["d"]["values"]
    for i, item_id in enumerate("abc"):
        assert streamed[item_id]["error_code"] == 0
        np.testing.assert_allclose(streamed[item_id]["values"], vectors[i], atol=1e-6)
    assert sum(streamed[i]["prompt_tokens"] for i in "abc") == embedded.usage.prompt_tokens

    ranked = stub.Rerank(pb.RerankRequest(model="reranker", query=QUERY, documents=TEXTS))
    want = {r.index: r.relevance_score for r in ranked.results}
    assert {int(i): s for i, s in got["rerank"].items()} == pytest.approx(want, abs=1e-6)

    assert got["errors"] == {"unknown_model": "NotFound", "rerank_on_embedder": "FailedPrecondition"}
