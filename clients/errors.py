"""Typed exceptions for encoderd's gRPC status codes.

Every client call raises a subclass of EncoderdError instead of grpc's internal
`_InactiveRpcError` / `AioRpcError`. EncoderdError is itself a grpc.RpcError with
`code()` and `details()`, so code written against the raw errors keeps working.
"""

from __future__ import annotations

import grpc


class EncoderdError(grpc.RpcError):
    """A failed call: `status` is the grpc.StatusCode, `message` the server's explanation,
    `attempts` how many times the call was sent (more than 1 after retries), `retry_after` the
    seconds the server asked the caller to wait before trying again (its `retry-after` trailer, sent
    with an overload's RESOURCE_EXHAUSTED), None where it said nothing."""

    status: grpc.StatusCode = grpc.StatusCode.UNKNOWN

    def __init__(
        self,
        message: str,
        *,
        status: grpc.StatusCode | None = None,
        attempts: int = 1,
        retry_after: float | None = None,
    ):
        super().__init__(message)
        self.message = message
        self.attempts = attempts
        self.retry_after = retry_after
        if status is not None:
            self.status = status

    def code(self) -> grpc.StatusCode:
        return self.status

    def details(self) -> str:
        return self.message

    def __str__(self) -> str:
        return f"{self.status.name}: {self.message}"


class InvalidArgument(EncoderdError):
    """A malformed request: an empty input, an unknown option, an input too long without truncation."""

    status = grpc.StatusCode.INVALID_ARGUMENT


class NotFound(EncoderdError):
    """No served model has this name."""

    status = grpc.StatusCode.NOT_FOUND


class FailedPrecondition(EncoderdError):
    """The call does not fit the model (Rerank on an embedding model, say)."""

    status = grpc.StatusCode.FAILED_PRECONDITION


class ResourceExhausted(EncoderdError):
    """The model is overloaded: its queue is full (--max-queued-inputs / --max-queued-tokens), or the
    call would wait longer than --max-queue-wait or its deadline (`retry_after` says when to come
    back); or a message too large."""

    status = grpc.StatusCode.RESOURCE_EXHAUSTED


class Unavailable(EncoderdError):
    """No server answers, the model's worker is restarting, or the server is draining."""

    status = grpc.StatusCode.UNAVAILABLE


class DeadlineExceeded(EncoderdError):
    status = grpc.StatusCode.DEADLINE_EXCEEDED


class Unauthenticated(EncoderdError):
    """A missing or wrong API key."""

    status = grpc.StatusCode.UNAUTHENTICATED


class PermissionDenied(EncoderdError):
    status = grpc.StatusCode.PERMISSION_DENIED


class Cancelled(EncoderdError):
    status = grpc.StatusCode.CANCELLED


class Unimplemented(EncoderdError):
    """The server is older than this client and lacks the method."""

    status = grpc.StatusCode.UNIMPLEMENTED


class Internal(EncoderdError):
    """The server failed for a reason that is not the caller's."""

    status = grpc.StatusCode.INTERNAL


_BY_STATUS = {
    cls.status: cls
    for cls in (
        InvalidArgument,
        NotFound,
        FailedPrecondition,
        ResourceExhausted,
        Unavailable,
        DeadlineExceeded,
        Unauthenticated,
        PermissionDenied,
        Cancelled,
        Unimplemented,
        Internal,
    )
}


def from_rpc_error(error: grpc.RpcError, attempts: int = 1) -> EncoderdError:
    """The typed exception for a raw grpc error (sync or asyncio)."""
    if isinstance(error, EncoderdError):
        return error
    status = error.code() if hasattr(error, "code") else grpc.StatusCode.UNKNOWN
    message = (error.details() if hasattr(error, "details") else None) or str(status)
    cls = _BY_STATUS.get(status, EncoderdError)
    return cls(message, status=status, attempts=attempts, retry_after=retry_after(error))


def retry_after(error: grpc.RpcError) -> float | None:
    """The seconds a failed call's `retry-after` trailer asks for (sync or asyncio errors), or None."""
    if isinstance(error, EncoderdError):
        return error.retry_after
    trailers = error.trailing_metadata() if hasattr(error, "trailing_metadata") else None
    for key, value in trailers or ():
        if key == "retry-after":
            try:
                seconds = float(value)
            except (TypeError, ValueError):
                return None  # not a number of seconds (an HTTP date is REST's, never gRPC's)
            return seconds if seconds >= 0 else None
    return None
