"""Cohere's embed API (`POST /v1/embed`, `/v2/embed`) for the Compat service (server/api/compat.py).

`input_type` selects the model's sentence-transformers prompt of that name when it
has one (say a model whose prompts are {"search_query": "query: ", ...}); when it
has none, the texts are embedded as given and `meta.warnings` says so.

Images (v1/v2 `images`, v2 `inputs` with an `image_url` part) go to a model that
embeds images (clip), one vector per image. Cohere's v4 models fuse the text and
image parts of one input into one vector; no model here does, so such an input is
refused rather than answered with something else.
"""

from __future__ import annotations

import uuid
from typing import Any

import numpy as np

from ...v1 import compat_pb2 as cpb
from ...workers.contract.model_spec import ModelKind
from ..base.errors import InvalidInput, echo
from ..models import multimodal, postprocess
from ..models.media import Content
from ..models.multimodal import SINGLE_VECTOR_KINDS
from ..models.request_options import EmbedOptions, positive
from .messages import Serialized
from .rest import base64_rows, float_rows, json_body_with, json_list, json_rows

INPUT_TYPES = ("search_document", "search_query", "classification", "clustering", "image")
EMBEDDING_TYPES = ("float", "int8", "uint8", "binary", "ubinary", "base64")
TRUNCATE = {"": ("right", True), "END": ("right", True), "START": ("left", True), "NONE": ("right", False)}


def contents_of(request: cpb.CohereEmbedRequest) -> list[Content]:
    """The inputs in order: `texts`, `images` (data URIs), or v2's `inputs` (one text or one image each)."""
    given = [f"`{f}`" for f in ("texts", "images") if getattr(request, f)] + (
        ["`inputs`"] if request.HasField("inputs") else []
    )
    if len(given) > 1:
        raise InvalidInput(f"send one of `texts`, `images` or `inputs`, not {' and '.join(given)}")
    if request.images:
        return [Content("image", url=uri) for uri in request.images]
    if request.HasField("inputs"):
        return [_input_content(item, i) for i, item in enumerate(_list(request.inputs, "inputs"))]
    if not request.texts:
        raise InvalidInput("`texts` is required: a non-empty list of strings")
    return [Content(text=t) for t in request.texts]


def _list(value, what: str):
    if value.WhichOneof("kind") != "list_value" or not value.list_value.values:
        raise InvalidInput(f"`{what}` must be a non-empty list")
    return value.list_value.values


def _input_content(item, index: int) -> Content:
    """One v2 input, {"content": [parts]}: its text parts joined, or its one image part."""
    fields = item.struct_value.fields if item.WhichOneof("kind") == "struct_value" else {}
    if "content" not in fields:
        raise InvalidInput(f"inputs[{index}] must be an object with a non-empty `content` list")
    parts = [_part(part, index) for part in _list(fields["content"], f"inputs[{index}].content")]
    images = [value for kind, value in parts if kind == "image"]
    if not images:
        return Content(text=" ".join(value for _, value in parts))
    if len(parts) > 1:
        raise InvalidInput(
            f"inputs[{index}] holds an image with other parts: one vector for text and image "
            "together (Cohere's v4 fused embedding) is not something the models here compute; "
            "send each text and each image as an input of its own"
        )
    return Content("image", url=images[0])


def _part(part, index: int) -> tuple[str, str]:
    """("text", text) or ("image", url) of one content part."""
    fields = part.struct_value.fields if part.WhichOneof("kind") == "struct_value" else {}
    kind = fields["type"].string_value if "type" in fields else ""
    if kind == "text" and "text" in fields and fields["text"].WhichOneof("kind") == "string_value":
        return "text", fields["text"].string_value
    if kind == "image_url" and "image_url" in fields:
        image = fields["image_url"]
        url = (
            image.string_value
            if image.WhichOneof("kind") == "string_value"
            else image.struct_value.fields["url"].string_value
            if image.WhichOneof("kind") == "struct_value" and "url" in image.struct_value.fields
            else ""
        )
        if url:
            return "image", url
    raise InvalidInput(
        f'inputs[{index}].content holds a part that is neither {{"type": "text", "text": ...}} '
        f'nor {{"type": "image_url", "image_url": {{"url": "data:..."}}}}'
    )


def embedding_types(request: cpb.CohereEmbedRequest, default: tuple[str, ...]) -> tuple[str, ...]:
    types = tuple(dict.fromkeys(request.embedding_types)) or default
    unknown = [t for t in types if t not in EMBEDDING_TYPES]
    if unknown:
        raise InvalidInput(f"`embedding_types` may hold {', '.join(EMBEDDING_TYPES)}; not {', '.join(unknown)}")
    return types


async def by_type(model: str, vectors: np.ndarray, types: tuple[str, ...]) -> list[bytes]:
    """Cohere's embeddings object, as pieces of JSON: one list per requested type (rendered a slice
    of rows per turn of the event loop, as OpenAI's: rest.json_rows)."""
    pieces = [b"{"]
    for n, kind in enumerate(types):
        if kind == "float":
            rows = await float_rows(model, vectors)
        elif kind == "base64":  # the float32 bytes, little-endian
            rows = base64_rows(vectors)
        else:
            rows = await json_rows(postprocess.quantize(vectors, kind))
        pieces += [b'%s"%s":' % (b"," if n else b"", kind.encode()), *json_list(rows)]
    return [*pieces, b"}"]


async def embed(service, request: cpb.CohereEmbedRequest, version: str) -> Serialized:
    if request.input_type and request.input_type not in INPUT_TYPES:
        raise InvalidInput(f"`input_type` must be one of {', '.join(INPUT_TYPES)}, not {echo(request.input_type)}")
    if request.truncate.upper() not in TRUNCATE:
        raise InvalidInput(f"`truncate` must be NONE, START or END, not {echo(request.truncate)}")
    types = embedding_types(request, () if version == "1" else ("float",))
    contents = contents_of(request)
    texts = [c.text for c in contents if c.modality == "text"]
    n_images = len(contents) - len(texts)
    side, truncate = TRUNCATE[request.truncate.upper()]
    model = service.registry.get(request.model, SINGLE_VECTOR_KINDS, prefer=(ModelKind.EMBEDDING,))
    _check_max_tokens(request, model.spec.max_length)
    warnings = []
    prompt_name = request.input_type if request.input_type in model.prompts else ""
    if request.input_type and not prompt_name and texts:
        warnings.append(
            f"model {model.spec.name!r} has no prompt named {echo(request.input_type)}: "
            "the texts were embedded without one"
        )
    options = EmbedOptions.for_call(
        truncate=truncate,
        side=side,
        prompt_name=prompt_name,
        dimensions=positive(request, "output_dimension"),
        dimensions_field="output_dimension",
    )
    if n_images:
        model, pooled, tokens = await _embed_media(service, model, contents, options)
    else:
        model, pooled, tokens = await service.registry.embed(model.spec.name, texts, options)
    vectors = postprocess.finish_requested(pooled, model.spec, options)
    billed = {"input_tokens": tokens, **({"images": n_images} if n_images else {})}
    meta: dict[str, Any] = {"api_version": {"version": version}, "billed_units": billed}
    if warnings:
        meta["warnings"] = warnings
    body = {"id": str(uuid.uuid4()), "texts": texts, "meta": meta}
    if types:
        body["response_type"] = "embeddings_by_type"
        embeddings = await by_type(model.spec.name, vectors, types)
    else:
        body["response_type"] = "embeddings_floats"
        embeddings = list(json_list(await float_rows(model.spec.name, vectors)))
    return await json_body_with(body, "embeddings", embeddings)


async def _embed_media(service, model, contents: list[Content], options: EmbedOptions):
    """Texts and images through the model's multi-modal path (texts with their prompt, as the text path)."""
    prefix = service.registry.prompt_text(model, "", options.prompt_name) if options.prompt_name else ""
    contents = [Content(text=prefix + c.text) if c.modality == "text" else c for c in contents]
    return await multimodal.embed_contents(service.registry, model.spec.name, contents, options)


def _check_max_tokens(request: cpb.CohereEmbedRequest, model_max: int) -> None:
    """v2's `max_tokens`: honoured when it is at least the model's own maximum (inputs are cut there)."""
    max_tokens = positive(request, "max_tokens")
    if max_tokens and max_tokens < model_max:
        raise InvalidInput(
            f"`max_tokens` below the model's maximum ({model_max}) is not supported; "
            f"inputs are cut at {model_max} tokens"
        )
