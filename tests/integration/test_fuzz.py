"""Issue 6: generated hostile requests over gRPC and REST: zero 5xx / INTERNAL,
no crash, the server healthy afterwards."""

from __future__ import annotations

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support.server import ServerProcess

from encoderd.v1 import encoderd_pb2 as pb
from encoderd.workers.contract.model_files import DEFAULT_MODEL_NAME, default_model_path

CLIENT_ERRORS = {
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.OUT_OF_RANGE,
}
FUZZ = settings(max_examples=400, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)

models = st.sampled_from([DEFAULT_MODEL_NAME, "reranker", "", "nope", "\x00", "x" * 300])
texts = st.text(max_size=40) | st.sampled_from(["", " ", "\ud7ff", "🙂" * 30, "a" * 3000, "\x00\x01"])
ints = st.integers(min_value=-(2**31), max_value=2**31 - 1)


@pytest.fixture(scope="module")
def fuzz_server(tmp_path_factory, reranker_path):
    log = tmp_path_factory.mktemp("logs") / "fuzz.log"
    with ServerProcess(
        "--model",
        f"{DEFAULT_MODEL_NAME}={default_model_path()}",
        "--model",
        f"reranker={reranker_path}",
        "--max-inputs-per-request",
        "64",
        rest=True,
        log_path=log,
    ) as server:
        yield server


@pytest.fixture(scope="module")
def fuzz_stub(fuzz_server):
    return fuzz_server.stub()


def _call(method, request):
    try:
        method(request, timeout=30)
    except grpc.RpcError as exc:
        assert exc.code() in CLIENT_ERRORS, (exc.code(), exc.details(), request)


@FUZZ
@given(
    model=models,
    inputs=st.lists(texts, max_size=70),
    dims=ints,
    direction=ints,
    dtype=ints,
    priority=ints,
    normalize=st.none() | st.booleans(),
    truncate=st.none() | st.booleans(),
    prompt=texts,
)
def test_embed_fuzz(fuzz_stub, model, inputs, dims, direction, dtype, priority, normalize, truncate, prompt):
    request = pb.EmbedRequest(
        model=model,
        inputs=inputs,
        dimensions=dims,
        truncation_direction=direction,
        output_dtype=dtype,
        priority=priority,
        prompt=prompt,
    )
    if normalize is not None:
        request.normalize = normalize
    if truncate is not None:
        request.truncate = truncate
    _call(fuzz_stub.Embed, request)


@FUZZ
@given(
    model=models, query=texts, documents=st.lists(texts, max_size=70), top_n=ints, raw=st.booleans(), docs=st.booleans()
)
def test_rerank_fuzz(fuzz_stub, model, query, documents, top_n, raw, docs):
    _call(
        fuzz_stub.Rerank,
        pb.RerankRequest(
            model=model, query=query, documents=documents, top_n=top_n, raw_scores=raw, return_documents=docs
        ),
    )


@FUZZ
@given(payload=st.binary(max_size=200), method=st.sampled_from(["Embed", "Rerank", "Classify", "Tokenize"]))
def test_raw_payload_fuzz(fuzz_server, payload, method):
    with grpc.insecure_channel(fuzz_server.address) as channel:
        raw = channel.unary_unary(
            f"/encoderd.v1.Encoder/{method}", request_serializer=lambda b: b, response_deserializer=lambda b: b
        )
        _call(raw, payload)


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | texts,
    lambda children: st.lists(children, max_size=5) | st.dictionaries(texts, children, max_size=5),
    max_leaves=20,
)
bodies = st.fixed_dictionaries(
    {},
    optional={
        "model": models | json_values,
        "input": json_values,
        "encoding_format": st.sampled_from(["float", "base64", "x"]) | json_values,
        "dimensions": ints | json_values,
        "query": texts | json_values,
        "documents": json_values,
        "top_n": ints | json_values,
        "return_documents": json_values,
        "inputs": json_values,
    },
)


@FUZZ
@given(
    path=st.sampled_from(["/v1/embeddings", "/embeddings", "/v1/rerank", "/v2/rerank", "/v1/classify", "/v1/tokenize"]),
    body=bodies | json_values,
)
def test_rest_fuzz(fuzz_server, path, body):
    with httpx.Client(base_url=fuzz_server.rest_url, trust_env=False, timeout=30) as http:
        response = http.post(path, json=body)
    assert response.status_code < 500, (path, body, response.status_code, response.text)
    if response.status_code >= 400:
        assert "error" in response.json(), response.text


@FUZZ
@given(raw=st.binary(max_size=300))
def test_rest_malformed_json_fuzz(fuzz_server, raw):
    with httpx.Client(base_url=fuzz_server.rest_url, trust_env=False, timeout=30) as http:
        response = http.post("/v1/embeddings", content=raw, headers={"content-type": "application/json"})
    assert response.status_code < 500, (raw, response.status_code, response.text)


def test_still_healthy_after_fuzzing(fuzz_server, fuzz_stub):
    with grpc.insecure_channel(fuzz_server.address) as channel:
        status = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest()).status
    assert status == health_pb2.HealthCheckResponse.SERVING
    assert fuzz_server.proc.poll() is None
    assert len(fuzz_stub.Embed(pb.EmbedRequest(model=DEFAULT_MODEL_NAME, inputs=["alive"])).embeddings) == 1
