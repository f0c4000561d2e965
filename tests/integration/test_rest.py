"""Issue 3: the REST gateway — the real server behind its real Envoy child, driven
by the official openai and cohere SDKs and raw HTTP, compared with gRPC and the
reference libraries."""

from __future__ import annotations

import base64
import concurrent.futures as cf
import gzip
import os
import queue
import re
import signal
import subprocess
import time
from pathlib import Path

import grpc
import httpx
import numpy as np
import pytest
from support.corpus import sentences
from support.server import ServerProcess

from encoderd.gateway.process import envoy_workers, listens_on
from encoderd.v1 import encoderd_pb2 as pb
from encoderd.v1 import encoderd_pb2_grpc
from encoderd.workers.contract.cpu_cores import cpu_budget
from encoderd.workers.contract.model_files import DEFAULT_MODEL_NAME, default_model_path

TEXTS = sentences(24, max_words=80, seed=3)
QUERY = "how do search engines rank documents"
DOCS = [*sentences(9, max_words=40, seed=11), "a cross encoder reranks candidate documents for search engines"]
MAX_QUEUED = 64  # small, so a few concurrent requests overflow it (429)


@pytest.fixture(scope="module")
def rest_server(tmp_path_factory, reranker_path, classifier_path):
    """One server with an embedder, a reranker and a classifier, and REST through Envoy."""
    log = tmp_path_factory.mktemp("rest") / "server.log"
    proc = ServerProcess(
        "--model",
        f"{DEFAULT_MODEL_NAME}={default_model_path()}",
        "--model",
        f"reranker={reranker_path}",
        "--model",
        f"classifier={classifier_path}",
        "--max-queued-inputs",
        str(MAX_QUEUED),
        "--max-inputs-per-request",
        "512",
        "--rest-max-body-mb",
        "1",
        rest=True,
        log_path=log,
    )
    proc.start()
    yield proc
    assert proc.stop() == 0, proc.log_text()


@pytest.fixture(scope="module")
def http(rest_server):
    with httpx.Client(base_url=rest_server.rest_url, timeout=60) as client:
        yield client


@pytest.fixture(scope="module")
def stub(rest_server):
    return rest_server.stub()


@pytest.fixture(scope="module")
def openai_client(rest_server):
    import openai

    return openai.OpenAI(base_url=rest_server.rest_url + "/v1", api_key="test-key", max_retries=0)


@pytest.fixture(scope="module")
def st_vectors(minilm_path):
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(minilm_path, device="cpu").encode(TEXTS)


def _assert_openai_error(response: httpx.Response, status: int, code: str) -> dict:
    """An OpenAI-shaped JSON error with the right status, and no gRPC plumbing headers."""
    assert response.status_code == status, response.text
    assert response.headers["content-type"] == "application/json"
    assert not {"grpc-status", "grpc-message"} & set(response.headers)
    error = response.json()["error"]
    assert error["code"] == code, error
    assert isinstance(error["message"], str) and error["message"]
    assert isinstance(error["type"], str) and error["type"]
    return error


# ---------------------------------------------------------------- embeddings
def test_openai_sdk_default_base64_equals_grpc_and_sentence_transformers(openai_client, stub, st_vectors):
    response = openai_client.embeddings.create(model=DEFAULT_MODEL_NAME, input=TEXTS)  # SDK asks for base64
    got = np.array([d.embedding for d in response.data], dtype=np.float32)
    assert [d.index for d in response.data] == list(range(len(TEXTS)))
    np.testing.assert_allclose(got, st_vectors, atol=1e-5)
    grpc = stub.Embed(pb.EmbedRequest(model=DEFAULT_MODEL_NAME, inputs=TEXTS))
    np.testing.assert_allclose(got, np.array([e.values for e in grpc.embeddings]), atol=1e-5)
    assert response.usage.prompt_tokens == response.usage.total_tokens == grpc.usage.prompt_tokens
    assert response.model == DEFAULT_MODEL_NAME and response.object == "list"


def test_openai_sdk_explicit_float_and_base64(openai_client, st_vectors):
    floats = openai_client.embeddings.create(model=DEFAULT_MODEL_NAME, input=TEXTS[:5], encoding_format="float")
    np.testing.assert_allclose(np.array([d.embedding for d in floats.data]), st_vectors[:5], atol=1e-5)
    raw = openai_client.embeddings.create(model=DEFAULT_MODEL_NAME, input=TEXTS[:5], encoding_format="base64")
    decoded = np.stack([np.frombuffer(base64.b64decode(d.embedding), dtype="<f4") for d in raw.data])
    # Both renderings carry the same float32 values: "%.9g" round-trips float32 exactly.
    np.testing.assert_array_equal(decoded, np.array([d.embedding for d in floats.data], dtype=np.float32))


def test_openai_sdk_single_string_and_dimensions(openai_client, st_vectors):
    one = openai_client.embeddings.create(model=DEFAULT_MODEL_NAME, input=TEXTS[0])
    np.testing.assert_allclose(one.data[0].embedding, st_vectors[0], atol=1e-5)
    short = openai_client.embeddings.create(model=DEFAULT_MODEL_NAME, input=TEXTS[:3], dimensions=64)
    want = st_vectors[:3, :64] / np.linalg.norm(st_vectors[:3, :64], axis=1, keepdims=True)
    np.testing.assert_allclose(np.array([d.embedding for d in short.data]), want, atol=1e-5)


def test_native_grpc_on_the_rest_port_is_passed_through_as_it_streams(rest_server, stub):
    """A gRPC client pointed at the REST port: unary calls answer as on the gRPC port, and an
    EmbedStream that sends each input only after the previous answer is served. Envoy's body
    buffer used to hold such a stream until the client half-closed: it hung to its deadline."""
    with grpc.insecure_channel(f"127.0.0.1:{rest_server.rest_port}") as channel:
        via_rest_port = encoderd_pb2_grpc.EncoderStub(channel)
        request = pb.EmbedRequest(model=DEFAULT_MODEL_NAME, inputs=TEXTS[:4])
        got = via_rest_port.Embed(request, timeout=30)
        want = stub.Embed(request, timeout=30)
        np.testing.assert_allclose([e.values for e in got.embeddings], [e.values for e in want.embeddings], atol=1e-6)

        outbox: queue.Queue = queue.Queue()
        outbox.put(pb.EmbedStreamRequest(model=DEFAULT_MODEL_NAME, id="0", input=TEXTS[0]))
        answers = []
        for answer in via_rest_port.EmbedStream(iter(outbox.get, None), timeout=30):
            answers.append(answer)
            following = len(answers)
            outbox.put(pb.EmbedStreamRequest(id=str(following), input=TEXTS[following]) if following < 4 else None)
        assert [a.id for a in answers] == ["0", "1", "2", "3"]
        streamed = [a.embedding.values for a in answers]
        np.testing.assert_allclose(streamed, [e.values for e in want.embeddings], atol=1e-6)


def test_token_id_inputs_equal_text_inputs(http, st_vectors):
    tokenized = http.post("/v1/tokenize", json={"model": DEFAULT_MODEL_NAME, "inputs": TEXTS[:3]}).json()
    ids = [r["ids"] for r in tokenized["results"]]
    many = http.post("/v1/embeddings", json={"model": DEFAULT_MODEL_NAME, "input": ids, "encoding_format": "float"})
    assert many.status_code == 200, many.text
    np.testing.assert_allclose([d["embedding"] for d in many.json()["data"]], st_vectors[:3], atol=1e-5)
    assert many.json()["usage"]["prompt_tokens"] == sum(len(i) for i in ids)
    single = http.post("/v1/embeddings", json={"model": DEFAULT_MODEL_NAME, "input": ids[0]}).json()
    np.testing.assert_allclose(single["data"][0]["embedding"], st_vectors[0], atol=1e-5)


def test_success_responses_hide_grpc_headers(http):
    response = http.post(
        "/embeddings",
        json={"model": DEFAULT_MODEL_NAME, "input": "hi", "user": "ignored", "unknown_field": {"nested": 1}},
    )
    assert response.status_code == 200, response.text
    assert response.headers["content-type"] == "application/json"
    assert not {"grpc-status", "grpc-message", "grpc-accept-encoding"} & set(response.headers)


# -------------------------------------------------------------------- rerank
@pytest.fixture(scope="module")
def cross_encoder_scores(reranker_path):
    from sentence_transformers import CrossEncoder

    return CrossEncoder(reranker_path, device="cpu").predict([(QUERY, d) for d in DOCS])


def test_cohere_v2_sdk_rerank_equals_cross_encoder_and_grpc(rest_server, stub, cross_encoder_scores):
    import cohere

    client = cohere.ClientV2(base_url=rest_server.rest_url, api_key="test-key")
    response = client.rerank(model="reranker", query=QUERY, documents=DOCS, top_n=4)
    want_order = np.argsort(-cross_encoder_scores, kind="stable")[:4]
    assert [r.index for r in response.results] == want_order.tolist()
    np.testing.assert_allclose(
        [r.relevance_score for r in response.results], cross_encoder_scores[want_order], atol=1e-5
    )
    grpc = stub.Rerank(pb.RerankRequest(model="reranker", query=QUERY, documents=DOCS, top_n=4))
    assert [r.index for r in grpc.results] == [r.index for r in response.results]
    np.testing.assert_allclose(
        [r.relevance_score for r in grpc.results], [r.relevance_score for r in response.results], atol=1e-6
    )
    assert response.meta.billed_units.search_units == 1 and response.id


def test_tei_predict_scores_pairs_on_a_reranker_as_tei_does(http, cross_encoder_scores):
    """TEI's /predict takes a one-label cross-encoder too: the sigmoid score under its label (it was
    a 400 "needs a classifier model" here)."""
    one = http.post("/predict", json={"model": "reranker", "inputs": [QUERY, DOCS[0]]})
    assert one.status_code == 200, one.text
    [only] = one.json()
    assert set(only) == {"score", "label"}
    np.testing.assert_allclose(only["score"], cross_encoder_scores[0], atol=1e-5)
    batch = http.post("/predict", json={"model": "reranker", "inputs": [[QUERY, d] for d in DOCS[:3]]}).json()
    np.testing.assert_allclose([row[0]["score"] for row in batch], cross_encoder_scores[:3], atol=1e-5)


def test_cohere_v1_sdk_and_raw_rerank_shapes(rest_server, http, cross_encoder_scores):
    import cohere

    client = cohere.Client(base_url=rest_server.rest_url, api_key="test-key")
    response = client.rerank(model="reranker", query=QUERY, documents=DOCS, return_documents=True)
    assert [r.document.text for r in response.results] == [DOCS[r.index] for r in response.results]
    assert len(response.results) == len(DOCS)
    raw = http.post(
        "/v1/rerank",
        json={
            "model": "reranker",
            "query": QUERY,
            "raw_scores": True,
            "documents": [{"text": d} for d in DOCS[:3]],
            "max_tokens_per_doc": 512,
        },
    )
    assert raw.status_code == 200, raw.text
    body = raw.json()
    assert set(body) >= {"id", "results", "model", "usage", "meta"}
    assert all("document" not in r for r in body["results"])
    logits = np.log(cross_encoder_scores[:3] / (1 - cross_encoder_scores[:3]))
    got = sorted(body["results"], key=lambda r: r["index"])
    np.testing.assert_allclose([r["relevance_score"] for r in got], logits, atol=1e-4)
    # Cohere's document limits are honoured or refused, never ignored: pairs are cut at the model's
    # maximum, one chunk a document (max_tokens_per_doc: the test below).
    request = {"model": "reranker", "query": QUERY, "documents": DOCS[:2]}
    assert http.post("/v1/rerank", json={**request, "max_chunks_per_doc": 3}).status_code == 200
    for field in ("max_chunks_per_doc", "max_tokens_per_doc"):
        refused = http.post("/v2/rerank", json={**request, field: -1})
        assert refused.status_code == 400 and f"`{field}` must be a positive integer" in refused.text, refused.text


# Accents, CJK and punctuation: the cut falls where the tokenizer's character offsets say.
ACCENTED = "Café déjà vu: the naïve résumé of 東京の検索エンジン ranks documents by relevance and freshness"


def test_cohere_v2_rerank_cuts_each_document_at_max_tokens_per_doc(rest_server, reranker_path):
    """Cohere's `max_tokens_per_doc` below the model's maximum cuts each document to its first N tokens
    (it was a 400): the scores are CrossEncoder's of the documents cut by the model's own tokenizer
    (transformers, its offsets), not those of the whole documents."""
    import cohere
    from sentence_transformers import CrossEncoder
    from transformers import AutoTokenizer

    limit = 8
    documents = [*[d for d in DOCS if len(d.split()) > limit][:4], ACCENTED, "short one"]
    tokenizer = AutoTokenizer.from_pretrained(reranker_path)

    def cut(text: str) -> str:
        offsets = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
        return text if len(offsets) <= limit else text[: offsets[limit - 1][1]]

    cut_documents = [cut(d) for d in documents]
    assert [c != d for c, d in zip(cut_documents, documents, strict=True)] == [True] * 5 + [False]
    cross_encoder = CrossEncoder(reranker_path, device="cpu")
    want = cross_encoder.predict([(QUERY, d) for d in cut_documents])
    uncut = cross_encoder.predict([(QUERY, d) for d in documents])
    assert np.abs(want - uncut).max() > 1e-3  # the cut is what the scores show
    client = cohere.ClientV2(base_url=rest_server.rest_url, api_key="test-key")
    response = client.rerank(model="reranker", query=QUERY, documents=documents, max_tokens_per_doc=limit)
    got = {r.index: r.relevance_score for r in response.results}
    np.testing.assert_allclose([got[i] for i in range(len(documents))], want, atol=1e-5)
    # At or above the model's maximum nothing is cut but the pair, at that maximum, as before.
    whole = client.rerank(model="reranker", query=QUERY, documents=documents, max_tokens_per_doc=100_000)
    got = {r.index: r.relevance_score for r in whole.results}
    np.testing.assert_allclose([got[i] for i in range(len(documents))], uncut, atol=1e-5)


# ------------------------------------------- classify, tokenize, models, health
def test_classify_through_encoder_annotations(http, stub):
    texts = TEXTS[:3]
    response = http.post("/v1/classify", json={"model": "classifier", "inputs": texts})
    assert response.status_code == 200, response.text
    body = response.json()
    grpc = stub.Classify(pb.ClassifyRequest(model="classifier", inputs=texts))
    assert body["usage"] == {"prompt_tokens": grpc.usage.prompt_tokens, "total_tokens": grpc.usage.total_tokens}
    for rest_result, grpc_result in zip(body["results"], grpc.results, strict=True):
        assert [ls["label"] for ls in rest_result["labels"]] == [ls.label for ls in grpc_result.labels]
        np.testing.assert_allclose(
            [ls["score"] for ls in rest_result["labels"]], [ls.score for ls in grpc_result.labels], atol=1e-6
        )
        assert {ls["label"] for ls in rest_result["labels"]} == {"negative", "neutral", "positive"}


def test_models_health_and_tokenize(http, openai_client):
    ids = sorted(m.id for m in openai_client.models.list())
    assert ids == sorted([DEFAULT_MODEL_NAME, "reranker", "classifier"])
    listed = http.get("/v1/models").json()
    assert listed["object"] == "list"
    for model in listed["data"]:
        assert model["object"] == "model" and model["owned_by"] == "encoderd" and model["created"] == 0
    assert openai_client.models.retrieve(DEFAULT_MODEL_NAME).id == DEFAULT_MODEL_NAME  # id with a slash
    health = http.get("/health")
    assert health.status_code == 200 and health.json()["status"] == "serving"
    tokens = http.post("/v1/tokenize", json={"model": DEFAULT_MODEL_NAME, "inputs": ["hello world"]}).json()
    assert tokens["results"][0]["tokens"] == ["[CLS]", "hello", "world", "[SEP]"]


# -------------------------------------------------------------------- errors
M = DEFAULT_MODEL_NAME
ERRORS = [
    # (method, path, JSON body or raw bytes, HTTP status, error code)
    ("POST", "/v1/embeddings", b'{"input": "x", ', 400, "invalid_argument"),
    ("POST", "/v1/embeddings", b"not json at all", 400, "invalid_argument"),
    ("POST", "/v1/embeddings", b'{"input": "\xff\xfe"}', 400, "invalid_argument"),
    ("POST", "/v1/embeddings", {"model": M, "input": "x", "dimensions": 'a"b\n\u0001'}, 400, "invalid_argument"),
    ("POST", "/v1/embeddings", {"model": M, "input": []}, 400, "invalid_argument"),
    ("POST", "/v1/embeddings", {"model": M, "input": ""}, 400, "invalid_argument"),
    ("POST", "/v1/embeddings", {"model": M}, 400, "invalid_argument"),
    ("POST", "/v1/embeddings", {"model": M, "input": ["a", 1]}, 400, "invalid_argument"),
    ("POST", "/v1/embeddings", {"model": M, "input": [[101, 10**9]]}, 400, "invalid_argument"),
    ("POST", "/v1/embeddings", {"model": M, "input": [101.5]}, 400, "invalid_argument"),
    ("POST", "/v1/embeddings", {"model": M, "input": "x", "dimensions": 0}, 400, "invalid_argument"),
    ("POST", "/v1/embeddings", {"model": M, "input": "x", "dimensions": 385}, 400, "invalid_argument"),
    ("POST", "/v1/embeddings", {"model": M, "input": "x", "encoding_format": "int8"}, 400, "invalid_argument"),
    ("POST", "/v1/embeddings", {"model": "reranker", "input": "x"}, 400, "failed_precondition"),
    ("POST", "/v1/embeddings", {"model": "no-such-model", "input": "x"}, 404, "not_found"),
    ("POST", "/v2/rerank", {"model": "reranker", "query": "", "documents": ["a"]}, 400, "invalid_argument"),
    (
        "POST",
        "/v2/rerank",
        {"model": "reranker", "query": "q", "documents": ["a"], "top_n": 0},
        400,
        "invalid_argument",
    ),
    ("POST", "/v2/rerank", {"model": "reranker", "query": "q", "documents": [{"title": "a"}]}, 400, "invalid_argument"),
    ("POST", "/v2/rerank", {"model": "no-such-model", "query": "q", "documents": ["a"]}, 404, "not_found"),
    ("GET", "/v1/models/no-such-model", None, 404, "not_found"),
    ("GET", "/v1/no-such-route", None, 404, "not_found"),
    ("POST", "/v1/embeddings", {"model": M, "input": "x" * (1024 * 1024 + 10)}, 413, "payload_too_large"),
]


@pytest.mark.parametrize(
    "method, path, body, status, code", ERRORS, ids=[f"{r[3]}-{r[1]}-{i}" for i, r in enumerate(ERRORS)]
)
def test_errors_are_openai_shaped(http, method, path, body, status, code):
    if isinstance(body, bytes):
        response = http.request(method, path, content=body, headers={"content-type": "application/json"})
    else:
        response = http.request(method, path, json=body)
    _assert_openai_error(response, status, code)


def test_deadline_exceeded_is_504(http):
    # grpc-timeout travels through Envoy as the gRPC deadline; 1 ms cannot embed 48 inputs.
    response = http.post("/v1/embeddings", json={"model": M, "input": TEXTS * 2}, headers={"grpc-timeout": "1m"})
    _assert_openai_error(response, 504, "deadline_exceeded")


def test_sdk_exceptions_carry_the_message(openai_client):
    import openai

    with pytest.raises(openai.NotFoundError, match="no-such-model"):
        openai_client.embeddings.create(model="no-such-model", input="x")
    with pytest.raises(openai.BadRequestError, match="dimensions"):
        openai_client.embeddings.create(model=DEFAULT_MODEL_NAME, input="x", dimensions=0)


def test_full_queue_is_429(rest_server, openai_client):
    import openai

    def embed(seed):
        try:  # distinct texts: identical inputs would be computed once
            openai_client.embeddings.create(model=DEFAULT_MODEL_NAME, input=sentences(60, max_words=4, seed=seed))
            return 200
        except openai.RateLimitError as exc:
            assert exc.body["code"] == "resource_exhausted" and "overloaded" in exc.body["message"]
            return 429

    with cf.ThreadPoolExecutor(8) as pool:
        statuses = list(pool.map(embed, range(100, 108)))
    assert 429 in statuses and 200 in statuses, statuses  # 8 x 60 inputs at once > the bound of 64


def test_a_dead_envoy_is_restarted(rest_server):
    envoys = [p for p in _children(rest_server.proc.pid) if _exe(p).endswith("envoy")]
    assert len(envoys) == 1
    os.kill(envoys[0], signal.SIGKILL)
    rest_server.wait_rest(timeout=30)
    assert [p for p in _children(rest_server.proc.pid) if _exe(p).endswith("envoy")] != envoys
    assert "restarting it" in rest_server.log_text()


def test_dead_worker_is_503_until_restarted(rest_server, http):
    """Kills the classifier's worker; runs last in this file, and waits for the restart."""
    models = {m["id"]: m for m in http.get("/v1/models").json()["data"]}
    pid = models["classifier"]["replicas"][0]["pid"]
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        response = http.post("/v1/classify", json={"model": "classifier", "inputs": ["x"]})
        if response.status_code == 503:
            break
        time.sleep(0.02)
    error = _assert_openai_error(response, 503, "unavailable")
    assert "classifier" in error["message"]
    while time.monotonic() < deadline + 60:
        if http.post("/v1/classify", json={"model": "classifier", "inputs": ["x"]}).status_code == 200:
            return
        time.sleep(0.2)
    pytest.fail("the classifier worker was not restarted")


# ------------------------------------------------------------------ lifecycle
def _children(pid: int) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                out.append(int(entry))
    return out


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie has exited
    except OSError:
        return False


def _exe(pid: int) -> str:
    try:
        return os.readlink(f"/proc/{pid}/exe")
    except OSError:
        return ""


def _envoy_workers(pid: int) -> int:
    """Envoy's worker threads (it names them wrk:worker_N)."""
    names = []
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            names.append(Path(f"/proc/{pid}/task/{task}/comm").read_text())
        except OSError:
            continue
    return sum(name.startswith("wrk:worker_") for name in names)


def test_envoy_returns_the_request_id_on_both_ports(rest_server, stub, http):
    """Behind Envoy the server leaves x-request-id to Envoy and sends its headers with the answer
    (a front can then retry a call whose host died mid-call); the caller still gets its id back,
    once, on gRPC and REST, and Envoy's own id where it sent none."""
    _, call = stub.Embed.with_call(pb.EmbedRequest(inputs=["hello"]), metadata=(("x-request-id", "envoy-id-1"),))
    assert dict(call.initial_metadata())["x-request-id"] == "envoy-id-1"
    _, call = stub.Embed.with_call(pb.EmbedRequest(inputs=["hello"]))
    made = [value for key, value in call.initial_metadata() if key == "x-request-id"]
    assert len(made) == 1 and re.fullmatch(r"[0-9a-f-]{36}", made[0]), made  # Envoy's UUID
    with pytest.raises(grpc.RpcError) as err:
        stub.Embed(pb.EmbedRequest(model="nope", inputs=["hello"]), metadata=(("x-request-id", "envoy-id-2"),))
    assert dict(err.value.trailing_metadata())["x-request-id"] == "envoy-id-2"  # errors: in the trailers
    for body, status in (({"inputs": "hi"}, 200), ({"model": "nope", "inputs": "hi"}, 404)):
        response = http.post("/embed", json=body, headers={"x-request-id": f"envoy-rest-{status}"})
        assert response.status_code == status, response.text
        assert response.headers.get_list("x-request-id") == [f"envoy-rest-{status}"]


SERVER_TIMING = re.compile(r"tokenize;dur=([\d.]+), queue;dur=([\d.]+), compute;dur=([\d.]+), total;dur=([\d.]+)")


def _assert_timed(value: str) -> None:
    """A computed call's server-timing: its steps, in milliseconds, within its total."""
    match = SERVER_TIMING.fullmatch(value)
    assert match, value
    tokenize, queue, compute, total = map(float, match.groups())
    assert compute > 0 and tokenize + queue + compute <= total + 0.02, value  # each printed to 0.01 ms


def test_where_a_calls_time_went_is_a_trailer_on_grpc_and_a_header_on_rest(rest_server, stub, http):
    """Every answered unary call says where its time went (W3C Server-Timing): gRPC in a trailer,
    REST in the header Envoy makes of it, over a gzip body too; errors carry none."""
    _, call = stub.Embed.with_call(pb.EmbedRequest(inputs=["timed over grpc"]))
    _assert_timed(dict(call.trailing_metadata())["server-timing"])
    for path, body in (
        ("/v1/embeddings", {"input": ["timed over rest", "and a second input"]}),
        ("/v1/rerank", {"model": "reranker", "query": QUERY, "documents": DOCS[:3]}),
    ):
        response = http.post(path, json=body)
        assert response.status_code == 200, response.text
        _assert_timed(response.headers["server-timing"])
    gzipped = http.post(
        "/v1/embeddings",
        content=gzip.compress(b'{"input": "timed with a gzip body"}'),
        headers={"content-type": "application/json", "content-encoding": "gzip"},
    )
    assert gzipped.status_code == 200, gzipped.text
    _assert_timed(gzipped.headers["server-timing"])
    assert re.fullmatch(r"total;dur=[\d.]+", http.get("/health").headers["server-timing"])  # no model work
    refused = http.post("/v1/embeddings", json={"model": "nope", "input": "x"})
    assert refused.status_code == 404 and "server-timing" not in refused.headers
    with pytest.raises(grpc.RpcError) as err:
        stub.Embed(pb.EmbedRequest(model="nope", inputs=["x"]))
    assert "server-timing" not in dict(err.value.trailing_metadata())


def test_health_is_503_while_loading_and_envoy_dies_with_a_killed_server(tmp_path):
    proc = ServerProcess(rest=True, log_path=tmp_path / "server.log").launch()
    try:
        deadline = time.monotonic() + 60
        while proc.rest_health() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        # Envoy is up before the model has loaded: /health says 503, as JSON.
        response = httpx.get(proc.rest_url + "/health")
        _assert_openai_error(response, 503, "unavailable")
        envoys = [p for p in _children(proc.proc.pid) if _exe(p).endswith("envoy")]
        assert len(envoys) == 1, proc.log_text()
        # Envoy's worker threads: as many as the gateway chose for the usable cores (its own default: all)
        assert _envoy_workers(envoys[0]) == envoy_workers(cpu_budget().usable)
        # Out of the server's process group (Ctrl-C reaches the frontend alone, which drains it), but in
        # its session: under autogroup scheduling a session of its own is a CPU group of its own.
        assert os.getpgid(envoys[0]) != os.getpgid(proc.proc.pid)
        assert os.getsid(envoys[0]) == os.getsid(proc.proc.pid)
        # Envoy holds the gRPC port too (REST on, no --grpc-direct); the server only its private socket.
        assert listens_on(envoys[0], proc.grpc_port) and not listens_on(proc.proc.pid, proc.grpc_port)
        not_grpc = httpx.get(f"http://127.0.0.1:{proc.grpc_port}/v1/models")
        assert not_grpc.status_code == 415 and f"REST is on port {proc.rest_port}" in not_grpc.text
        deadline = time.monotonic() + 10  # logged once the server has seen Envoy listen, a moment later
        while "gateway: Envoy" not in proc.log_text() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert "gateway: Envoy" in proc.log_text()
        children = _children(proc.proc.pid)
        os.kill(proc.proc.pid, signal.SIGKILL)  # no chance to clean up
        deadline = time.monotonic() + 10
        while any(_alive(p) for p in children) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not [p for p in children if _alive(p)], "children outlived a SIGKILLed server"
    finally:
        proc.stop()


def test_gateway_render_writes_a_valid_standalone_config(tmp_path):
    from encoderd.gateway.envoy import find_envoy

    out = tmp_path / "gw"
    subprocess.run(
        [
            "encoderd",
            "gateway",
            "render",
            "--out",
            str(out),
            "--grpc-address",
            "10.0.0.1:50051",
            "--grpc-address",
            "encoderd-2.internal:50051",
            "--rest-port",
            "8080",
        ],
        check=True,
    )
    config = (out / "envoy.yaml").read_text()
    assert (out / "encoderd.pb").stat().st_size > 1000
    assert "STRICT_DNS" in config and "port_value: 8080" in config
    check = subprocess.run(
        [find_envoy(), "--mode", "validate", "--config-path", str(out / "envoy.yaml"), "--disable-hot-restart"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert check.returncode == 0, check.stdout + check.stderr


async def test_authorization_reaches_grpc_metadata():
    """Envoy forwards the API key as gRPC metadata (where a key check will read it);
    a stand-in upstream echoes what it received."""
    import json

    from google.api import httpbody_pb2
    from support.server import free_port

    from encoderd.gateway.envoy import GatewaySettings
    from encoderd.gateway.process import EnvoyProcess
    from encoderd.v1 import compat_pb2_grpc

    class EchoMetadata(compat_pb2_grpc.CompatServicer):
        async def Health(self, request, context):
            metadata = dict(context.invocation_metadata())
            return httpbody_pb2.HttpBody(content_type="application/json", data=json.dumps(metadata).encode())

    upstream = grpc.aio.server()
    compat_pb2_grpc.add_CompatServicer_to_server(EchoMetadata(), upstream)
    port = upstream.add_insecure_port("127.0.0.1:0")
    await upstream.start()
    envoy = EnvoyProcess(GatewaySettings(grpc_addresses=(f"127.0.0.1:{port}",), rest_port=free_port()))
    try:
        await envoy.start()
        async with httpx.AsyncClient(base_url=envoy.url) as client:
            response = await client.get("/health", headers={"Authorization": "Bearer sk-test"})
        assert response.json()["authorization"] == "Bearer sk-test"
    finally:
        await envoy.stop()
        await upstream.stop(0)


def test_a_client_cancelling_many_calls_keeps_its_connection(rest_server):
    """Envoy's rapid-reset guard aborted a connection once 250 of its calls had been cancelled young
    (a client cancelling queries as a user types, or tight deadlines under load), failing the stream
    and the calls that connection still carried. Through the server's Envoy on the gRPC port."""
    import asyncio

    async def main() -> tuple[int, int]:
        async with grpc.aio.insecure_channel(rest_server.address) as channel:
            stub = encoderd_pb2_grpc.EncoderStub(channel)
            cancelling = True

            async def items():
                i = 0
                while cancelling:
                    yield pb.EmbedStreamRequest(model=DEFAULT_MODEL_NAME, id=str(i), input=f"streamed item {i}")
                    i += 1
                    await asyncio.sleep(0.02)

            async def read_stream() -> int:
                return len([answer async for answer in stub.EmbedStream(items(), timeout=120)])

            stream = asyncio.create_task(read_stream())
            for i in range(300):
                call = stub.Embed(pb.EmbedRequest(model=DEFAULT_MODEL_NAME, inputs=[f"typed {i}"]), timeout=30)
                await asyncio.sleep(0.003)
                call.cancel()
            cancelling = False
            answered = await stream  # raised UNAVAILABLE ("Socket closed") when Envoy aborted the connection
            after = await stub.Embed(pb.EmbedRequest(model=DEFAULT_MODEL_NAME, inputs=["still here"]), timeout=30)
            return answered, len(after.embeddings)

    answered, after = asyncio.run(main())
    assert answered > 10 and after == 1
