"""Never a NaN vector: a model that overflows on some input answers an error for that call,
naming the input, instead of returning NaN or infinity as an embedding (over gRPC a client
would store it; REST could not print it).

The bundled MiniLM with one word-piece embedding ("zebra") set to 1e38: any text holding it
overflows in the first LayerNorm, every other text is computed as before. A real server, its
real worker, the default dtype for this host.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import grpc
import httpx
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file
from support.server import ServerProcess
from tokenizers import Tokenizer

from encoderd.v1 import encoderd_pb2 as pb


def build_overflowing_minilm(minilm: str, out: Path, word: str) -> Path:
    shutil.copytree(minilm, out, ignore=shutil.ignore_patterns("model.safetensors"))  # written below
    token = Tokenizer.from_file(str(out / "tokenizer.json")).token_to_id(word)  # a whole word piece
    weights = load_file(str(Path(minilm) / "model.safetensors"))
    weights["embeddings.word_embeddings.weight"][token] = 1e38
    save_file(weights, str(out / "model.safetensors"))
    return out


@pytest.fixture(scope="module")
def server(tmp_path_factory, minilm_path):
    root = tmp_path_factory.mktemp("non-finite")
    model = build_overflowing_minilm(minilm_path, root / "model", "zebra")
    with ServerProcess("--model", f"m={model}", rest=True, log_path=root / "server.log") as proc:
        yield proc


def test_an_input_that_overflows_is_an_error_never_a_nan_vector(server):
    stub = server.stub()
    with pytest.raises(grpc.RpcError) as error:
        stub.Embed(pb.EmbedRequest(model="m", inputs=["hello there", "a zebra in the grass"]), timeout=60)
    assert error.value.code() == grpc.StatusCode.INTERNAL, error.value.details()
    assert "non-finite values" in error.value.details() and "inputs[1]" in error.value.details()
    assert "inputs[0]" not in error.value.details()
    fine = stub.Embed(pb.EmbedRequest(model="m", inputs=["hello there"]), timeout=60)
    assert np.isfinite(np.array(fine.embeddings[0].values)).all()
    # Not remembered: the same text fails again, it is not answered from the result cache.
    with pytest.raises(grpc.RpcError):
        stub.Embed(pb.EmbedRequest(model="m", inputs=["a zebra in the grass"]), timeout=60)


def test_over_rest_it_is_a_json_error(server):
    response = httpx.post(server.rest_url + "/v1/embeddings", json={"model": "m", "input": ["a zebra"]}, timeout=60)
    assert response.status_code == 500, response.text
    error = response.json()["error"]
    assert error["code"] == "internal" and "non-finite values" in error["message"], error
