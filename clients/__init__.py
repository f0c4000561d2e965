"""Python clients for encoderd over the generated gRPC stubs.

Installed with the server (`encoderd`) or alone (`encoderd-client`: grpcio, protobuf, numpy only).
"""

from .client import (
    AsyncEncoderClient,
    Classification,
    Embeddings,
    EncoderClient,
    RerankResult,
    SparseVector,
    Tokens,
    audio,
    image,
)
from .errors import (
    Cancelled,
    DeadlineExceeded,
    EncoderdError,
    FailedPrecondition,
    Internal,
    InvalidArgument,
    NotFound,
    PermissionDenied,
    ResourceExhausted,
    Unauthenticated,
    Unavailable,
    Unimplemented,
)
from .retry import NO_RETRY, RetryPolicy
from .tls import tls_credentials

__all__ = [
    "NO_RETRY",
    "AsyncEncoderClient",
    "Cancelled",
    "Classification",
    "DeadlineExceeded",
    "Embeddings",
    "EncoderClient",
    "EncoderdError",
    "FailedPrecondition",
    "Internal",
    "InvalidArgument",
    "NotFound",
    "PermissionDenied",
    "RerankResult",
    "ResourceExhausted",
    "RetryPolicy",
    "SparseVector",
    "Tokens",
    "Unauthenticated",
    "Unavailable",
    "Unimplemented",
    "audio",
    "image",
    "tls_credentials",
]
