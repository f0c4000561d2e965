"""Python clients for encoderd over the generated gRPC stubs."""

from .client import AsyncEncoderClient, Classification, EncoderClient, Embeddings, RerankResult

__all__ = ["AsyncEncoderClient", "Classification", "EncoderClient", "Embeddings", "RerankResult"]
