"""Cohere's embed API (`POST /v1/embed`, `/v2/embed`) for the Compat service (server/rest.py).

`input_type` selects the model's sentence-transformers prompt of that name when it
has one (say a model whose prompts are {"search_query": "query: ", ...}); when it
has none, the texts are embedded as given and `meta.warnings` says so.
"""

from __future__ import annotations

import base64
import uuid

import numpy as np
from google.api import httpbody_pb2

from ..v1 import compat_pb2 as cpb
from ..workers.model_spec import ModelKind
from . import postprocess
from . import rest as compat
from .errors import InvalidInput
from .scheduler import DEFAULT_PRIORITY

INPUT_TYPES = ("search_document", "search_query", "classification", "clustering", "image")
EMBEDDING_TYPES = ("float", "int8", "uint8", "binary", "ubinary", "base64")
TRUNCATE = {"": ("right", True), "END": ("right", True), "START": ("left", True), "NONE": ("right", False)}


def texts_of(request: cpb.CohereEmbedRequest) -> list[str]:
    """`texts`, or v2's `inputs` of text content; images are not embedded here."""
    if request.images:
        raise InvalidInput("`images` are not supported on /v1/embed or /v2/embed; embed images through "
                           "/v1/encoderd/embed_multimodal with a clip model")
    if request.HasField("inputs"):
        if request.texts:
            raise InvalidInput("send `texts` or `inputs`, not both")
        return [_input_text(item, i) for i, item in enumerate(_list(request.inputs, "inputs"))]
    if not request.texts:
        raise InvalidInput("`texts` is required: a non-empty list of strings")
    return list(request.texts)


def _list(value, what: str):
    if value.WhichOneof("kind") != "list_value" or not value.list_value.values:
        raise InvalidInput(f"`{what}` must be a non-empty list")
    return value.list_value.values


def _input_text(item, index: int) -> str:
    """One v2 input, {"content": [{"type": "text", "text": ...}, ...]}: its text parts, joined."""
    fields = item.struct_value.fields if item.WhichOneof("kind") == "struct_value" else {}
    if "content" not in fields:
        raise InvalidInput(f"inputs[{index}] must be an object with a non-empty `content` list")
    return " ".join(_text_part(part, index) for part in _list(fields["content"], f"inputs[{index}].content"))


def _text_part(part, index: int) -> str:
    fields = part.struct_value.fields if part.WhichOneof("kind") == "struct_value" else {}
    kind, text = fields.get("type"), fields.get("text")
    if kind is None or kind.string_value != "text" or text is None or text.WhichOneof("kind") != "string_value":
        raise InvalidInput(f"inputs[{index}].content holds a part that is not "
                           f"{{\"type\": \"text\", \"text\": ...}}; image parts are not supported here")
    return text.string_value


def embedding_types(request: cpb.CohereEmbedRequest, default: tuple[str, ...]) -> tuple[str, ...]:
    types = tuple(dict.fromkeys(request.embedding_types)) or default
    unknown = [t for t in types if t not in EMBEDDING_TYPES]
    if unknown:
        raise InvalidInput(f"`embedding_types` may hold {', '.join(EMBEDDING_TYPES)}; not {', '.join(unknown)}")
    return types


def by_type(vectors: np.ndarray, types: tuple[str, ...]) -> dict:
    """Cohere's embeddings object: one list per requested type."""
    out = {}
    for kind in types:
        if kind == "float":
            out[kind] = vectors.tolist()
        elif kind == "base64":  # the float32 bytes, little-endian
            out[kind] = [base64.b64encode(row.astype("<f4").tobytes()).decode() for row in vectors]
        else:
            out[kind] = postprocess.quantize(vectors, kind).astype(np.int64).tolist()
    return out


async def embed(service, request: cpb.CohereEmbedRequest, version: str) -> httpbody_pb2.HttpBody:
    if request.input_type and request.input_type not in INPUT_TYPES:
        raise InvalidInput(f"`input_type` must be one of {', '.join(INPUT_TYPES)}, not {request.input_type!r}")
    if request.truncate.upper() not in TRUNCATE:
        raise InvalidInput(f"`truncate` must be NONE, START or END, not {request.truncate!r}")
    types = embedding_types(request, () if version == "1" else ("float",))
    texts = texts_of(request)
    side, truncate = TRUNCATE[request.truncate.upper()]
    name = service.model_name(request.model, ModelKind.EMBEDDING)
    model = service.engine.get(name, (ModelKind.EMBEDDING, ModelKind.CLIP, ModelKind.CLAP))
    _check_max_tokens(request, model.spec.max_length)
    warnings = []
    prompt_name = request.input_type if request.input_type in model.prompts else ""
    if request.input_type and not prompt_name:
        warnings.append(f"model {model.spec.name!r} has no prompt named {request.input_type!r}: "
                        f"the texts were embedded without one")
    model, pooled, tokens = await service.engine.embed(model.spec.name, texts, truncate=truncate, side=side,
                                                       prompt_name=prompt_name, priority=DEFAULT_PRIORITY.get())
    dimensions = compat._positive(request, "output_dimension")
    vectors = postprocess.finish_embeddings(pooled, normalize=model.spec.normalize, dimensions=dimensions)
    meta = {"api_version": {"version": version}, "billed_units": {"input_tokens": tokens}}
    if warnings:
        meta["warnings"] = warnings
    body = {"id": str(uuid.uuid4()), "texts": texts, "meta": meta}
    if types:
        body.update(response_type="embeddings_by_type", embeddings=by_type(vectors, types))
    else:
        body.update(response_type="embeddings_floats", embeddings=vectors.tolist())
    return compat._json(body)


def _check_max_tokens(request: cpb.CohereEmbedRequest, model_max: int) -> None:
    """v2's `max_tokens`: honoured when it is at least the model's own maximum (inputs are cut there)."""
    max_tokens = compat._positive(request, "max_tokens")
    if max_tokens and max_tokens < model_max:
        raise InvalidInput(f"`max_tokens` below the model's maximum ({model_max}) is not supported; "
                           f"inputs are cut at {model_max} tokens")
