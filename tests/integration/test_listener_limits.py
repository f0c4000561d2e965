"""Issue 16, finding 8: slow and idle clients are cut off by Envoy's listener limits, on the REST
port and on the gRPC port (Envoy holds both by default), and a client that vanishes mid-call
leaves one WARNING line (method, request id), never an ERROR or a traceback. Finding 2: past
--rest-max-in-flight, Envoy refuses itself (429 for REST, RESOURCE_EXHAUSTED for gRPC on either
port). One real server (REST and gRPC through its Envoy child) with small limits; raw sockets and
real gRPC clients on loopback."""

from __future__ import annotations

import concurrent.futures
import json
import re
import select
import socket
import time

import grpc
import httpx
import pytest
from grpc_health.v1.health_pb2 import HealthCheckRequest, HealthCheckResponse
from grpc_health.v1.health_pb2_grpc import HealthStub
from support.server import ServerProcess

from encoderd.gateway.envoy import DRAIN_S
from encoderd.v1 import encoderd_pb2 as pb
from encoderd.v1.encoderd_pb2_grpc import EncoderStub

HEADER_TIMEOUT = 1.0
IDLE_TIMEOUT = 2.0
REQUEST_TIMEOUT = 3.0
MARGIN = 2.0  # Envoy's timers fire on time; this is for a loaded 2-core host
BODY_LIMIT = 100 * 1024
MAX_IN_FLIGHT = 2


@pytest.fixture(scope="module")
def limited(tmp_path_factory, minilm_path):
    """Envoy's limits alone: --max-queue-wait 0, or the server's admission might refuse the second of
    two long calls itself (its wait predicted at 2.5 s on a loaded host) before Envoy's in-flight limit
    is what answers."""
    log = tmp_path_factory.mktemp("limits") / "server.log"
    server = ServerProcess(
        "--model",
        f"m={minilm_path}",
        "--max-queue-wait",
        "0",
        "--rest-header-timeout",
        str(HEADER_TIMEOUT),
        "--rest-idle-timeout",
        str(IDLE_TIMEOUT),
        "--rest-request-timeout",
        str(REQUEST_TIMEOUT),
        "--rest-max-body-mb",
        str(BODY_LIMIT / 2**20),
        "--rest-max-in-flight",
        str(MAX_IN_FLIGHT),
        log_path=log,
        rest=True,
    ).start()
    yield server
    assert server.stop() == 0, server.log_text()
    assert not re.search(r" ERROR |Traceback", server.log_path.read_text()), server.log_text()


def _closed(sock: socket.socket, wait: float) -> tuple[bool, bytes]:
    """Whether the peer closed `sock` within `wait` seconds, and what it sent before."""
    received = b""
    deadline = time.monotonic() + wait
    while (left := deadline - time.monotonic()) > 0:
        if not select.select([sock], [], [], left)[0]:
            break
        try:
            chunk = sock.recv(65536)
        except ConnectionResetError:
            return True, received
        if not chunk:
            return True, received
        received += chunk
    return False, received


def _connect(server, port: str = "rest") -> socket.socket:
    """A raw connection to the server's REST port or ("grpc") its gRPC port."""
    return socket.create_connection(("127.0.0.1", getattr(server, f"{port}_port")), timeout=5)


def _trickle(sock: socket.socket, data: bytes) -> tuple[bool, bytes, int]:
    """Sends `data` a byte every 0.1 s until the peer closes: (closed, all it sent back, bytes sent)."""
    closed, answer, sent = False, b"", 0
    while not closed and sent < len(data):
        try:
            sock.send(data[sent : sent + 1])
        except (BrokenPipeError, ConnectionResetError):
            return True, answer, sent
        sent += 1
        closed, more = _closed(sock, 0.1)
        answer += more
    return closed, answer, sent


PORTS = pytest.mark.parametrize("port", ["rest", "grpc"])


@PORTS
def test_headers_trickled_one_byte_at_a_time_are_cut_off_at_the_header_timeout(limited, port):
    request = (
        b"POST /v1/embeddings HTTP/1.1\r\nHost: encoderd\r\nContent-Type: application/json\r\n"
        + b"X-Padding: "
        + b"a" * 400
        + b"\r\n\r\n"
    )
    with _connect(limited, port) as sock:
        started = time.monotonic()
        closed, answer, sent = _trickle(sock, request)  # 50 s for the whole header
        elapsed = time.monotonic() - started
    assert closed and sent < len(request), f"still open after {elapsed:.1f}s, {sent} bytes"
    assert HEADER_TIMEOUT - 0.2 < elapsed < HEADER_TIMEOUT + MARGIN
    assert not answer or answer.startswith(b"HTTP/1.1 408"), answer[:200]


def test_a_body_trickled_one_byte_at_a_time_gets_408_at_the_request_timeout(limited):
    body = json.dumps({"model": "m", "input": ["a trickled body " * 20]}).encode()
    head = (
        b"POST /v1/embeddings HTTP/1.1\r\nHost: encoderd\r\nContent-Type: application/json\r\n"
        + f"Content-Length: {len(body)}\r\n\r\n".encode()
    )
    with _connect(limited) as sock:
        started = time.monotonic()
        sock.sendall(head)  # the headers in time: only the body is slow
        closed, answer, sent = _trickle(sock, body)  # 35 s for the whole body
        elapsed = time.monotonic() - started
    assert closed and sent < len(body), f"still open after {elapsed:.1f}s, {sent} bytes"
    assert REQUEST_TIMEOUT - 0.2 < elapsed < REQUEST_TIMEOUT + MARGIN
    assert answer.startswith(b"HTTP/1.1 408"), answer[:300]
    head, _, error = answer.partition(b"\r\n\r\n")
    assert b"content-type: application/json" in head.lower(), answer[:300]  # the usual JSON error
    assert json.loads(error)["error"]["code"] == "request_timeout", error


def test_a_slow_request_that_is_sent_in_time_is_served(limited):
    """The request timeout bounds sending, not computing: a whole body sent in time is answered."""
    with httpx.Client(base_url=limited.rest_url, timeout=30) as http:
        response = http.post("/v1/embeddings", json={"model": "m", "input": ["x " * 200] * 64})
    assert response.status_code == 200 and len(response.json()["data"]) == 64


@PORTS
def test_a_connection_that_sends_nothing_is_closed_at_the_idle_timeout(limited, port):
    with _connect(limited, port) as sock:
        started = time.monotonic()
        closed, _ = _closed(sock, IDLE_TIMEOUT + MARGIN)
        elapsed = time.monotonic() - started
    assert closed and IDLE_TIMEOUT - 0.2 < elapsed < IDLE_TIMEOUT + MARGIN, elapsed


def test_a_kept_alive_connection_is_drained_and_closed_after_the_idle_timeout(limited):
    closes_by = IDLE_TIMEOUT + DRAIN_S + 1  # Envoy drains it first, then closes 1 s later
    with _connect(limited) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: encoderd\r\n\r\n")
        answered = time.monotonic()
        closed, answer = _closed(sock, closes_by + MARGIN)
        elapsed = time.monotonic() - answered
    assert answer.startswith(b"HTTP/1.1 200"), answer[:200]
    assert closed and IDLE_TIMEOUT - 0.2 < elapsed < closes_by + MARGIN, elapsed


def test_a_body_over_the_limit_gets_413(limited):
    body = {"model": "m", "input": ["x" * BODY_LIMIT]}
    response = httpx.post(limited.rest_url + "/v1/embeddings", json=body, timeout=30)
    assert response.status_code == 413
    assert response.headers["content-type"].startswith("application/json")
    small = httpx.post(limited.rest_url + "/v1/embeddings", json={"model": "m", "input": ["x"]}, timeout=30)
    assert small.status_code == 200


def test_headers_over_the_limit_get_431(limited):
    response = httpx.get(limited.rest_url + "/health", headers={"x-big": "a" * 20_000}, timeout=30)
    assert response.status_code == 431


def test_headers_under_the_limit_are_always_served(limited):
    """Envoy passes a REST request's headers on to the gRPC server as metadata, the path twice after
    its rewrite: near --rest-max-header-kb (16) they once went past gRPC's own soft limit (8 KiB),
    and a random share of the calls got 429 with Retry-After."""
    with httpx.Client(base_url=limited.rest_url, timeout=30) as client:
        for size in (9_000, 12_000, 15_000):
            for _ in range(4):
                response = client.post(
                    "/v1/embeddings", json={"model": "m", "input": "x"}, headers={"x-trace": "a" * size}
                )
                assert response.status_code == 200, (size, response.text)
        long_path = client.get("/health", params={"q": "a" * 7_000})  # the path counts twice
        assert long_path.status_code == 200, long_path.text
    with grpc.insecure_channel(limited.address) as channel:  # the gRPC port: Envoy's too, by default
        stub = EncoderStub(channel)
        stub.Embed(pb.EmbedRequest(model="m", inputs=["metadata"]), metadata=[("x-trace", "a" * 15_000)], timeout=30)


def _native_grpc_probe(port: int) -> grpc.RpcError | None:
    """A gRPC Embed sent to `port`: its error, None if it was served."""
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        try:
            EncoderStub(channel).Embed(pb.EmbedRequest(model="m", inputs=["grpc probe"]), timeout=30)
        except grpc.RpcError as exc:
            return exc
    return None


def _health_probes(server) -> list:
    """gRPC health on the gRPC and the REST port (status names), REST GET /health and /ping (codes)."""
    answers: list = []
    for port in (server.grpc_port, server.rest_port):
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            try:
                status = HealthStub(channel).Check(HealthCheckRequest(), timeout=10).status
                answers.append(HealthCheckResponse.ServingStatus.Name(status))
            except grpc.RpcError as exc:
                answers.append(exc.code().name)
    answers += [httpx.get(server.rest_url + path, timeout=10).status_code for path in ("/health", "/ping")]
    return answers


def test_requests_past_the_in_flight_limit_get_429_from_envoy(limited):
    """Envoy answers past --rest-max-in-flight itself (429, the JSON error, Retry-After), where
    the server's own refusal would wait behind every call already sent to it; the calls in flight
    are served, and so is the next call once they are done."""
    url = limited.rest_url + "/v1/embeddings"

    def long_call(n: int) -> httpx.Response:  # seconds of compute on 2 cores
        body = {"model": "m", "input": [f"{n} passage {i} " + "word " * 60 for i in range(200)]}
        return httpx.post(url, json=body, timeout=120)

    with concurrent.futures.ThreadPoolExecutor(MAX_IN_FLIGHT) as pool:
        long_calls = [pool.submit(long_call, n) for n in range(MAX_IN_FLIGHT)]
        time.sleep(0.3)  # most often they are in flight by now (a probe sent first gets one refused)
        refusals = []
        while not refusals and not all(call.done() for call in long_calls):
            probe = httpx.post(url, json={"model": "m", "input": ["probe"]}, timeout=30)
            if probe.status_code != 200:  # 200: a long call was not in flight yet
                refusals.append(probe)
            time.sleep(0.05)
        # A refused probe saw both long calls in flight: gRPC sent meanwhile, to the gRPC port or
        # to this one, is refused by Envoy too, as RESOURCE_EXHAUSTED.
        grpc_probes = [_native_grpc_probe(port) for port in (limited.grpc_port, limited.rest_port)] if refusals else []
        # Health probes have calls in flight of their own: refused like the rest, Kubernetes would
        # take an overloaded server for a dead one.
        health = _health_probes(limited) if refusals else []
        both_still_in_flight = not any(call.done() for call in long_calls)
        answers = [call.result() for call in long_calls]
    if grpc_probes and both_still_in_flight:
        assert health == ["SERVING", "SERVING", 200, 200], health
        for grpc_probe in grpc_probes:
            assert grpc_probe is not None and grpc_probe.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, grpc_probe
            assert f"limit of {MAX_IN_FLIGHT} requests in flight" in grpc_probe.details(), grpc_probe.details()
    # A probe may reach Envoy before the last long call does: that call is then the one refused.
    refusals += [a for a in answers if a.status_code != 200]
    assert refusals, "no call was refused while the long ones were in flight"
    assert any(a.status_code == 200 for a in answers), answers  # the calls in flight are served
    for refusal in refusals:
        assert refusal.status_code == 429, refusal.text
        assert refusal.headers["retry-after"] == "1"
        error = refusal.json()["error"]
        assert error["code"] == "resource_exhausted" and error["type"] == "rate_limit_error", error
        assert f"limit of {MAX_IN_FLIGHT} requests in flight" in error["message"], error
    assert httpx.post(url, json={"model": "m", "input": ["probe"]}, timeout=30).status_code == 200


def test_a_rest_call_past_the_rest_timeout_gets_504(tmp_path, minilm_path):
    """--rest-timeout is the REST route's timeout. Envoy's transcoder matched a REST call's route
    again on its rewritten gRPC path, so every call took the native gRPC route (no timeout): a
    1 s limit let a call compute for as long as it took."""
    with ServerProcess(
        "--model", f"m={minilm_path}", "--rest-timeout", "1", log_path=tmp_path / "server.log", rest=True
    ) as server:
        body = {"model": "m", "input": [f"{i} passage " + "word " * 120 for i in range(2000)]}  # ~250 K tokens: seconds
        started = time.monotonic()
        response = httpx.post(server.rest_url + "/v1/embeddings", json=body, timeout=300)
        took = time.monotonic() - started
        assert response.status_code == 504, response.text[:300]
        assert response.json()["error"]["code"] == "deadline_exceeded", response.text
        assert took < 1 + 5 * MARGIN, took
        assert httpx.get(server.rest_url + "/health", timeout=30).status_code == 200


# ---------------------------------------------------------------------- vanishing clients
def _slow_request(tag: str) -> pb.EmbedRequest:
    """Distinct long inputs (no dedup), so the call is still computing when its client leaves."""
    return pb.EmbedRequest(model="m", inputs=[f"{tag} passage {i} " + "word " * 150 for i in range(256)])


def _new_log_lines(server, since: int) -> str:
    return server.log_path.read_text()[since:]


def _warnings_after(server, since: int, request_id: str, timeout: float = 20.0) -> list[str]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        lines = [line for line in _new_log_lines(server, since).splitlines() if request_id in line]
        if lines:
            time.sleep(0.5)  # a second line, if there were one, would come now
            return [line for line in _new_log_lines(server, since).splitlines() if request_id in line]
        time.sleep(0.1)
    return []


def _assert_one_warning(server, since: int, request_id: str, method: str) -> None:
    lines = _warnings_after(server, since, request_id)
    assert len(lines) == 1 and " WARNING " in lines[0] and method in lines[0], lines
    new = _new_log_lines(server, since)
    assert " ERROR " not in new and "Traceback" not in new, new


@pytest.mark.parametrize("how", ["cancel", "close"])
def test_a_grpc_client_that_leaves_mid_call_is_one_warning(limited, how):
    since = len(limited.log_path.read_text())
    request_id = f"vanishing-{how}"
    channel = limited.channel()
    call = EncoderStub(channel).Embed.future(_slow_request(how), metadata=(("x-request-id", request_id),), timeout=60)
    time.sleep(0.5)
    call.cancel() if how == "cancel" else channel.close()
    _assert_one_warning(limited, since, request_id, "Encoder/Embed")
    channel.close()


def test_a_stream_client_that_stops_reading_then_leaves_is_one_warning(limited):
    since = len(limited.log_path.read_text())
    channel = limited.channel()
    inputs = (
        pb.EmbedStreamRequest(model="m", id=str(i), input=f"stream input {i} " + "word " * 40) for i in range(3000)
    )
    responses = EncoderStub(channel).EmbedStream(inputs, metadata=(("x-request-id", "vanishing-stream"),))
    next(responses)  # then never read again: the server's window fills, its writes wait
    time.sleep(2)
    channel.close()
    _assert_one_warning(limited, since, "vanishing-stream", "Encoder/EmbedStream")


def test_a_rest_client_that_hangs_up_mid_call_is_one_warning(limited):
    since = len(limited.log_path.read_text())
    body = json.dumps({"model": "m", "input": [f"rest passage {i} " + "word " * 50 for i in range(256)]}).encode()
    assert len(body) < BODY_LIMIT
    with _connect(limited) as sock:
        sock.sendall(
            b"POST /v1/embeddings HTTP/1.1\r\nHost: encoderd\r\nContent-Type: application/json\r\n"
            b"X-Request-Id: vanishing-rest\r\nContent-Length: %d\r\n\r\n" % len(body) + body
        )
        time.sleep(0.3)
    _assert_one_warning(limited, since, "vanishing-rest", "Compat/CreateEmbeddings")
