"""Typed sync and async clients. Embeddings come back as numpy arrays.

    from encoderd.clients import EncoderClient
    with EncoderClient("127.0.0.1:50051") as client:
        vectors = client.embed(["hello", "world"]).vectors     # (2, 384) float32
        ranked = client.rerank("query", ["doc a", "doc b"], model="reranker")
"""

from __future__ import annotations

from dataclasses import dataclass

import grpc
import numpy as np

from ..v1 import encoderd_pb2 as pb
from ..v1 import encoderd_pb2_grpc


@dataclass(frozen=True)
class Embeddings:
    model: str
    vectors: np.ndarray      # (n, dim) float32, in input order
    prompt_tokens: int


@dataclass(frozen=True)
class RerankResult:
    index: int
    score: float
    document: str | None


@dataclass(frozen=True)
class Classification:
    labels: list[tuple[str, float]]   # best first

    @property
    def top(self) -> str:
        return self.labels[0][0]


def _metadata(api_key: str | None):
    return (("authorization", f"Bearer {api_key}"),) if api_key else None


def _embed_request(inputs, model, normalize, dimensions, prompt) -> pb.EmbedRequest:
    if isinstance(inputs, str):
        raise TypeError("pass a list of strings, not a single string")
    return pb.EmbedRequest(model=model, inputs=list(inputs), normalize=normalize, dimensions=dimensions, prompt=prompt)


def _embeddings(response: pb.EmbedResponse) -> Embeddings:
    vectors = np.array([e.values for e in response.embeddings], dtype=np.float32)
    return Embeddings(response.model, vectors, response.usage.prompt_tokens)


def _rerank(response: pb.RerankResponse, return_documents: bool) -> list[RerankResult]:
    return [RerankResult(r.index, r.relevance_score, r.document if return_documents else None) for r in response.results]


def _classifications(response: pb.ClassifyResponse) -> list[Classification]:
    return [Classification([(s.label, s.score) for s in c.labels]) for c in response.results]


class EncoderClient:
    """Blocking client. `timeout` is the per-call deadline in seconds."""

    def __init__(self, target: str = "127.0.0.1:50051", *, api_key: str | None = None, timeout: float = 60.0,
                 channel: grpc.Channel | None = None):
        self._channel = channel or grpc.insecure_channel(target)
        self._stub = encoderd_pb2_grpc.EncoderStub(self._channel)
        self._metadata = _metadata(api_key)
        self._timeout = timeout

    def embed(self, inputs: list[str], model: str = "", *, normalize: bool | None = None, dimensions: int = 0,
              prompt: str = "") -> Embeddings:
        request = _embed_request(inputs, model, normalize, dimensions, prompt)
        return _embeddings(self._stub.Embed(request, timeout=self._timeout, metadata=self._metadata))

    def rerank(self, query: str, documents: list[str], model: str = "", *, top_n: int = 0,
               return_documents: bool = False, raw_scores: bool = False) -> list[RerankResult]:
        request = pb.RerankRequest(model=model, query=query, documents=documents, top_n=top_n,
                                   return_documents=return_documents, raw_scores=raw_scores)
        return _rerank(self._stub.Rerank(request, timeout=self._timeout, metadata=self._metadata), return_documents)

    def classify(self, inputs: list[str], model: str = "", *, raw_scores: bool = False) -> list[Classification]:
        request = pb.ClassifyRequest(model=model, inputs=inputs, raw_scores=raw_scores)
        return _classifications(self._stub.Classify(request, timeout=self._timeout, metadata=self._metadata))

    def models(self) -> list[pb.ModelInfo]:
        return list(self._stub.ListModels(pb.ListModelsRequest(), timeout=self._timeout, metadata=self._metadata).models)

    def close(self) -> None:
        self._channel.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class AsyncEncoderClient:
    """asyncio client over grpc.aio; create it inside a running event loop."""

    def __init__(self, target: str = "127.0.0.1:50051", *, api_key: str | None = None, timeout: float = 60.0):
        self._channel = grpc.aio.insecure_channel(target)
        self._stub = encoderd_pb2_grpc.EncoderStub(self._channel)
        self._metadata = _metadata(api_key)
        self._timeout = timeout

    async def embed(self, inputs: list[str], model: str = "", *, normalize: bool | None = None, dimensions: int = 0,
                    prompt: str = "") -> Embeddings:
        request = _embed_request(inputs, model, normalize, dimensions, prompt)
        return _embeddings(await self._stub.Embed(request, timeout=self._timeout, metadata=self._metadata))

    async def rerank(self, query: str, documents: list[str], model: str = "", *, top_n: int = 0,
                     return_documents: bool = False, raw_scores: bool = False) -> list[RerankResult]:
        request = pb.RerankRequest(model=model, query=query, documents=documents, top_n=top_n,
                                   return_documents=return_documents, raw_scores=raw_scores)
        response = await self._stub.Rerank(request, timeout=self._timeout, metadata=self._metadata)
        return _rerank(response, return_documents)

    async def classify(self, inputs: list[str], model: str = "", *, raw_scores: bool = False) -> list[Classification]:
        request = pb.ClassifyRequest(model=model, inputs=inputs, raw_scores=raw_scores)
        return _classifications(await self._stub.Classify(request, timeout=self._timeout, metadata=self._metadata))

    async def models(self) -> list[pb.ModelInfo]:
        response = await self._stub.ListModels(pb.ListModelsRequest(), timeout=self._timeout, metadata=self._metadata)
        return list(response.models)

    async def close(self) -> None:
        await self._channel.close()

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        await self.close()
