"""Issue 7: the Prometheus series exist after real traffic, and move with it."""

from __future__ import annotations

import os
import signal
import time
import urllib.request

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families
from support.corpus import sentences
from support.server import ServerProcess, stopped, until

from encoderd.v1 import encoderd_pb2 as pb
from encoderd.workers.contract.model_files import DEFAULT_MODEL_NAME

EMBEDDER = DEFAULT_MODEL_NAME
MODELS = (EMBEDDER, "reranker", "classifier")
TEXTS = sentences(24, max_words=40, seed=11)


def scrape(server) -> dict[tuple[str, frozenset], float]:
    """Every sample of /metrics, parsed by prometheus_client's own parser."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=5).read().decode()
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def total(samples, name: str, **labels) -> float:
    """Sum of the samples of `name` whose labels include `labels` (missing series: 0)."""
    want = set(labels.items())
    return sum(v for (n, ls), v in samples.items() if n == name and want <= ls)


def has(samples, name: str, **labels) -> bool:
    want = set(labels.items())
    return any(n == name and want <= ls for n, ls in samples)


def send_traffic(stub) -> None:
    for text in TEXTS[:8]:  # one at a time and ...
        stub.Embed(pb.EmbedRequest(model=EMBEDDER, inputs=[text]))
    futures = [stub.Embed.future(pb.EmbedRequest(model=EMBEDDER, inputs=[t])) for t in TEXTS]  # ... concurrently
    [f.result() for f in futures]
    stub.Rerank(pb.RerankRequest(model="reranker", query="what is a batch", documents=TEXTS[:10]))
    stub.Classify(pb.ClassifyRequest(model="classifier", inputs=TEXTS[:5]))
    for bad in (pb.EmbedRequest(model="no-such-model", inputs=["x"]), pb.EmbedRequest(model=EMBEDDER)):
        with pytest.raises(grpc.RpcError):
            stub.Embed(bad)


@pytest.fixture(scope="module")
def scrapes(server, stub):
    before = scrape(server)
    send_traffic(stub)
    return before, scrape(server)


@pytest.mark.parametrize(
    "model,rpc", [(EMBEDDER, "Encoder/Embed"), ("reranker", "Encoder/Rerank"), ("classifier", "Encoder/Classify")]
)
def test_requests_and_latency_by_model_and_rpc(scrapes, model, rpc):
    before, after = scrapes
    ok = {"model": model, "rpc": rpc, "code": "OK"}
    assert total(after, "encoderd_requests_total", **ok) > total(before, "encoderd_requests_total", **ok)
    count = "encoderd_request_duration_seconds_count"
    assert total(after, count, model=model, rpc=rpc) > total(before, count, model=model, rpc=rpc)
    assert has(after, "encoderd_request_duration_seconds_bucket", model=model, rpc=rpc, le="0.05")


def test_errors_are_counted_by_code_without_echoing_unknown_model_names(scrapes):
    before, after = scrapes
    for labels in (
        {"model": "(unknown)", "rpc": "Encoder/Embed", "code": "NOT_FOUND"},
        {"model": EMBEDDER, "rpc": "Encoder/Embed", "code": "INVALID_ARGUMENT"},
    ):
        assert (
            total(after, "encoderd_requests_total", **labels) == total(before, "encoderd_requests_total", **labels) + 1
        )
    assert not has(after, "encoderd_requests_total", model="no-such-model")  # label sets stay bounded


@pytest.mark.parametrize("model", MODELS)
def test_scheduler_series_move(scrapes, model):
    before, after = scrapes

    def moved(name, **labels):
        return total(after, name, model=model, **labels) - total(before, name, model=model, **labels)

    batches = moved("encoderd_batches_total")
    assert batches >= 1
    assert moved("encoderd_batch_size_count") == batches
    assert moved("encoderd_batch_tokens_count") == batches
    assert moved("encoderd_batch_duration_seconds_count") == batches  # compute time, per replica
    assert moved("encoderd_queue_wait_seconds_count") == moved("encoderd_batch_size_sum")  # one per input
    real, computed = moved("encoderd_real_tokens_total"), moved("encoderd_computed_tokens_total")
    assert 0 < real <= computed  # padded engines compute more than the inputs hold
    assert moved("encoderd_batch_tokens_sum") == computed
    assert has(after, "encoderd_queue_depth", model=model)
    assert total(after, "encoderd_queue_depth", model=model) == 0  # all done: nothing left queued


def test_embedder_batches_coalesced_concurrent_inputs(scrapes):
    before, after = scrapes
    inputs = total(after, "encoderd_batch_size_sum", model=EMBEDDER) - total(
        before, "encoderd_batch_size_sum", model=EMBEDDER
    )
    batches = total(after, "encoderd_batches_total", model=EMBEDDER) - total(
        before, "encoderd_batches_total", model=EMBEDDER
    )
    assert inputs == 8 + len(TEXTS) and batches < inputs


@pytest.mark.parametrize("model", MODELS)
def test_worker_state_and_load_time(scrapes, model):
    _, after = scrapes
    assert total(after, "encoderd_model_load_seconds", model=model) > 0
    assert total(after, "encoderd_worker_up", model=model) >= 1
    assert has(after, "encoderd_worker_restarts_total", model=model)  # exported at 0 before any restart


def test_worker_restart_is_counted(server, stub, scrapes):
    """Kill the classifier's worker: the supervisor restarts it and the counter moves by one."""
    before = total(scrape(server), "encoderd_worker_restarts_total", model="classifier")
    (info,) = [m for m in stub.ListModels(pb.ListModelsRequest()).models if m.id == "classifier"]
    os.kill(info.replicas[0].pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while total(scrape(server), "encoderd_worker_restarts_total", model="classifier") == before:
        assert time.monotonic() < deadline, "the restart was not counted"
        time.sleep(0.1)
    server.wait_serving(120, service="classifier")  # leave the shared server as we found it
    after = scrape(server)
    assert total(after, "encoderd_worker_restarts_total", model="classifier") == before + 1
    assert total(after, "encoderd_worker_up", model="classifier") >= 1
    assert len(stub.Classify(pb.ClassifyRequest(model="classifier", inputs=["back again"])).results) == 1


def test_embed_stream_is_counted_and_carries_the_request_id(server, stub):
    rpc = "Encoder/EmbedStream"
    before = scrape(server)
    messages = [
        pb.EmbedStreamRequest(model=EMBEDDER if k == 0 else "", id=str(k), input=text)
        for k, text in enumerate(TEXTS[:6])
    ]
    call = stub.EmbedStream(iter(messages), metadata=(("x-request-id", "stream-1"),))
    assert sorted(r.id for r in call) == sorted(m.id for m in messages)
    assert dict(call.initial_metadata())["x-request-id"] == "stream-1"
    with pytest.raises(grpc.RpcError) as bad:  # a stream naming an unknown model fails whole
        list(stub.EmbedStream(iter([pb.EmbedStreamRequest(model="no-such-model", id="0", input="x")])))
    assert bad.value.code() == grpc.StatusCode.NOT_FOUND
    after = scrape(server)
    for code, model in (("OK", EMBEDDER), ("NOT_FOUND", "(unknown)")):
        labels = {"model": model, "rpc": rpc, "code": code}
        assert (
            total(after, "encoderd_requests_total", **labels) == total(before, "encoderd_requests_total", **labels) + 1
        )
    count = "encoderd_request_duration_seconds_count"
    assert total(after, count, model=EMBEDDER, rpc=rpc) == total(before, count, model=EMBEDDER, rpc=rpc) + 1


def test_calls_in_flight_are_a_gauge_back_to_zero_after_cancels(tmp_path):
    """Queue depth counted inputs, not calls: nothing showed a call held (or leaked) by the server.
    Its own server without --max-queue-wait (the three big calls must all be admitted to be held) and
    without the stall watchdog: its workers stay stopped (SIGSTOP) until all three are counted in
    flight, so none can finish first, however slow or fast the host."""

    server = ServerProcess(
        "--max-queue-wait", "0", "--worker-stall-timeout", "0", log_path=tmp_path / "server.log"
    ).start()
    try:
        _cancelled_calls_leave_no_call_in_flight(server, server.stub())
    finally:
        server.stop()


def _in_flight(server, **labels) -> float:
    return total(scrape(server), "encoderd_requests_in_flight", **labels)


def _cancelled_calls_leave_no_call_in_flight(server, stub):
    (model,) = [m for m in stub.ListModels(pb.ListModelsRequest()).models if m.id == EMBEDDER]
    with stopped(replica.pid for replica in model.replicas):
        calls = [
            stub.Embed.future(pb.EmbedRequest(model=EMBEDDER, inputs=[f"{c} {i} " + "word " * 200 for i in range(256)]))
            for c in range(3)
        ]
        until(lambda: _in_flight(server, rpc="Encoder/Embed") == 3, "the three calls were never all in flight")
        for call in calls[1:]:
            call.cancel()
    calls[0].result()
    until(lambda: _in_flight(server) == 0, "a call stayed counted in flight after it ended")
