"""Issue 17: clients of the engines people switch from work unchanged — Infinity's own
client (infinity_client), TEI's API through huggingface_hub's InferenceClient and raw
HTTP, the Cohere SDK's embed (v1 and v2) — against the real server behind its real
Envoy, checked against sentence-transformers and the gRPC API."""

from __future__ import annotations

import base64
import io
import json
from pathlib import Path

import httpx
import numpy as np
import pytest
from support.corpus import sentences
from support.media import png_data_uri, random_image
from support.multimodal_models import CLAP_SAMPLING_RATE, build_clap, build_clip, build_colbert, build_sparse
from support.server import ServerProcess

from encoderd.v1 import encoderd_pb2 as pb
from encoderd.workers.contract.model_files import DEFAULT_MODEL_NAME, default_model_path

M = DEFAULT_MODEL_NAME
TEXTS = sentences(6, max_words=30, seed=17)
QUERY = "how do search engines rank documents"
DOCS = [*sentences(5, max_words=30, seed=5), "a cross encoder reranks candidate documents for search engines"]
QUERY_PROMPT = "query: "  # served as the prompt named search_query (Cohere's input_type)
ORIGIN = "https://app.example"  # the browser origin the server allows (CORS)


@pytest.fixture(scope="module")
def compat_server(tmp_path_factory, models_dir, reranker_path, classifier_path):
    log = tmp_path_factory.mktemp("compat") / "server.log"
    proc = ServerProcess(
        "--model",
        f"{M}={default_model_path()}",
        "--model",
        f"reranker={reranker_path}",
        "--model",
        f"classifier={classifier_path}",
        "--model",
        f"colbert={build_colbert(models_dir / 'mm-colbert')}",
        "--model",
        f"splade={build_sparse(models_dir / 'mm-sparse')}:sparse",
        "--prompt",
        f"search_query={QUERY_PROMPT}",
        "--cpu-threads",
        "1",
        "--cache-size",  # results are reused: a route's output must never come from another's entry
        "1024",
        "--cors-allow-origin",
        ORIGIN,
        rest=True,
        log_path=log,
    )
    proc.start()
    yield proc
    assert proc.stop() == 0, proc.log_text()


@pytest.fixture(scope="module")
def http(compat_server):
    with httpx.Client(base_url=compat_server.rest_url, timeout=60, trust_env=False) as client:
        yield client


@pytest.fixture(scope="module")
def stub(compat_server):
    return compat_server.stub()


@pytest.fixture(scope="module")
def st_model(minilm_path):
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(minilm_path, device="cpu")


@pytest.fixture(scope="module")
def st_vectors(st_model):
    return st_model.encode(TEXTS)


@pytest.fixture(scope="module")
def cross_encoder_scores(reranker_path):
    from sentence_transformers import CrossEncoder

    return CrossEncoder(reranker_path, device="cpu").predict([(QUERY, d) for d in DOCS])


def _grpc_classes(stub, texts):
    response = stub.Classify(pb.ClassifyRequest(model="classifier", inputs=texts))
    return [[(ls.label, ls.score) for ls in result.labels] for result in response.results]


def _error(response: httpx.Response, status: int, *words: str) -> None:
    assert response.status_code == status, response.text
    message = response.json()["error"]["message"]
    assert all(w in message for w in words), message


# ------------------------------------------------------------------ Infinity
@pytest.fixture(scope="module")
def infinity(compat_server):
    from infinity_client import Client

    # Infinity serves at the root (no /v1): the client's base URL is the server itself.
    return Client(base_url=compat_server.rest_url, raise_on_unexpected_status=True, timeout=60)


def test_infinity_client_embeddings_with_its_defaults(infinity, st_vectors):
    from infinity_client.api.default import embeddings
    from infinity_client.models import OpenAIEmbeddingInputText

    body = OpenAIEmbeddingInputText(input_=TEXTS, model=M)
    assert body.to_dict()["dimensions"] == 0  # what the client sends unless told otherwise
    result = embeddings.sync(client=infinity, body=body)
    np.testing.assert_allclose([d.embedding for d in result.data], st_vectors, atol=1e-5)
    assert [d.index for d in result.data] == list(range(len(TEXTS))) and result.model == M
    short = embeddings.sync(client=infinity, body=OpenAIEmbeddingInputText(input_=TEXTS[:2], model=M, dimensions=32))
    want = st_vectors[:2, :32] / np.linalg.norm(st_vectors[:2, :32], axis=1, keepdims=True)
    np.testing.assert_allclose([d.embedding for d in short.data], want, atol=1e-5)


def test_dimensions_zero_is_full_size_at_the_root_only(http):
    root = http.post("/embeddings", json={"model": M, "input": "x", "dimensions": 0})
    assert root.status_code == 200 and len(root.json()["data"][0]["embedding"]) == 384
    _error(http.post("/v1/embeddings", json={"model": M, "input": "x", "dimensions": 0}), 400, "dimensions")


def test_infinity_client_rerank_without_naming_the_model(infinity, cross_encoder_scores):
    from infinity_client.api.default import rerank
    from infinity_client.models import RerankInput

    result = rerank.sync(
        client=infinity, body=RerankInput(query=QUERY, documents=DOCS, return_documents=True, top_n=3)
    )  # model: the client's "default/not-specified"
    want = np.argsort(-cross_encoder_scores, kind="stable")[:3]
    assert [r.index for r in result.results] == want.tolist()
    np.testing.assert_allclose([r.relevance_score for r in result.results], cross_encoder_scores[want], atol=1e-5)
    assert [r.document for r in result.results] == [DOCS[i] for i in want]  # strings, as Infinity answers
    assert result.model == "reranker" and result.usage.total_tokens > 0


def test_infinity_client_classify(infinity, stub):
    from infinity_client.api.default import classify
    from infinity_client.models import ClassifyInput

    result = classify.sync(client=infinity, body=ClassifyInput(input_=TEXTS[:3], model="classifier"))
    assert result.object_ == "classify" and result.model == "classifier"
    got = [[(c.label, c.score) for c in row] for row in result.data]
    for got_row, want_row in zip(got, _grpc_classes(stub, TEXTS[:3]), strict=True):
        assert [label for label, _ in got_row] == [label for label, _ in want_row]
        np.testing.assert_allclose([s for _, s in got_row], [s for _, s in want_row], atol=1e-6)


def test_infinity_client_models_and_health(infinity):
    from infinity_client.api.default import health, models

    listed = models.sync(client=infinity)
    by_id = {m.id: m for m in listed.data}
    assert set(by_id) == {M, "reranker", "classifier", "colbert", "splade"}
    assert by_id["reranker"].capabilities == ["rerank"] and by_id[M].capabilities == ["embed"]
    stats = by_id[M].stats.additional_properties
    assert stats["queue_absolute"] == 0 and stats["batch_size"] > 0
    assert by_id[M].backend == "torch"
    assert isinstance(health.sync(client=infinity)["unix"], float)


def test_metrics_on_the_rest_port(compat_server, infinity, http):
    """GET /metrics on the REST port, as Infinity and TEI serve it and Infinity's client calls it (it
    was a 404): Prometheus' text format, the metrics --metrics-port serves, counting REST calls."""
    from infinity_client.api.default import metrics_metrics_get
    from prometheus_client.parser import text_string_to_metric_families

    def families(text: str) -> dict:
        return {family.name: family for family in text_string_to_metric_families(text)}

    assert http.post("/embeddings", json={"model": M, "input": "counted"}).status_code == 200
    response = metrics_metrics_get.sync_detailed(client=infinity)
    assert response.status_code == 200, response.content
    direct = httpx.get(f"http://127.0.0.1:{compat_server.metrics_port}/metrics", trust_env=False)
    assert response.headers["content-type"] == direct.headers["content-type"]  # Prometheus' text format
    assert response.headers["content-type"].startswith("text/plain; version=")
    rest = families(response.content.decode())
    assert set(rest) == set(families(direct.text))
    # Prometheus asks for OpenMetrics: negotiated as the metrics port does.
    openmetrics = {"accept": "application/openmetrics-text;version=1.0.0,text/plain;version=0.0.4;q=0.5"}
    asked = http.get("/metrics", headers=openmetrics)
    port = httpx.get(f"http://127.0.0.1:{compat_server.metrics_port}/metrics", headers=openmetrics, trust_env=False)
    assert asked.status_code == 200 and asked.headers["content-type"] == port.headers["content-type"]
    assert asked.headers["content-type"].startswith("application/openmetrics-text") and asked.text.endswith("# EOF\n")
    counted = [
        sample.value
        for sample in rest["encoderd_requests"].samples
        if sample.name == "encoderd_requests_total"
        and sample.labels == {"model": M, "rpc": "Compat/CreateRootEmbeddings", "code": "OK"}
    ]
    assert counted and counted[0] >= 1


# ----------------------------------------------------------------------- TEI
@pytest.fixture
def inference_client(monkeypatch, compat_server):
    """huggingface_hub's InferenceClient aimed at one route; HF_HUB_OFFLINE (no hub in tests) would
    refuse even loopback calls, so it is lifted for this client, which only calls our server."""
    from huggingface_hub import InferenceClient, constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    return lambda route: InferenceClient(base_url=compat_server.rest_url + route)


def test_tei_inference_client_feature_extraction(inference_client, st_vectors):
    client = inference_client("/embed")
    got = client.feature_extraction(TEXTS[0])
    assert got.shape == (1, 384)
    np.testing.assert_allclose(got[0], st_vectors[0], atol=1e-5)
    # Its options travel nested under "parameters": honoured, not dropped.
    raw = client.feature_extraction(TEXTS[0], normalize=False, dimensions=64)
    assert raw.shape == (1, 64) and abs(np.linalg.norm(raw[0]) - 1) > 1e-3


def test_tei_inference_client_similarity_and_classification(inference_client, st_model, stub, http):
    similarity = inference_client("/similarity").sentence_similarity(TEXTS[0], other_sentences=TEXTS[1:4])
    vectors = st_model.encode(TEXTS[:4], normalize_embeddings=True)
    np.testing.assert_allclose(similarity, vectors[1:] @ vectors[0], atol=1e-5)
    empty = {"model": M, "inputs": {"source_sentence": "hello", "sentences": ["hi", ""]}}
    refused = http.post("/similarity", json=empty)  # named by the caller's own list and index
    assert refused.status_code == 400 and "inputs.sentences[1] is an empty string" in refused.text, refused.text
    best = inference_client("/predict").text_classification(TEXTS[0])
    label, score = _grpc_classes(stub, TEXTS[:1])[0][0]
    # TEI answers a single input with a flat list, of which the client keeps the first (best) label.
    assert best.label == label and best.score == pytest.approx(score, abs=1e-6)
    # Its options (nested under "parameters") apply, not silently dropped.
    logits = stub.Classify(pb.ClassifyRequest(model="classifier", inputs=TEXTS[:1], raw_scores=True)).results[0]
    sigmoid = inference_client("/predict").text_classification(TEXTS[0], function_to_apply="sigmoid", top_k=1)
    assert sigmoid.label == logits.labels[0].label
    assert sigmoid.score == pytest.approx(1 / (1 + np.exp(-logits.labels[0].score)), abs=1e-6)


def test_tei_embed_shapes(http, st_vectors, st_model):
    batch = http.post("/embed", json={"inputs": TEXTS[:3]})
    assert batch.status_code == 200, batch.text
    np.testing.assert_allclose(batch.json(), st_vectors[:3], atol=1e-5)
    ids = http.post("/tokenize", json={"inputs": TEXTS[0], "model": M}).json()[0]
    by_ids = http.post("/embed", json={"inputs": [[t["id"] for t in ids]]})
    np.testing.assert_allclose(by_ids.json()[0], st_vectors[0], atol=1e-5)
    left = http.post("/embed", json={"inputs": "word " * 600, "truncation_direction": "Left", "normalize": False})
    got = np.array(left.json()[0])  # the raw mean pool: all "word", so either side cut is the same
    assert abs(np.linalg.norm(got) - 1) > 0.1
    np.testing.assert_allclose(got / np.linalg.norm(got), st_model.encode("word " * 600), atol=1e-5)
    _error(http.post("/embed", json={"inputs": "word " * 600, "truncate": False}), 400, "longer")


def test_tei_rerank_and_infinity_rerank_share_the_route(http, cross_encoder_scores):
    tei = http.post("/rerank", json={"query": QUERY, "texts": DOCS, "return_text": True})
    assert tei.status_code == 200, tei.text
    order = np.argsort(-cross_encoder_scores, kind="stable")
    assert [r["index"] for r in tei.json()] == order.tolist()
    np.testing.assert_allclose([r["score"] for r in tei.json()], cross_encoder_scores[order], atol=1e-5)
    assert [r["text"] for r in tei.json()] == [DOCS[i] for i in order]
    raw = http.post("/rerank", json={"query": QUERY, "texts": DOCS[:2], "raw_scores": True}).json()
    logits = np.log(cross_encoder_scores[:2] / (1 - cross_encoder_scores[:2]))
    np.testing.assert_allclose([r["score"] for r in sorted(raw, key=lambda r: r["index"])], logits, atol=1e-4)
    _error(http.post("/rerank", json={"query": QUERY, "texts": DOCS, "documents": DOCS}), 400, "exactly one")
    _error(http.post("/rerank", json={"query": QUERY, "texts": DOCS, "top_n": 2}), 400, "top_n")
    _error(http.post("/rerank", json={"query": QUERY, "documents": DOCS, "return_text": True}), 400, "return_text")


def test_tei_predict_top_k_and_activations(http, stub):
    logits = [
        ls.score
        for ls in stub.Classify(pb.ClassifyRequest(model="classifier", inputs=TEXTS[:1], raw_scores=True))
        .results[0]
        .labels
    ]
    top = http.post("/predict", json={"inputs": TEXTS[0], "parameters": {"top_k": 2, "function_to_apply": "none"}})
    np.testing.assert_allclose([p["score"] for p in top.json()], logits[:2], atol=1e-6)
    _error(http.post("/predict", json={"inputs": "x", "parameters": {"function_to_apply": "relu"}}), 400, "relu")
    _error(
        http.post("/predict", json={"inputs": "x", "raw_scores": True, "parameters": {"function_to_apply": "none"}}),
        400,
        "not both",
    )
    _error(http.post("/embed", json={"model": M, "inputs": "x", "parameters": {"top_k": 2}}), 400, "/predict")


def test_tei_predict_shapes(http, stub):
    want = _grpc_classes(stub, TEXTS[:3])
    single = http.post("/predict", json={"inputs": TEXTS[0]})
    assert single.status_code == 200, single.text
    assert [(p["label"], round(p["score"], 5)) for p in single.json()] == [(label, round(s, 5)) for label, s in want[0]]
    batch = http.post("/predict", json={"inputs": [[TEXTS[0]], [TEXTS[1]], [TEXTS[2]]]}).json()
    assert [[p["label"] for p in row] for row in batch] == [[label for label, _ in row] for row in want]
    for bad in ([TEXTS[0], TEXTS[1], TEXTS[2]], [[TEXTS[0], TEXTS[1], TEXTS[2]]], [[TEXTS[0]], TEXTS[1]], [[]]):
        _error(http.post("/predict", json={"inputs": bad}), 400, "text_pair")


@pytest.fixture(scope="module")
def classifier_logits(classifier_path):
    """transformers' logits for (text, text_pair) pairs and single texts: the pair classifier's reference."""
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(classifier_path)
    model = AutoModelForSequenceClassification.from_pretrained(classifier_path).eval()

    def logits(*texts):
        with torch.no_grad():
            return model(**tokenizer(*texts, truncation=True, return_tensors="pt")).logits[0].numpy()

    return logits, model.config.id2label


def test_tei_predict_text_pairs_equal_transformers(http, classifier_logits):
    """TEI's pair input (cross-encoders, NLI-style pair classifiers): the tokenizer's own pair
    encoding, token types included; a batch may mix pairs and single texts."""
    logits, id2label = classifier_logits
    pairs = [(QUERY, DOCS[0]), (TEXTS[1], TEXTS[2]), (TEXTS[3], DOCS[5] * 80)]  # the last one truncated

    def by_label(row):
        return [row[label] for label in id2label.values()]

    one = http.post("/predict", json={"inputs": list(pairs[0]), "raw_scores": True})
    assert one.status_code == 200, one.text
    np.testing.assert_allclose(by_label({p["label"]: p["score"] for p in one.json()}), logits(*pairs[0]), atol=1e-4)
    mixed = [list(pairs[0]), [TEXTS[0]], list(pairs[1]), list(pairs[2])]
    batch = http.post("/predict", json={"inputs": mixed, "parameters": {"function_to_apply": "none"}})
    assert batch.status_code == 200, batch.text
    for row, item in zip(batch.json(), mixed, strict=True):
        np.testing.assert_allclose(by_label({p["label"]: p["score"] for p in row}), logits(*item), atol=1e-4)
    # The model's own activation (softmax here) over the pair's logits, best first.
    scored = http.post("/predict", json={"inputs": list(pairs[1])}).json()
    want = np.exp(logits(*pairs[1])) / np.exp(logits(*pairs[1])).sum()
    assert [p["label"] for p in scored] == [id2label[i] for i in np.argsort(-want, kind="stable")]
    np.testing.assert_allclose(sorted(p["score"] for p in scored), sorted(want), atol=1e-5)


def test_tei_tokenize_decode_info(http, minilm_path):
    from tokenizers import Tokenizer

    text = "Hello world, tokenizers!"
    # Several models are served here, so the model-agnostic routes name one (TEI serves just one).
    tokens = http.post("/tokenize", json={"inputs": [text], "model": M}).json()[0]
    tokenizer = Tokenizer.from_file(f"{minilm_path}/tokenizer.json")
    tokenizer.no_padding()
    encoding = tokenizer.encode(text)
    assert [t["id"] for t in tokens] == encoding.ids
    assert tokens[0] == {"id": 101, "text": "[CLS]", "special": True, "start": None, "stop": None}
    assert [text[t["start"] : t["stop"]] for t in tokens[1:-1]] == [t["text"] for t in tokens[1:-1]]
    plain = http.post("/tokenize", json={"inputs": text, "add_special_tokens": False, "model": M}).json()[0]
    assert [t["id"] for t in plain] == encoding.ids[1:-1]
    decoded = http.post("/decode", json={"ids": encoding.ids, "model": M}).json()
    assert decoded == ["hello world, tokenizers!"]
    both = http.post(
        "/decode", json={"ids": [encoding.ids, encoding.ids[:2]], "skip_special_tokens": False, "model": M}
    ).json()
    assert both == ["[CLS] hello world, tokenizers! [SEP]", "[CLS] hello"]
    _error(http.post("/decode", json={"ids": [1, 10**9], "model": M}), 400, "token id")
    info = http.get("/info", params={"model": M}).json()
    assert (
        info["model_id"] == M
        and info["max_input_length"] == 256
        and info["model_type"] == {"embedding": {"pooling": "mean"}}
    )
    assert http.get("/info", params={"model": "reranker"}).json()["model_type"]["reranker"]["id2label"]
    _error(http.get("/info"), 400, "model")  # several served: TEI's single-model route needs a name


def test_tei_embed_all_and_sparse_equal_grpc(http, stub):
    texts = ["late interaction", "sparse lexical retrieval"]
    tokens = http.post("/embed_all", json={"inputs": texts, "model": "colbert"})
    assert tokens.status_code == 200, tokens.text
    contents = [pb.Content(text=t) for t in texts]
    grpc = stub.EmbedMultiVector(pb.EmbedMultiVectorRequest(model="colbert", inputs=contents))
    for got, want in zip(tokens.json(), grpc.embeddings, strict=True):
        np.testing.assert_allclose(got, np.reshape(want.values, (want.rows, grpc.dimensions)), atol=1e-6)
    sparse = http.post("/embed_sparse", json={"inputs": texts})
    assert sparse.status_code == 200, sparse.text
    grpc = stub.EmbedSparse(pb.EmbedSparseRequest(model="splade", inputs=texts))
    for got, want in zip(sparse.json(), grpc.embeddings, strict=True):
        assert [v["index"] for v in got] == list(want.indices)
        np.testing.assert_allclose([v["value"] for v in got], want.values, atol=1e-6)


def test_tei_root_route_dispatches_by_model_kind(http, st_vectors, cross_encoder_scores):
    embedded = http.post("/", json={"model": M, "inputs": TEXTS[:2], "parameters": {"truncate": True}})
    assert embedded.status_code == 200, embedded.text
    np.testing.assert_allclose(embedded.json(), st_vectors[:2], atol=1e-5)
    ranked = http.post("/", json={"model": "reranker", "query": QUERY, "texts": DOCS})
    assert [r["index"] for r in ranked.json()] == np.argsort(-cross_encoder_scores, kind="stable").tolist()
    _error(http.post("/", json={"model": M, "inputs": "x", "query": "q"}), 400, "/embed", "query")
    _error(http.post("/", json={"inputs": "x"}), 400, "several models")


@pytest.fixture(scope="module")
def prefixed_server(tmp_path_factory):
    """One model (the default) at the REST root --url-prefix /api, no CORS."""
    log = tmp_path_factory.mktemp("compat-prefix") / "server.log"
    with ServerProcess("--cpu-threads", "1", "--url-prefix", "/api", rest=True, log_path=log) as server:
        yield server


@pytest.fixture(scope="module")
def prefixed_http(prefixed_server):
    with httpx.Client(base_url=prefixed_server.rest_url, timeout=60, trust_env=False) as client:
        yield client


def test_tei_inference_client_at_the_root_of_a_one_model_server_under_a_url_prefix(
    prefixed_server, prefixed_http, monkeypatch, st_vectors, st_model
):
    """What TEI users run: InferenceClient(base_url=server) posts to "/" itself (feature_extraction and
    sentence_similarity, which TEI's root takes for a similarity model: it was a 400 here); here the
    server's root is --url-prefix /api."""
    from huggingface_hub import InferenceClient, constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)  # see inference_client
    http, client = prefixed_http, InferenceClient(base_url=prefixed_server.rest_url + "/api")
    got = client.feature_extraction(TEXTS[:2])
    similarity = client.sentence_similarity(TEXTS[0], other_sentences=TEXTS[1:4])
    assert http.get("/api/v1/models").json()["data"][0]["id"] == M
    _error(http.get("/v1/models"), 404, "under /api")
    assert http.get("/api/health").status_code == http.get("/health").status_code == 200
    assert "openapi.json" in http.get("/api/docs").text and http.get("/docs").status_code == 404
    # No --cors-allow-origin: no CORS at all (a preflight is just a method not served).
    preflight = http.options("/api/embed", headers={"origin": ORIGIN, "access-control-request-method": "POST"})
    np.testing.assert_allclose(got, st_vectors[:2], atol=1e-5)
    vectors = st_model.encode(TEXTS[:4], normalize_embeddings=True)
    np.testing.assert_allclose(similarity, vectors[1:] @ vectors[0], atol=1e-5)
    assert preflight.status_code == 405 and "access-control-allow-origin" not in preflight.headers
    # The root's similarity shape is the /similarity route's: what it does not take is a 400 naming it.
    body = {"inputs": {"source_sentence": "a", "sentences": ["b"]}, "truncate": True}
    _error(http.post("/api/", json=body), 400, "/similarity", "truncate")
    _error(http.post("/api/", json={"inputs": {"source_sentence": "a"}}), 400, "sentences")


def test_openapi_and_docs_under_a_url_prefix(prefixed_http):
    """Under --url-prefix /api the OpenAPI document names it as its server and /docs shows the paths
    as called (both were unprefixed: generated clients called the wrong URLs); every path, called
    where the document says, is served."""
    from openapi_spec_validator import validate

    http = prefixed_http
    document = http.get("/api/openapi.json").json()
    validate(document)
    assert [server["url"] for server in document["servers"]] == ["/api"]
    assert http.get("/openapi.json").status_code == 404
    page = http.get("/api/docs").text
    for path, operations in document["paths"].items():
        assert f"<code>/api{path}</code>" in page, path
        url = "/api" + path.replace("{id}", M)
        for verb in operations:
            response = http.request(verb.upper(), url, **({"json": {}} if verb == "post" else {}))
            assert response.status_code not in (404, 405), (verb, url, response.text)
    head = http.head("/api/openapi.json", headers={"accept-encoding": "identity"})
    assert head.status_code == 200 and head.content == b"" and head.headers["content-type"] == "application/json"


def test_tei_routes_refuse_what_they_cannot_do(http):
    _error(http.post("/embed_sparse", json={"inputs": "x", "model": M}), 400, "sparse")
    _error(http.post("/embed_all", json={"inputs": "x", "model": "reranker"}), 400, "embedding or colbert")
    # An embedder and colbert are served: without `model`, TEI's routes take the embedding model.
    unnamed = http.post("/embed_all", json={"inputs": "x"})
    assert unnamed.status_code == 200 and len(unnamed.json()[0][0]) == 384, unnamed.text
    body = {"inputs": "x", "model": "colbert", "truncation_direction": "left"}
    _error(http.post("/embed_all", json=body), 400, "right only")
    _error(http.post("/embed_all", json={"inputs": "x", "normalize": True}), 400, "normalize")
    _error(http.post("/embed", json={"inputs": "x", "truncation_direction": "middle"}), 400, "truncation_direction")
    _error(http.post("/embed", json={"inputs": "x", "dimensions": 0}), 400, "dimensions")
    # With the article English takes (it said "is a embedding model").
    wrong_kind = http.post("/rerank", json={"model": M, "query": "q", "texts": ["a"]})
    _error(wrong_kind, 400, f"model {M!r} is an embedding model; /rerank needs a reranker model")


# A text over MiniLM's 256 tokens: TEI's /embed_all cuts it, then returns every token left.
LONG = " ".join(sentences(30, max_words=40, seed=4))


@pytest.fixture(scope="module")
def hidden_states(minilm_path):
    """transformers' last_hidden_state of a text, tokenized as the model's tokenizer does (special
    tokens included, cut at 256 tokens on the given side)."""
    import torch
    from transformers import AutoModel, AutoTokenizer

    model = AutoModel.from_pretrained(minilm_path, dtype=torch.float32).eval()
    tokenizers = {side: AutoTokenizer.from_pretrained(minilm_path, truncation_side=side) for side in ("right", "left")}

    def states(text: str, side: str = "right") -> np.ndarray:
        encoded = tokenizers[side](text, truncation=True, max_length=256, return_tensors="pt")
        with torch.inference_mode():
            return model(**encoded).last_hidden_state[0].numpy()

    return states


def _assert_states(got: list, want: list[np.ndarray]) -> None:
    assert len(got) == len(want)
    for rows, reference in zip(got, want, strict=True):
        assert np.shape(rows) == reference.shape
        np.testing.assert_allclose(rows, reference, atol=1e-4)


def test_tei_embed_all_on_a_plain_embedder_equals_transformers(http, hidden_states):
    """TEI's /embed_all on an embedding model: per input, every token's last hidden state (special
    tokens included, after truncation), not pooled and not normalized."""
    texts = [TEXTS[0], LONG, "short"]  # three lengths; the second is cut at 256 tokens
    response = http.post("/embed_all", json={"model": M, "inputs": texts})
    assert response.status_code == 200, response.text
    got = response.json()
    _assert_states(got, [hidden_states(t) for t in texts])
    assert len(got[1]) == 256 and len(got[2]) == 3  # [CLS] short [SEP]
    one = http.post("/embed_all", json={"model": M, "inputs": LONG, "truncation_direction": "left"})
    _assert_states(one.json(), [hidden_states(LONG, "left")])
    prompted = http.post("/embed_all", json={"model": M, "inputs": [TEXTS[1]], "prompt_name": "search_query"})
    _assert_states(prompted.json(), [hidden_states(QUERY_PROMPT + TEXTS[1])])
    _error(http.post("/embed_all", json={"model": M, "inputs": LONG, "truncate": False}), 400, "256")
    _error(http.post("/embed_all", json={"model": M, "inputs": "x", "dimensions": 8}), 400, "dimensions")


def test_embed_and_embed_all_at_once_each_get_their_own_output(http, st_vectors):
    """Pooled and token-state work for the same texts, interleaved on one model: never in one batch,
    never one's result for the other (in-flight sharing and the result cache key them apart)."""
    from concurrent.futures import ThreadPoolExecutor

    def embed(i: int):
        return http.post("/embed", json={"model": M, "inputs": TEXTS[i % 3 : i % 3 + 3]})

    def embed_all(i: int):
        return http.post("/embed_all", json={"model": M, "inputs": TEXTS[i % 3 : i % 3 + 3]})

    with ThreadPoolExecutor(8) as pool:
        futures = [(pool.submit(embed, i), pool.submit(embed_all, i)) for i in range(8)]
        answers = [(i, f.result(), g.result()) for i, (f, g) in enumerate(futures)]
    lengths = [len(t) for t in http.post("/tokenize", json={"model": M, "inputs": TEXTS}).json()]
    for i, pooled, states in answers:
        assert pooled.status_code == states.status_code == 200, (pooled.text, states.text)
        window = slice(i % 3, i % 3 + 3)
        np.testing.assert_allclose(pooled.json(), st_vectors[window], atol=1e-5)
        assert [np.shape(rows) for rows in states.json()] == [(n, 384) for n in lengths[window]]


# -------------------------------------------------------------------- Cohere
@pytest.fixture(scope="module")
def reference(st_model):
    """sentence-transformers' vectors of TEXTS, with the search_query prompt and without."""
    return {"search_query": st_model.encode([QUERY_PROMPT + t for t in TEXTS]), "plain": st_model.encode(TEXTS)}


def test_cohere_v1_embed_floats_and_input_type(compat_server, reference):
    import cohere

    co = cohere.Client(base_url=compat_server.rest_url, api_key="test-key")
    query = co.embed(texts=TEXTS, model=M, input_type="search_query")
    assert query.response_type == "embeddings_floats" and query.texts == TEXTS
    np.testing.assert_allclose(query.embeddings, reference["search_query"], atol=1e-5)
    document = co.embed(texts=TEXTS, model=M, input_type="search_document")
    np.testing.assert_allclose(document.embeddings, reference["plain"], atol=1e-5)
    assert "no prompt named 'search_document'" in document.meta.warnings[0]
    assert query.meta.billed_units.input_tokens > 0 and not query.meta.warnings


def test_cohere_embedding_types_v1_and_v2(compat_server, reference):
    import cohere
    from sentence_transformers.util.quantization import quantize_embeddings

    floats = reference["plain"]
    types = ["float", "int8", "uint8", "binary", "ubinary", "base64"]
    v1 = cohere.Client(base_url=compat_server.rest_url, api_key="k").embed(
        texts=TEXTS, model=M, input_type="clustering", embedding_types=types
    )
    v2 = cohere.ClientV2(base_url=compat_server.rest_url, api_key="k").embed(
        texts=TEXTS, model=M, input_type="clustering", embedding_types=types
    )
    for response in (v1, v2):
        e = response.embeddings
        np.testing.assert_allclose(e.float_, floats, atol=1e-5)
        np.testing.assert_array_equal(e.int8, np.round(np.clip(floats.astype(np.float64), -1, 1) * 127))
        np.testing.assert_array_equal(e.uint8, np.round((np.clip(floats.astype(np.float64), -1, 1) + 1) * 127.5))
        np.testing.assert_array_equal(e.binary, quantize_embeddings(floats, precision="binary"))
        np.testing.assert_array_equal(e.ubinary, quantize_embeddings(floats, precision="ubinary"))
        np.testing.assert_array_equal(
            [np.frombuffer(base64.b64decode(b), "<f4") for b in e.base64], np.array(e.float_, dtype=np.float32)
        )
    assert v2.meta.api_version.version == "2" and v1.meta.api_version.version == "1"


def test_cohere_v2_defaults_to_float_and_reads_inputs(compat_server, http, reference):
    import cohere

    co = cohere.ClientV2(base_url=compat_server.rest_url, api_key="k")
    response = co.embed(
        model=M,
        input_type="search_query",
        output_dimension=128,
        inputs=[{"content": [{"type": "text", "text": t}]} for t in TEXTS[:2]],
    )
    want = reference["search_query"][:2, :128]
    np.testing.assert_allclose(
        response.embeddings.float_, want / np.linalg.norm(want, axis=1, keepdims=True), atol=1e-5
    )
    assert response.embeddings.int8 is None
    _error(http.post("/v2/embed", json={"model": M, "texts": ["x"], "embedding_types": ["int4"]}), 400, "int4")
    _error(http.post("/v2/embed", json={"model": M, "texts": ["x"], "input_type": "query"}), 400, "input_type")
    _error(http.post("/v1/embed", json={"model": M, "texts": ["word " * 600], "truncate": "NONE"}), 400, "longer")
    _error(http.post("/v2/embed", json={"model": M, "texts": ["x"], "max_tokens": 16}), 400, "max_tokens")
    _error(
        http.post("/v2/embed", json={"model": M, "texts": ["x"], "output_dimension": 1000}), 400, "`output_dimension`"
    )
    _error(
        http.post("/v2/embed", json={"model": M, "texts": ["x"], "images": ["data:image/png;base64,AA=="]}),
        400,
        "images",
    )


def _png_uri(seed: int, size=(48, 40)) -> str:
    return png_data_uri(random_image(seed, size))


def _wav_uri(freq: float = 440.0, seconds: float = 0.5) -> str:
    import soundfile

    t = np.arange(int(seconds * CLAP_SAMPLING_RATE)) / CLAP_SAMPLING_RATE
    buffer = io.BytesIO()
    soundfile.write(buffer, (0.3 * np.sin(2 * np.pi * freq * t)).astype(np.float32), CLAP_SAMPLING_RATE, format="WAV")
    return "data:audio/wav;base64," + base64.b64encode(buffer.getvalue()).decode()


@pytest.fixture(scope="module")
def clip_server(tmp_path_factory, models_dir):
    """The media models (clip, clap) apart: beside compat_server's embedder, TEI's model-less routes
    would have two embedding models to choose from."""
    proc = ServerProcess(
        "--model",
        f"clip={build_clip(models_dir / 'mm-clip')}",
        "--model",
        f"clap={build_clap(models_dir / 'mm-clap')}",
        "--cpu-threads",
        "1",
        rest=True,
        log_path=tmp_path_factory.mktemp("compat-clip") / "server.log",
    )
    proc.start()
    yield proc
    assert proc.stop() == 0, proc.log_text()


def test_cohere_embed_images_equal_the_grpc_image_embedding(clip_server, http):
    """Cohere's image inputs (v1 and v2 `images`, v2 `image_url` parts beside text inputs) on the
    clip model: the same vectors as gRPC's EmbedMultimodal of the same images and texts."""
    import cohere

    images, caption = [_png_uri(1), _png_uri(2, (30, 60))], "a photo of a cat"
    contents = [pb.Content(image=pb.Media(url=u)) for u in images] + [pb.Content(text=caption)]
    want = np.array(
        [
            e.values
            for e in clip_server.stub()
            .EmbedMultimodal(pb.EmbedMultimodalRequest(model="clip", inputs=contents))
            .embeddings
        ]
    )  # clip's default: unit vectors
    v1 = cohere.Client(base_url=clip_server.rest_url, api_key="k").embed(
        model="clip", images=images, input_type="image", embedding_types=["float", "int8"]
    )
    np.testing.assert_allclose(v1.embeddings.float_, want[:2], atol=1e-5)
    assert v1.meta.billed_units.images == 2 and v1.texts == [] and len(v1.embeddings.int8[0]) == want.shape[1]
    co = cohere.ClientV2(base_url=clip_server.rest_url, api_key="k")
    mixed = co.embed(
        model="clip",
        input_type="image",
        embedding_types=["float"],
        inputs=[
            {"content": [{"type": "image_url", "image_url": {"url": images[0]}}]},
            {"content": [{"type": "text", "text": caption}]},
            {"content": [{"type": "image_url", "image_url": {"url": images[1]}}]},
        ],
    )
    np.testing.assert_allclose(mixed.embeddings.float_, want[[0, 2, 1]], atol=1e-5)
    assert mixed.texts == [caption] and mixed.meta.billed_units.images == 2
    by_images = co.embed(model="clip", input_type="image", images=images[1:], embedding_types=["float"])
    np.testing.assert_allclose(by_images.embeddings.float_, want[1:2], atol=1e-5)
    fused = {"content": [{"type": "text", "text": caption}, {"type": "image_url", "image_url": {"url": images[0]}}]}
    with httpx.Client(base_url=clip_server.rest_url, timeout=60, trust_env=False) as clip_http:
        _error(
            clip_http.post("/v2/embed", json={"model": "clip", "input_type": "image", "inputs": [fused]}),
            400,
            "inputs[0]",
            "input of its own",
        )
        _error(
            clip_http.post("/v1/embed", json={"model": "clip", "images": ["data:image/png;base64,AAAA"]}),
            400,
            "not an image",
        )
    _error(http.post("/v1/embed", json={"model": M, "images": images[:1]}), 400, "takes text")


@pytest.mark.parametrize(
    ("model", "modality", "uris"),
    [("clip", "image", [_png_uri(3), _png_uri(4, (20, 30))]), ("clap", "audio", [_wav_uri(440), _wav_uri(660, 0.8)])],
)
def test_infinity_client_image_and_audio_embeddings(clip_server, model, modality, uris):
    """Infinity's client on its media routes, /embeddings_image and /embeddings_audio, and on
    /embeddings with an image or audio body, which always carries `dimensions: 0` (Infinity's "full
    size"; it was a 400 on the media routes): the same vectors as gRPC's EmbedMultimodal."""
    from infinity_client import Client
    from infinity_client.api.default import embeddings, embeddings_audio, embeddings_image
    from infinity_client.models import (
        AudioEmbeddingInput,
        ImageEmbeddingInput,
        OpenAIEmbeddingInputAudio,
        OpenAIEmbeddingInputImage,
    )

    contents = [pb.Content(**{modality: pb.Media(url=u)}) for u in uris]
    want = [
        e.values
        for e in clip_server.stub().EmbedMultimodal(pb.EmbedMultimodalRequest(model=model, inputs=contents)).embeddings
    ]
    infinity = Client(base_url=clip_server.rest_url, raise_on_unexpected_status=True, timeout=60)
    route, route_body, root_body = {
        "image": (embeddings_image, ImageEmbeddingInput, OpenAIEmbeddingInputImage),
        "audio": (embeddings_audio, AudioEmbeddingInput, OpenAIEmbeddingInputAudio),
    }[modality]
    on_route = route.sync(client=infinity, body=route_body(input_=uris, model=model))
    body = root_body(input_=uris, model=model)
    assert body.to_dict()["dimensions"] == 0 and body.to_dict()["modality"] == modality
    at_root = embeddings.sync(client=infinity, body=body)
    np.testing.assert_allclose([d.embedding for d in on_route.data], want, atol=1e-5)
    np.testing.assert_allclose([d.embedding for d in at_root.data], want, atol=1e-5)
    with httpx.Client(base_url=clip_server.rest_url, timeout=60, trust_env=False) as media_http:
        for path in (f"/embeddings_{modality}", f"/v1/embeddings_{modality}"):  # Infinity's, with and without /v1
            full = media_http.post(path, json={"model": model, "input": uris[:1], "dimensions": 0})
            assert full.status_code == 200, full.text
            np.testing.assert_allclose(full.json()["data"][0]["embedding"], want[0], atol=1e-5)


# ---------------------------------------------------------------------- gRPC
@pytest.mark.parametrize("protocol", ["grpc-v1", "grpc-v1alpha"])
def test_reflection_v1_and_v1alpha_with_buf_curl(compat_server, protocol):
    import subprocess

    from support.node import node_client_dir

    buf = node_client_dir() / "node_modules" / ".bin" / "buf"
    base = ["--protocol", "grpc", "--http2-prior-knowledge", "--reflect-protocol", protocol]
    url = f"http://{compat_server.address}"
    listed = subprocess.run(
        [str(buf), "curl", *base, "--list-services", url], capture_output=True, text=True, timeout=60, check=False
    )
    assert listed.returncode == 0, listed.stderr
    assert {
        "encoderd.v1.Encoder",
        "grpc.reflection.v1.ServerReflection",
        "grpc.reflection.v1alpha.ServerReflection",
    } <= set(listed.stdout.split())
    # A call whose schema comes from reflection alone.
    called = subprocess.run(
        [
            str(buf),
            "curl",
            *base,
            "-d",
            '{"model": "reranker", "query": "q", "documents": ["a"]}',
            f"{url}/encoderd.v1.Encoder/Rerank",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert called.returncode == 0, called.stderr
    assert '"model": "reranker"' in called.stdout and '"relevanceScore"' in called.stdout


def test_health_answers_for_the_service_names(compat_server):
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(compat_server.address) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        for service in ("", "encoderd.v1.Encoder", "encoderd.v1.Compat", M, "reranker"):
            assert (
                health.Check(health_pb2.HealthCheckRequest(service=service)).status
                == health_pb2.HealthCheckResponse.SERVING
            ), service
        with pytest.raises(grpc.RpcError) as unknown:
            health.Check(health_pb2.HealthCheckRequest(service="encoderd.v1.Nope"))
        assert unknown.value.code() == grpc.StatusCode.NOT_FOUND


# ---------------------------------------------------------------------- fuzz
def _fuzz_bodies():
    from hypothesis import strategies as st

    text = st.text(max_size=20) | st.sampled_from(["", "a" * 2000, "\x00", "🙂"])
    value = st.recursive(
        st.none() | st.booleans() | st.integers(-(2**40), 2**40) | st.floats(allow_nan=False) | text,
        lambda children: st.lists(children, max_size=4) | st.dictionaries(text, children, max_size=3),
        max_leaves=12,
    )
    model = (
        st.sampled_from([M, "reranker", "classifier", "colbert", "splade", "", "nope", "default/not-specified"]) | value
    )
    keys = [
        "input",
        "inputs",
        "texts",
        "documents",
        "query",
        "ids",
        "embedding_types",
        "input_type",
        "truncate",
        "truncation_direction",
        "parameters",
        "normalize",
        "dimensions",
        "output_dimension",
        "top_n",
        "return_documents",
        "return_text",
        "raw_scores",
        "add_special_tokens",
        "skip_special_tokens",
        "max_tokens",
        "prompt_name",
        "images",
        "encoding_format",
        "modality",
    ]
    return st.fixed_dictionaries({"model": model}, optional=dict.fromkeys(keys, value)) | value


COMPAT_POSTS = [
    "/embeddings",
    "/rerank",
    "/classify",
    "/embed",
    "/embed_all",
    "/embed_sparse",
    "/predict",
    "/similarity",
    "/tokenize",
    "/decode",
    "/",
    "/v1/embed",
    "/v2/embed",
]


def test_compat_routes_fuzz(http):
    """Generated bodies on every route added here: client errors (4xx, JSON) or answers, never a 5xx."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    @settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
    @given(path=st.sampled_from(COMPAT_POSTS), body=_fuzz_bodies())
    def check(path, body):
        response = http.post(path, json=body)
        assert response.status_code < 500, (path, body, response.status_code, response.text)
        if response.status_code >= 400:
            assert "error" in response.json(), response.text

    check()


# ------------------------------------------------------------- HTTP habits
def test_gzip_responses(http, st_vectors):
    body = {"model": M, "input": TEXTS, "encoding_format": "float"}
    response = http.post("/v1/embeddings", json=body, headers={"accept-encoding": "gzip"})
    assert response.status_code == 200, response.text
    assert response.headers["content-encoding"] == "gzip"
    assert response.num_bytes_downloaded < 0.8 * len(response.content)  # sent compressed, inflated by httpx
    np.testing.assert_allclose([d["embedding"] for d in response.json()["data"]], st_vectors, atol=1e-5)
    plain = http.post("/v1/embeddings", json=body, headers={"accept-encoding": "identity"})
    assert "content-encoding" not in plain.headers and plain.json() == response.json()


def _post_gzipped(http, path: str, raw: bytes, encoding: str = "gzip") -> httpx.Response:
    return http.post(path, content=raw, headers={"content-type": "application/json", "content-encoding": encoding})


def _gzip(body) -> bytes:
    import gzip

    return gzip.compress(json.dumps(body).encode())


# A working body for each kind of POST route (others get {}: an error, which must be the same error).
GZIP_BODIES = {
    "/v1/embeddings": {"model": M, "input": TEXTS},
    "/embeddings": {"model": M, "input": TEXTS[:2]},
    "/v1/encoderd/embed": {"model": M, "inputs": TEXTS[:2]},
    "/embed": {"model": M, "inputs": TEXTS[:2]},
    "/v2/embed": {"model": M, "texts": TEXTS[:2], "input_type": "search_query", "embedding_types": ["float"]},
    "/v1/embed": {"model": M, "texts": TEXTS[:2]},
    "/rerank": {"model": "reranker", "query": QUERY, "texts": DOCS},
    "/v2/rerank": {"model": "reranker", "query": QUERY, "documents": DOCS},
    "/v1/encoderd/rerank": {"model": "reranker", "query": QUERY, "documents": DOCS},
    "/classify": {"model": "classifier", "input": TEXTS[:2]},
    "/predict": {"model": "classifier", "inputs": TEXTS[0]},
    "/v1/classify": {"model": "classifier", "inputs": TEXTS[:2]},
    "/tokenize": {"model": M, "inputs": TEXTS[0]},
    "/embed_all": {"model": "colbert", "inputs": TEXTS[:2]},
    "/embed_sparse": {"model": "splade", "inputs": TEXTS[0]},
}


def _stable(answer):
    """An answer less the fields that differ per call (response ids, timestamps)."""
    return {k: v for k, v in answer.items() if k not in ("id", "created")} if isinstance(answer, dict) else answer


def test_gzip_request_bodies_on_every_rest_route(compat_server, http, st_vectors):
    """Every POST route of /openapi.json answers a gzip body exactly as the same JSON sent plain."""
    posts = [path for path, operations in http.get("/openapi.json").json()["paths"].items() if "post" in operations]
    assert set(GZIP_BODIES) <= set(posts) and len(posts) > 20
    for path in posts:
        body = GZIP_BODIES.get(path, {})
        plain, gzipped = http.post(path, json=body), _post_gzipped(http, path, _gzip(body))
        assert (gzipped.status_code, _stable(gzipped.json())) == (plain.status_code, _stable(plain.json())), (
            path,
            gzipped.text[:300],
        )
        assert plain.status_code == 200 if path in GZIP_BODIES else plain.status_code < 500, (path, plain.text)
    embedded = _post_gzipped(http, "/v1/embeddings", _gzip(GZIP_BODIES["/v1/embeddings"]), encoding="x-gzip")
    np.testing.assert_allclose([d["embedding"] for d in embedded.json()["data"]], st_vectors, atol=1e-5)
    body = _gzip({"model": M, "input": "hello"})
    raw = _raw_http(
        compat_server.rest_port,
        b"POST /v1/embeddings HTTP/1.0\r\nContent-Type: application/json\r\n"
        b"Content-Encoding: GZIP\r\n"
        b"Content-Length: %d\r\n\r\n%s" % (len(body), body),
    )
    assert raw.split(b"\r\n")[0].endswith(b" 200 OK") and b'"embedding":[' in raw, raw[:300]


def _with_control(text: str, char: str) -> tuple[str, int]:
    """`text` (a JSON body) with `char` put raw inside its first request text, and the byte
    offset it is at."""
    for known in (QUERY, TEXTS[0], "x y"):
        literal = json.dumps(known)
        if literal in text:
            at = text.index(literal) + 2
            return text[:at] + char + text[at:], len(text[:at].encode())
    raise AssertionError(f"no request text in {text}")


def test_control_characters_in_json_strings_are_a_400_naming_their_place(http):
    """RFC 8259 allows no raw U+0000-U+001F in a string (and only tab, LF and CR between tokens):
    every REST route answers such a body 400 with the character and its place, plain or gzipped,
    before any model sees it. The transcoder took a raw NUL into the text (200) before."""
    import gzip

    posts = [path for path, operations in http.get("/openapi.json").json()["paths"].items() if "post" in operations]
    assert set(GZIP_BODIES) <= set(posts) and len(posts) > 20
    for path in posts:
        body = json.dumps(GZIP_BODIES.get(path, {"model": M, "input": "x y", "inputs": "x y"}))
        raw, at = _with_control(body, "\x00")
        for response in (http.post(path, content=raw.encode()), _post_gzipped(http, path, gzip.compress(raw.encode()))):
            _error(response, 400, f"control character U+0000 at byte {at} (line 1, column {at + 1})", "\\u0000")
    body = json.dumps(GZIP_BODIES["/v1/embeddings"])
    for code in range(0x20):
        raw, at = _with_control(body, chr(code))
        _error(http.post("/v1/embeddings", content=raw.encode()), 400, f"U+{code:04X} at byte {at} ")
    # Between tokens tab, LF and CR are whitespace; escaped, any control character is text.
    pretty = json.dumps(GZIP_BODIES["/v1/embeddings"], indent="\t").replace("\n", "\r\n")
    assert http.post("/v1/embeddings", content=pretty.encode()).status_code == 200
    escaped, _ = _with_control(body, "\\u0000\\n\\t")
    assert http.post("/v1/embeddings", content=escaped.encode()).status_code == 200
    # The place is counted in lines too, in a pretty-printed body.
    raw, at = _with_control(pretty, "\x01")
    line = raw[:at].count("\n") + 1
    column = at - raw[:at].rfind("\n")
    _error(
        http.post("/v1/embeddings", content=raw.encode()), 400, f"U+0001 at byte {at} (line {line}, column {column})"
    )
    for code in (0x00, 0x1F):  # outside a string, only tab, LF and CR may be
        _error(http.post("/v1/embeddings", content=(chr(code) + body).encode()), 400, f"U+{code:04X} at byte 0 ")


def test_bad_gzip_bodies_are_a_400_at_once(http):
    """Truncated, corrupt or mislabelled gzip: a 400 naming the problem, never a hang (the client's
    30 s timeout) or a request built from a prefix of the body."""
    import gzip

    text = json.dumps({"model": M, "input": TEXTS}).encode()
    whole = gzip.compress(text)
    flipped = bytearray(whole)
    flipped[len(whole) // 2] ^= 0x10
    bad_crc = bytearray(whole)
    bad_crc[-8] ^= 0x01  # the data is intact, its checksum is not
    cases = {
        "truncated": [whole[:cut] for cut in (10, 17, 18, 40, len(whole) // 2, len(whole) - 8, len(whole) - 1)],
        "corrupt": [bytes(flipped), bytes(bad_crc), gzip.compress(text[:40]) + gzip.compress(text[40:])],
        "not gzip": [text, b"x" * 100],
    }
    for kind, bodies in cases.items():
        for raw in bodies:
            response = http.post(
                "/v1/embeddings",
                content=raw,
                timeout=30,
                headers={"content-type": "application/json", "content-encoding": "gzip"},
            )
            _error(response, 400, "gzip", "send a complete gzip stream")
            assert kind.split()[0] in response.json()["error"]["message"] or kind == "corrupt", response.text
    # Whole gzip, JSON cut short inside: the transcoder's own 400, as for the same JSON sent plain
    # (this hung until the route timeout with the decompressor in front of the transcoder).
    cut = _post_gzipped(http, "/v1/embeddings", gzip.compress(text[: len(text) // 2]))
    assert cut.status_code == 400 and cut.json() == http.post("/v1/embeddings", content=text[: len(text) // 2]).json()
    for encoding in ("deflate", "br", "gzip, br"):
        _error(_post_gzipped(http, "/v1/embeddings", whole, encoding), 415, f"Content-Encoding {encoding}", "gzip")
    assert http.get("/v1/models", headers={"content-encoding": "gzip"}).status_code == 200  # no body: nothing to do


def _zero_bomb(inflated_mib: int) -> bytes:
    """A gzip stream of `inflated_mib` MiB of zeros, made from one repeated 1 MiB block (fully
    flushed, so each copy stands alone): kilobytes to send, any size inflated."""
    import zlib

    deflate = zlib.compressobj(9, zlib.DEFLATED, -15)
    block = deflate.compress(bytes(1 << 20)) + deflate.flush(zlib.Z_FULL_FLUSH)
    header = b"\x1f\x8b\x08\x00\x00\x00\x00\x00\x00\xff"
    return header + block * inflated_mib + deflate.flush() + b"\x00" * 8  # its trailer never matters


def test_gzip_bomb_hits_the_body_limit(compat_server, http):
    """8 GiB of zeros in 8 MiB of gzip: 413 at the 32 MiB limit on inflated bytes, with Envoy's
    memory peak bounded (one 64 KiB read inflated at most 1032:1, plus the buffered body)."""
    envoy = compat_server.envoy_pid()
    peak = _peak_rss_mib(envoy)
    bomb = _zero_bomb(8192)
    assert len(bomb) < 10 << 20
    response = _post_gzipped(http, "/v1/embeddings", bomb)
    _error(response, 413, "Payload Too Large")
    assert _peak_rss_mib(envoy) - peak < 400, "Envoy inflated far past the body limit"
    assert http.post("/v1/embeddings", json={"model": M, "input": "still serving"}).status_code == 200


def _peak_rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise AssertionError(f"no VmHWM for {pid}")


def _raw_http(port: int, request: bytes) -> bytes:
    import socket

    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(request)
        chunks = []
        while chunk := sock.recv(65536):  # HTTP/1.0: the server closes after the response
            chunks.append(chunk)
    return b"".join(chunks)


def test_http_1_0_and_head(compat_server, http):
    health = _raw_http(compat_server.rest_port, b"GET /health HTTP/1.0\r\n\r\n")
    assert health.split(b"\r\n")[0].endswith(b" 200 OK"), health[:200]
    assert b'"status":"serving"' in health
    body = b'{"model": "%s", "input": "hello"}' % M.encode()
    embedded = _raw_http(
        compat_server.rest_port,
        b"POST /v1/embeddings HTTP/1.0\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n%s" % (len(body), body),
    )
    assert embedded.split(b"\r\n")[0].endswith(b" 200 OK") and b'"embedding":[' in embedded, embedded[:300]
    for path in ("/health", "/v1/models"):
        head = http.head(path, headers={"accept-encoding": "gzip"})
        assert head.status_code == 200 and head.content == b"", head.content[:100]
        assert int(head.headers["content-length"]) > 0 and "content-encoding" not in head.headers
    identity = {"accept-encoding": "identity"}  # else GET /v1/models comes gzipped, chunked
    assert (
        http.head("/v1/models").headers["content-length"]
        == http.get("/v1/models", headers=identity).headers["content-length"]
    )
    assert http.get("/health").status_code == 200  # the connection is still in step
    for path in ("/", "/ping"):  # where TEI answers health probes (Inference API, SageMaker)
        probe = http.get(path)
        assert probe.status_code == 200 and probe.json()["status"] == "serving", (path, probe.text)


def test_wrong_method_is_405_with_allow(http):
    for method, path, allow in [
        ("GET", "/v1/embeddings", "POST"),
        ("POST", "/health", "GET, HEAD"),
        ("DELETE", "/v1/models/x/y", "GET, HEAD"),
        ("HEAD", "/embed", "POST"),
        ("PUT", "/", "GET, HEAD, POST"),  # GET: health, as TEI answers it; POST: TEI's dispatching route
    ]:
        response = http.request(method, path)
        assert response.status_code == 405, (method, path, response.text)
        assert response.headers["allow"] == allow
        if method != "HEAD":
            error = response.json()["error"]
            assert error["code"] == "method_not_allowed" and allow.replace(", ", " or ") in error["message"]
    assert http.get("/v1/no-such-route").status_code == 404
    assert http.get("/v1/models?limit=3").status_code == 200  # a query string is not part of the route


def test_cors_for_the_allowed_origin_only(http):
    preflight = {
        "access-control-request-method": "POST",
        "access-control-request-headers": "authorization,content-type",
    }
    allowed = http.options("/v1/embeddings", headers={"origin": ORIGIN, **preflight})
    assert allowed.status_code == 200, allowed.text
    assert allowed.headers["access-control-allow-origin"] == ORIGIN
    assert "POST" in allowed.headers["access-control-allow-methods"]
    assert "authorization" in allowed.headers["access-control-allow-headers"]
    call = http.post("/embed", json={"model": M, "inputs": "hi"}, headers={"origin": ORIGIN})
    assert call.status_code == 200 and call.headers["access-control-allow-origin"] == ORIGIN
    assert "x-request-id" in call.headers["access-control-expose-headers"]
    other = {"origin": "https://elsewhere.example"}
    refused = http.options("/v1/embeddings", headers={**other, **preflight})
    assert refused.status_code == 405 and "access-control-allow-origin" not in refused.headers
    plain = http.post("/embed", json={"model": M, "inputs": "hi"}, headers=other)
    assert plain.status_code == 200 and "access-control-allow-origin" not in plain.headers


def test_openapi_document_is_valid_and_every_route_in_it_is_served(http):
    from openapi_spec_validator import validate

    document = http.get("/openapi.json").json()
    validate(document)
    paths = document["paths"]
    assert {
        "/v1/embeddings",
        "/embeddings",
        "/embed",
        "/rerank",
        "/v2/embed",
        "/info",
        "/openapi.json",
        "/v1/encoderd/embed",
    } <= set(paths)
    assert paths["/v1/models/{id}"]["get"]["parameters"][0]["name"] == "id"
    schema = document["components"]["schemas"]["encoderd.v1.CohereEmbedRequest"]["properties"]
    assert schema["embedding_types"] == {"type": "array", "items": {"type": "string"}}
    for path, operations in paths.items():
        url = path.replace("{id}", M)
        for verb in operations:
            # Served: an answer or a client error about the body, never "no such route" / "wrong method".
            response = http.request(verb.upper(), url, **({"json": {}} if verb == "post" else {}))
            assert response.status_code not in (404, 405), (verb, path, response.text)


def test_docs_page_shows_every_route_without_scripts(http):
    """GET /docs: HTML rendered from the OpenAPI document (no script, no CDN), every route and
    message in it; other methods get 405 as on any GET route."""
    from html.parser import HTMLParser

    document = http.get("/openapi.json").json()
    page = http.get("/docs", headers={"accept-encoding": "gzip"})
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert page.headers["content-encoding"] == "gzip"

    class Collect(HTMLParser):
        tags, text, ids = set(), [], set()

        def handle_starttag(self, tag, attrs):
            self.tags.add(tag)
            self.ids.update(value for name, value in attrs if name == "id")

        def handle_data(self, data):
            self.text.append(data)

    parsed = Collect()
    parsed.feed(page.text)
    text = " ".join(parsed.text)
    assert not {"script", "link", "img"} & parsed.tags and "://" not in page.text  # nothing fetched from elsewhere
    for path, operations in document["paths"].items():
        assert path in text and all(verb.upper() in text for verb in operations), path
    assert set(document["components"]["schemas"]) - {"Error"} <= parsed.ids
    head = http.head("/docs", headers={"accept-encoding": "identity"})  # Envoy's own reply, not the server's
    assert head.status_code == 200 and head.content == b""
    assert int(head.headers["content-length"]) == len(page.content), head.headers
    response = http.post("/docs", json={})
    assert response.status_code == 405 and response.headers["allow"] == "GET, HEAD"


def test_cohere_v1_rerank_object_documents_and_rank_fields(compat_server, reranker_path):
    import cohere
    from sentence_transformers import CrossEncoder

    documents = [{"title": f"doc {i}", "text": d, "source": "corpus"} for i, d in enumerate(DOCS[:4])]
    co = cohere.Client(base_url=compat_server.rest_url, api_key="k")
    response = co.rerank(
        model="reranker", query=QUERY, documents=documents, rank_fields=["title", "text"], return_documents=True
    )
    ranked_texts = [f"title: {d['title']}\ntext: {d['text']}" for d in documents]
    want = CrossEncoder(reranker_path, device="cpu").predict([(QUERY, t) for t in ranked_texts])
    assert [r.index for r in response.results] == np.argsort(-want, kind="stable").tolist()
    np.testing.assert_allclose([r.relevance_score for r in response.results], np.sort(want)[::-1], atol=1e-5)
    # Every field of an object document comes back, not only `text` (the SDK keeps extra fields).
    assert [(r.document.text, r.document.title, r.document.source) for r in response.results] == [
        (documents[r.index]["text"], documents[r.index]["title"], "corpus") for r in response.results
    ]
    assert response.meta.api_version.version == "1"
    v2 = cohere.ClientV2(base_url=compat_server.rest_url, api_key="k").rerank(
        model="reranker", query=QUERY, documents=DOCS[:2]
    )
    assert v2.meta.api_version.version == "2"


def test_token_ids_without_special_tokens_get_them(compat_server, http, minilm_path, st_vectors, st_model):
    """OpenAI-style ids (tokenized without [CLS] / [SEP]) embed as their text does."""
    import openai
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(f"{minilm_path}/tokenizer.json")
    tokenizer.no_padding()
    tokenizer.no_truncation()
    ids = [tokenizer.encode(t, add_special_tokens=False).ids for t in TEXTS[:3]]
    client = openai.OpenAI(base_url=compat_server.rest_url + "/v1", api_key="k", max_retries=0)
    response = client.embeddings.create(model=M, input=ids)
    np.testing.assert_allclose([d.embedding for d in response.data], st_vectors[:3], atol=1e-5)
    assert response.usage.prompt_tokens == sum(len(i) + 2 for i in ids)
    long = tokenizer.encode("word " * 600, add_special_tokens=False).ids  # cut to 256 between [CLS] and [SEP]
    got = http.post("/embed", json={"model": M, "inputs": [long]}).json()[0]
    np.testing.assert_allclose(got, st_model.encode("word " * 600), atol=1e-5)
