"""Python clients for encoderd over the generated gRPC stubs.

Installed with the server (`encoderd`) or alone (`encoderd-client`: grpcio, protobuf, numpy only).
"""

from .client import (AsyncEncoderClient, Classification, EncoderClient, Embeddings, RerankResult, SparseVector,
                     Tokens, audio, image)
from .errors import (Cancelled, DeadlineExceeded, EncoderdError, FailedPrecondition, Internal, InvalidArgument,
                     NotFound, PermissionDenied, ResourceExhausted, Unauthenticated, Unavailable, Unimplemented)
from .retry import NO_RETRY, RetryPolicy
from .tls import tls_credentials

__all__ = ["AsyncEncoderClient", "Classification", "EncoderClient", "Embeddings", "RerankResult", "SparseVector",
           "Tokens", "audio", "image", "RetryPolicy", "NO_RETRY", "tls_credentials",
           "EncoderdError", "InvalidArgument", "NotFound", "FailedPrecondition", "ResourceExhausted", "Unavailable",
           "DeadlineExceeded", "Unauthenticated", "PermissionDenied", "Cancelled", "Unimplemented", "Internal"]
