"""Issue 16, findings 3 and 10: a hung worker is found and replaced; deadlines and bad enum
values are accounted for. Real servers, real workers, loopback. (Finding 7, leftovers, and
the auth failure count: test_reliability.py's SIGTERM, SIGKILL and API key tests.)"""

from __future__ import annotations

import os
import signal
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from support.corpus import sentences
from support.server import ServerProcess, stopped
from test_metrics import scrape, total
from test_reliability import _alive, _pids

from encoderd.v1 import encoderd_pb2 as pb
from encoderd.workers.contract.model_files import DEFAULT_MODEL_NAME

STALL_TIMEOUT = 2.0
MARGIN = 2.5  # the watchdog looks every 0.5s; scheduling on a loaded 2-core host


def _health(server, service: str) -> int:
    with grpc.insecure_channel(server.address) as channel:
        return (
            health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service), timeout=5).status
        )


def _until(condition, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while not (result := condition()):
        assert time.monotonic() < deadline, what
        time.sleep(0.05)
    return result


def _timed_code(call) -> tuple[grpc.StatusCode, float]:
    started = time.monotonic()
    try:
        call()
        code = grpc.StatusCode.OK
    except grpc.RpcError as exc:
        code = exc.code()
    return code, time.monotonic() - started


def test_a_stopped_worker_is_found_failed_fast_killed_and_replaced(tmp_path, minilm_path):
    # Batches big enough that one forward pass outlasts the stall timeout.
    server = ServerProcess(
        "--model",
        f"a={minilm_path}",
        "--model",
        f"b={minilm_path}",
        "--batch-size",
        "256",
        "--max-batch-tokens",
        "65536",
        "--worker-stall-timeout",
        str(STALL_TIMEOUT),
        log_path=tmp_path / "s.log",
    ).start()
    stub = server.stub()
    pids = _pids(stub)
    embed = {m: (lambda m=m: stub.Embed(pb.EmbedRequest(model=m, inputs=["still here?"]), timeout=60)) for m in "ab"}
    try:
        long_inputs = sentences(256, min_words=150, max_words=200, seed=16)
        started = time.monotonic()
        assert len(stub.Embed(pb.EmbedRequest(model="a", inputs=long_inputs), timeout=120).embeddings) == 256
        assert time.monotonic() - started > STALL_TIMEOUT  # computing is not stalling: the beats went on
        assert _pids(stub) == pids and "stalled" not in server.log_path.read_text()
        time.sleep(1)  # a few quiet heartbeats: silence between calls is not a stall either
        assert _health(server, "a") == health_pb2.HealthCheckResponse.SERVING
        os.kill(pids["a"], signal.SIGSTOP)
        in_flight = stub.Embed.future(pb.EmbedRequest(model="a", inputs=["sent to a stopped worker"]), timeout=60)
        stopped_at = time.monotonic()
        with pytest.raises(grpc.RpcError) as err:
            in_flight.result()
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE  # not a hang until its deadline
        assert time.monotonic() - stopped_at < STALL_TIMEOUT + MARGIN
        _until(lambda: _health(server, "a") == health_pb2.HealthCheckResponse.NOT_SERVING, 2, "a still SERVING")
        assert total(scrape(server), "encoderd_worker_up", model="a") == 0
        code, seconds = _timed_code(embed["a"])  # while it restarts: refused at once
        assert code == grpc.StatusCode.UNAVAILABLE and seconds < 1.0
        assert _timed_code(embed["b"])[0] == grpc.StatusCode.OK  # the other model never noticed
        _until(lambda: not _alive(pids["a"]), 5, "the stopped worker was not killed")
        _until(lambda: _health(server, "a") == health_pb2.HealthCheckResponse.SERVING, 120, "a never came back")
        assert embed["a"]().embeddings and embed["b"]().embeddings
        new = _pids(stub)
        assert new["a"] != pids["a"] and new["b"] == pids["b"]
        assert total(scrape(server), "encoderd_worker_up", model="a") == 1
        stalls = [line for line in server.log_path.read_text().splitlines() if "stalled" in line]
        assert len(stalls) == 1 and "WARNING" in stalls[0] and f"pid {pids['a']}" in stalls[0], stalls
    finally:
        if _alive(pids["a"]):
            os.kill(pids["a"], signal.SIGCONT)
        assert server.stop() == 0, server.log_text()


def _requests(server, code: str) -> float:
    return total(scrape(server), "encoderd_requests_total", model=DEFAULT_MODEL_NAME, rpc="Encoder/Embed", code=code)


def test_a_stream_whose_deadline_passes_while_it_waits_for_the_client_counts_as_expired(server, stub):
    """The client cancels at its own deadline, which the server hears just before its own: it was
    counted (and logged) as a client that left."""

    def expired() -> float:
        return total(
            scrape(server),
            "encoderd_requests_total",
            model=DEFAULT_MODEL_NAME,
            rpc="Encoder/EmbedStream",
            code="DEADLINE_EXCEEDED",
        )

    def messages():
        yield pb.EmbedStreamRequest(model=DEFAULT_MODEL_NAME, id="0", input="one input, then nothing")
        time.sleep(3)  # neither another message nor the end of the stream: the server waits on the client

    before = expired()
    with pytest.raises(grpc.RpcError) as err:
        list(stub.EmbedStream(messages(), timeout=1.5))
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    _until(lambda: expired() == before + 1, 10, "the expired stream was not counted as DEADLINE_EXCEEDED")


def test_expired_deadlines_are_counted_as_such_and_hang_ups_as_cancelled(server, stub):
    """The hang-up comes once the server holds the call, its workers stopped meanwhile: after a fixed
    0.3 s, a call still on its way on a loaded host would be cancelled before the server saw it."""
    # Inputs unseen by the other tests (no cache hit), each call enough work for ~1 s on 2 cores.
    texts = iter(sentences(512, max_words=60, seed=1616))
    work = lambda: pb.EmbedRequest(model=DEFAULT_MODEL_NAME, inputs=[next(texts) for _ in range(256)])  # noqa: E731
    expired_before, cancelled_before = _requests(server, "DEADLINE_EXCEEDED"), _requests(server, "CANCELLED")
    with pytest.raises(grpc.RpcError) as err:
        stub.Embed(work(), timeout=0.3)
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    _until(lambda: _requests(server, "DEADLINE_EXCEEDED") == expired_before + 1, 10, "the expired call was not counted")
    models = stub.ListModels(pb.ListModelsRequest()).models
    workers = [replica.pid for m in models if m.id == DEFAULT_MODEL_NAME for replica in m.replicas]
    in_flight = lambda: total(scrape(server), "encoderd_requests_in_flight", rpc="Encoder/Embed")  # noqa: E731
    with stopped(workers):
        hung_up = stub.Embed.future(work(), timeout=60)
        _until(lambda: in_flight() == 1, 10, "the server never held the call")
        hung_up.cancel()
        _until(lambda: _requests(server, "CANCELLED") == cancelled_before + 1, 10, "the hang-up was not counted")
    assert _requests(server, "DEADLINE_EXCEEDED") == expired_before + 1


BAD_ENUMS = [
    ("Embed", pb.EmbedRequest(model=DEFAULT_MODEL_NAME, inputs=["x"], truncation_direction=99), "truncation_direction"),
    ("Embed", pb.EmbedRequest(model=DEFAULT_MODEL_NAME, inputs=["x"], priority=99), "priority"),
    ("Embed", pb.EmbedRequest(model=DEFAULT_MODEL_NAME, inputs=["x"], output_dtype=99), "output_dtype"),
    (
        "EmbedSparse",
        pb.EmbedSparseRequest(model=DEFAULT_MODEL_NAME, inputs=["x"], truncation_direction=-1),
        "truncation_direction",
    ),
    ("Rerank", pb.RerankRequest(model="reranker", query="q", documents=["d"], priority=99), "priority"),
    ("Classify", pb.ClassifyRequest(model="classifier", inputs=["x"], priority=3), "priority"),
]


@pytest.mark.parametrize("method,request_,field", BAD_ENUMS, ids=[f"{m}.{f}" for m, _, f in BAD_ENUMS])
def test_out_of_range_enum_values_are_invalid_argument(stub, method, request_, field):
    with pytest.raises(grpc.RpcError) as err:
        getattr(stub, method)(request_, timeout=30)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert field in err.value.details()


def test_out_of_range_enum_values_in_a_stream(stub):
    with pytest.raises(grpc.RpcError) as err:  # in the first message: the whole stream
        list(
            stub.EmbedStream(
                iter([pb.EmbedStreamRequest(model=DEFAULT_MODEL_NAME, id="0", input="x", priority=99)]), timeout=30
            )
        )
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "priority" in err.value.details()
    messages = [
        pb.EmbedStreamRequest(model=DEFAULT_MODEL_NAME, id="0", input="fine"),
        pb.EmbedStreamRequest(id="1", input="x", output_dtype=42),
    ]
    responses = {r.id: r for r in stub.EmbedStream(iter(messages), timeout=30)}
    assert responses["0"].embedding.values and not responses["0"].HasField("error")
    bad = responses["1"]  # later messages: that one only, answered under its own id
    assert bad.HasField("error") and bad.error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert "output_dtype" in bad.error.message


def test_a_stream_message_that_does_not_parse_is_answered_under_its_id(server):
    """Invalid UTF-8 fails the whole message's parse; its id is still read from the wire."""
    fine = pb.EmbedStreamRequest(model=DEFAULT_MODEL_NAME, id="a", input="fine").SerializeToString()
    broken = pb.EmbedStreamRequest(id="b", input="y").SerializeToString().replace(b"y", b"\xff")
    with grpc.insecure_channel(server.address) as channel:
        call = channel.stream_stream(
            "/encoderd.v1.Encoder/EmbedStream",
            request_serializer=lambda raw: raw,
            response_deserializer=pb.EmbedStreamResponse.FromString,
        )
        responses = {r.id: r for r in call(iter([fine, broken]), timeout=30)}
    assert set(responses) == {"a", "b"} and not responses["a"].HasField("error")
    assert responses["b"].error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert "UTF-8" in responses["b"].error.message, responses["b"].error.message
