"""Issue 15 item 4: every model family users bring, against the reference libraries.

For each family of tests/support/families.py (tiny random models of the real
architectures, with their own tokenizers) and each kind (embedding, reranker,
classifier), on a mixed-length corpus batched in corpus order so every batch pads:

  * the torch float32 engine equals sentence-transformers' `encode` (embedders, after
    Normalize) or transformers' logits (rerankers, classifiers) on the same weights,
    through the padding-free forward where it applies and through the padded one;
  * every other engine either claims the family (base.ENGINE_FAMILIES) and then equals
    the reference too, or refuses it at load naming the engines that serve it.

One real server serves an XLM-R reranker and the Qwen3 embedder end to end.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from unittest import mock

import numpy as np
import pytest
from support.corpus import sentences
from support.families import FAMILIES, KINDS, MAX_POSITIONS, build

from encoderd.workers.backends import BackendOptions, create_backend, packed_encoder, resolve_engine
from encoderd.workers.backends.base import ENGINE_FAMILIES
from encoderd.workers.contract.model_spec import ModelKind, Pooling
from encoderd.workers.contract.protocol import TokenBatch
from encoderd.workers.contract.spec_reader import load_model_spec

_SHORT = sentences(22, max_words=300, seed=11)  # 5 to ~380 tokens
_LONG = sentences(2, min_words=600, max_words=700, seed=5)  # past every family's 512 tokens: truncated
# Whitespace some tokenizer classes drop where their raw tokenizer.json keeps it (XLM-R, CamemBERT,
# DeBERTa-v2 in transformers 5): a trailing space or newline, a tab, doubled spaces.
WHITESPACE = ["a document about cats ", "it ends with a newline\n", "a\ttab and  two  spaces", "  both ends  "]
# Each batch of 8 mixes lengths; the last is the whitespace texts.
TEXTS = _SHORT[:3] + _LONG[:1] + _SHORT[3:12] + _LONG[1:] + _SHORT[12:] + WHITESPACE
QUERY = "how do search engines rank documents"
BATCH = 8
CONVERTING_ENGINES = [("onnx", "onnxruntime"), ("ctranslate2", "ctranslate2")]
PACKED_FAMILIES = (
    "bert",
    "xlm-roberta",
    "camembert",
    "roberta",
    "distilbert",
    "modernbert",
    "qwen3",
)  # what packed_encoder.usable() claims
POOLING = {"mean": Pooling.MEAN, "cls": Pooling.CLS, "lasttoken": Pooling.LAST_TOKEN}
CASES = [(family, kind) for family in FAMILIES for kind in KINDS]
IDS = [f"{family}-{kind}" for family, kind in CASES]


# ------------------------------------------------------------------ fixtures
@pytest.fixture(scope="module")
def models_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("family-models")


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory) -> str:
    """Exports and conversions, each built once for the module."""
    return str(tmp_path_factory.mktemp("family-cache"))


@pytest.fixture(scope="module")
def references() -> dict:
    """(family, kind) -> (spec, reference output), computed once each."""
    return {}


def case(references, models_dir, family: str, kind: str):
    if (family, kind) not in references:
        spec = load_model_spec(f"{family}-{kind}", str(build(family, kind, models_dir / f"{family}-{kind}")))
        references[family, kind] = spec, reference(spec)
    return references[family, kind]


def reference(spec) -> np.ndarray:
    """sentence-transformers for embedders (normalized), transformers' logits for the others: each
    library's own tokenizer, padding (Qwen3's on the left) and truncation, in batches of BATCH."""
    if spec.kind == ModelKind.EMBEDDING:
        from sentence_transformers import SentenceTransformer

        return SentenceTransformer(spec.path, device="cpu").encode(TEXTS, batch_size=BATCH)
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(spec.path)
    model = AutoModelForSequenceClassification.from_pretrained(spec.path).eval()
    out = []
    for start in range(0, len(TEXTS), BATCH):
        texts = TEXTS[start : start + BATCH]
        args = ([QUERY] * len(texts), texts) if spec.kind == ModelKind.RERANKER else (texts,)
        encoded = tokenizer(*args, padding=True, truncation=True, max_length=spec.max_length, return_tensors="pt")
        with torch.no_grad():
            out.append(model(**encoded).logits.numpy())
    return np.concatenate(out)


def token_batches(spec) -> list[TokenBatch]:
    """What the frontend sends: the ids of the tokenizer its worker built (pairs for rerankers, with
    type ids), truncated to the spec's maximum, in batches of mixed lengths."""
    from encoderd.workers.contract.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(spec.path)
    tokenizer.enable_truncation(spec.max_length)
    tokenizer.no_padding()
    pairs = spec.kind == ModelKind.RERANKER
    encodings = tokenizer.encode_batch([(QUERY, t) for t in TEXTS] if pairs else TEXTS)
    chunks = [encodings[start : start + BATCH] for start in range(0, len(encodings), BATCH)]
    return [
        TokenBatch.from_sequences(k, [e.ids for e in chunk], [e.type_ids for e in chunk] if pairs else None)
        for k, chunk in enumerate(chunks)
    ]


def load(engine: str, spec, cache_dir: str = ""):
    backend = create_backend(engine, spec, BackendOptions(threads=1, cache_dir=cache_dir))
    backend.load()
    return backend


def outputs(backend) -> np.ndarray:
    out = np.concatenate([backend.forward(batch) for batch in token_batches(backend.spec)])
    if backend.spec.kind == ModelKind.EMBEDDING:  # the frontend normalizes (the model's Normalize module)
        out = out / np.linalg.norm(out, axis=1, keepdims=True)
    return out


def assert_matches(got: np.ndarray, want: np.ndarray, kind: str) -> None:
    """float32 engines: equal to the reference within float32 reordering noise. Measured max |diff|:
    embeddings 7e-7, logits 2.3e-5 (spread 0.6-5 logits)."""
    assert got.shape == want.shape and got.dtype == np.float32
    if kind == "embedding":
        np.testing.assert_allclose(got, want, atol=1e-5)
        return
    np.testing.assert_allclose(got, want, atol=1e-4)
    if kind == "reranker":
        np.testing.assert_array_equal(np.argsort(-got[:, 0]), np.argsort(-want[:, 0]))
    else:
        np.testing.assert_array_equal(got.argmax(1), want.argmax(1))


# ------------------------------------------------------------------ torch: every family
@pytest.mark.parametrize("family,kind", CASES, ids=IDS)
def test_torch_matches_reference(family, kind, references, models_dir):
    spec, want = case(references, models_dir, family, kind)
    assert spec.kind.value == kind and spec.model_type == family
    assert spec.max_length == MAX_POSITIONS
    if kind == "embedding":
        pooling = POOLING[FAMILIES[family].pooling]
        assert spec.pooling in (pooling, (pooling,)) and spec.normalize  # one mode, or a tuple of concatenated ones
    backend = load("torch", spec)
    assert (backend.packed is not None) == (family in PACKED_FAMILIES), "packed_encoder.usable() disagrees"
    assert backend.output_dim == want.shape[1]
    assert_matches(outputs(backend), want, kind)


@pytest.mark.parametrize("family", PACKED_FAMILIES)
@pytest.mark.parametrize("kind", KINDS)
def test_torch_padded_path_of_packed_families(family, kind, references, models_dir):
    """The padded forward too (--torch-compile and CUDA float32 take it for BERT)."""
    spec, want = case(references, models_dir, family, kind)
    backend = create_backend("torch", spec, BackendOptions(threads=1))
    with mock.patch.object(packed_encoder, "usable", return_value=False):
        backend.load()
    assert backend.packed is None
    assert_matches(outputs(backend), want, kind)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_frontend_tokenizer_gives_the_reference_ids(family, references, models_dir):
    """The frontend encodes with the tokenizer its worker built (load_tokenizer); the references with
    AutoTokenizer (the family's tokenizer class), which may rebuild parts of tokenizer.json. Same ids,
    singles and pairs, or the vectors differ."""
    from transformers import AutoTokenizer

    from encoderd.workers.contract.tokenizer import load_tokenizer

    spec, _ = case(references, models_dir, family, "reranker")
    raw, auto = load_tokenizer(spec.path), AutoTokenizer.from_pretrained(spec.path)
    raw.no_truncation()  # the frontend drops both, then truncates to the spec's maximum
    raw.no_padding()
    assert [e.ids for e in raw.encode_batch(TEXTS)] == auto(TEXTS)["input_ids"]
    assert [e.ids for e in raw.encode_batch([(QUERY, t) for t in TEXTS])] == auto([QUERY] * len(TEXTS), TEXTS)[
        "input_ids"
    ]


@pytest.mark.parametrize("family", ["xlm-roberta", "deberta-v2"])
def test_a_served_model_tokenizes_whitespace_as_its_reference(family, references, models_dir, tmp_path):
    """End to end through the real server: the frontend tokenized with the raw tokenizer.json, which
    kept a trailing space, newline or tab as tokens these families' transformers tokenizers drop
    (served cosine 0.58-0.93 to sentence-transformers), and the self-check, tokenizing the same way,
    saw nothing."""
    from support.server import ServerProcess

    from encoderd.clients import EncoderClient

    spec, want = case(references, models_dir, family, "embedding")
    served = ServerProcess("--model", f"m={spec.path}", "--dtype", "float32", log_path=tmp_path / "server.log")
    with served, EncoderClient(served.address) as client:  # (entering starts it; stopped on leaving)
        got = client.embed(WHITESPACE, "m").vectors
    want = want[-len(WHITESPACE) :]
    cosines = np.sum(got * want, axis=1) / np.linalg.norm(got, axis=1) / np.linalg.norm(want, axis=1)
    assert cosines.min() > 0.9999, dict(zip(WHITESPACE, cosines.round(5), strict=True))


# ------------------------------------------------------------------ other engines: match or refuse
# Families whose classifier graph is not their reranker's with a wider last layer: ModernBERT's heads
# pool differently here (CLS vs mean), Qwen3's picks the token to score from the ids (see base.padded).
ONNX_CLASSIFIERS = ("modernbert", "qwen3")


def _engine_cases() -> list[tuple[str, str, str]]:
    """(engine, family, kind) for every case but the ONNX classifiers that repeat their reranker's graph:
    each export costs 3-10 s on 2 shared cores."""
    return [
        (engine, family, kind)
        for engine, _ in CONVERTING_ENGINES
        for family, kind in CASES
        if not (
            engine == "onnx"
            and kind == "classifier"
            and family not in ONNX_CLASSIFIERS
            and kind in ENGINE_FAMILIES[engine].get(family, ())
        )
    ]


@pytest.mark.parametrize("engine,family,kind", _engine_cases(), ids=["-".join(c) for c in _engine_cases()])
def test_engine_matches_reference_or_refuses(engine, family, kind, references, models_dir, cache_dir):
    pytest.importorskip(dict(CONVERTING_ENGINES)[engine])
    spec, want = case(references, models_dir, family, kind)
    if kind in ENGINE_FAMILIES[engine].get(family, ()):
        backend = load(engine, spec, cache_dir)
        assert backend.output_dim == want.shape[1]
        assert_matches(outputs(backend), want, kind)
        return
    with pytest.raises(ValueError) as refused:
        load(engine, spec, cache_dir)
    message = str(refused.value)
    assert f"the {engine} engine does not serve" in message and f"{family} {kind} model" in message, message
    serving = message.rpartition(": ")[2].split(", ")
    assert serving[0] == "torch" and engine not in serving, message
    assert serving == ["torch"] + [e for e, fam in ENGINE_FAMILIES.items() if kind in fam.get(family, ())]


@pytest.mark.parametrize("family,kind", CASES, ids=IDS)
def test_auto_engine_picks_one_that_serves_the_family(family, kind):
    """auto picks onnx on CPU and ctranslate2 for int8 on CUDA, unless it does not serve the family."""
    pytest.importorskip("onnxruntime")
    pytest.importorskip("ctranslate2")
    for options, engine in ((BackendOptions(), "onnx"), (BackendOptions(device="cuda", dtype="int8"), "ctranslate2")):
        serves = kind in ENGINE_FAMILIES[engine].get(family, ())
        assert resolve_engine("auto", options, kind, family) == (engine if serves else "torch")


def test_every_claimed_family_is_in_the_matrix():
    """A family an engine claims must be one the matrix above checks."""
    for engine, families in ENGINE_FAMILIES.items():
        assert set(families) <= set(FAMILIES), engine
        assert all(set(kinds) <= set(KINDS) for kinds in families.values()), engine


def test_refuses_a_model_without_model_type(references, models_dir, tmp_path, cache_dir):
    pytest.importorskip("onnxruntime")
    spec, _ = case(references, models_dir, "bert", "embedding")
    anonymous = shutil.copytree(spec.path, tmp_path / "anonymous")
    config = json.loads((anonymous / "config.json").read_text())
    config.pop("model_type")
    (anonymous / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="unknown-family"):
        load("onnx", load_model_spec("anonymous", str(anonymous)), cache_dir)


# ------------------------------------------------------------------ maximum length
@pytest.mark.parametrize("family", list(FAMILIES))
def test_max_length_from_the_position_table_alone(family, references, models_dir, tmp_path):
    """Without sentence_bert_config.json or a tokenizer model_max_length, the maximum comes from the
    position table (RoBERTa-style ones reserve two slots), and an input that long runs."""
    spec, _ = case(references, models_dir, family, "embedding")
    bare = shutil.copytree(spec.path, tmp_path / family)
    (bare / "sentence_bert_config.json").unlink()
    tok_config = json.loads((bare / "tokenizer_config.json").read_text())
    tok_config.pop("model_max_length")
    (bare / "tokenizer_config.json").write_text(json.dumps(tok_config))
    bare_spec = load_model_spec(family, str(bare))
    assert bare_spec.max_length == MAX_POSITIONS
    backend = load("torch", bare_spec)
    ids = np.full(bare_spec.max_length, 5, dtype=np.int32)
    assert np.isfinite(backend.forward(TokenBatch.from_sequences(0, [ids]))).all()


# ------------------------------------------------------------------ one real server
def test_server_serves_xlm_roberta_reranker_and_qwen3_embedder(references, models_dir, tmp_path):
    pytest.importorskip("grpc")
    from sentence_transformers import CrossEncoder, SentenceTransformer
    from support.server import ServerProcess

    from encoderd.v1 import encoderd_pb2 as pb

    reranker, _ = case(references, models_dir, "xlm-roberta", "reranker")
    embedder, _ = case(references, models_dir, "qwen3", "embedding")
    docs = TEXTS[:16]
    with ServerProcess(
        "--cpu-threads",
        "1",
        "--model",
        f"rr={reranker.path}",
        "--model",
        f"qwen={embedder.path}",
        log_path=tmp_path / "server.log",
    ) as server:
        stub = server.stub()
        ranked = stub.Rerank(pb.RerankRequest(model="rr", query=QUERY, documents=docs)).results
        vectors = np.array([e.values for e in stub.Embed(pb.EmbedRequest(model="qwen", inputs=docs)).embeddings])
    want_scores = CrossEncoder(reranker.path, device="cpu").predict([(QUERY, d) for d in docs])
    assert [r.index for r in ranked] == list(np.argsort(-want_scores, kind="stable"))
    np.testing.assert_allclose(
        [r.relevance_score for r in sorted(ranked, key=lambda r: r.index)], want_scores, atol=1e-5
    )
    np.testing.assert_allclose(vectors, SentenceTransformer(embedder.path, device="cpu").encode(docs), atol=1e-5)
