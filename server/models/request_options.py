"""A request's options, read once at the edge and checked here.

The Encoder service, EmbedStream and the Compat (REST) service each turn a request into
one of these frozen objects before any work, so every default (truncate, cut on the
right, the API key's priority, the model's own normalization) is decided in one place:

    EmbedOptions     embed, multi-modal, multi-vector, sparse, stream, OpenAI / Cohere / TEI
    RerankOptions    Rerank, MaxSim, Cohere / Infinity / TEI rerank
    ClassifyOptions  Classify, Infinity classify, TEI predict

The `from_*` parsers read the encoderd.v1 messages, which share field names; the Compat
routes, whose JSON shapes differ per API, build theirs with `for_call`.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from typing import Any, TypeVar

from ...v1 import encoderd_pb2 as pb
from ..base.errors import InvalidInput
from ..scheduling.scheduler import CALLER, DEFAULT_PRIORITY, Priority

SIDES: dict[int, str] = {
    pb.TRUNCATION_DIRECTION_UNSPECIFIED: "right",
    pb.TRUNCATION_DIRECTION_RIGHT: "right",
    pb.TRUNCATION_DIRECTION_LEFT: "left",
}
PRIORITIES: dict[int, Priority] = {pb.PRIORITY_INTERACTIVE: Priority.INTERACTIVE, pb.PRIORITY_BULK: Priority.BULK}
# OutputDtype -> a postprocess.QUANTIZERS name, or float32 (the values as floats).
OUTPUT_DTYPES: dict[int, str] = {
    pb.OUTPUT_DTYPE_UNSPECIFIED: "float32",
    pb.OUTPUT_DTYPE_FLOAT32: "float32",
    pb.OUTPUT_DTYPE_FLOAT16: "float16",
    pb.OUTPUT_DTYPE_INT8: "int8",
    pb.OUTPUT_DTYPE_UINT8: "uint8",
    pb.OUTPUT_DTYPE_BINARY: "binary",
    pb.OUTPUT_DTYPE_UBINARY: "ubinary",
}


def bind_key_priority(key: str, bulk_keys: Collection[str]) -> None:
    """At the start of every call (its task only): a --bulk-api-key's calls default to bulk."""
    DEFAULT_PRIORITY.set(Priority.BULK if key and key in bulk_keys else Priority.INTERACTIVE)


def bind_caller(key: str, peer: str) -> None:
    """At the start of every call (its task only): who it comes from, for the scheduler's turns
    between big requests (scheduler.CALLER): its API key (behind Envoy's pooled connections the
    only handle on a REST caller; a hash, the key itself is not kept), else its connection."""
    CALLER.set(("key", hash(key)) if key else ("peer", peer))


def key_priority() -> Priority:
    """The priority of a call that asks for none: its API key's (see bind_key_priority)."""
    return DEFAULT_PRIORITY.get()


_Options = TypeVar("_Options", bound="InputOptions")  # typing.Self needs Python 3.11


@dataclass(frozen=True, kw_only=True)
class InputOptions:
    """How any request's texts are cut and scheduled."""

    truncate: bool = True  # False: an over-long input is refused
    side: str = "right"  # which end an over-long input is cut from
    priority: Priority = Priority.INTERACTIVE

    @classmethod
    def for_call(cls: type[_Options], **fields: Any) -> _Options:
        """Options of a Compat (REST) call: its fields, scheduled at the API key's priority."""
        return cls(priority=key_priority(), **fields)


@dataclass(frozen=True, kw_only=True)
class EmbedOptions(InputOptions):
    prompt: str = ""
    prompt_name: str = ""
    normalize: bool | None = None  # None: the model's own default
    dimensions: int = 0  # 0: the model's full size
    dimensions_field: str = "dimensions"  # what the caller's API calls it, for errors
    output_dtype: str = "float32"

    def normalizes(self, model_default: bool) -> bool:
        return model_default if self.normalize is None else self.normalize


@dataclass(frozen=True, kw_only=True)
class RerankOptions(InputOptions):
    raw_scores: bool = False  # the logits, not the model's activation
    top_n: int = 0  # 0: every document
    return_documents: bool = False


@dataclass(frozen=True, kw_only=True)
class ClassifyOptions(InputOptions):
    raw_scores: bool = False


# ----------------------------------------------------------- encoderd.v1
def priority(field: int, default: Priority | None = None) -> Priority:
    """A message's `priority`, else `default` (EmbedStream's is bulk), else the API key's."""
    return PRIORITIES.get(field) or default or key_priority()


def _field(request, name: str, default):
    """A field's value, or `default` when the message lacks it or leaves it unset."""
    descriptor = request.DESCRIPTOR.fields_by_name.get(name)
    if descriptor is None or (descriptor.has_presence and not request.HasField(name)):
        return default
    return getattr(request, name)


def _inputs(request, default_priority: Priority | None) -> dict:
    return {
        "truncate": _field(request, "truncate", True),
        "side": SIDES.get(_field(request, "truncation_direction", 0), "right"),
        "priority": priority(_field(request, "priority", 0), default_priority),
    }


def from_embed(request, default_priority: Priority | None = None) -> EmbedOptions:
    """EmbedRequest, EmbedStreamRequest (bulk unless it says otherwise), EmbedMultimodalRequest,
    EmbedMultiVectorRequest, EmbedSparseRequest: whichever of these fields the message has."""
    dimensions = _field(request, "dimensions", 0)
    if dimensions < 0:
        raise InvalidInput(f"`dimensions` must be positive or 0 (the model's size), not {dimensions}")
    return EmbedOptions(
        **_inputs(request, default_priority),
        prompt=_field(request, "prompt", ""),
        prompt_name=_field(request, "prompt_name", ""),
        normalize=_field(request, "normalize", None),
        dimensions=dimensions,
        output_dtype=output_dtype(_field(request, "output_dtype", pb.OUTPUT_DTYPE_UNSPECIFIED)),
    )


def from_rerank(request) -> RerankOptions:
    """RerankRequest, MaxSimRequest."""
    return RerankOptions(
        **_inputs(request, None),
        raw_scores=_field(request, "raw_scores", False),
        top_n=top_n(request.top_n),
        return_documents=request.return_documents,
    )


def from_classify(request: pb.ClassifyRequest) -> ClassifyOptions:
    return ClassifyOptions(**_inputs(request, None), raw_scores=request.raw_scores)


def output_dtype(value: int) -> str:
    if value not in OUTPUT_DTYPES:
        raise InvalidInput(f"unknown output_dtype {value}")
    return OUTPUT_DTYPES[value]


def top_n(value: int) -> int:
    if value < 0:
        raise InvalidInput(f"`top_n` must be positive, not {value}")
    return value


# ------------------------------------------------------------- Compat
def positive(request, field: str) -> int:
    """An optional int field of a Compat request: 0 when absent, an error when given and < 1."""
    if not request.HasField(field):
        return 0
    value = getattr(request, field)
    if value < 1:
        raise InvalidInput(f"`{field}` must be a positive integer, not {value}")
    return value
