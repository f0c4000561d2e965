"""gRPC servicer: proto <-> registry calls, and errors -> status codes. Nothing else."""

from __future__ import annotations

import asyncio
import functools
import logging
import time

import grpc

from ...v1 import encoderd_pb2 as pb
from ...v1 import encoderd_pb2_grpc
from ...workers.contract import logs
from ..base import metrics, tracing
from ..base.errors import EncoderdError, InvalidInput, Overloaded, status_message
from ..models import model_resolver, multimodal, postprocess, request_options
from ..models.media import Content
from ..models.registry import ModelRegistry
from ..scheduling import timing
from ..scheduling.admission import CALL_DEADLINE
from .auth import presented_key
from .handlers import MalformedRequest
from .messages import with_embeddings
from .streaming import embed_stream

log = logging.getLogger("encoderd.service")

# Set by every Envoy config of encoderd's (gateway/request_id.yaml, deploy/envoy/front.yaml) on the
# calls it forwards: "I return your x-request-id to the caller myself".
PROXY_RETURNS_ID_KEY = "x-encoderd-proxy-returns-id"


class _Observed:
    """Around every call: request id, bulk-key priority, caller, trace span, error -> status, metrics.
    Entering gives the metadata that carries the request id back to the client, and whether the proxy
    in front returns it for us (`_proxy_returns_id`). A class rather than an asynccontextmanager: with
    an error thrown into the generator, a refused gRPC call (every call of a flood but a few) cost the
    frontend 230 us of CPU where it costs 195 now, grpc.aio's own work included (bench.gateway_cpu)."""

    __slots__ = (
        "context",
        "ended",
        "in_flight",
        "model_name",
        "name",
        "rid_metadata",
        "rpc_label",
        "scope",
        "service",
        "span",
        "started",
    )

    def __init__(self, service, name: str, model_name: str, context: grpc.aio.ServicerContext):
        self.service, self.name, self.model_name, self.context = service, name, model_name, context
        self.ended = False

    async def __aenter__(self) -> tuple[tuple[tuple[str, str], ...], bool]:
        self.started = time.perf_counter()
        context = self.context
        service = type(self.service).__name__.removesuffix("Service")
        self.rpc_label = f"{service}/{self.name}"  # Encoder/Rerank vs Compat/Rerank
        metadata = context.invocation_metadata()
        rid = logs.bind_request_id(metadata)
        key = presented_key(metadata)
        request_options.bind_key_priority(key, self.service.registry.config.bulk_api_keys)
        request_options.bind_caller(key, context.peer())
        remaining = context.time_remaining()  # admission refuses a call its deadline cannot wait for
        CALL_DEADLINE.set(None if remaining is None else time.monotonic() + remaining)
        self.rid_metadata = ((logs.REQUEST_ID_KEY, rid),)
        model_resolver.RESOLVED.set("")  # this call's task only; set when the call resolves its model
        self.in_flight = metrics.series(metrics.IN_FLIGHT, self.rpc_label)
        self.scope = tracing.rpc_span(self.rpc_label, metadata, {"encoderd.request_id": rid})
        self.span = self.scope.__enter__()
        self.in_flight.inc()
        return self.rid_metadata, _proxy_returns_id(metadata, rid)

    async def __aexit__(self, exc_type, exc, traceback) -> bool:
        """Counts the call and turns an error into its status (context.abort raises, ending the call);
        a cancellation (BaseException) goes on as it is."""
        raised: BaseException | None = exc
        try:
            if isinstance(exc, EncoderdError):
                self._end(exc.code)
                # errors: in the trailers, with the wait the server advises before a retry
                await self.context.abort(exc.code, status_message(str(exc)), self.rid_metadata + _retry_after(exc))
            elif isinstance(exc, Exception):
                log.error("%s failed", self.name, exc_info=(exc_type, exc, traceback))
                self._end(grpc.StatusCode.INTERNAL)
                message = f"internal error in {self.name}; see the server log"
                await self.context.abort(grpc.StatusCode.INTERNAL, message, self.rid_metadata)
            elif exc is not None:  # cancelled: the client's deadline passed, it hung up, or the server is stopping
                self._end(_why_it_ended(self.context, self.rpc_label))
        except BaseException as new:  # abort's own exception, which ends the call
            raised = new
            raise
        finally:
            self._end(grpc.StatusCode.OK)  # no-op where an error was counted
            self.scope.__exit__(type(raised) if raised else None, raised, raised.__traceback__ if raised else None)
        return False

    def _end(self, code: grpc.StatusCode) -> None:
        """Count the call (once). An error is counted before abort sends its status: a client that
        has its answer finds it in /metrics."""
        if self.ended:
            return
        self.ended = True
        self.in_flight.dec()
        elapsed = time.perf_counter() - self.started
        model = model_resolver.metrics_label(self.service.registry.models, self.model_name)
        if log.isEnabledFor(logging.DEBUG):  # an access log, for debugging only: it costs per call
            log.debug("%s model=%s code=%s %.1fms", self.rpc_label, model, code.name, elapsed * 1000)
        tracing.finish(self.span, code, model)
        metrics.series(metrics.REQUESTS, model, self.rpc_label, code.name).inc()
        metrics.series(metrics.REQUEST_SECONDS, model, self.rpc_label).observe(elapsed)


def _retry_after(exc: EncoderdError) -> tuple[tuple[str, str], ...]:
    """An overload's `retry-after` trailer (whole seconds): gRPC clients read it from the trailing
    metadata, and Envoy passes it on to REST clients as the Retry-After header (gateway/errors.lua)."""
    return (("retry-after", str(exc.retry_after)),) if isinstance(exc, Overloaded) else ()


# A client whose deadline passes cancels the call itself, by its own clock: the server's deadline is
# that plus the time the call took to arrive, so it hears the cancel a little before its own expiry.
DEADLINE_SLACK_S = 0.05


def _why_it_ended(context, rpc_label: str) -> grpc.StatusCode:
    """A call that ended without its answer: DEADLINE_EXCEEDED when its deadline had (all but) passed,
    else CANCELLED, logged in one line (a client that leaves is not our error: no traceback)."""
    remaining = context.time_remaining()
    if remaining is not None and remaining <= DEADLINE_SLACK_S:
        return grpc.StatusCode.DEADLINE_EXCEEDED
    log.warning(
        "%s: the call ended before its answer was sent (the client cancelled, disconnected "
        "or stopped reading, or the server is stopping)",
        rpc_label,
    )
    return grpc.StatusCode.CANCELLED


def _proxy_returns_id(metadata, rid: str) -> bool:
    """Whether the Envoy in front puts `rid` on the response itself. encoderd's Envoy configs mark
    each call they forward (PROXY_RETURNS_ID_KEY) and add the forwarded x-request-id to a response
    that has none; that is `rid` unless the caller's id was refused (logs.bind_request_id)."""
    marked = forwarded = False
    for key, value in metadata or ():
        marked = marked or key == PROXY_RETURNS_ID_KEY
        forwarded = forwarded or (key == logs.REQUEST_ID_KEY and value == rid)
    return marked and forwarded


def rpc(method):
    """A unary RPC, observed (see `_Observed`)."""

    @functools.wraps(method)
    async def wrapper(self, request, context: grpc.aio.ServicerContext):
        # A unary call's timing, and admission's calibration, count from here (a stream's messages
        # each queue long after the stream began: they count from their own submit).
        call_timing = timing.CallTiming(time.monotonic())
        timing.CALL_TIMING.set(call_timing)
        async with _Observed(self, method.__name__, getattr(request, "model", ""), context) as (rid_metadata, proxied):
            if isinstance(request, MalformedRequest):
                raise InvalidInput(request.reason)
            response = await method(self, request, context)
            # Where its time went: a trailer, as the headers must leave with the answer (below);
            # Envoy moves it into REST responses' headers (gateway/server_timing.lua).
            context.set_trailing_metadata(((timing.TRAILER, call_timing.header()),))
            # gRPC-Python sends our own headers in a batch of their own, ahead of the message: a
            # host that dies between the two leaves a proxy holding headers it has passed on, and
            # it can no longer retry the call elsewhere. Behind encoderd's Envoy the headers go out
            # with the message (Envoy adds the id); otherwise only now, once the answer is ready.
            if not proxied:
                await context.send_initial_metadata(rid_metadata)
            return response

    return wrapper


def stream_rpc(method):
    """A bidirectional-streaming RPC, observed from its first message (which names the model)
    to its last response. The method gets that first message apart from the rest."""

    @functools.wraps(method)
    async def wrapper(self, request_iterator, context: grpc.aio.ServicerContext):
        requests = request_iterator.__aiter__()
        first = await anext(requests, None)
        if first is None:  # the client closed without sending anything: nothing to answer
            return
        async with _Observed(self, method.__name__, getattr(first, "model", ""), context) as (rid_metadata, _):
            await context.send_initial_metadata(rid_metadata)  # a stream is never retried: the id at once
            async for response in method(self, first, requests, context):
                yield response
            if _client_left(context):  # its requests ended because it left: no answer reaches it
                raise asyncio.CancelledError

    return wrapper


def _client_left(context) -> bool:
    """A client that cancels (at its deadline, say) ends its request stream as if it had closed
    it, and the call may not say it is cancelled yet: a deadline all but passed tells."""
    remaining = context.time_remaining()
    return context.cancelled() or (remaining is not None and remaining <= DEADLINE_SLACK_S)


def _usage(tokens: int) -> pb.Usage:
    return pb.Usage(prompt_tokens=tokens, total_tokens=tokens)


def _media_content(modality: str, media: pb.Media) -> Content:
    return Content(modality, data=media.data) if media.HasField("data") else Content(modality, url=media.url)


def contents(messages, what: str = "inputs") -> list[Content]:
    """Proto Content messages -> the registry's; an unset oneof is a client error."""
    out = []
    for i, message in enumerate(messages):
        which = message.WhichOneof("content")
        if which is None:
            raise InvalidInput(f"{what}[{i}] sets none of text, image, audio")
        out.append(Content(text=message.text) if which == "text" else _media_content(which, getattr(message, which)))
    return out


class EncoderService(encoderd_pb2_grpc.EncoderServicer):
    def __init__(self, registry: ModelRegistry, draining: asyncio.Event | None = None):
        self.registry = registry
        self.draining = draining or asyncio.Event()  # set when the server stops taking calls

    @rpc
    async def Embed(self, request: pb.EmbedRequest, context) -> pb.EmbedResponse:
        options = request_options.from_embed(request)
        model, pooled, tokens = await self.registry.embed(request.model, request.inputs, options)
        vectors = postprocess.finish_requested(pooled, model.spec, options)
        response = pb.EmbedResponse(model=model.spec.name, usage=_usage(tokens))
        return with_embeddings(response, vectors, options.output_dtype)

    @stream_rpc
    async def EmbedStream(self, first, requests, context):
        """Bulk embedding over a bidirectional stream; see streaming.py."""
        async for response in embed_stream(self.registry, first, requests, self.draining):
            yield response

    @rpc
    async def Rerank(self, request: pb.RerankRequest, context) -> pb.RerankResponse:
        options = request_options.from_rerank(request)
        model, logits, tokens = await self.registry.score_pairs(
            request.model, request.query, request.documents, options
        )
        scores = postprocess.scores(logits, model.spec.score_activation, options.raw_scores)
        results = [
            pb.RerankResult(
                index=int(i),
                relevance_score=float(scores[i]),
                document=request.documents[i] if options.return_documents else "",
            )
            for i in postprocess.rank(scores, options.top_n)
        ]
        return pb.RerankResponse(model=model.spec.name, results=results, usage=_usage(tokens))

    @rpc
    async def Classify(self, request: pb.ClassifyRequest, context) -> pb.ClassifyResponse:
        options = request_options.from_classify(request)
        model, logits, tokens = await self.registry.classify(request.model, request.inputs, options)
        scores = postprocess.scores(logits, model.spec.score_activation, options.raw_scores)
        labels = model.spec.labels or tuple(f"LABEL_{i}" for i in range(scores.shape[1]))
        results = []
        for row in scores:
            order = postprocess.rank(row, 0)
            results.append(
                pb.Classification(labels=[pb.LabelScore(label=labels[j], score=float(row[j])) for j in order])
            )
        return pb.ClassifyResponse(model=model.spec.name, results=results, usage=_usage(tokens))

    @rpc
    async def Tokenize(self, request: pb.TokenizeRequest, context) -> pb.TokenizeResponse:
        model = self.registry.get(request.model)
        texts = self.registry.check_inputs(request.inputs)
        add_special = request.add_special_tokens if request.HasField("add_special_tokens") else True
        await self.registry.check_token_floor(model, texts)
        encodings = await model.tokenizer.tokenize(texts, add_special)
        self.registry.check_token_budget(0, sum(len(e.ids) for e in encodings))
        return pb.TokenizeResponse(
            model=model.spec.name,
            results=[
                pb.TokenizedInput(
                    ids=e.ids, tokens=e.tokens, offsets=[pb.TokenSpan(start=s, end=t) for s, t in e.offsets]
                )
                for e in encodings
            ],
        )

    @rpc
    async def EmbedMultimodal(self, request: pb.EmbedMultimodalRequest, context) -> pb.EmbedMultimodalResponse:
        options = request_options.from_embed(request)
        model, pooled, usage = await multimodal.embed_contents(
            self.registry, request.model, contents(request.inputs), options
        )
        vectors = postprocess.finish_requested(pooled, model.spec, options)
        response = pb.EmbedMultimodalResponse(model=model.spec.name, usage=_usage(usage))
        return with_embeddings(response, vectors, options.output_dtype)

    @rpc
    async def EmbedMultiVector(self, request: pb.EmbedMultiVectorRequest, context) -> pb.EmbedMultiVectorResponse:
        options = request_options.from_embed(request)
        model, rows, usage = await multimodal.embed_multivector(
            self.registry, request.model, contents(request.inputs), options
        )
        return pb.EmbedMultiVectorResponse(
            model=model.spec.name,
            dimensions=model.output_dim,
            usage=_usage(usage),
            embeddings=[pb.MultiVector(rows=len(r), values=r.reshape(-1).tolist()) for r in rows],
        )

    @rpc
    async def MaxSim(self, request: pb.MaxSimRequest, context) -> pb.MaxSimResponse:
        options = request_options.from_rerank(request)
        model, scores, usage = await multimodal.maxsim(
            self.registry,
            request.model,
            request.query,
            contents(request.documents, "documents"),
            options,
            query_prompt=request.query_prompt,
            document_prompt=request.document_prompt,
        )
        documents = request.documents
        results = [
            pb.RerankResult(
                index=int(i),
                relevance_score=float(scores[i]),
                document=documents[i].text if options.return_documents else "",
            )
            for i in postprocess.rank(scores, options.top_n)
        ]
        return pb.MaxSimResponse(model=model.spec.name, results=results, usage=_usage(usage))

    @rpc
    async def EmbedSparse(self, request: pb.EmbedSparseRequest, context) -> pb.EmbedSparseResponse:
        options = request_options.from_embed(request)
        model, vectors, usage = await multimodal.embed_sparse(
            self.registry,
            request.model,
            request.inputs,
            options,
            top_k=request.top_k,
            threshold=request.threshold,
        )
        return pb.EmbedSparseResponse(
            model=model.spec.name,
            dimensions=model.output_dim,
            usage=_usage(usage),
            embeddings=[pb.SparseEmbedding(indices=i.tolist(), values=v.tolist()) for i, v in vectors],
        )

    @rpc
    async def ListModels(self, request: pb.ListModelsRequest, context) -> pb.ListModelsResponse:
        loading = [pb.ModelInfo(id=name, status="loading") for name in sorted(self.registry.loading)]
        return pb.ListModelsResponse(models=[model_info(m) for m in self.registry.models.values()] + loading)


def model_info(model) -> pb.ModelInfo:
    replicas = [
        pb.ModelReplica(
            device=r.ready_info.device if r.ready_info else r.label.rpartition("@")[2],
            pid=r.pid or 0,
            restarts=r.restarts,
            status="ready" if r.ready else "unavailable",
        )
        for r in model.replicas
    ]
    return pb.ModelInfo(
        id=model.spec.name,
        kind=model.spec.kind.value,
        max_input_tokens=model.spec.max_length,
        dimensions=model.output_dim,
        engine=model.engine,
        device=",".join(sorted({r.device for r in replicas})),
        dtype=model.dtype,
        labels=list(model.spec.labels),
        status="ready" if model.ready else "unavailable",
        replicas=replicas,
        fidelity_status=model.fidelity_status,
        fidelity=[
            pb.FidelityFigure(metric=f.metric, value=f.value, bound=f.bound, passed=f.passed) for f in model.fidelity
        ],
    )
