"""The clients every mode drives: encoderd over gRPC, any OpenAI/Cohere REST server (encoderd's Envoy,
Infinity), and sentence-transformers in this process. Each has embed() and rerank(); the servers' also
session(), an async embed for the bulk clients."""

from __future__ import annotations

import contextlib

import numpy as np


class GrpcTarget:
    """encoderd over gRPC (generated stubs: what a Go/Java/Python client pays)."""

    protocol = "grpc"

    def __init__(self, address: str, embed_model: str, rerank_model: str | None, bulk_priority: str = "bulk"):
        import grpc

        from ..v1 import encoderd_pb2, encoderd_pb2_grpc

        self.address, self.embed_model, self.rerank_model = address, embed_model, rerank_model
        # The bulk clients' calls: PRIORITY_BULK, as an ingestion pipeline should send them.
        self.bulk_priority = encoderd_pb2.Priority.Value(f"PRIORITY_{bulk_priority.upper()}")
        self._grpc, self._pb, self._pb_grpc = grpc, encoderd_pb2, encoderd_pb2_grpc
        self._channel = grpc.insecure_channel(address, options=[("grpc.max_receive_message_length", 64 << 20)])
        self._stub = encoderd_pb2_grpc.EncoderStub(self._channel)

    def embed(self, texts: list[str]) -> int:
        reply = self._stub.Embed(self._pb.EmbedRequest(model=self.embed_model, inputs=texts), timeout=600)
        return len(reply.embeddings)

    def rerank(self, query: str, docs: list[str]) -> int:
        request = self._pb.RerankRequest(model=self.rerank_model, query=query, documents=docs)
        return len(self._stub.Rerank(request, timeout=600).results)

    @contextlib.asynccontextmanager
    async def aio_stub(self):
        """(stub, messages module) on a grpc.aio channel; such channels belong to the running loop."""
        channel = self._grpc.aio.insecure_channel(self.address, options=[("grpc.max_receive_message_length", 64 << 20)])
        try:
            yield self._pb_grpc.EncoderStub(channel), self._pb
        finally:
            await channel.close()

    @contextlib.asynccontextmanager
    async def session(self):
        """An async embed function for bulk clients, at `bulk_priority`."""
        async with self.aio_stub() as (stub, pb):

            async def embed(texts: list[str]) -> int:
                request = pb.EmbedRequest(model=self.embed_model, inputs=texts, priority=self.bulk_priority)
                reply = await stub.Embed(request, timeout=600)
                return len(reply.embeddings)

            yield embed

    def close(self) -> None:
        self._channel.close()


class RestTarget:
    """OpenAI `POST {base}/embeddings` (encoding_format float) and Cohere `POST {base}/rerank`, over httpx:
    the same client code for encoderd's Envoy and for Infinity."""

    protocol = "rest"

    def __init__(self, base_url: str, embed_model: str, rerank_model: str | None):
        import httpx

        self.base, self.embed_model, self.rerank_model = base_url.rstrip("/"), embed_model, rerank_model
        self._httpx = httpx
        self._client = httpx.Client(timeout=600)

    def _embed_body(self, texts: list[str]) -> dict:
        return {"model": self.embed_model, "input": texts, "encoding_format": "float"}

    def embed(self, texts: list[str]) -> int:
        reply = self._client.post(self.base + "/embeddings", json=self._embed_body(texts))
        reply.raise_for_status()
        return len(reply.json()["data"])

    def rerank(self, query: str, docs: list[str]) -> int:
        body = {"model": self.rerank_model, "query": query, "documents": docs, "return_documents": False}
        reply = self._client.post(self.base + "/rerank", json=body)
        reply.raise_for_status()
        return len(reply.json()["results"])

    @contextlib.asynccontextmanager
    async def session(self):
        limits = self._httpx.Limits(max_connections=1024, max_keepalive_connections=1024)
        async with self._httpx.AsyncClient(timeout=600, limits=limits) as client:

            async def embed(texts: list[str]) -> int:
                reply = await client.post(self.base + "/embeddings", json=self._embed_body(texts))
                reply.raise_for_status()
                return len(reply.json()["data"])

            yield embed

    def close(self) -> None:
        self._client.close()


class SentenceTransformersTarget:
    """sentence-transformers in this process: no server, no serialization; its encode() sorts by length."""

    protocol = "in-process"

    def __init__(self, embed_dir: str, rerank_dir: str | None, threads: int, device: str = "cpu"):
        import torch
        from sentence_transformers import CrossEncoder, SentenceTransformer

        torch.set_num_threads(threads)  # the same threads as the encoderd worker
        self.model = SentenceTransformer(embed_dir, device=device)
        self.cross = CrossEncoder(rerank_dir, device=device) if rerank_dir else None
        # On a GPU, float16: what its users run there (and what encoderd's --dtype auto serves).
        self.dtype = "float16" if device.startswith("cuda") else "float32"
        if self.dtype == "float16":
            self.model.half()
            if self.cross is not None:
                self.cross.model.half()

    def embed(self, texts: list[str], batch_size: int = 32) -> int:
        return len(self.model.encode(texts, batch_size=batch_size, show_progress_bar=False))

    def rerank(self, query: str, docs: list[str]) -> int:
        if self.cross is None:
            raise ValueError("this target was made without a reranker (rerank_dir)")
        return len(self.cross.predict([(query, d) for d in docs], show_progress_bar=False))

    def padding_ratio(self, texts: list[str], lengths: np.ndarray, batch_size: int) -> float:
        """Padding its encode() computes: it sorts by character length, batches, pads to each batch's longest."""
        order = np.argsort([-len(t) for t in texts], kind="stable")
        sorted_lengths = lengths[order]
        computed = sum(
            len(b) * b.max() for b in np.array_split(sorted_lengths, range(batch_size, len(texts), batch_size))
        )
        return float(computed / sorted_lengths.sum())

    def close(self) -> None:
        pass
