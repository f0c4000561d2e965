"""Optional OpenTelemetry traces: one SERVER span per Encoder RPC, exported over OTLP/gRPC.

Off unless `--otel-endpoint` is set, and then only if the `[otel]` extra is
installed (opentelemetry-sdk + the OTLP gRPC exporter); otherwise a warning
and no tracing, never a failed start. The caller's W3C `traceparent` metadata
is honoured, so our span joins the client's trace. Spans stop at the frontend:
a batch mixes many requests, so workers are not traced per request.
"""

from __future__ import annotations

import contextlib
import logging

log = logging.getLogger("encoderd.tracing")

_tracer = None
_provider = None


def configure(endpoint: str, service_name: str = "encoderd") -> bool:
    """Start exporting spans to `endpoint` (host:port or URL); True when tracing is on."""
    global _tracer, _provider  # noqa: PLW0603 - the process's one tracer, set at start and drain
    if not endpoint:
        return False
    try:
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import SERVICE_NAME, Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
    except ImportError:
        log.warning(
            "--otel-endpoint is set but OpenTelemetry is not installed "
            "(pip install '<encoderd checkout>[otel]'); tracing is off"
        )
        return False
    insecure = not endpoint.startswith("https://")
    # Resource.create merges OTEL_RESOURCE_ATTRIBUTES / OTEL_SERVICE_NAME from the environment over ours.
    _provider = TracerProvider(resource=Resource.create({SERVICE_NAME: service_name}))
    _provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint, insecure=insecure)))
    _tracer = _provider.get_tracer("encoderd")
    log.info("tracing: exporting spans over OTLP/gRPC to %s", endpoint)
    return True


def shutdown() -> None:
    """Flush the spans still buffered (at drain)."""
    global _tracer, _provider  # noqa: PLW0603 - the process's one tracer, set at start and drain
    if _provider is not None:
        _provider.shutdown()
    _tracer = _provider = None


def rpc_span(method: str, metadata, attributes: dict):
    """A context manager around one RPC ("Encoder/Embed"): a real span when tracing is on, else nothing."""
    if _tracer is None:
        return contextlib.nullcontext()
    return _span(method, metadata, attributes)


@contextlib.contextmanager
def _span(method: str, metadata, attributes: dict):
    from opentelemetry import propagate, trace

    assert _tracer is not None  # rpc_span calls this only while tracing is on

    service, _, name = method.partition("/")
    carrier = {key: value for key, value in metadata or () if isinstance(value, str)}
    with _tracer.start_as_current_span(
        f"encoderd.v1.{method}",
        context=propagate.extract(carrier),
        kind=trace.SpanKind.SERVER,
        attributes={"rpc.system": "grpc", "rpc.service": f"encoderd.v1.{service}", "rpc.method": name, **attributes},
        record_exception=False,
        set_status_on_exception=False,
    ) as span:  # finish() sets the status
        yield span


def finish(span, code, model: str) -> None:
    """Record the outcome (a grpc.StatusCode) on the span; no-op when tracing is off."""
    if span is None:
        return
    from opentelemetry.trace import Status, StatusCode

    span.set_attribute("rpc.grpc.status_code", code.value[0])
    span.set_attribute("encoderd.model", model)
    if code.name != "OK":
        span.set_status(Status(StatusCode.ERROR, code.name))
