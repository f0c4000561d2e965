"""Issue 7: one real server run as an operator would: JSON logs, request ids, sd_notify
readiness to a real datagram socket, and OpenTelemetry spans exported over OTLP/gRPC
to a real (in-process) collector."""

from __future__ import annotations

import json
import re
import signal
import socket
import threading
import time
from concurrent import futures

import grpc
import pytest
from support.server import ServerProcess

from encoderd.v1 import encoderd_pb2 as pb
from encoderd.workers.contract.model_files import DEFAULT_MODEL_NAME

otlp = pytest.importorskip(
    "opentelemetry.proto.collector.trace.v1.trace_service_pb2_grpc", reason="the [otel] extra is not installed"
)
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2  # noqa: E402

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_SPAN_ID = "00f067aa0ba902b7"


class Collector(otlp.TraceServiceServicer):
    """Keeps every span it is sent."""

    def __init__(self):
        self.spans = []

    def Export(self, request, context):
        for resource_spans in request.resource_spans:
            for scope_spans in resource_spans.scope_spans:
                self.spans.extend(scope_spans.spans)
        return trace_service_pb2.ExportTraceServiceResponse()


class NotifyListener:
    """A unix datagram socket standing in for systemd's $NOTIFY_SOCKET."""

    def __init__(self, path: str):
        self.messages: list[dict[str, str]] = []
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(path)
        self.sock.settimeout(0.2)
        self._stop = False
        self.thread = threading.Thread(target=self._loop, daemon=True)
        self.thread.start()

    def _loop(self):
        while not self._stop:
            try:
                data = self.sock.recv(4096)
            except TimeoutError:
                continue
            self.messages.append(dict(line.split("=", 1) for line in data.decode().split("\n")))

    def wait_for(self, key: str, timeout: float = 10) -> dict[str, str]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for message in self.messages:
                if key in message:
                    return message
            time.sleep(0.05)
        raise AssertionError(f"no {key} notification; got {self.messages}")

    def close(self):
        self._stop = True
        self.thread.join()
        self.sock.close()


@pytest.fixture(scope="module")
def operated(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ops")
    collector = Collector()
    otlp_server = grpc.server(futures.ThreadPoolExecutor(2))
    otlp.add_TraceServiceServicer_to_server(collector, otlp_server)
    otlp_port = otlp_server.add_insecure_port("127.0.0.1:0")
    otlp_server.start()
    notify = NotifyListener(str(tmp / "notify"))
    server = ServerProcess(
        "--log-format",
        "json",
        "--log-level",
        "DEBUG",
        "--otel-endpoint",
        f"127.0.0.1:{otlp_port}",
        env={
            "NOTIFY_SOCKET": str(tmp / "notify"),
            "OTEL_BSP_SCHEDULE_DELAY": "100",
            "OTEL_SERVICE_NAME": "encoderd-test",
        },
        log_path=tmp / "server.log",
    )
    try:
        server.start()
        yield server, notify, collector
    finally:
        server.stop()
        notify.close()
        otlp_server.stop(0)


def embed_with(server, metadata=(), model=DEFAULT_MODEL_NAME):
    with grpc.insecure_channel(server.address) as channel:
        call = channel.unary_unary(
            "/encoderd.v1.Encoder/Embed", pb.EmbedRequest.SerializeToString, pb.EmbedResponse.FromString
        )
        try:
            _, info = call.with_call(pb.EmbedRequest(model=model, inputs=["hello"]), metadata=metadata)
            return dict(info.initial_metadata()), grpc.StatusCode.OK
        except grpc.RpcError as err:  # errors carry it in the trailers
            return dict(err.trailing_metadata()), err.code()


def log_records(server) -> list[dict]:
    lines = server.log_path.read_text(errors="replace").splitlines()
    records = [json.loads(line) for line in lines if line.startswith("{")]
    assert records and all({"time", "level", "logger", "message"} <= r.keys() for r in records)
    return records


def test_ready_is_notified_once_models_are_warm(operated):
    _server, notify, _ = operated
    ready = notify.wait_for("READY")
    assert ready["READY"] == "1" and ready["STATUS"].startswith("serving 1 model(s) on 127.0.0.1:")
    loading = notify.messages.index(notify.wait_for("STATUS"))
    assert loading < notify.messages.index(ready) and "loading" in notify.messages[loading]["STATUS"]


def test_request_id_is_echoed_or_made(operated):
    server, _, _ = operated
    metadata, code = embed_with(server, [("x-request-id", "ops-test-1")])
    assert code == grpc.StatusCode.OK and metadata["x-request-id"] == "ops-test-1"
    metadata, code = embed_with(server)
    assert re.fullmatch(r"[0-9a-f]{32}", metadata["x-request-id"])
    metadata, code = embed_with(server, [("x-request-id", "ops-test-2")], model="nope")
    assert code == grpc.StatusCode.NOT_FOUND and metadata["x-request-id"] == "ops-test-2"  # errors carry it too
    # A call marked by encoderd's Envoy (which then adds the id to the response itself): the server's
    # headers go out with the answer, without the id; one it refused and replaced, it sends itself.
    proxied = ("x-encoderd-proxy-returns-id", "1")
    metadata, code = embed_with(server, [("x-request-id", "ops-test-6"), proxied])
    assert code == grpc.StatusCode.OK and "x-request-id" not in metadata
    metadata, code = embed_with(server, [("x-request-id", "x" * 200), proxied])
    assert code == grpc.StatusCode.OK and re.fullmatch(r"[0-9a-f]{32}", metadata["x-request-id"])


def test_logs_are_json_lines_with_request_ids_from_frontend_and_workers(operated):
    server, _, _ = operated
    embed_with(server, [("x-request-id", "ops-test-3")])
    deadline = time.monotonic() + 5
    while not any(r.get("request_id") == "ops-test-3" for r in log_records(server)):
        assert time.monotonic() < deadline, "no log record carries the request id"
        time.sleep(0.1)
    records = log_records(server)
    access = [r for r in records if r.get("request_id") == "ops-test-3"]
    assert access[0]["logger"] == "encoderd.service" and "code=OK" in access[0]["message"]
    assert any(r["logger"] == "encoderd" and "ready" in r["message"] for r in records)
    worker = [r for r in records if "worker" in r]
    assert worker and worker[0]["worker"].startswith(DEFAULT_MODEL_NAME) and worker[0]["logger"] == "encoderd.worker"


def test_spans_are_exported_and_join_the_callers_trace(operated):
    server, _, collector = operated
    traceparent = f"00-{TRACE_ID}-{PARENT_SPAN_ID}-01"
    embed_with(server, [("x-request-id", "ops-test-4"), ("traceparent", traceparent)])
    embed_with(server, [("x-request-id", "ops-test-5")], model="nope")
    deadline = time.monotonic() + 10

    def span_of(rid):
        for span in collector.spans:
            attrs = {a.key: a.value for a in span.attributes}
            if attrs["encoderd.request_id"].string_value == rid:
                return span, attrs
        return None, None

    while span_of("ops-test-5")[0] is None or span_of("ops-test-4")[0] is None:
        assert time.monotonic() < deadline, f"spans not exported; got {len(collector.spans)}"
        time.sleep(0.1)
    span, attrs = span_of("ops-test-4")
    assert span.name == "encoderd.v1.Encoder/Embed" and span.kind == span.SPAN_KIND_SERVER
    assert span.trace_id.hex() == TRACE_ID and span.parent_span_id.hex() == PARENT_SPAN_ID
    assert attrs["encoderd.model"].string_value == DEFAULT_MODEL_NAME and attrs["rpc.grpc.status_code"].int_value == 0
    failed, attrs = span_of("ops-test-5")
    assert attrs["rpc.grpc.status_code"].int_value == grpc.StatusCode.NOT_FOUND.value[0]
    assert failed.status.code == failed.status.STATUS_CODE_ERROR


def test_sigterm_notifies_stopping_and_exits_cleanly(operated):
    server, notify, _ = operated
    assert server.stop(signal.SIGTERM) == 0
    assert notify.wait_for("STOPPING")["STOPPING"] == "1"
