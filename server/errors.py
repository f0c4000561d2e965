"""One error taxonomy for the frontend and its single mapping to gRPC status.

Envoy derives the HTTP code from the gRPC status, so there is no second table.
"""

from __future__ import annotations

import grpc


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


class Overloaded(EncoderdError):
    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class Unavailable(EncoderdError):
    """The model's worker crashed, is restarting or the server is draining."""

    code = grpc.StatusCode.UNAVAILABLE


class BackendError(EncoderdError):
    """The backend failed on a batch for a reason that is not the client's."""

    code = grpc.StatusCode.INTERNAL
