"""API keys: `authorization: Bearer KEY` on every call (gRPC metadata; REST's
Authorization header arrives as the same metadata through Envoy)."""

from __future__ import annotations

import hmac
import logging

import grpc

from ...workers.contract import logs
from ..base import metrics

log = logging.getLogger("encoderd.auth")

# Open without a key unless --no-open-health: health checks (the REST /health route is Compat/Health
# behind Envoy) and the REST /metrics route (Compat/GetMetrics), which Infinity and TEI serve without
# their key too and Prometheus scrapes like a probe; --metrics-port is never behind a key either.
OPEN_METHODS = (
    "/grpc.health.v1.Health/Check",
    "/grpc.health.v1.Health/Watch",
    "/encoderd.v1.Compat/Health",
    "/encoderd.v1.Compat/GetMetrics",
)
REFLECTION_PREFIX = "/grpc.reflection."


def load_keys(keys: tuple[str, ...], key_file: str | None) -> tuple[str, ...]:
    """Keys from flags plus one per line of a file (blank lines and # comments skipped)."""
    found = [k.strip() for k in keys if k.strip()]
    if key_file:
        with open(key_file) as f:
            found += [line.strip() for line in f if line.strip() and not line.lstrip().startswith("#")]
    return tuple(dict.fromkeys(found))


def presented_key(metadata) -> str:
    for name, value in metadata or ():
        if name == "authorization":
            scheme, _, token = value.partition(" ")
            return token.strip() if scheme.lower() == "bearer" else ""
    return ""


class ApiKeyInterceptor(grpc.aio.ServerInterceptor):
    def __init__(self, keys: tuple[str, ...], open_health: bool = True):
        self._keys = tuple(k.encode() for k in keys)
        self._open_health = open_health

    def _is_open(self, method: str) -> bool:
        return self._open_health and (method in OPEN_METHODS or method.startswith(REFLECTION_PREFIX))

    def _authorized(self, metadata) -> bool:
        presented = presented_key(metadata).encode()
        # Compare against every key, in constant time per key: no early exit reveals which matched.
        matches = [hmac.compare_digest(presented, key) for key in self._keys]
        return bool(presented) and any(matches)

    async def intercept_service(self, continuation, details: grpc.HandlerCallDetails):
        if not self._keys or self._is_open(details.method) or self._authorized(details.invocation_metadata):
            return await continuation(details)
        handler = await continuation(details)
        # An unknown method stays UNIMPLEMENTED; its name is client text, never a label.
        route = details.method if handler is not None else "(unknown)"
        presented = "a wrong key" if presented_key(details.invocation_metadata) else "no key"
        logs.bind_request_id(details.invocation_metadata)  # the line carries the caller's x-request-id
        log.warning("authentication failed on %s: %s", route, presented)  # never the key itself
        metrics.AUTH_FAILURES.labels(route).inc()
        return _refusing(handler, "missing or wrong API key: send `authorization: Bearer <key>`")


def _refusing(handler: grpc.RpcMethodHandler | None, message: str):
    async def refuse_unary(request, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    async def refuse_stream(request_iterator, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)
        yield  # pragma: no cover - makes this an async generator

    if handler is None:
        return None
    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(
            refuse_stream, handler.request_deserializer, handler.response_serializer
        )
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(
            refuse_stream, handler.request_deserializer, handler.response_serializer
        )
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(
            refuse_unary, handler.request_deserializer, handler.response_serializer
        )
    return grpc.unary_unary_rpc_method_handler(refuse_unary, handler.request_deserializer, handler.response_serializer)
