"""Issue 15 item 5 end to end: a real `encoderd serve` with per-model --revision, --pooling and
--max-length, and a model that ships its own code, against sentence-transformers."""

from __future__ import annotations

import numpy as np
import pytest
from support.corpus import sentences
from support.model_repos import build_hub_cache, build_remote_code_model
from support.server import ServerProcess

from encoderd.v1 import encoderd_pb2 as pb

# Long inputs too, so truncation at 64 tokens (not the model's own 256) shows.
TEXTS = sentences(24, min_words=3, max_words=200, seed=15)
MAIN, V1 = "1" * 40, "2" * 40


def _embed(stub, model: str) -> np.ndarray:
    response = stub.Embed(pb.EmbedRequest(model=model, inputs=TEXTS))
    return np.array([e.values for e in response.embeddings], dtype=np.float32)


def _exit_log(tmp_path, *args: str, env: dict | None = None) -> str:
    """Start a server that must refuse to: its log, after checking it exited with status 2."""
    proc = ServerProcess(*args, env=env, log_path=tmp_path / "refused.log").launch()
    assert proc.proc.wait(timeout=120) == 2, proc.log_text()  # refused: 2, as argparse refuses
    return proc.log_text()


@pytest.fixture(scope="module")
def hub_env(tmp_path_factory, minilm_path) -> dict:
    """An offline hub cache holding org/minilm: main is an empty snapshot (serving it fails), tag v1 the
    bundled MiniLM; so only a server that asks for v1 comes up."""
    cache = build_hub_cache(
        tmp_path_factory.mktemp("hub"), "org/minilm", {"main": MAIN, "v1": V1}, {MAIN: None, V1: minilm_path}
    )
    return {"HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1"}


@pytest.fixture(scope="module")
def overrides_server(tmp_path_factory, hub_env, minilm_path):
    """org/minilm at v1 with CLS pooling and 64 tokens; the bundled model beside it as it ships."""
    proc = ServerProcess(
        "--model",
        "org/minilm",
        "--revision",
        "org/minilm=v1",
        "--pooling",
        "org/minilm=cls",
        "--max-length",
        "org/minilm=64",
        "--model",
        f"plain={minilm_path}",
        env=hub_env,
        log_path=tmp_path_factory.mktemp("logs") / "overrides.log",
    )
    proc.start()
    yield proc
    assert proc.stop() == 0, proc.log_text()


@pytest.fixture(scope="module")
def reference(minilm_path) -> np.ndarray:
    """sentence-transformers' vectors of TEXTS from the bundled model as it ships."""
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(minilm_path, device="cpu").encode(TEXTS)


def test_overrides_equal_sentence_transformers_with_the_same_settings(overrides_server, minilm_path, reference):
    from sentence_transformers import SentenceTransformer

    overridden = SentenceTransformer(minilm_path, device="cpu")
    overridden[1] = type(overridden[1])(384, pooling_mode="cls")  # its Pooling module, whatever the release
    overridden.max_seq_length = 64
    stub = overrides_server.stub()
    got = _embed(stub, "org/minilm")
    np.testing.assert_allclose(got, overridden.encode(TEXTS), atol=1e-5)
    assert float(np.min(np.sum(got * reference, axis=1))) < 0.9  # the overrides did change the vectors
    np.testing.assert_allclose(_embed(stub, "plain"), reference, atol=1e-5)  # ...of that model only
    limits = {m.id: m.max_input_tokens for m in stub.ListModels(pb.ListModelsRequest()).models}
    assert limits == {"org/minilm": 64, "plain": 256}


def test_a_revision_for_a_local_directory_is_refused(tmp_path, minilm_path):
    log = _exit_log(tmp_path, "--model", f"m={minilm_path}", "--revision", "m=v1")
    assert "--revision 'v1' is for hub models, but" in log and "is a local directory" in log


def test_a_max_length_beyond_the_position_table_is_refused(tmp_path, minilm_path):
    log = _exit_log(tmp_path, "--model", f"m={minilm_path}", "--max-length", "1024")
    assert "--max-length 1024 for m: its position table holds 512 tokens; choose 8..512" in log


@pytest.fixture(scope="module")
def remote_code_model(tmp_path_factory) -> str:
    return str(build_remote_code_model(tmp_path_factory.mktemp("remote") / "relu-minilm"))


@pytest.fixture(scope="module")
def modules_env(tmp_path_factory) -> dict:
    # transformers copies repository code here before importing it.
    return {"HF_MODULES_CACHE": str(tmp_path_factory.mktemp("hf-modules"))}


def test_repository_code_is_refused_without_trust(tmp_path, remote_code_model, modules_env):
    log = _exit_log(tmp_path, "--model", f"relu={remote_code_model}", env=modules_env)
    assert "needs its own model code (config.json auto_map: AutoConfig -> relu_bert.ReluBertConfig" in log
    assert "--trust-remote-code (env ENCODERD_TRUST_REMOTE_CODE=1)" in log
    assert "model relu ready" not in log


@pytest.fixture(scope="module")
def remote_reference(remote_code_model) -> np.ndarray:
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(remote_code_model, device="cpu", trust_remote_code=True).encode(TEXTS)


def test_trusted_repository_code_is_served_as_sentence_transformers_runs_it(
    tmp_path, remote_code_model, modules_env, reference, remote_reference
):
    proc = ServerProcess(
        "--model",
        f"relu={remote_code_model}",
        env={**modules_env, "ENCODERD_TRUST_REMOTE_CODE": "1"},
        log_path=tmp_path / "trusted.log",
    ).start()
    try:
        got = _embed(proc.stub(), "relu")
    finally:
        assert proc.stop() == 0, proc.log_text()
    np.testing.assert_allclose(got, remote_reference, atol=1e-5)
    # The repository's ReLU ran: the stock BERT class would have served the bundled model's vectors.
    assert float(np.min(np.sum(got * reference, axis=1))) < 0.9


def test_onnx_refuses_the_repository_codes_own_family(tmp_path, remote_code_model):
    """Repository code is a model family no export of ours was checked on (base.ENGINE_FAMILIES):
    the onnx engine refuses it at load and names torch, which runs that code itself."""
    pytest.importorskip("onnxruntime")
    from encoderd.workers.backends import BackendOptions, create_backend
    from encoderd.workers.contract.spec_reader import load_model_spec

    spec = load_model_spec("relu", remote_code_model, trust_remote_code=True)
    backend = create_backend("onnx", spec, BackendOptions(threads=1, cache_dir=str(tmp_path), trust_remote_code=True))
    with pytest.raises(
        ValueError,
        match=r"does not serve relu, a relu_bert embedding model.*serve relu_bert "
        "embedding models: torch",
    ):
        backend.load()


def test_ctranslate2_refuses_repository_code(tmp_path, remote_code_model):
    pytest.importorskip("ctranslate2")
    from encoderd.workers.backends.ct2_backend import convert
    from encoderd.workers.contract.model_spec import ModelKind

    with pytest.raises(
        ValueError,
        match="ReluBertModel is the model repository's own code, which CTranslate2 "
        "cannot reproduce; serve this model with --engine torch",
    ):
        convert(remote_code_model, ModelKind.EMBEDDING, "float32", tmp_path / "ct2", trust_remote_code=True)
