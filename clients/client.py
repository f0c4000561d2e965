"""Typed sync and async clients. Embeddings come back as numpy arrays.

    from encoderd.clients import EncoderClient
    with EncoderClient("127.0.0.1:50051") as client:
        vectors = client.embed(["hello", "world"]).vectors     # (2, 384) float32
        ranked = client.rerank("query", ["doc a", "doc b"], model="reranker")

Failures raise encoderd.clients.errors.EncoderdError subclasses (NotFound,
ResourceExhausted, ...); UNAVAILABLE and RESOURCE_EXHAUSTED are retried with
backoff within the call's deadline (see retry.RetryPolicy).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import grpc
import numpy as np

from ..v1 import encoderd_pb2 as pb
from ..v1 import encoderd_pb2_grpc
from . import bulk, vectors
from .retry import RetryPolicy, acall_with_retry, call_with_retry, channel_options

DEFAULT_RETRY = RetryPolicy()  # frozen: one shared default is safe


@dataclass(frozen=True)
class Embeddings:
    model: str
    vectors: np.ndarray  # (n, dim) float32 (or the requested output dtype), in input order
    prompt_tokens: int


@dataclass(frozen=True)
class RerankResult:
    index: int
    score: float
    document: str | None


@dataclass(frozen=True)
class Classification:
    labels: list[tuple[str, float]]  # best first

    @property
    def top(self) -> str:
        return self.labels[0][0]


@dataclass(frozen=True)
class Tokens:
    ids: list[int]
    tokens: list[str]
    offsets: list[tuple[int, int]]  # character spans [start, end) in the input


@dataclass(frozen=True)
class SparseVector:
    indices: np.ndarray  # int32 vocabulary ids, ascending
    values: np.ndarray  # float32 weights
    dimensions: int  # the vocabulary size


def image(source: bytes | str) -> pb.Content:
    """A multi-modal image input: the encoded file's bytes, or a URL / data: URI."""
    return pb.Content(image=_media(source))


def audio(source: bytes | str) -> pb.Content:
    """A multi-modal audio input: the encoded file's bytes, or a URL / data: URI."""
    return pb.Content(audio=_media(source))


def _media(source: bytes | str) -> pb.Media:
    return pb.Media(data=source) if isinstance(source, (bytes, bytearray)) else pb.Media(url=source)


def _content(item: str | pb.Content) -> pb.Content:
    return pb.Content(text=item) if isinstance(item, str) else item


def _texts(inputs) -> list[str]:
    if isinstance(inputs, str):
        raise TypeError("pass a list of strings, not a single string")
    return list(inputs)


def _metadata(api_key: str | None):
    return (("authorization", f"Bearer {api_key}"),) if api_key else None


def _ranked(results, documents: bool) -> list[RerankResult]:
    return [RerankResult(r.index, r.relevance_score, r.document if documents else None) for r in results]


def _open_channel(grpc_module, target: str, credentials: grpc.ChannelCredentials | None, retry: RetryPolicy):
    """A channel of grpc (blocking) or grpc.aio: TLS with `credentials`, else plaintext."""
    options = channel_options(retry)
    if credentials is None:
        return grpc_module.insecure_channel(target, options=options)
    return grpc_module.secure_channel(target, credentials, options=options)


class _Methods:
    """The API, written once for both clients: each method builds a request and names the RPC and
    the conversion of its response; `_invoke` (blocking, or a coroutine in the async client) sends it."""

    # (rpc name, request, convert response, timeout) -> converted response, or a coroutine of it (async client)
    _invoke: Callable[[str, Any, Callable[[Any], Any], float | None], Any]

    def embed(
        self,
        inputs: list[str],
        model: str = "",
        *,
        normalize: bool | None = None,
        dimensions: int = 0,
        prompt: str = "",
        prompt_name: str = "",
        truncate: bool | None = None,
        output_dtype: str = "float32",
        timeout: float | None = None,
    ) -> Embeddings:
        dtype = vectors.output_dtype(output_dtype)
        request = pb.EmbedRequest(
            model=model,
            inputs=_texts(inputs),
            normalize=normalize,
            dimensions=dimensions,
            prompt=prompt,
            prompt_name=prompt_name,
            truncate=truncate,
            output_dtype=dtype,
        )
        return self._invoke(
            "Embed",
            request,
            lambda r: Embeddings(r.model, vectors.stack(r.embeddings, dtype), r.usage.prompt_tokens),
            timeout,
        )

    def rerank(
        self,
        query: str,
        documents: list[str],
        model: str = "",
        *,
        top_n: int = 0,
        return_documents: bool = False,
        raw_scores: bool = False,
        truncate: bool | None = None,
        timeout: float | None = None,
    ) -> list[RerankResult]:
        request = pb.RerankRequest(
            model=model,
            query=query,
            documents=_texts(documents),
            top_n=top_n,
            return_documents=return_documents,
            raw_scores=raw_scores,
            truncate=truncate,
        )
        return self._invoke("Rerank", request, lambda r: _ranked(r.results, return_documents), timeout)

    def classify(
        self,
        inputs: list[str],
        model: str = "",
        *,
        raw_scores: bool = False,
        truncate: bool | None = None,
        timeout: float | None = None,
    ) -> list[Classification]:
        request = pb.ClassifyRequest(model=model, inputs=_texts(inputs), raw_scores=raw_scores, truncate=truncate)
        return self._invoke(
            "Classify",
            request,
            lambda r: [Classification([(s.label, s.score) for s in c.labels]) for c in r.results],
            timeout,
        )

    def tokenize(
        self, inputs: list[str], model: str = "", *, add_special_tokens: bool = True, timeout: float | None = None
    ) -> list[Tokens]:
        request = pb.TokenizeRequest(model=model, inputs=_texts(inputs), add_special_tokens=add_special_tokens)
        return self._invoke(
            "Tokenize",
            request,
            lambda r: [Tokens(list(t.ids), list(t.tokens), [(s.start, s.end) for s in t.offsets]) for t in r.results],
            timeout,
        )

    def list_models(self, *, timeout: float | None = None) -> list[pb.ModelInfo]:
        return self._invoke("ListModels", pb.ListModelsRequest(), lambda r: list(r.models), timeout)

    models = list_models  # the name of earlier releases

    def embed_multimodal(
        self,
        inputs: list[str | pb.Content],
        model: str = "",
        *,
        normalize: bool | None = None,
        dimensions: int = 0,
        truncate: bool | None = None,
        output_dtype: str = "float32",
        timeout: float | None = None,
    ) -> Embeddings:
        """Texts (str), image(...) and audio(...) inputs into one space (clip, clap models)."""
        dtype = vectors.output_dtype(output_dtype)
        request = pb.EmbedMultimodalRequest(
            model=model,
            inputs=[_content(i) for i in inputs],
            normalize=normalize,
            dimensions=dimensions,
            truncate=truncate,
            output_dtype=dtype,
        )
        return self._invoke(
            "EmbedMultimodal",
            request,
            lambda r: Embeddings(r.model, vectors.stack(r.embeddings, dtype), r.usage.prompt_tokens),
            timeout,
        )

    def embed_multivector(
        self,
        inputs: list[str | pb.Content],
        model: str = "",
        *,
        prompt: str = "",
        truncate: bool | None = None,
        timeout: float | None = None,
    ) -> list[np.ndarray]:
        """Per input, a (rows, dimensions) float32 array of unit vectors (colbert, colpali, clip_patches)."""
        request = pb.EmbedMultiVectorRequest(
            model=model, inputs=[_content(i) for i in inputs], prompt=prompt, truncate=truncate
        )
        return self._invoke(
            "EmbedMultiVector",
            request,
            lambda r: [np.asarray(m.values, dtype=np.float32).reshape(m.rows, r.dimensions) for m in r.embeddings],
            timeout,
        )

    def maxsim(
        self,
        query: str,
        documents: list[str | pb.Content],
        model: str = "",
        *,
        top_n: int = 0,
        return_documents: bool = False,
        query_prompt: str = "",
        document_prompt: str = "",
        truncate: bool | None = None,
        timeout: float | None = None,
    ) -> list[RerankResult]:
        """Documents ranked by late interaction with the query (colbert, colpali, clip_patches), best first."""
        request = pb.MaxSimRequest(
            model=model,
            query=query,
            documents=[_content(d) for d in documents],
            top_n=top_n,
            return_documents=return_documents,
            query_prompt=query_prompt,
            document_prompt=document_prompt,
            truncate=truncate,
        )
        return self._invoke("MaxSim", request, lambda r: _ranked(r.results, return_documents), timeout)

    def embed_sparse(
        self,
        inputs: list[str],
        model: str = "",
        *,
        top_k: int = 0,
        threshold: float = 0.0,
        prompt: str = "",
        truncate: bool | None = None,
        timeout: float | None = None,
    ) -> list[SparseVector]:
        """SPLADE vectors of a sparse model."""
        request = pb.EmbedSparseRequest(
            model=model, inputs=_texts(inputs), top_k=top_k, threshold=threshold, prompt=prompt, truncate=truncate
        )
        return self._invoke(
            "EmbedSparse",
            request,
            lambda r: [
                SparseVector(
                    np.asarray(s.indices, dtype=np.int32), np.asarray(s.values, dtype=np.float32), r.dimensions
                )
                for s in r.embeddings
            ],
            timeout,
        )


class EncoderClient(_Methods):
    """Blocking client. `timeout` is each call's deadline in seconds (None: none), retries included;
    `retry` the policy for UNAVAILABLE / RESOURCE_EXHAUSTED (retry.NO_RETRY: fail at once);
    `credentials` for TLS (tls_credentials(root_certs=, cert_chain=, private_key=): PEM paths or bytes;
    mutual TLS with a client certificate); `channel` to bring your own."""

    def __init__(
        self,
        target: str = "127.0.0.1:50051",
        *,
        api_key: str | None = None,
        timeout: float | None = 60.0,
        retry: RetryPolicy = DEFAULT_RETRY,
        credentials: grpc.ChannelCredentials | None = None,
        channel: grpc.Channel | None = None,
    ):
        self._channel = channel or _open_channel(grpc, target, credentials, retry)
        self._stub = encoderd_pb2_grpc.EncoderStub(self._channel)
        self._api_key = api_key
        self._timeout = timeout
        self._retry = retry

    def _invoke(self, rpc: str, request, convert, timeout: float | None):
        method = getattr(self._stub, rpc)
        response = call_with_retry(
            lambda t: method(request, timeout=t, metadata=_metadata(self._api_key)),
            self._retry,
            self._timeout if timeout is None else timeout,
        )
        return convert(response)

    def embed_stream(self, items: Iterable[tuple[str, str]], model: str = "", **options) -> Iterator[bulk.StreamResult]:
        """Bulk: (id, text) items in, a StreamResult per item out as batches finish (see bulk.embed_iterable)."""
        return bulk.embed_iterable(
            self._channel, items, model=model, api_key=self._api_key, progress=options.pop("progress", False), **options
        )

    def close(self) -> None:
        self._channel.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class AsyncEncoderClient(_Methods):
    """asyncio client over grpc.aio; create it inside a running event loop. Same methods, awaited."""

    def __init__(
        self,
        target: str = "127.0.0.1:50051",
        *,
        api_key: str | None = None,
        timeout: float | None = 60.0,
        retry: RetryPolicy = DEFAULT_RETRY,
        credentials: grpc.ChannelCredentials | None = None,
        channel: grpc.aio.Channel | None = None,
    ):
        self._channel = channel or _open_channel(grpc.aio, target, credentials, retry)
        self._stub = encoderd_pb2_grpc.EncoderStub(self._channel)
        self._api_key = api_key
        self._timeout = timeout
        self._retry = retry

    async def _invoke(self, rpc: str, request, convert, timeout: float | None):
        method = getattr(self._stub, rpc)
        response = await acall_with_retry(
            lambda t: method(request, timeout=t, metadata=_metadata(self._api_key)),
            self._retry,
            self._timeout if timeout is None else timeout,
        )
        return convert(response)

    def embed_stream(
        self, items: Iterable[tuple[str, str]], model: str = "", **options
    ) -> AsyncIterator[bulk.StreamResult]:
        """Bulk: `async for result in client.embed_stream(items)` (see bulk.aembed_iterable)."""
        return bulk.aembed_iterable(self._channel, items, model=model, api_key=self._api_key, **options)

    async def close(self) -> None:
        await self._channel.close()

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        await self.close()
