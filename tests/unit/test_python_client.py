"""The Python client against a real in-process grpc.aio server that fails a scripted number of
times, then answers: the retry policy, typed errors, TLS, and the request / response mapping of
the methods the shared test server cannot serve (multi-modal, multi-vector, sparse)."""

from __future__ import annotations

import asyncio
import itertools
import random
import shutil
import subprocess
import threading
import time

import grpc
import numpy as np
import pytest
from support.server import free_port

from encoderd.clients import (
    NO_RETRY,
    AsyncEncoderClient,
    EncoderClient,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
    RetryPolicy,
    Unavailable,
    audio,
    image,
)
from encoderd.clients.errors import DeadlineExceeded, EncoderdError
from encoderd.clients.retry import _Attempts
from encoderd.v1 import encoderd_pb2 as pb
from encoderd.v1 import encoderd_pb2_grpc

FAST = RetryPolicy(max_attempts=4, initial_backoff=0.05, multiplier=2, jitter=0)


class ScriptedEncoder(encoderd_pb2_grpc.EncoderServicer):
    """Fails the next calls with the scripted (code, message) pairs, then embeds each input as [i, 1]."""

    def __init__(self):
        self.reset()

    def reset(self, failures=(), delay: float = 0.0):
        self.failures = list(failures)
        self.delay = delay
        self.calls: list[tuple[float, float | None]] = []  # (arrival, the deadline's time remaining)
        self.authorization: list[str | None] = []
        self.requests: list = []

    async def Embed(self, request, context):
        self.calls.append((time.monotonic(), context.time_remaining()))
        self.authorization.append(dict(context.invocation_metadata()).get("authorization"))
        await asyncio.sleep(self.delay)
        if self.failures:
            await context.abort(*self.failures.pop(0))
        return pb.EmbedResponse(model="m", embeddings=[pb.Embedding(values=[i, 1]) for i in range(len(request.inputs))])

    async def EmbedMultimodal(self, request, context):
        self.requests.append(request)
        return pb.EmbedMultimodalResponse(embeddings=[pb.Embedding(values=[i, 0]) for i in range(len(request.inputs))])

    async def EmbedMultiVector(self, request, context):
        # Input i gets i + 1 rows of 2 values: 0, 1, 2, ...
        return pb.EmbedMultiVectorResponse(
            dimensions=2,
            embeddings=[pb.MultiVector(rows=i + 1, values=range(2 * (i + 1))) for i in range(len(request.inputs))],
        )

    async def MaxSim(self, request, context):
        self.requests.append(request)
        return pb.MaxSimResponse(
            results=[
                pb.RerankResult(index=i, relevance_score=float(i), document=f"doc {i}")
                for i in reversed(range(len(request.documents)))
            ]
        )

    async def EmbedSparse(self, request, context):
        return pb.EmbedSparseResponse(
            dimensions=30522,
            embeddings=[pb.SparseEmbedding(indices=[1, 5], values=[0.5, 0.25]) for _ in request.inputs],
        )

    async def EmbedStream(self, request_iterator, context):
        async for request in request_iterator:
            if request.model != "m":
                await context.abort(grpc.StatusCode.NOT_FOUND, f"model {request.model!r} is not served")
            yield pb.EmbedStreamResponse(id=request.id, embedding=pb.Embedding(values=[1, 2]))


class ServerThread:
    """A grpc.aio server on its own event loop thread, so blocking clients can call it too."""

    def __init__(self, servicer, port: int = 0, credentials: grpc.ServerCredentials | None = None):
        self.servicer = servicer
        self.port = port
        self.credentials = credentials
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)

    def _run(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(10)

    async def _start(self) -> int:
        self.server = grpc.aio.server()
        encoderd_pb2_grpc.add_EncoderServicer_to_server(self.servicer, self.server)
        address = f"127.0.0.1:{self.port}"
        port = (
            self.server.add_secure_port(address, self.credentials)
            if self.credentials
            else self.server.add_insecure_port(address)
        )
        await self.server.start()
        return port

    def start(self) -> str:
        self.thread.start()
        return f"127.0.0.1:{self._run(self._start())}"

    def stop(self) -> None:
        self._run(self.server.stop(None))
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


@pytest.fixture(scope="module")
def scripted():
    servicer = ScriptedEncoder()
    thread = ServerThread(servicer)
    address = thread.start()
    yield servicer, address
    thread.stop()


@pytest.fixture
def encoder(scripted):
    servicer, address = scripted
    servicer.reset()
    return servicer, address


def _gaps(calls) -> list[float]:
    return [b[0] - a[0] for a, b in itertools.pairwise(calls)]


def test_unavailable_is_retried_with_growing_backoff_until_it_succeeds(encoder):
    servicer, address = encoder
    servicer.reset([(grpc.StatusCode.UNAVAILABLE, "worker restarting")] * 2)
    with EncoderClient(address, retry=FAST) as client:
        got = client.embed(["a", "b"])
    np.testing.assert_array_equal(got.vectors, np.array([[0, 1], [1, 1]], dtype=np.float32))
    assert len(servicer.calls) == 3
    first, second = _gaps(servicer.calls)
    assert first >= 0.05 and second >= 0.1  # initial_backoff, then doubled


def test_after_the_last_attempt_the_typed_error_carries_the_servers_message(encoder):
    servicer, address = encoder
    servicer.reset([(grpc.StatusCode.RESOURCE_EXHAUSTED, "model m is overloaded")] * 10)
    with (
        EncoderClient(address, retry=RetryPolicy(max_attempts=3, initial_backoff=0.01)) as client,
        pytest.raises(ResourceExhausted) as err,
    ):
        client.embed(["a"])
    assert len(servicer.calls) == 3 and err.value.attempts == 3
    assert err.value.message == "model m is overloaded"
    # Still a grpc.RpcError with code() / details(), as the raw errors were.
    assert isinstance(err.value, grpc.RpcError) and err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert err.value.details() == "model m is overloaded"


def test_retries_stop_at_the_callers_deadline(encoder):
    servicer, address = encoder
    servicer.reset([(grpc.StatusCode.UNAVAILABLE, "down")] * 100)
    policy = RetryPolicy(max_attempts=100, initial_backoff=0.1, multiplier=1, jitter=0)
    start = time.monotonic()
    with EncoderClient(address, retry=policy, timeout=0.55) as client, pytest.raises(Unavailable) as err:
        client.embed(["a"])
    elapsed = time.monotonic() - start
    # Attempts at about 0, 0.1, ..., 0.5; a sixth retry would start past the deadline, so none is made.
    assert elapsed < 0.55 + 0.05
    assert err.value.attempts == len(servicer.calls) and 4 <= err.value.attempts <= 6
    # Each attempt was sent with what was left of the one deadline, not a fresh one.
    remaining = [r for _, r in servicer.calls]
    assert remaining == sorted(remaining, reverse=True) and remaining[0] < 0.56 and remaining[-1] < 0.2


def test_an_attempt_that_outlives_the_deadline_is_deadline_exceeded_and_not_retried(encoder):
    servicer, address = encoder
    servicer.reset(delay=2.0)
    start = time.monotonic()
    with EncoderClient(address, retry=FAST, timeout=0.3) as client, pytest.raises(DeadlineExceeded):
        client.embed(["a"])
    assert time.monotonic() - start < 0.8 and len(servicer.calls) == 1


def test_client_errors_are_not_retried(encoder):
    servicer, address = encoder
    servicer.reset([(grpc.StatusCode.INVALID_ARGUMENT, "input 0 is empty")])
    with EncoderClient(address, retry=FAST) as client, pytest.raises(InvalidArgument, match="input 0 is empty"):
        client.embed([""])
    assert len(servicer.calls) == 1


def test_per_call_timeout_overrides_the_clients(encoder):
    servicer, address = encoder
    with EncoderClient(address, timeout=30) as client:
        client.embed(["a"], timeout=5)
    assert 4 < servicer.calls[0][1] < 5.5  # not the client-wide 30 s


def test_no_server_is_unavailable_after_the_retries():
    policy = RetryPolicy(max_attempts=3, initial_backoff=0.01)
    with (
        EncoderClient(f"127.0.0.1:{free_port()}", retry=policy, timeout=10) as client,
        pytest.raises(Unavailable) as err,
    ):
        client.list_models()
    assert err.value.attempts == 3 and err.value.message


def test_a_server_that_comes_up_during_the_retries_is_reached():
    port = free_port()
    late = ServerThread(ScriptedEncoder(), port)
    timer = threading.Timer(0.2, late.start)
    timer.start()
    # Attempts at 0, 0.1, 0.3, 0.5, 0.7 s: all before gRPC's default 1 s reconnect delay, so only a
    # channel that reconnects at the policy's pace finds the server.
    policy = RetryPolicy(max_attempts=5, initial_backoff=0.1, max_backoff=0.2, jitter=0)
    try:
        with EncoderClient(f"127.0.0.1:{port}", retry=policy, timeout=10) as client:
            assert client.embed(["a"]).vectors.tolist() == [[0.0, 1.0]]
    finally:
        timer.join()
        late.stop()


@pytest.fixture(scope="module")
def tls_pair(tmp_path_factory) -> tuple[bytes, bytes]:
    """A self-signed (key, certificate) for 127.0.0.1."""
    if not shutil.which("openssl"):
        pytest.skip("openssl is needed to make a test certificate")
    tmp = tmp_path_factory.mktemp("tls")
    subprocess.run(
        [
            "openssl",
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-days",
            "1",
            "-subj",
            "/CN=localhost",
            "-addext",
            "subjectAltName=IP:127.0.0.1",
            "-keyout",
            str(tmp / "key.pem"),
            "-out",
            str(tmp / "cert.pem"),
        ],
        check=True,
        capture_output=True,
        timeout=60,
    )
    return (tmp / "key.pem").read_bytes(), (tmp / "cert.pem").read_bytes()


def test_tls_credentials_and_api_key(tls_pair):
    key, cert = tls_pair
    servicer = ScriptedEncoder()
    tls_server = ServerThread(servicer, credentials=grpc.ssl_server_credentials([(key, cert)]))
    address = tls_server.start()
    try:
        with EncoderClient(address, api_key="k1", credentials=grpc.ssl_channel_credentials(cert)) as client:
            assert client.embed(["a"]).vectors.shape == (1, 2)
        with EncoderClient(address, retry=NO_RETRY, timeout=5) as plaintext, pytest.raises(Unavailable):
            plaintext.embed(["a"])
    finally:
        tls_server.stop()
    assert servicer.authorization == ["Bearer k1"]


async def test_async_client_retries_then_succeeds(encoder):
    servicer, address = encoder
    servicer.reset([(grpc.StatusCode.RESOURCE_EXHAUSTED, "full")] * 3)
    async with AsyncEncoderClient(address, retry=FAST) as client:
        got = await client.embed(["a"])
    assert got.vectors.tolist() == [[0.0, 1.0]] and len(servicer.calls) == 4


async def test_async_client_raises_typed_errors(encoder):
    servicer, address = encoder
    servicer.reset([(grpc.StatusCode.NOT_FOUND, "model 'x' is not served")])
    async with AsyncEncoderClient(address, retry=FAST) as client:
        with pytest.raises(NotFound, match="'x' is not served") as err:
            await client.embed(["a"], model="x")
    assert err.value.attempts == 1


def test_bulk_stream_failures_are_typed(encoder):
    _, address = encoder
    with EncoderClient(address) as client:
        assert [r.id for r in client.embed_stream([("a", "x"), ("b", "y")], model="m")] == ["a", "b"]
        with pytest.raises(NotFound):
            list(client.embed_stream([("a", "x")], model="nope"))


async def test_async_bulk_stream(encoder):
    _, address = encoder
    async with AsyncEncoderClient(address) as client:
        results = [r async for r in client.embed_stream([("a", "x"), ("b", "y")], model="m")]
        assert [r.vector.tolist() for r in results] == [[1.0, 2.0]] * 2
        with pytest.raises(NotFound):
            [r async for r in client.embed_stream([("a", "x")], model="nope")]


def test_multimodal_requests_and_responses(encoder):
    servicer, address = encoder
    with EncoderClient(address) as client:
        got = client.embed_multimodal(["a cat", image(b"\x89PNG..."), audio("https://example.com/a.wav")])
        sent = servicer.requests[-1].inputs
        assert [c.WhichOneof("content") for c in sent] == ["text", "image", "audio"]
        assert sent[1].image.data == b"\x89PNG..." and sent[2].audio.url == "https://example.com/a.wav"
        assert got.vectors.tolist() == [[0, 0], [1, 0], [2, 0]]
        rows = client.embed_multivector(["q", "longer"])
        assert [r.shape for r in rows] == [(1, 2), (2, 2)] and rows[1].tolist() == [[0, 1], [2, 3]]
        ranked = client.maxsim("q", ["a", image("data:image/png;base64,AA==")], top_n=2, return_documents=True)
        assert [(r.index, r.document) for r in ranked] == [(1, "doc 1"), (0, "doc 0")]
        assert servicer.requests[-1].top_n == 2
        sparse = client.embed_sparse(["x"])[0]
        assert sparse.indices.tolist() == [1, 5] and sparse.values.tolist() == [0.5, 0.25]
        assert sparse.dimensions == 30522


OVERLOADED = (grpc.StatusCode.RESOURCE_EXHAUSTED, "model m is overloaded; retry in 3 s", (("retry-after", "3"),))


def test_an_overload_error_carries_the_servers_retry_after(encoder):
    servicer, address = encoder
    servicer.reset([OVERLOADED])
    with EncoderClient(address, retry=NO_RETRY) as client, pytest.raises(ResourceExhausted) as err:
        client.embed(["x"])
    assert err.value.retry_after == 3.0
    servicer.reset([(grpc.StatusCode.RESOURCE_EXHAUSTED, "message too large")])  # no trailer: no advice
    with EncoderClient(address, retry=NO_RETRY) as client, pytest.raises(ResourceExhausted) as err:
        client.embed(["x"])
    assert err.value.retry_after is None


async def test_the_async_client_reads_retry_after_too(encoder):
    servicer, address = encoder
    servicer.reset([OVERLOADED])
    async with AsyncEncoderClient(address, retry=NO_RETRY) as client:
        with pytest.raises(ResourceExhausted) as err:
            await client.embed(["x"])
    assert err.value.retry_after == 3.0


def test_a_call_whose_deadline_ends_before_the_retry_after_fails_at_once(encoder):
    """Retrying before the server asked would be refused again: the call gives up on the first answer."""
    servicer, address = encoder
    servicer.reset([OVERLOADED] * 4)
    policy = RetryPolicy(max_attempts=4, initial_backoff=0.01, jitter=0)
    with EncoderClient(address, retry=policy, timeout=2.0) as client, pytest.raises(ResourceExhausted) as err:
        client.embed(["x"])
    assert len(servicer.calls) == 1 and err.value.attempts == 1


def test_the_retry_waits_at_least_what_the_server_asked():
    class Refused(grpc.RpcError):
        def code(self):
            return grpc.StatusCode.RESOURCE_EXHAUSTED

        def trailing_metadata(self):
            return (("retry-after", "2"),)

    policy = RetryPolicy(max_attempts=3, initial_backoff=0.1, jitter=0.5)
    attempts = _Attempts(policy, timeout=None)
    attempts.start()
    delays = [attempts.delay_before_retry(Refused()) for _ in range(50)]
    assert all(2.0 <= d <= 3.0 for d in delays) and max(delays) - min(delays) > 0.3  # spread, never early
    deaf = _Attempts(RetryPolicy(max_attempts=3, initial_backoff=0.1, jitter=0, honor_retry_after=False), None)
    deaf.start()
    assert deaf.delay_before_retry(Refused()) == pytest.approx(0.1)


def test_backoff_grows_to_its_cap_with_jitter_below_it():
    policy = RetryPolicy(initial_backoff=0.1, max_backoff=1.0, multiplier=2, jitter=0.5)
    rng = random.Random(7)
    for retry, ceiling in enumerate([0.1, 0.2, 0.4, 0.8, 1.0, 1.0], start=1):
        draws = [policy.backoff(retry, rng) for _ in range(50)]
        assert all(ceiling * 0.5 <= d <= ceiling for d in draws)
        assert max(draws) - min(draws) > ceiling * 0.3  # the jitter spreads the retries
    assert RetryPolicy(jitter=0).backoff(3) == pytest.approx(0.4)


@pytest.mark.parametrize("bad", [{"max_attempts": 0}, {"jitter": 1.5}, {"multiplier": 0.5}, {"initial_backoff": -1}])
def test_invalid_policies_are_refused(bad):
    with pytest.raises(ValueError):
        RetryPolicy(**bad)


def test_every_error_is_an_encoderd_error():
    assert issubclass(Unavailable, EncoderdError) and issubclass(EncoderdError, grpc.RpcError)
