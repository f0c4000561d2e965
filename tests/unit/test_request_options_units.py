"""Issue 20: request options parsed in one place (server/models/request_options.py) and one model
resolver (server/models/model_resolver.py), on real proto messages."""

from __future__ import annotations

import contextlib
import contextvars
from types import SimpleNamespace

import pytest

from encoderd.server.base.errors import InvalidInput, ModelNotFound, Unavailable, WrongModelKind
from encoderd.server.models import model_resolver, request_options
from encoderd.server.models.model_resolver import resolve
from encoderd.server.scheduling.scheduler import Priority
from encoderd.v1 import encoderd_pb2 as pb
from encoderd.workers.contract.model_spec import MULTI_VECTOR_KINDS, ModelKind

EMBEDDERS = (ModelKind.EMBEDDING, ModelKind.CLIP, ModelKind.CLAP)


def in_call(function, *args, key: str = "", **kwargs):
    """Run `function` as inside one call of a server with the bulk key "ingest"."""

    def call():
        request_options.bind_key_priority(key, ("ingest",))
        return function(*args, **kwargs)

    return contextvars.copy_context().run(call)


EMBED_MESSAGES = (
    pb.EmbedRequest,
    pb.EmbedStreamRequest,
    pb.EmbedMultimodalRequest,
    pb.EmbedMultiVectorRequest,
    pb.EmbedSparseRequest,
)


@pytest.mark.parametrize("message", EMBED_MESSAGES)
def test_every_embed_message_has_the_same_defaults(message):
    options = in_call(request_options.from_embed, message())
    assert options == request_options.EmbedOptions()
    assert options.normalizes(True) and not options.normalizes(False)  # unset: the model's own default


def test_embed_options_are_read_from_the_message():
    request = pb.EmbedRequest(
        truncate=False,
        truncation_direction=pb.TRUNCATION_DIRECTION_LEFT,
        prompt="query: ",
        normalize=False,
        dimensions=8,
        output_dtype=pb.OUTPUT_DTYPE_INT8,
        priority=pb.PRIORITY_BULK,
    )
    assert in_call(request_options.from_embed, request) == request_options.EmbedOptions(
        truncate=False,
        side="left",
        priority=Priority.BULK,
        prompt="query: ",
        normalize=False,
        dimensions=8,
        output_dtype="int8",
    )


def test_the_stream_reads_its_truncation_direction():
    first = pb.EmbedStreamRequest(truncation_direction=pb.TRUNCATION_DIRECTION_LEFT)
    assert in_call(request_options.from_embed, first).side == "left"


@pytest.mark.parametrize(
    "field,key,default,want",
    [
        (pb.PRIORITY_UNSPECIFIED, "", None, Priority.INTERACTIVE),
        (pb.PRIORITY_UNSPECIFIED, "ingest", None, Priority.BULK),  # the bulk key's default
        (pb.PRIORITY_INTERACTIVE, "ingest", None, Priority.INTERACTIVE),  # the field wins
        (pb.PRIORITY_UNSPECIFIED, "", Priority.BULK, Priority.BULK),  # a stream's default
        (pb.PRIORITY_INTERACTIVE, "", Priority.BULK, Priority.INTERACTIVE),
    ],
)
def test_priority_is_the_field_else_the_call_default_else_the_key(field, key, default, want):
    assert in_call(request_options.priority, field, default, key=key) == want


def test_compat_options_take_the_key_priority():
    assert in_call(request_options.EmbedOptions.for_call, key="ingest").priority == Priority.BULK
    assert in_call(request_options.RerankOptions.for_call, key="other").priority == Priority.INTERACTIVE


@pytest.mark.parametrize(
    "parse,request_,message",
    [
        (request_options.from_embed, pb.EmbedRequest(dimensions=-1), "`dimensions` must be positive"),
        (request_options.from_embed, pb.EmbedRequest(output_dtype=99), "unknown output_dtype 99"),
        (request_options.from_rerank, pb.RerankRequest(top_n=-2), "`top_n` must be positive"),
    ],
)
def test_bad_options_are_refused_at_the_edge(parse, request_, message):
    with pytest.raises(InvalidInput, match=message):
        in_call(parse, request_)


# ----------------------------------------------------------------- resolver
def served(**kinds: ModelKind) -> dict:
    return {name: SimpleNamespace(spec=SimpleNamespace(name=name, kind=kind)) for name, kind in kinds.items()}


def resolved(models, name="", kinds=None, prefer=(), loading=()) -> str:
    return contextvars.copy_context().run(lambda: resolve(models, loading, name, kinds, prefer).spec.name)


def test_a_call_naming_no_model_gets_the_one_of_its_kind():
    models = served(minilm=ModelKind.EMBEDDING, reranker=ModelKind.RERANKER, colbert=ModelKind.COLBERT)
    assert resolved(models, kinds=(ModelKind.RERANKER,)) == "reranker"
    assert resolved(models, kinds=EMBEDDERS) == "minilm"
    assert resolved(models, kinds=(*EMBEDDERS, *MULTI_VECTOR_KINDS), prefer=(ModelKind.EMBEDDING,)) == "minilm"
    assert resolved(served(colbert=ModelKind.COLBERT), kinds=(*EMBEDDERS, *MULTI_VECTOR_KINDS)) == "colbert"
    assert resolved(models, name=model_resolver.INFINITY_NO_MODEL, kinds=(ModelKind.COLBERT,)) == "colbert"


def test_resolver_errors_say_what_is_needed_and_what_is_served():
    colbert_only = served(colbert=ModelKind.COLBERT)
    with pytest.raises(WrongModelKind, match=r"needs an embedding or clip or clap model, and none is served here"):
        resolved(colbert_only, kinds=EMBEDDERS)
    with pytest.raises(WrongModelKind, match=r"model 'colbert' is a colbert model; this call needs an embedding"):
        resolved(colbert_only, name="colbert", kinds=EMBEDDERS)
    with pytest.raises(ModelNotFound, match="model 'nope' is not served here; served models: colbert"):
        resolved(colbert_only, name="nope")
    with pytest.raises(InvalidInput, match="names no model and several fit: set `model` to one of a, b"):
        resolved(served(a=ModelKind.EMBEDDING, b=ModelKind.EMBEDDING), kinds=EMBEDDERS)
    with pytest.raises(Unavailable, match="'late' is loading"):
        resolved(colbert_only, kinds=EMBEDDERS, loading={"late"})


def test_the_metrics_label_is_the_resolved_model_or_a_bounded_stand_in():
    models = served(minilm=ModelKind.EMBEDDING)

    def label_after(name: str) -> str:
        model_resolver.RESOLVED.set("")
        with contextlib.suppress(ModelNotFound):
            resolve(models, (), name)
        return model_resolver.metrics_label(models, name)

    run = contextvars.copy_context().run
    assert run(label_after, "") == "minilm"
    assert run(label_after, "minilm") == "minilm"
    assert run(label_after, "no-such-model") == model_resolver.UNKNOWN_MODEL
