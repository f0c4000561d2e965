"""#42 item 1: one client's long field never hurts another's call. A `model` (or prompt_name,
encoding_format, input_type...) of >= ~65,000 characters was echoed whole into the error, the
grpc-message outgrew what the HTTP/2 link from Envoy accepts, the link was reset, and the calls of
other clients on it failed (502 / UNAVAILABLE). Here a 1 MiB value goes into every string field of
every RPC (native gRPC, through Envoy's gRPC port) and of every REST route, while other clients'
calls run as a stream that spans the whole sending phase: every one of theirs succeeds, the sender
gets a 2xx/4xx (gRPC: OK or a client-error code) with a bounded message.
Real server, workers and Envoy, loopback."""

from __future__ import annotations

import threading

import grpc
import httpx
import pytest
from google.api import annotations_pb2
from google.protobuf import message_factory
from google.protobuf.descriptor import FieldDescriptor
from support.server import ServerProcess

from encoderd.server.base.errors import STATUS_MESSAGE_BYTES
from encoderd.v1 import compat_pb2, encoderd_pb2, encoderd_pb2_grpc
from encoderd.v1 import encoderd_pb2 as pb
from encoderd.workers.contract.model_files import DEFAULT_MODEL_NAME, default_model_path

BIG = "m" * (1 << 20)
URL_BIG = "m" * 60_000  # Envoy takes 60 KiB of headers, and httpx sends no longer URL
CLIENT_ERRORS = {
    grpc.StatusCode.OK,  # a field the call ignores (OpenAI's `user`)
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.OUT_OF_RANGE,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
}
REST_ERROR_BYTES = 4096 + 200  # gateway/errors.lua's ceiling on the message, and the JSON around it
OTHERS = 4  # REST clients, and as many gRPC ones, calling all along
SERVICES = [s for m in (encoderd_pb2, compat_pb2) for s in m.DESCRIPTOR.services_by_name.values()]


@pytest.fixture(scope="module")
def server(tmp_path_factory, reranker_path, classifier_path):
    log = tmp_path_factory.mktemp("logs") / "long_fields.log"
    with ServerProcess(
        "--model",
        f"{DEFAULT_MODEL_NAME}={default_model_path()}",
        "--model",
        f"reranker={reranker_path}",
        "--model",
        f"classifier={classifier_path}",
        rest=True,
        log_path=log,
    ) as proc:
        yield proc


def _model_for(method: str) -> str:
    """A served model that fits the call, so that validation goes past `model` to the other fields."""
    if "Rerank" in method:
        return "reranker"
    return "classifier" if "Classify" in method or "Predict" in method else DEFAULT_MODEL_NAME


def _string_paths(message, prefix: tuple = (), enums: bool = False) -> list[tuple]:
    """Every string field of `message` (google.protobuf.Value ones too, as they hold JSON strings;
    with `enums`, enum fields, which JSON writes as strings), nested messages included, as paths."""
    paths = []
    for field in message.fields:
        path = (*prefix, field)
        kind = field.message_type.full_name if field.message_type else ""
        as_string = field.type == FieldDescriptor.TYPE_STRING or kind == "google.protobuf.Value"
        if as_string or (enums and field.type == FieldDescriptor.TYPE_ENUM):
            paths.append(path)
        elif kind and not kind.startswith("google."):
            paths += _string_paths(field.message_type, path, enums)
    return paths


def _set_big(request, path: tuple) -> None:
    *parents, last = path
    for field in parents:
        request = getattr(request, field.name).add() if field.is_repeated else getattr(request, field.name)
    if last.type == FieldDescriptor.TYPE_STRING:
        if last.is_repeated:
            getattr(request, last.name).append(BIG)
        else:
            setattr(request, last.name, BIG)
    else:
        getattr(request, last.name).string_value = BIG


def _json_big(path: tuple, model: str) -> dict:
    body: dict = {"model": model}
    inner = body
    *parents, last = path
    for field in parents:
        child: dict = {}
        inner[field.json_name] = [child] if field.is_repeated else child
        inner = child
    inner[last.json_name] = [BIG] if last.is_repeated else BIG
    return body


def _grpc_cases():
    for service in SERVICES:
        for method in service.methods:
            for path in _string_paths(method.input_type):
                yield service, method, path


def _rest_cases():
    for service in SERVICES:
        for method in service.methods:
            rule = method.GetOptions().Extensions[annotations_pb2.http]
            for binding in (rule, *rule.additional_bindings):
                verb = binding.WhichOneof("pattern")
                if verb not in ("get", "post"):
                    continue
                route = getattr(binding, verb)
                if verb == "get":
                    # in the path (its parameter) or the query string, as much as a URL holds
                    yield "GET", route.replace("{id}", URL_BIG) if "{" in route else f"{route}?model={URL_BIG}", None
                    continue
                for path in _string_paths(method.input_type, enums=True):
                    yield "POST", route, _json_big(path, "" if path[0].name == "model" else _model_for(method.name))


def _grpc_call(channel, service, method, path) -> tuple[grpc.StatusCode, str]:
    request_class = message_factory.GetMessageClass(method.input_type)
    response_class = message_factory.GetMessageClass(method.output_type)
    request = request_class()
    if "model" in method.input_type.fields_by_name and path[0].name != "model":
        request.model = _model_for(method.name)
    _set_big(request, path)
    name = f"/{service.full_name}/{method.name}"
    try:
        if method.client_streaming:
            call = channel.stream_stream(name, request_class.SerializeToString, response_class.FromString)
            for answer in call(iter([request]), timeout=60):
                if answer.HasField("error"):  # an item refused on the stream, the stream goes on
                    return grpc.StatusCode(next(c for c in grpc.StatusCode if c.value[0] == answer.error.code)), (
                        answer.error.message
                    )
        else:
            channel.unary_unary(name, request_class.SerializeToString, response_class.FromString)(request, timeout=60)
    except grpc.RpcError as exc:
        return exc.code(), exc.details() or ""
    return grpc.StatusCode.OK, ""


class _Others:
    """Other clients' calls, each thread one after another from before the sending phase until
    after it: every result is kept, none may fail."""

    def __init__(self, server):
        self.server = server
        self.done = threading.Event()
        self.results: list[tuple[str, object]] = []
        self.lock = threading.Lock()
        self.ready = threading.Barrier(2 * OTHERS + 1)
        self.threads = [threading.Thread(target=self._rest) for _ in range(OTHERS)]
        self.threads += [threading.Thread(target=self._grpc) for _ in range(OTHERS)]

    def _loop(self, call, what: str) -> None:
        first = True
        while first or not self.done.is_set():
            result = call()
            with self.lock:
                self.results.append((what, result))
            if first:
                self.ready.wait(timeout=120)  # every one has answered once before the big ones go
                first = False

    def _rest(self) -> None:
        with httpx.Client(base_url=self.server.rest_url, timeout=60, trust_env=False) as http:

            def call():
                try:
                    return http.post("/v1/embeddings", json={"model": DEFAULT_MODEL_NAME, "input": "hi"}).status_code
                except httpx.HTTPError as exc:
                    return repr(exc)

            self._loop(call, "REST")

    def _grpc(self) -> None:
        with grpc.insecure_channel(self.server.address) as channel:  # Envoy's gRPC port
            stub = encoderd_pb2_grpc.EncoderStub(channel)

            def call():
                try:
                    stub.Embed(pb.EmbedRequest(model=DEFAULT_MODEL_NAME, inputs=["hi"]), timeout=60)
                    return grpc.StatusCode.OK
                except grpc.RpcError as exc:
                    return exc.code()

            self._loop(call, "gRPC")

    def __enter__(self):
        for thread in self.threads:
            thread.start()
        self.ready.wait(timeout=120)
        with self.lock:
            self.before = len(self.results)
        return self

    def __exit__(self, *exc):
        self.done.set()
        for thread in self.threads:
            thread.join(timeout=120)


def test_a_megabyte_in_any_string_field_fails_only_its_own_call(server):
    grpc_cases, rest_cases = list(_grpc_cases()), list(_rest_cases())
    assert len(grpc_cases) > 60 and len(rest_cases) > 80  # every RPC, every route: none skipped
    bad = []
    with (
        _Others(server) as others,
        grpc.insecure_channel(server.address, options=[("grpc.max_send_message_length", 8 << 20)]) as channel,
        httpx.Client(base_url=server.rest_url, timeout=60, trust_env=False) as http,
    ):
        for service, method, path in grpc_cases:
            code, details = _grpc_call(channel, service, method, path)
            where = f"{method.name} {'.'.join(f.name for f in path)}"
            if code not in CLIENT_ERRORS or len(details.encode()) > STATUS_MESSAGE_BYTES:
                bad.append((where, code, details[:200], len(details)))
        for verb, route, body in rest_cases:
            response = http.request(verb, route, json=body)
            where = f"{verb} {route[:60]} {sorted(body) if body else ''}"
            refused = response.status_code >= 400
            if not 200 <= response.status_code < 500 or (refused and len(response.content) > REST_ERROR_BYTES):
                bad.append((where, response.status_code, response.text[:200], len(response.content)))
        during = len(others.results) - others.before
    failed = [r for r in others.results if r[1] not in (200, grpc.StatusCode.OK)]
    assert not failed, f"{len(failed)} of {len(others.results)} other clients' calls failed: {failed[:5]}"
    assert during >= 2 * OTHERS, during  # their calls went on through the whole sending phase
    assert not bad, bad
