"""Issue 2: the core engine end to end against the reference libraries."""

from __future__ import annotations

import concurrent.futures as cf
import re
import urllib.request

import grpc
import numpy as np
import pytest
from support.corpus import sentences

from encoderd.v1 import encoderd_pb2 as pb
from encoderd.workers.contract.model_files import DEFAULT_MODEL_NAME

TEXTS = sentences(96, max_words=300, seed=7)


def _vectors(response) -> np.ndarray:
    return np.array([e.values for e in response.embeddings], dtype=np.float32)


@pytest.fixture(scope="module")
def st_model(minilm_path):
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(minilm_path, device="cpu")


def test_embeddings_equal_sentence_transformers_under_concurrency(stub, st_model):
    # Many concurrent requests of different sizes, so their inputs interleave across batches.
    sizes = [1, 7, 3, 12, 5, 2, 9, 4, 16, 6, 8, 10, 13]
    chunks, start = [], 0
    for size in sizes:
        chunks.append(TEXTS[start : start + size])
        start += size
    assert start == len(TEXTS)
    with cf.ThreadPoolExecutor(len(chunks)) as pool:
        responses = list(pool.map(lambda c: stub.Embed(pb.EmbedRequest(model=DEFAULT_MODEL_NAME, inputs=c)), chunks))
    got = np.concatenate([_vectors(r) for r in responses])
    want = st_model.encode(TEXTS, batch_size=16)
    assert got.shape == want.shape == (96, 384)
    np.testing.assert_allclose(got, want, atol=1e-5)
    assert sum(r.usage.prompt_tokens for r in responses) == sum(
        len(st_model.tokenizer(t, truncation=True, max_length=256)["input_ids"]) for t in TEXTS
    )


def test_embed_options(stub, st_model):
    texts = TEXTS[:4]
    raw = _vectors(stub.Embed(pb.EmbedRequest(model=DEFAULT_MODEL_NAME, inputs=texts, normalize=False)))
    want = st_model.encode(texts, normalize_embeddings=False)
    # all-MiniLM normalizes in its pipeline; without Normalize the pooled vectors must have other norms.
    assert not np.allclose(np.linalg.norm(raw, axis=1), 1)
    unit = raw / np.linalg.norm(raw, axis=1, keepdims=True)
    np.testing.assert_allclose(unit, want, atol=1e-5)
    short = _vectors(stub.Embed(pb.EmbedRequest(model=DEFAULT_MODEL_NAME, inputs=texts, dimensions=64)))
    expect = want[:, :64] / np.linalg.norm(want[:, :64], axis=1, keepdims=True)
    np.testing.assert_allclose(short, expect, atol=1e-5)
    prompted = _vectors(stub.Embed(pb.EmbedRequest(model=DEFAULT_MODEL_NAME, inputs=texts, prompt="query: ")))
    np.testing.assert_allclose(prompted, st_model.encode(["query: " + t for t in texts]), atol=1e-5)


def test_left_truncation_keeps_the_end(stub, st_model):
    long_text = " ".join(f"word{i}" for i in range(600))
    left = _vectors(
        stub.Embed(
            pb.EmbedRequest(
                model=DEFAULT_MODEL_NAME, inputs=[long_text], truncation_direction=pb.TRUNCATION_DIRECTION_LEFT
            )
        )
    )
    right = _vectors(stub.Embed(pb.EmbedRequest(model=DEFAULT_MODEL_NAME, inputs=[long_text])))
    np.testing.assert_allclose(right, st_model.encode([long_text]), atol=1e-5)
    assert float(left[0] @ right[0]) < 0.99


def test_rerank_equals_cross_encoder(stub, reranker_path):
    from sentence_transformers import CrossEncoder

    query = "how do retrieval systems rank documents"
    docs = TEXTS[:40]
    response = stub.Rerank(pb.RerankRequest(model="reranker", query=query, documents=docs, return_documents=True))
    want = CrossEncoder(reranker_path, device="cpu").predict([(query, d) for d in docs])
    assert [r.index for r in response.results] == list(np.argsort(-want, kind="stable"))
    got = np.array([r.relevance_score for r in sorted(response.results, key=lambda r: r.index)])
    np.testing.assert_allclose(got, want, atol=1e-5)
    assert all(r.document == docs[r.index] for r in response.results)
    top = stub.Rerank(pb.RerankRequest(model="reranker", query=query, documents=docs, top_n=3, raw_scores=True))
    assert [r.index for r in top.results] == [r.index for r in response.results[:3]]
    np.testing.assert_allclose(
        [r.relevance_score for r in top.results], np.log(want / (1 - want))[[r.index for r in top.results]], atol=1e-4
    )
    assert not top.results[0].document


def test_classify_equals_transformers_softmax(stub, classifier_path):
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    texts = TEXTS[:20]
    response = stub.Classify(pb.ClassifyRequest(model="classifier", inputs=texts))
    tok = AutoTokenizer.from_pretrained(classifier_path)
    model = AutoModelForSequenceClassification.from_pretrained(classifier_path).eval()
    with torch.no_grad():
        logits = model(**tok(texts, padding=True, truncation=True, max_length=256, return_tensors="pt")).logits
    want = torch.softmax(logits, dim=-1).numpy()
    for row, result in zip(want, response.results, strict=True):
        got = {s.label: s.score for s in result.labels}
        assert [s.label for s in result.labels] == [model.config.id2label[i] for i in np.argsort(-row, kind="stable")]
        np.testing.assert_allclose([got[model.config.id2label[i]] for i in range(3)], row, atol=1e-5)


def test_tokenize_and_list_models(stub, st_model):
    response = stub.Tokenize(pb.TokenizeRequest(model=DEFAULT_MODEL_NAME, inputs=["Hello world"]))
    assert list(response.results[0].ids) == st_model.tokenizer("Hello world")["input_ids"]
    assert response.results[0].tokens[0] == "[CLS]"
    assert (response.results[0].offsets[1].start, response.results[0].offsets[1].end) == (0, 5)
    models = {m.id: m for m in stub.ListModels(pb.ListModelsRequest()).models}
    assert models[DEFAULT_MODEL_NAME].kind == "embedding" and models[DEFAULT_MODEL_NAME].dimensions == 384
    assert models["reranker"].kind == "reranker" and models["classifier"].labels == ["negative", "neutral", "positive"]
    assert models[DEFAULT_MODEL_NAME].max_input_tokens == 256


def test_each_model_runs_in_its_own_worker_process(stub, server):
    models = stub.ListModels(pb.ListModelsRequest()).models
    pids = [m.replicas[0].pid for m in models]
    assert len(set(pids)) == 3 and server.proc.pid not in pids
    for pid in pids:  # real, live children of the server
        with open(f"/proc/{pid}/stat") as f:
            assert int(f.read().split()[3]) == server.proc.pid


def _batches_counted(server, model: str) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=5).read().decode()
    match = re.search(rf'^encoderd_batches_total{{model="{re.escape(model)}"}} (\S+)$', text, re.M)
    return float(match.group(1)) if match else 0.0


def test_concurrent_requests_are_coalesced(stub, server):
    n = 48
    before = _batches_counted(server, DEFAULT_MODEL_NAME)
    futures = [stub.Embed.future(pb.EmbedRequest(model=DEFAULT_MODEL_NAME, inputs=[t])) for t in TEXTS[:n]]
    results = [f.result() for f in futures]
    passes = _batches_counted(server, DEFAULT_MODEL_NAME) - before
    assert all(len(r.embeddings) == 1 for r in results)
    assert 1 <= passes <= n / 4, f"{n} concurrent requests ran in {passes} forward passes"


BAD_REQUESTS = [
    ("Embed", pb.EmbedRequest(model="nope", inputs=["a"]), grpc.StatusCode.NOT_FOUND),
    ("Embed", pb.EmbedRequest(model=DEFAULT_MODEL_NAME), grpc.StatusCode.INVALID_ARGUMENT),
    ("Embed", pb.EmbedRequest(model=DEFAULT_MODEL_NAME, inputs=["ok", ""]), grpc.StatusCode.INVALID_ARGUMENT),
    ("Embed", pb.EmbedRequest(model=DEFAULT_MODEL_NAME, inputs=["x"] * 257), grpc.StatusCode.INVALID_ARGUMENT),
    (
        "Embed",
        pb.EmbedRequest(model=DEFAULT_MODEL_NAME, inputs=["word " * 400], truncate=False),
        grpc.StatusCode.INVALID_ARGUMENT,
    ),
    (
        "Embed",
        pb.EmbedRequest(model=DEFAULT_MODEL_NAME, inputs=["a"], dimensions=999),
        grpc.StatusCode.INVALID_ARGUMENT,
    ),
    # Naming no model: the one served model of a kind the call takes; Tokenize takes any kind, and three are served.
    ("Tokenize", pb.TokenizeRequest(inputs=["a"]), grpc.StatusCode.INVALID_ARGUMENT),
    ("Rerank", pb.RerankRequest(model="reranker", query="q"), grpc.StatusCode.INVALID_ARGUMENT),
    ("Rerank", pb.RerankRequest(model="reranker", query="", documents=["a"]), grpc.StatusCode.INVALID_ARGUMENT),
    (
        "Rerank",
        pb.RerankRequest(model="reranker", query="q", documents=["a"], top_n=-1),
        grpc.StatusCode.INVALID_ARGUMENT,
    ),
    (
        "Rerank",
        pb.RerankRequest(model=DEFAULT_MODEL_NAME, query="q", documents=["a"]),
        grpc.StatusCode.FAILED_PRECONDITION,
    ),
    ("Embed", pb.EmbedRequest(model="reranker", inputs=["a"]), grpc.StatusCode.FAILED_PRECONDITION),
    ("Classify", pb.ClassifyRequest(model="reranker", inputs=["a"]), grpc.StatusCode.FAILED_PRECONDITION),
    ("Classify", pb.ClassifyRequest(model="classifier"), grpc.StatusCode.INVALID_ARGUMENT),
    ("Tokenize", pb.TokenizeRequest(model="nope", inputs=["a"]), grpc.StatusCode.NOT_FOUND),
]


@pytest.mark.parametrize(
    "method,request_,code", BAD_REQUESTS, ids=[f"{m}-{c.name}-{i}" for i, (m, _, c) in enumerate(BAD_REQUESTS)]
)
def test_bad_input_gets_its_status(stub, method, request_, code):
    with pytest.raises(grpc.RpcError) as err:
        getattr(stub, method)(request_)
    assert err.value.code() == code
    assert err.value.details()  # a message that says why


def test_a_call_naming_no_model_gets_the_one_served_model_of_its_kind(stub):
    """Issue 20: one resolver for every API (REST did this; gRPC asked for a name)."""
    assert stub.Embed(pb.EmbedRequest(inputs=["a"])).model == DEFAULT_MODEL_NAME
    assert stub.Rerank(pb.RerankRequest(query="q", documents=["d"])).model == "reranker"
    assert stub.Classify(pb.ClassifyRequest(inputs=["a"])).model == "classifier"


def test_server_still_serves_after_bad_input(stub):
    assert len(stub.Embed(pb.EmbedRequest(model=DEFAULT_MODEL_NAME, inputs=["still fine"])).embeddings) == 1


def test_a_prompt_before_every_input_is_held_to_what_a_message_carries(stub):
    """A prompt within the per-field limit (--max-input-chars), before each of 256 inputs: 256 MB of
    texts, refused at once as INVALID_ARGUMENT (they were built, hashed and tokenized whole first:
    115 s of tokenizing and +0.6 GB in the frontend). A short prompt still goes before every input."""
    with pytest.raises(grpc.RpcError) as refused:
        stub.Embed(pb.EmbedRequest(inputs=["a"] * 256, prompt="p " * 500_000), timeout=30)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT, refused.value.details()
    assert "the prompt (1000000 characters) before each of the 256 inputs" in refused.value.details()
    prompted = _vectors(stub.Embed(pb.EmbedRequest(inputs=["a", "b"], prompt="query: "), timeout=30))
    written = _vectors(stub.Embed(pb.EmbedRequest(inputs=["query: a", "query: b"]), timeout=30))
    np.testing.assert_allclose(prompted, written, atol=1e-6)
