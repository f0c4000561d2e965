"""Issue 43, items 1 and 4: the settings sentence-transformers 6.3 reads from a model directory
besides its modules (workers/contract/st_config.py), served as it applies them or refused at start
naming the key and the file; a StaticEmbedding model refused naming the module and its file.

Every model here is saved by sentence-transformers itself from the bundled MiniLM, and every served
vector is compared with what SentenceTransformer returns for the same saved directory.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import grpc
import numpy as np
import pytest
from support.corpus import sentences
from support.server import ServerProcess

from encoderd.v1 import encoderd_pb2 as pb
from encoderd.workers.contract.model_files import default_model_path
from encoderd.workers.contract.model_spec import ModelLoadError
from encoderd.workers.contract.spec_reader import load_model_spec

TRUNCATE_DIM = 64
TEXTS = [*sentences(6, max_words=40, seed=43), "   .   ", "a" * 300]


def _save(directory: Path, **kwargs) -> str:
    from sentence_transformers import SentenceTransformer

    SentenceTransformer(default_model_path(), device="cpu", **kwargs).save(str(directory))
    return str(directory)


def _encode(path: str, texts: list[str], **kwargs) -> np.ndarray:
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(path, device="cpu").encode(texts, convert_to_numpy=True, **kwargs)


def _edit(path: str, into: Path, file: str, change) -> str:
    """A copy of the saved model with `change(settings)` applied to its `file` (absent: {})."""
    shutil.copytree(path, into)
    target = into / file
    data = json.loads(target.read_text()) if target.exists() else {}
    target.write_text(json.dumps(change(data) or data))
    return str(into)


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("st-settings")
    return {"plain": _save(root / "plain"), "truncated": _save(root / "truncated", truncate_dim=TRUNCATE_DIM)}


# --------------------------------------------------------------- truncate_dim
@pytest.fixture(scope="module")
def truncated_server(saved, tmp_path_factory):
    log = tmp_path_factory.mktemp("truncate-logs") / "server.log"
    with ServerProcess("--model", f"cut={saved['truncated']}", rest=True, log_path=log) as server:
        yield server


def test_truncate_dim_is_served_as_sentence_transformers_serves_it(saved, truncated_server):
    """Cut after Normalize, not re-normalized; fails on the old code (384 dimensions served)."""
    want = _encode(saved["truncated"], TEXTS)
    assert want.shape == (len(TEXTS), TRUNCATE_DIM)
    assert np.all(np.linalg.norm(want, axis=1) < 0.999)  # the reference does not re-normalize
    stub = truncated_server.stub()
    response = stub.Embed(pb.EmbedRequest(model="cut", inputs=TEXTS))
    got = np.array([e.values for e in response.embeddings], dtype=np.float32)
    np.testing.assert_allclose(got, want, atol=2e-6)
    [info] = stub.ListModels(pb.ListModelsRequest()).models
    assert info.dimensions == TRUNCATE_DIM


def test_truncate_dim_reported_over_rest(truncated_server):
    import urllib.request

    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    with opener.open(truncated_server.rest_url + "/v1/models", timeout=10) as response:
        [model] = json.loads(response.read())["data"]
    assert model["id"] == "cut" and model["dimensions"] == TRUNCATE_DIM
    request = urllib.request.Request(
        truncated_server.rest_url + "/v1/embeddings",
        data=json.dumps({"model": "cut", "input": TEXTS[:2]}).encode(),
        headers={"Content-Type": "application/json"},
    )
    with opener.open(request, timeout=30) as response:
        data = json.loads(response.read())["data"]
    assert [len(row["embedding"]) for row in data] == [TRUNCATE_DIM] * 2


def test_dimensions_still_narrow_a_truncate_dim_model(saved, truncated_server):
    """A request's `dimensions` cuts further and re-normalizes, as on any model: sentence-transformers'
    encode(truncate_dim=32, normalize_embeddings=True) on the same directory."""
    want = _encode(saved["truncated"], TEXTS, truncate_dim=32, normalize_embeddings=True)
    stub = truncated_server.stub()
    response = stub.Embed(pb.EmbedRequest(model="cut", inputs=TEXTS, dimensions=32))
    got = np.array([e.values for e in response.embeddings], dtype=np.float32)
    np.testing.assert_allclose(got, want, atol=2e-6)
    with pytest.raises(grpc.RpcError) as error:
        stub.Embed(pb.EmbedRequest(model="cut", inputs=TEXTS[:1], dimensions=TRUNCATE_DIM + 1))
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert f"between 1 and {TRUNCATE_DIM}" in error.value.details()


def test_truncate_dim_spec(saved):
    assert load_model_spec("cut", saved["truncated"]).truncate_dim == TRUNCATE_DIM
    assert load_model_spec("plain", saved["plain"]).truncate_dim == 0


# --------------------------------------------------------------- other keys
def test_processor_kwargs_max_length_wins_as_in_sentence_transformers(saved, tmp_path):
    from sentence_transformers import SentenceTransformer

    path = _edit(
        saved["plain"],
        tmp_path / "short",
        "sentence_bert_config.json",
        lambda c: {**c, "max_seq_length": 200, "processor_kwargs": {"model_max_length": 24}},
    )
    assert load_model_spec("short", path).max_length == SentenceTransformer(path, device="cpu").max_seq_length == 24


def test_requirements_checked_as_sentence_transformers_checks_them(saved, tmp_path):
    from sentence_transformers import SentenceTransformer

    unmet = _edit(
        saved["plain"],
        tmp_path / "unmet",
        "config_sentence_transformers.json",
        lambda c: {**c, "requirements": {"transformers": ">=99"}},
    )
    with pytest.raises(ImportError):
        SentenceTransformer(unmet, device="cpu")
    with pytest.raises(ModelLoadError, match=r"config_sentence_transformers\.json: requirements .*transformers>=99"):
        load_model_spec("unmet", unmet)
    met = _edit(
        saved["plain"],
        tmp_path / "met",
        "config_sentence_transformers.json",
        lambda c: {**c, "requirements": {"pytorch": ">=2", "python": ">=3.9"}},
    )
    load_model_spec("met", met)


REFUSED = {
    # file, change, the key the message names
    "processing-kwargs": (
        "sentence_bert_config.json",
        lambda c: {**c, "processing_kwargs": {"text": {"padding": "max_length"}}},
        "processing_kwargs",
    ),
    "query-length": ("sentence_bert_config.json", lambda c: {**c, "query_length": 32}, "query_length"),
    "config-kwargs": (
        "sentence_bert_config.json",
        lambda c: {**c, "config_kwargs": {"num_hidden_layers": 3}},
        "config_kwargs sets num_hidden_layers",
    ),
    "tokenizer-args": (
        "sentence_bert_config.json",
        lambda c: {**c, "tokenizer_args": {"do_lower_case": False}},
        "tokenizer_args sets do_lower_case",
    ),
    "tokenizer-path": (
        "sentence_bert_config.json",
        lambda c: {**c, "tokenizer_name_or_path": "bert-base-cased"},
        "tokenizer_name_or_path",
    ),
    "unknown-transformer-key": ("sentence_bert_config.json", lambda c: {**c, "pad_to": 8}, "unknown setting.* pad_to"),
    "truncation-side": ("tokenizer_config.json", lambda c: {**c, "truncation_side": "left"}, "truncation_side 'left'"),
    "split-special": ("tokenizer_config.json", lambda c: {**c, "split_special_tokens": True}, "split_special_tokens"),
    "truncate-dim-type": ("config_sentence_transformers.json", lambda c: {**c, "truncate_dim": "64"}, "truncate_dim"),
}


@pytest.mark.parametrize("case", REFUSED)
def test_settings_encoderd_does_not_compute_are_refused(case, saved, tmp_path):
    file, change, key = REFUSED[case]
    path = _edit(saved["plain"], tmp_path / case, file, change)
    with pytest.raises(ModelLoadError, match=rf"{file.replace('.', '[.]')}: .*{key}"):
        load_model_spec(case, path)


def test_settings_that_change_no_vector_are_accepted(saved, tmp_path):
    path = _edit(
        saved["plain"],
        tmp_path / "harmless",
        "sentence_bert_config.json",
        lambda c: {**c, "unpad_inputs": False, "model_kwargs": {"attn_implementation": "eager"}, "query_length": None},
    )
    path = _edit(
        path,
        tmp_path / "harmless2",
        "config_sentence_transformers.json",
        lambda c: {**c, "similarity_fn_name": "dot", "keep_in_fp32_modules": ["classifier"], "not_a_key": 1},
    )
    assert load_model_spec("harmless", path).max_length == 256


def test_truncate_dim_refused_on_a_reranker(reranker_path, tmp_path):
    path = shutil.copytree(reranker_path, tmp_path / "reranker")
    (path / "config_sentence_transformers.json").write_text(json.dumps({"truncate_dim": 1}))
    with pytest.raises(ModelLoadError, match="truncate_dim 1 applies to dense embedding models"):
        load_model_spec("reranker", str(path))


# --------------------------------------------------------------- item 4
def test_static_embedding_refusal_names_the_module_and_its_file(tmp_path):
    """Fails on the old code ("no config.json: not a transformers model directory")."""
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import StaticEmbedding
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(Path(default_model_path()) / "tokenizer.json"))
    SentenceTransformer(modules=[StaticEmbedding(tokenizer, embedding_dim=32)], device="cpu").save(str(tmp_path / "m"))
    with pytest.raises(ModelLoadError) as error:
        load_model_spec("static", str(tmp_path / "m"))
    message = str(error.value)
    # sentence-transformers 6.3 keeps the module in the model directory itself, named in modules.json
    assert message.startswith(f"{tmp_path / 'm' / 'modules.json'}: module 0 ("), message
    assert "static_embedding.StaticEmbedding" in message and "config.json" not in message, message
