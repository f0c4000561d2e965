"""What every REST dialect of the Compat service shares (OpenAI, Infinity, Cohere, TEI): the JSON
values of a request read from their google.protobuf.Value, another API's fields refused, and answers
rendered as JSON bytes.

Dialect-neutral: server/api/compat.py (OpenAI, Infinity and Cohere rerank), tei.py and
cohere_embed.py import these; this module imports none of them.
"""

from __future__ import annotations

import asyncio
import base64
import itertools
import json
from collections.abc import Iterable, Iterator

import numpy as np
import orjson
from google.api import httpbody_pb2
from google.protobuf import json_format, struct_pb2

from ..base.errors import BackendError, InvalidInput, echo
from ..models.media import Content
from .messages import Serialized, http_body

INPUT_SHAPES = "a string, a list of strings, a list of token ids, or a list of token-id lists"


# ------------------------------------------------------------------ requests
def embedding_inputs(value: struct_pb2.Value) -> tuple[list[str] | None, list[list[float]] | None]:
    """OpenAI `input` -> (texts, None) or (None, token-id lists); ids are range-checked by the registry."""
    kind = value.WhichOneof("kind")
    if kind == "string_value":
        return [value.string_value], None
    if kind != "list_value":
        raise InvalidInput(f"`input` is required and must be {INPUT_SHAPES}")
    items = value.list_value.values
    if not items:
        raise InvalidInput("`input` is empty: send at least one")
    kinds = {v.WhichOneof("kind") for v in items}
    if kinds == {"string_value"}:
        return [v.string_value for v in items], None
    if kinds == {"number_value"}:
        return None, [[v.number_value for v in items]]
    if kinds == {"list_value"}:
        return None, [_token_ids(v.list_value.values, i) for i, v in enumerate(items)]
    raise InvalidInput(f"`input` mixes element types; it must be {INPUT_SHAPES}")


def input_count(value: struct_pb2.Value) -> int:
    """How many inputs an `input` value (texts, token ids, media strings) holds, read without
    converting them, for the refusal that comes before: a string or a single token list is one
    input, a list of strings or of token lists one each. Never more than embedding_inputs or
    media_inputs find, so a call is never refused for inputs it does not hold; 0 where they would
    refuse it as malformed anyway (no input, or an empty list)."""
    kind = value.WhichOneof("kind")
    if kind != "list_value":
        return 1 if kind == "string_value" else 0
    items = value.list_value.values
    if not items:
        return 0
    return 1 if items[0].WhichOneof("kind") == "number_value" else len(items)


def _token_ids(values, index: int) -> list[float]:
    if not values:
        raise InvalidInput(f"input[{index}] is an empty token list")
    if any(v.WhichOneof("kind") != "number_value" for v in values):
        raise InvalidInput(f"input[{index}] must be a list of token ids (integers)")
    return [v.number_value for v in values]


def media_inputs(value: struct_pb2.Value, modality: str) -> list[Content]:
    """Infinity's image / audio `input`: a string or a list of strings, each a data
    URI, an http(s) URL or bare base64 (decoded later, off the event loop)."""
    kind = value.WhichOneof("kind")
    items = [value] if kind == "string_value" else list(value.list_value.values) if kind == "list_value" else []
    if not items or any(v.WhichOneof("kind") != "string_value" for v in items):
        raise InvalidInput(
            f"`input` must be a string or a non-empty list of strings (data URIs, http(s) URLs or "
            f"base64) for modality {echo(modality)}"
        )
    return [Content(modality, url=v.string_value) for v in items]


def rerank_documents(value: struct_pb2.Value, rank_fields=()) -> tuple[list[str], list]:
    """Cohere `documents` -> (the texts ranked, the documents as given): strings, or objects
    (the v1 API) ranked on their `text`, or on `rank_fields` as "key: value" lines."""
    if value.WhichOneof("kind") != "list_value":
        raise InvalidInput('`documents` is required and must be a list of strings or of {"text": ...} objects')
    texts, originals = [], []
    for i, item in enumerate(value.list_value.values):
        kind = item.WhichOneof("kind")
        if kind == "string_value":
            texts.append(item.string_value)
            originals.append({"text": item.string_value})
        elif kind == "struct_value":
            texts.append(_document_text(item.struct_value, rank_fields, i))
            originals.append(json_format.MessageToDict(item.struct_value))
        else:
            raise InvalidInput(f'documents[{i}] must be a string or an object with a string "text" field')
    return texts, originals


def _document_text(document: struct_pb2.Struct, rank_fields, index: int) -> str:
    fields = document.fields
    for key in rank_fields or ("text",):
        if key not in fields or fields[key].WhichOneof("kind") != "string_value":
            raise InvalidInput(
                f"documents[{index}] must be a string or an object with a string {echo(key)} field"
                + (" (one of `rank_fields`)" if rank_fields else "")
            )
    if not rank_fields:
        return fields["text"].string_value
    return "\n".join(f"{key}: {fields[key].string_value}" for key in rank_fields)


def string_list(value: struct_pb2.Value, what: str) -> list[str]:
    """A string or a non-empty list of strings."""
    kind = value.WhichOneof("kind")
    if kind == "string_value":
        return [value.string_value]
    items = value.list_value.values if kind == "list_value" else []
    if not items or any(v.WhichOneof("kind") != "string_value" for v in items):
        raise InvalidInput(f"`{what}` is required and must be a string or a non-empty list of strings")
    return [v.string_value for v in items]


def reject_set(request, fields: tuple[str, ...], context: str) -> None:
    """Fields of another API's shape that cannot apply here: a 400, never silently ignored."""
    for field in fields:
        descriptor = request.DESCRIPTOR.fields_by_name[field]
        is_set = (
            request.HasField(field) if descriptor.has_presence else getattr(request, field) != descriptor.default_value
        )
        if is_set:
            raise InvalidInput(f"`{field}` does not apply {context}")


# ----------------------------------------------------------------- responses
def json_body(document: dict | list) -> httpbody_pb2.HttpBody:
    return httpbody_pb2.HttpBody(
        content_type="application/json",
        data=json.dumps(document, ensure_ascii=False, separators=(",", ":"), allow_nan=False).encode(),
    )


async def json_body_with(document: dict, key: str, pieces: Iterable[bytes]) -> Serialized:
    """json_body of `document` with `key` last, its value the JSON `pieces` (rows rendered a slice at
    a time, json_rows), assembled as json_answer does."""
    text = json.dumps(document, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
    head = (text[:-1] + ("," if document else "") + json.dumps(key) + ":").encode()
    return await json_answer(itertools.chain([head], pieces, [b"}"]))


# JSON bytes gathered per turn of the event loop when a big answer is assembled.
BYTES_PER_TURN = 1 << 20


async def json_answer(pieces: Iterable[bytes]) -> Serialized:
    """An application/json HttpBody of the pieces of JSON, in wire format, copied once whole
    (messages.http_body): a 2,048 x 384 answer (10 MB) built as a message and serialized held the
    loop 5-25 ms in one step. The pieces may be made as they are read (an envelope around each row):
    the loop turns every BYTES_PER_TURN of them."""
    chunks: list[bytes] = []
    size = 0
    for piece in pieces:
        chunks.append(piece)
        size += len(piece)
        if size >= BYTES_PER_TURN:
            size = 0
            await asyncio.sleep(0)  # the calls waiting on the loop go first
    return http_body("application/json", chunks)


def json_list(items: Iterable[bytes]) -> Iterator[bytes]:
    """The pieces of a JSON list of `items`, each JSON already."""
    yield b"["
    for i, item in enumerate(items):
        if i:
            yield b","
        yield item
    yield b"]"


def usage(tokens: int) -> dict:
    return {"prompt_tokens": tokens, "total_tokens": tokens}


# Values rendered as JSON per turn of the event loop (orjson, ~30 ns a value: ~1 ms a turn).
VALUES_PER_TURN = 32768
_NUMPY = orjson.OPT_SERIALIZE_NUMPY


async def json_rows(vectors: np.ndarray) -> list[bytes]:
    """Each row of a 2-D array as a JSON list, VALUES_PER_TURN values per turn of the event loop.
    Integers print as integers; floats as float32, each the shortest text that reads back as the
    same float32 (orjson's; "%.9g" in Python took ~0.2 us a value: a 2,048 x 384 answer ~150 ms of
    the event loop at once, Cohere's json.dumps of the same floats ~400 ms)."""
    if vectors.dtype.kind == "f":
        vectors = vectors.astype(np.float32, copy=False)
    vectors = np.ascontiguousarray(vectors)  # orjson takes C-ordered arrays only
    rows, width = vectors.shape
    step = max(1, VALUES_PER_TURN // max(width, 1))
    out: list[bytes] = []
    for start in range(0, rows, step):
        if start:
            await asyncio.sleep(0)  # the calls waiting on the loop go first
        out.extend(orjson.dumps(row, option=_NUMPY) for row in vectors[start : start + step])
    return out


async def float_rows(model: str, vectors: np.ndarray) -> list[bytes]:
    """Each row of a 2-D float array as a JSON list of float32 values (json_rows)."""
    vectors = np.asarray(vectors, dtype=np.float32)
    if not np.isfinite(vectors).all():  # orjson would print null, and JSON has no nan
        raise BackendError(f"model {model} produced non-finite embedding values")
    return await json_rows(vectors)


async def nested_float_rows(model: str, arrays: list[np.ndarray]) -> list[bytes]:
    """Each 2-D array (an input's vectors) as a JSON list of float_rows lists, all of them rendered
    as one array's rows (a slice of them per turn of the event loop)."""
    if not arrays:
        return []
    rows = iter(await float_rows(model, np.concatenate(arrays)))
    return [b"[" + b",".join(next(rows) for _ in range(len(a))) + b"]" for a in arrays]


def base64_rows(vectors: np.ndarray | list[np.ndarray]) -> list[bytes]:
    """Each row as a JSON string: base64 of its little-endian float32 bytes (what the OpenAI SDK decodes)."""
    return [b'"' + base64.b64encode(row.astype("<f4").tobytes()) + b'"' for row in vectors]


async def render_embeddings(model: str, vectors, encoding_format: str, tokens: int) -> Serialized:
    """The OpenAI embeddings response: one vector per input, its floats as JSON (json_rows) or
    base64."""
    rows = base64_rows(vectors) if encoding_format == "base64" else await float_rows(model, vectors)
    return await _embedding_list(model, rows, tokens)


async def render_multivectors(model: str, rows: list[np.ndarray], encoding_format: str, tokens: int) -> Serialized:
    """Infinity's multi-vector shape: each `embedding` a list of vectors, or in
    base64 all of them as one flat little-endian float32 buffer."""
    if encoding_format == "base64":
        rendered = base64_rows(rows)  # an input's (vectors, dim) array: its bytes are the flat buffer
    else:
        rendered = await nested_float_rows(model, rows)
    return await _embedding_list(model, rendered, tokens)


async def _embedding_list(model: str, rows: list[bytes], tokens: int) -> Serialized:
    """The one envelope of every embeddings answer (one vector or several per input), built around
    rows already rendered as JSON values."""
    tail = json.dumps({"model": model, "usage": usage(tokens)}, ensure_ascii=False, separators=(",", ":"))[1:]
    data = (b'{"object":"embedding","index":%d,"embedding":%s}' % (i, row) for i, row in enumerate(rows))
    return await json_answer(itertools.chain([b'{"object":"list","data":'], json_list(data), [b",", tail.encode()]))
