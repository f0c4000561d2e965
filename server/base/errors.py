"""One error taxonomy for the frontend and its single mapping to gRPC status.

Envoy derives the HTTP code from the gRPC status, so there is no second table. A batch a worker
failed arrives with an error code (workers/contract/errors.py), mapped here too (WORKER_FAILURES).
"""

from __future__ import annotations

import grpc

from ...workers.contract.errors import ErrorCode


class EncoderdError(Exception):
    code = grpc.StatusCode.INTERNAL


class InvalidInput(EncoderdError):
    """Malformed request, empty input, bad option, input too long."""

    code = grpc.StatusCode.INVALID_ARGUMENT


class ModelNotFound(EncoderdError):
    code = grpc.StatusCode.NOT_FOUND


class WrongModelKind(EncoderdError):
    """The call does not fit the model (Rerank on an embedding model)."""

    code = grpc.StatusCode.FAILED_PRECONDITION


class Unsupported(EncoderdError):
    """The served model or its engine does not do this (images sent to an ONNX engine)."""

    code = grpc.StatusCode.FAILED_PRECONDITION


class Overloaded(EncoderdError):
    """Temporary: the model's queue is full, or a call would wait too long in it. `retry_after`: whole
    seconds until a retry may be served (sent as the `retry-after` trailer, REST's Retry-After)."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED

    def __init__(self, message: str, retry_after: int = 1):
        super().__init__(message)
        self.retry_after = retry_after


class OutOfMemory(EncoderdError):
    """The device ran out of memory (a text batch is first halved down to one input). Not
    Overloaded: waiting does not help (a stream retries Overloaded), fewer or shorter inputs do."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class Unavailable(EncoderdError):
    """The model's worker crashed, is restarting or the server is draining."""

    code = grpc.StatusCode.UNAVAILABLE


class BackendError(EncoderdError):
    """The backend failed on a batch for a reason that is not the client's."""

    code = grpc.StatusCode.INTERNAL


# A failed batch's code (workers/contract/errors.py) -> the error its requests fail with.
WORKER_FAILURES: dict[ErrorCode, type[EncoderdError]] = {
    ErrorCode.INVALID_INPUT: InvalidInput,
    ErrorCode.UNSUPPORTED: Unsupported,
    ErrorCode.OUT_OF_MEMORY: OutOfMemory,
    ErrorCode.INTERNAL: BackendError,
}


def worker_failure(code: ErrorCode, message: str) -> EncoderdError:
    """The error a batch the worker failed with `code` raises in the frontend (an error sent without
    a code is INTERNAL)."""
    return WORKER_FAILURES.get(code, BackendError)(message)


# A client's value in an error message: enough to recognize it, never all of it. A 65,000-character
# `model` echoed whole made a grpc-message header larger than the HTTP/2 link from Envoy accepts:
# the link was reset, and with it every other client's call on it (502 / UNAVAILABLE).
ECHO_CHARS = 48
# Every status message, whatever it holds, is cut to this many UTF-8 bytes where the status is set
# (service.py, streaming.py): percent-encoded in grpc-message it stays far below Envoy's 60 KiB of
# headers, and a REST error body stays small.
STATUS_MESSAGE_BYTES = 2048


def echo(value: object) -> str:
    """`value` as an error message quotes it: whole when short, else its first ECHO_CHARS
    characters and its length."""
    text = str(value)
    if len(text) <= ECHO_CHARS:
        return repr(text)
    return f"{text[:ECHO_CHARS]!r}... ({len(text)} characters)"


def status_message(message: str) -> str:
    """`message` within STATUS_MESSAGE_BYTES of UTF-8, cut where a character ends, saying it was cut."""
    data = message.encode("utf-8", "replace")
    if len(data) <= STATUS_MESSAGE_BYTES:
        return message
    kept = data[: STATUS_MESSAGE_BYTES - 64].decode("utf-8", "ignore")
    return f"{kept}... (message cut: {len(data)} bytes)"
