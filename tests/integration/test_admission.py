"""Issue 42, item 2: an interactive call that would wait longer than --max-queue-wait is refused at
once, RESOURCE_EXHAUSTED with a `retry-after` trailer over gRPC, 429 with Retry-After over REST,
while health is answered; a bulk call is not (its deadline and the queue's size bound it). The real
server, its workers and Envoy; the queue is held full by stopping the workers (SIGSTOP) under one
interactive call of 2,048 inputs (split: all but its first batch wait in the SPLIT queue), so
nothing drains until the test lets it."""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import json
import os
import signal
import time
import urllib.error
import urllib.request

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from support.corpus import sentences
from support.server import ServerProcess
from test_metrics import scrape, total

from encoderd.v1 import encoderd_pb2 as pb

_DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}))
# ~200,000 tokens: at any CPU's rate (tens of thousands of tokens/s) far more than the default
# 2 s of --max-queue-wait, and within --max-request-tokens.
HELD = sentences(2048, min_words=60, max_words=70, seed=42)
# Over SPLIT_BATCHES (4) batches of the default 64 inputs: its rest waits behind HELD's.
BIG = ["one more"] * 300


def _worker_pids(stub) -> list[int]:
    return [r.pid for m in stub.ListModels(pb.ListModelsRequest()).models for r in m.replicas]


def _until(condition, timeout: float, what: str) -> None:
    """Waits for a state of the server (polled), never for time to pass."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def holdable_server(tmp_path, model_path: str) -> ServerProcess:
    """Default flags (--max-queue-wait 2) and REST, but a stopped worker is not taken for a hung one."""
    return ServerProcess(
        "--model", model_path, "--worker-stall-timeout", "600", rest=True, log_path=tmp_path / "s.log"
    ).start()


def run_then_stop(server: ServerProcess, check) -> None:
    """check(server), then a clean stop (the server is stopped, and its log shown, either way)."""
    try:
        check(server)
    except BaseException:
        server.stop()
        raise
    assert server.stop() == 0, server.log_text()


@contextlib.contextmanager
def held_queue(server, stub, pool: cf.Executor):
    """Stops the workers under one interactive call of HELD (queued, never computed) until the block
    ends; yields its future."""
    pids = _worker_pids(stub)
    try:
        for pid in pids:
            os.kill(pid, signal.SIGSTOP)
        held = pool.submit(stub.Embed, pb.EmbedRequest(inputs=HELD), timeout=300)
        _until(
            lambda: held.done() or total(scrape(server), "encoderd_queue_depth") > 0,
            120,
            "the held call's inputs were queued",
        )
        assert not held.done(), held.exception()
        yield held
    finally:
        for pid in pids:
            os.kill(pid, signal.SIGCONT)


def _rest_embed(server, body: dict) -> tuple[int, dict, dict]:
    request = urllib.request.Request(
        server.rest_url + "/v1/encoderd/embed",
        data=json.dumps(body).encode(),
        headers={"content-type": "application/json"},
    )
    try:
        with _DIRECT.open(request, timeout=60) as response:
            return response.status, dict(response.headers), json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, dict(exc.headers), json.loads(exc.read())


def test_a_call_that_would_wait_past_max_queue_wait_is_refused_with_retry_after(tmp_path, minilm_path):
    run_then_stop(holdable_server(tmp_path, minilm_path), _refuse_while_held)


def _refuse_while_held(server) -> None:
    stub = server.stub()
    pool = cf.ThreadPoolExecutor(4)
    with held_queue(server, stub, pool) as held:
        started = time.monotonic()
        try:
            stub.Embed(pb.EmbedRequest(inputs=BIG), timeout=60)
            raise AssertionError("admitted behind ~10 s of work")
        except grpc.RpcError as exc:
            refused_in = time.monotonic() - started
            assert exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, exc
            assert "--max-queue-wait is 2.0 s" in exc.details()
            retry_after = dict(exc.trailing_metadata())["retry-after"]
            assert int(retry_after) >= 1
        assert refused_in < 10  # at once, not at the client's 60 s deadline (generous: a loaded host)

        status, headers, body = _rest_embed(server, {"inputs": BIG})
        assert status == 429, body
        assert headers["retry-after"] == retry_after  # the server's estimate (Envoy's own refusals say 1)
        assert body["error"]["code"] == "resource_exhausted" and "--max-queue-wait" in body["error"]["message"]
        assert "grpc-status" not in {k.lower() for k in headers}

        # A bulk call is not refused for --max-queue-wait: it queues behind everything (and waits
        # for the stopped workers).
        depth = total(scrape(server), "encoderd_queue_depth")
        bulk = pool.submit(stub.Embed, pb.EmbedRequest(inputs=["one more"], priority=pb.PRIORITY_BULK), timeout=300)
        _until(
            lambda: bulk.done() or total(scrape(server), "encoderd_queue_depth") > depth,
            60,
            "the bulk call was queued",
        )
        assert not bulk.done(), bulk.exception()

        # A query goes before the big call's queued rest: not refused for it (it waits for the
        # stopped workers like everything else), and health is answered throughout.
        interactive = pool.submit(stub.Embed, pb.EmbedRequest(inputs=["a query"]), timeout=300)
        with grpc.insecure_channel(server.address) as channel:
            health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
        assert health.status == health_pb2.HealthCheckResponse.SERVING
        assert server.rest_health() == 200
        rejected = scrape(server)
        assert total(rejected, "encoderd_rejected_requests_total", reason="queue_wait") >= 2
    assert len(held.result(timeout=300).embeddings) == len(HELD)
    assert len(interactive.result(timeout=300).embeddings) == 1
    assert len(bulk.result(timeout=300).embeddings) == 1
    # Drained: the refused call is served now.
    assert len(stub.Embed(pb.EmbedRequest(inputs=BIG), timeout=60).embeddings) == len(BIG)
    pool.shutdown()
