"""gRPC servicer: proto <-> engine calls, and errors -> status codes. Nothing else."""

from __future__ import annotations

import functools
import logging
import time

import grpc

from ..v1 import encoderd_pb2 as pb
from ..v1 import encoderd_pb2_grpc
from . import metrics, postprocess
from .engine import Engine
from .errors import EncoderdError

log = logging.getLogger("encoderd.service")

_SIDES = {pb.TRUNCATION_DIRECTION_UNSPECIFIED: "right", pb.TRUNCATION_DIRECTION_RIGHT: "right",
          pb.TRUNCATION_DIRECTION_LEFT: "left"}


def rpc(method):
    """Map EncoderdError to its status; count and time every call."""
    name = method.__name__

    @functools.wraps(method)
    async def wrapper(self, request, context: grpc.aio.ServicerContext):
        started = time.perf_counter()
        model = getattr(request, "model", "")
        code = grpc.StatusCode.OK
        try:
            return await method(self, request, context)
        except EncoderdError as exc:
            code = exc.code
            await context.abort(exc.code, str(exc))
        except Exception:
            code = grpc.StatusCode.INTERNAL
            log.exception("%s failed", name)
            await context.abort(grpc.StatusCode.INTERNAL, f"internal error in {name}; see the server log")
        finally:
            metrics.REQUESTS.labels(model, name, code.name).inc()
            metrics.REQUEST_SECONDS.labels(model, name).observe(time.perf_counter() - started)

    return wrapper


def _usage(tokens: int) -> pb.Usage:
    return pb.Usage(prompt_tokens=tokens, total_tokens=tokens)


class EncoderService(encoderd_pb2_grpc.EncoderServicer):
    def __init__(self, engine: Engine):
        self.engine = engine

    @rpc
    async def Embed(self, request: pb.EmbedRequest, context) -> pb.EmbedResponse:
        truncate = request.truncate if request.HasField("truncate") else True
        model, pooled, tokens = await self.engine.embed(
            request.model, request.inputs, truncate=truncate, side=_SIDES.get(request.truncation_direction, "right"),
            prompt=request.prompt)
        normalize = request.normalize if request.HasField("normalize") else model.spec.normalize
        vectors = postprocess.finish_embeddings(pooled, normalize=normalize, dimensions=request.dimensions)
        return pb.EmbedResponse(model=model.spec.name, usage=_usage(tokens),
                                embeddings=[pb.Embedding(values=v) for v in vectors.tolist()])

    @rpc
    async def Rerank(self, request: pb.RerankRequest, context) -> pb.RerankResponse:
        truncate = request.truncate if request.HasField("truncate") else True
        model, logits, tokens = await self.engine.score_pairs(request.model, request.query, request.documents,
                                                              truncate=truncate)
        scores = logits if request.raw_scores else postprocess.sigmoid(logits)
        results = [pb.RerankResult(index=int(i), relevance_score=float(scores[i]),
                                   document=request.documents[i] if request.return_documents else "")
                   for i in postprocess.rank(scores, request.top_n)]
        return pb.RerankResponse(model=model.spec.name, results=results, usage=_usage(tokens))

    @rpc
    async def Classify(self, request: pb.ClassifyRequest, context) -> pb.ClassifyResponse:
        truncate = request.truncate if request.HasField("truncate") else True
        model, logits, tokens = await self.engine.classify(request.model, request.inputs, truncate=truncate)
        scores = logits if request.raw_scores else postprocess.softmax(logits)
        labels = model.spec.labels or tuple(f"LABEL_{i}" for i in range(scores.shape[1]))
        results = []
        for row in scores:
            order = postprocess.rank(row, 0)
            results.append(pb.Classification(labels=[pb.LabelScore(label=labels[j], score=float(row[j])) for j in order]))
        return pb.ClassifyResponse(model=model.spec.name, results=results, usage=_usage(tokens))

    @rpc
    async def Tokenize(self, request: pb.TokenizeRequest, context) -> pb.TokenizeResponse:
        model = self.engine.get(request.model)
        texts = self.engine.check_inputs(request.inputs)
        add_special = request.add_special_tokens if request.HasField("add_special_tokens") else True
        encodings = await model.tokenizer.tokenize(texts, add_special)
        return pb.TokenizeResponse(model=model.spec.name, results=[
            pb.TokenizedInput(ids=e.ids, tokens=e.tokens, offsets=[pb.TokenSpan(start=s, end=t) for s, t in e.offsets])
            for e in encodings])

    @rpc
    async def ListModels(self, request: pb.ListModelsRequest, context) -> pb.ListModelsResponse:
        return pb.ListModelsResponse(models=[model_info(m) for m in self.engine.models.values()])


def model_info(model) -> pb.ModelInfo:
    return pb.ModelInfo(
        id=model.spec.name, kind=model.spec.kind.value, max_input_tokens=model.spec.max_length,
        dimensions=model.output_dim, engine=model.engine, device=model.device, dtype=model.dtype,
        labels=list(model.spec.labels), status="ready" if model.worker.ready else "unavailable",
        replicas=[pb.ModelReplica(device=model.device, pid=model.worker.pid or 0, restarts=model.worker.restarts,
                                  status="ready" if model.worker.ready else "unavailable")])
