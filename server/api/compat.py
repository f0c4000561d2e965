"""The Compat gRPC service: what Envoy transcodes the OpenAI / Cohere REST API to.

Each RPC answers a google.api.HttpBody whose JSON is rendered here, so the bytes
are exactly what the official SDKs parse (snake_case, base64 or float lists) and
Envoy never prints floats itself (it is ~10x slower at it; see bench/rest.py).
Failures raise EncoderdError like the Encoder service; gateway/errors.lua turns
the resulting status into an OpenAI-shaped error body.

The service answers OpenAI, Infinity and Cohere rerank here and hands Cohere embed and TEI's
routes to cohere_embed.py and tei.py; what the dialects share (reading inputs, rendering JSON)
is in rest.py, below all three.
"""

from __future__ import annotations

import time
import uuid

from google.api import httpbody_pb2
from google.protobuf import json_format, struct_pb2
from grpc_health.v1 import health_pb2

from ...v1 import compat_pb2 as cpb
from ...v1 import compat_pb2_grpc
from ...workers.contract.model_spec import MULTI_VECTOR_KINDS, ModelKind, modalities
from ..base import metrics
from ..base.errors import InvalidInput, Unavailable, echo
from ..models import multimodal, postprocess
from ..models.media import Content
from ..models.multimodal import SINGLE_VECTOR_KINDS
from ..models.registry import ModelRegistry
from ..models.request_options import ClassifyOptions, EmbedOptions, RerankOptions, positive
from ..models.served import ServedModel
from ..scheduling.scheduler import Priority
from . import cohere_embed, openapi, tei
from .messages import Serialized
from .rest import (
    embedding_inputs,
    input_count,
    json_body,
    media_inputs,
    reject_set,
    render_embeddings,
    render_multivectors,
    rerank_documents,
    string_list,
    usage,
)
from .service import model_info, rpc

ENCODING_FORMATS = ("float", "base64")
MODALITIES = ("text", "image", "audio")


# Kinds /embeddings serves: one vector per input, or (colbert, colpali, clip_patches) one per token or patch.
EMBEDDINGS_KINDS = (*SINGLE_VECTOR_KINDS, *MULTI_VECTOR_KINDS)


# ------------------------------------------------------------------ requests
def _preferred_kinds(modality: str) -> tuple[ModelKind, ...]:
    """Which model a call naming none means: the embedding model for text (not a clip or colbert
    served beside it), else the model that takes the modality."""
    if modality == "text":
        return (ModelKind.EMBEDDING,)
    return tuple(kind for kind in EMBEDDINGS_KINDS if modality in modalities(kind))


def _check_document_limits(request: cpb.CohereRerankRequest) -> None:
    """Cohere's `max_tokens_per_doc` (v2) and `max_chunks_per_doc` (v1): positive when given."""
    for field in ("max_tokens_per_doc", "max_chunks_per_doc"):
        if getattr(request, field) < 0:
            raise InvalidInput(f"`{field}` must be a positive integer, not {getattr(request, field)}")


async def cut_documents(registry: ModelRegistry, model: ServedModel, texts: list[str], max_tokens: int) -> list[str]:
    """Cohere's `max_tokens_per_doc`: each document cut to its first `max_tokens` tokens of the
    model's tokenizer (special tokens not counted), at the end of the last one kept in the original
    text, so the pair is scored on text the document holds (no decode round trip). A limit at or
    above the model's maximum changes nothing: each pair is cut there anyway (one chunk a document)."""
    if not max_tokens or max_tokens >= model.spec.max_length:
        return texts
    texts = registry.check_inputs(texts, "documents")  # bounded before any tokenizing
    encodings = await model.tokenizer.tokenize(texts, add_special_tokens=False)
    return [
        text if len(encoding.offsets) <= max_tokens else text[: encoding.offsets[max_tokens - 1][1]]
        for text, encoding in zip(texts, encodings, strict=True)
    ]


# ----------------------------------------------------------------- responses
def _infinity_id() -> dict:
    return {"id": str(uuid.uuid4()), "created": int(time.time())}


def openai_model(model: ServedModel) -> dict:
    info = json_format.MessageToDict(
        model_info(model), preserving_proto_field_name=True, always_print_fields_with_no_presence=True
    )
    return {"id": info.pop("id"), "object": "model", "created": 0, "owned_by": "encoderd", **info}


# Infinity's names for what a model can do, by kind.
INFINITY_CAPABILITIES = {
    ModelKind.EMBEDDING: ["embed"],
    ModelKind.RERANKER: ["rerank"],
    ModelKind.CLASSIFIER: ["classify"],
    ModelKind.CLIP: ["embed", "image_embed"],
    ModelKind.CLAP: ["embed", "audio_embed"],
    ModelKind.COLBERT: ["embed"],
    ModelKind.COLPALI: ["embed", "image_embed"],
    ModelKind.CLIP_PATCHES: ["embed", "image_embed"],
    ModelKind.SPARSE: [],
}


def infinity_model(model: ServedModel) -> dict:
    """openai_model plus Infinity's `stats`, `backend` and `capabilities`. `owned_by` is
    "infinity" because Infinity's client parses it as an enum of that one value."""
    scheduler = model.scheduler
    stats = {
        "queue_fraction": scheduler.queued / max(scheduler.max_queued, 1),
        "queue_absolute": scheduler.queued,
        "results_pending": sum(load.batches for load in scheduler.load.values()),
        "batch_size": scheduler.limits[Priority.INTERACTIVE].max_batch_size,
    }
    return {
        **openai_model(model),
        "owned_by": "infinity",
        "stats": stats,
        "backend": model.engine,
        "capabilities": INFINITY_CAPABILITIES.get(model.spec.kind, []),
    }


# ------------------------------------------------------------------- service
class CompatService(compat_pb2_grpc.CompatServicer):
    def __init__(self, registry: ModelRegistry, health):
        self.registry = registry
        self.health = health  # grpc_health's servicer: /health reports its overall status

    @rpc
    async def CreateEmbeddings(self, request: cpb.OpenAIEmbeddingsRequest, context) -> Serialized:
        return await self._embeddings(request, request.modality or "text")

    @rpc
    async def CreateRootEmbeddings(self, request: cpb.OpenAIEmbeddingsRequest, context) -> Serialized:
        return await self._embeddings(request, request.modality or "text", zero_is_full=True)

    @rpc
    async def CreateImageEmbeddings(self, request: cpb.OpenAIEmbeddingsRequest, context) -> Serialized:
        return await self._embeddings(request, "image", zero_is_full=True)

    @rpc
    async def CreateAudioEmbeddings(self, request: cpb.OpenAIEmbeddingsRequest, context) -> Serialized:
        return await self._embeddings(request, "audio", zero_is_full=True)

    async def _embeddings(
        self, request: cpb.OpenAIEmbeddingsRequest, modality: str, zero_is_full: bool = False
    ) -> Serialized:
        encoding_format = request.encoding_format or "float"
        if encoding_format not in ENCODING_FORMATS:
            raise InvalidInput(f'`encoding_format` must be "float" or "base64", not {echo(encoding_format)}')
        if modality not in MODALITIES:
            raise InvalidInput(f"`modality` must be one of {', '.join(MODALITIES)}, not {echo(modality)}")
        # Infinity reads `dimensions: 0` as full size (its client sends it on every call); OpenAI's
        # API has no such value.
        options = EmbedOptions.for_call(
            dimensions=0 if zero_is_full and request.dimensions == 0 else positive(request, "dimensions")
        )
        model = self.registry.get(request.model, EMBEDDINGS_KINDS, prefer=_preferred_kinds(modality))
        # Under a flood, refused before its inputs are read (as compute.run refuses a gRPC call
        # before validating them): walking 32 JSON strings cost a REST refusal more than the check.
        if count := input_count(request.input):
            model.scheduler.refuse_if_full(count, options.priority)
        if model.spec.kind in MULTI_VECTOR_KINDS:
            return await self._multivectors(model, request, modality, encoding_format, options)
        if modality != "text":
            inputs = media_inputs(request.input, modality)
            model, pooled, tokens = await multimodal.embed_contents(self.registry, model.spec.name, inputs, options)
        else:
            model, pooled, tokens = await self._embed_texts(model.spec.name, request.input, options)
        vectors = postprocess.finish_requested(pooled, model.spec, options)
        return await render_embeddings(model.spec.name, vectors, encoding_format, tokens)

    async def _embed_texts(self, name: str, value: struct_pb2.Value, options: EmbedOptions):
        """OpenAI's `input`: texts, or token ids."""
        texts, token_ids = embedding_inputs(value)
        if texts is not None:
            return await self.registry.embed(name, texts, options)
        return await self.registry.embed_ids(name, token_ids, options)

    async def _multivectors(
        self, model: ServedModel, request, modality: str, encoding_format: str, options
    ) -> Serialized:
        """A multi-vector model (colbert, colpali, clip_patches) on /embeddings: per input, its rows."""
        if options.dimensions:
            raise InvalidInput("`dimensions` does not apply to multi-vector models")
        if modality == "text":
            texts, _token_ids = embedding_inputs(request.input)
            if texts is None:
                raise InvalidInput("multi-vector models take text, not token ids")
            inputs = [Content(text=t) for t in texts]
        else:
            inputs = media_inputs(request.input, modality)
        model, rows, tokens = await multimodal.embed_multivector(self.registry, model.spec.name, inputs, options)
        return await render_multivectors(model.spec.name, rows, encoding_format, tokens)

    async def rerank_scores(self, name: str, query: str, documents: list[str], options: RerankOptions):
        """(model, scores, tokens): a cross-encoder's scores (its activation), or its logits when asked."""
        model, logits, tokens = await self.registry.score_pairs(name, query, documents, options)
        return model, postprocess.scores(logits, model.spec.score_activation, options.raw_scores), tokens

    @rpc
    async def Rerank(self, request: cpb.CohereRerankRequest, context) -> httpbody_pb2.HttpBody:
        return await self._cohere_rerank(request, "1")

    @rpc
    async def RerankV2(self, request: cpb.CohereRerankRequest, context) -> httpbody_pb2.HttpBody:
        return await self._cohere_rerank(request, "2")

    async def _cohere_rerank(self, request: cpb.CohereRerankRequest, version: str) -> httpbody_pb2.HttpBody:
        options = RerankOptions.for_call(
            raw_scores=request.raw_scores, top_n=positive(request, "top_n"), return_documents=request.return_documents
        )
        texts, documents = rerank_documents(request.documents, tuple(request.rank_fields))
        _check_document_limits(request)
        served = self.registry.get(request.model, ModelKind.RERANKER)
        texts = await cut_documents(self.registry, served, texts, request.max_tokens_per_doc)
        model, scores, tokens = await self.rerank_scores(request.model, request.query, texts, options)
        results = []
        for i in postprocess.rank(scores, options.top_n).tolist():
            result = {"index": i, "relevance_score": float(scores[i])}
            if options.return_documents:
                result["document"] = documents[i]  # every field of an object document, as Cohere v1 returns
            results.append(result)
        return json_body(
            {
                "id": str(uuid.uuid4()),
                "results": results,
                "model": model.spec.name,
                "usage": usage(tokens),
                "meta": {"api_version": {"version": version}, "billed_units": {"search_units": 1}},
            }
        )

    @rpc
    async def RootRerank(self, request: cpb.RootRerankRequest, context) -> httpbody_pb2.HttpBody:
        has_documents = request.HasField("documents")
        if has_documents == bool(request.texts):
            raise InvalidInput("send `documents` (Infinity's /rerank) or `texts` (TEI's /rerank), exactly one of them")
        if has_documents:
            return await self._infinity_rerank(request)
        return await tei.rerank(self, request)

    async def _infinity_rerank(self, request: cpb.RootRerankRequest) -> httpbody_pb2.HttpBody:
        reject_set(request, ("return_text", "truncate", "truncation_direction"), "with `documents` (Infinity)")
        options = RerankOptions.for_call(
            raw_scores=request.raw_scores, top_n=positive(request, "top_n"), return_documents=request.return_documents
        )
        documents, _ = rerank_documents(request.documents)
        model, scores, tokens = await self.rerank_scores(request.model, request.query, documents, options)
        results = []
        for i in postprocess.rank(scores, options.top_n).tolist():
            result = {"relevance_score": float(scores[i]), "index": i}
            if options.return_documents:
                result["document"] = documents[i]  # Infinity's shape: the string itself
            results.append(result)
        return json_body(
            {
                "object": "rerank",
                "results": results,
                "model": model.spec.name,
                "usage": usage(tokens),
                **_infinity_id(),
            }
        )

    @rpc
    async def InfinityClassify(self, request: cpb.InfinityClassifyRequest, context) -> httpbody_pb2.HttpBody:
        texts = string_list(request.input, "input")
        options = ClassifyOptions.for_call(raw_scores=request.raw_scores)
        model, scores, tokens = await self.classifications(request.model, texts, options)
        return json_body(
            {"object": "classify", "data": scores, "model": model.spec.name, "usage": usage(tokens), **_infinity_id()}
        )

    async def classifications(
        self,
        name: str,
        texts: list[str],
        options: ClassifyOptions,
        kinds: tuple[ModelKind, ...] = (ModelKind.CLASSIFIER,),
    ) -> tuple[ServedModel, list[list[dict]], int]:
        """Per input, every label with its score ({"score", "label"}), best first."""
        model, logits, tokens = await self.registry.classify(name, texts, options, kinds)
        scores = postprocess.scores(logits, model.spec.score_activation, options.raw_scores)
        labels = model.spec.labels or tuple(f"LABEL_{i}" for i in range(scores.shape[1]))
        return (
            model,
            [[{"score": float(row[j]), "label": labels[j]} for j in postprocess.rank(row, 0)] for row in scores],
            tokens,
        )

    # Cohere embed: server/api/cohere_embed.py.
    @rpc
    async def CohereEmbedV1(self, request: cpb.CohereEmbedRequest, context) -> Serialized:
        return await cohere_embed.embed(self, request, "1")

    @rpc
    async def CohereEmbedV2(self, request: cpb.CohereEmbedRequest, context) -> Serialized:
        return await cohere_embed.embed(self, request, "2")

    # TEI's routes: server/api/tei.py.
    @rpc
    async def TeiEmbed(self, request: cpb.TeiEmbedRequest, context) -> Serialized:
        return await tei.embed(self, request)

    @rpc
    async def TeiEmbedAll(self, request: cpb.TeiEmbedRequest, context) -> Serialized:
        return await tei.embed_all(self, request)

    @rpc
    async def TeiEmbedSparse(self, request: cpb.TeiEmbedRequest, context) -> httpbody_pb2.HttpBody:
        return await tei.embed_sparse(self, request)

    @rpc
    async def TeiPredict(self, request: cpb.TeiPredictRequest, context) -> httpbody_pb2.HttpBody:
        return await tei.predict(self, request)

    @rpc
    async def TeiSimilarity(self, request: cpb.TeiSimilarityRequest, context) -> httpbody_pb2.HttpBody:
        return await tei.similarity(self, request)

    @rpc
    async def TeiTokenize(self, request: cpb.TeiTokenizeRequest, context) -> httpbody_pb2.HttpBody:
        return await tei.tokenize(self, request)

    @rpc
    async def TeiDecode(self, request: cpb.TeiDecodeRequest, context) -> httpbody_pb2.HttpBody:
        return await tei.decode(self, request)

    @rpc
    async def TeiRoot(self, request: cpb.TeiRootRequest, context) -> httpbody_pb2.HttpBody:
        return await tei.root(self, request)

    @rpc
    async def TeiInfo(self, request: cpb.TeiInfoRequest, context) -> httpbody_pb2.HttpBody:
        return await tei.info(self, request)

    @rpc
    async def ListModels(self, request, context) -> httpbody_pb2.HttpBody:
        loading = [
            {"id": name, "object": "model", "created": 0, "owned_by": "encoderd", "status": "loading"}
            for name in sorted(self.registry.loading)
        ]
        return json_body({"object": "list", "data": [openai_model(m) for m in self.registry.models.values()] + loading})

    @rpc
    async def ListRootModels(self, request, context) -> httpbody_pb2.HttpBody:
        return json_body({"object": "list", "data": [infinity_model(m) for m in self.registry.models.values()]})

    @rpc
    async def GetModel(self, request: cpb.GetModelRequest, context) -> httpbody_pb2.HttpBody:
        return json_body(openai_model(self.registry.get(request.id)))

    @rpc
    async def GetOpenApi(self, request, context) -> httpbody_pb2.HttpBody:
        return json_body(openapi.document())

    @rpc
    async def GetMetrics(self, request, context) -> httpbody_pb2.HttpBody:
        """What --metrics-port serves, on the REST port (Envoy passes the scraper's Accept header on)."""
        accept = next((value for key, value in context.invocation_metadata() or () if key == "accept"), "")
        content_type, body = metrics.exposition(accept)
        return httpbody_pb2.HttpBody(content_type=content_type, data=body)

    @rpc
    async def Health(self, request, context) -> httpbody_pb2.HttpBody:
        status = (await self.health.Check(health_pb2.HealthCheckRequest(service=""), context)).status
        if status != health_pb2.HealthCheckResponse.SERVING:
            raise Unavailable("encoderd is not serving: models are loading or the server is draining")
        models = {name: "ready" if m.ready else "unavailable" for name, m in self.registry.models.items()}
        # `unix`: the server's clock, which Infinity's /health answers with.
        return json_body({"status": "serving", "models": models, "unix": time.time()})
