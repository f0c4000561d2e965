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


async def json_body_with(document: dict, key: str, pieces: Iterable[str]) -> Serialized:
    """json_body of `document` with `key` last, its value the JSON text `pieces` (rows rendered a
    slice at a time, json_rows), assembled as json_answer does."""
    text = json.dumps(document, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
    head = [text[:-1], "," if document else "", json.dumps(key), ":"]
    return await json_answer(itertools.chain(head, pieces, ["}"]))


# JSON text joined and encoded per turn of the event loop when a big answer is assembled (~1 ms).
CHARS_PER_TURN = 1 << 20


async def json_answer(pieces: Iterable[str]) -> Serialized:
    """An application/json HttpBody of the pieces of JSON text, in wire format: joined and encoded
    CHARS_PER_TURN characters per turn of the event loop, then copied once (messages.http_body). A
    2,048 x 384 answer (10 MB) built whole held the loop 5-25 ms in one step."""
    chunks: list[bytes] = []
    pending: list[str] = []
    size = 0
    for piece in pieces:
        pending.append(piece)
        size += len(piece)
        if size >= CHARS_PER_TURN:
            chunks.append("".join(pending).encode())
            pending, size = [], 0
            await asyncio.sleep(0)  # the calls waiting on the loop go first
    chunks.append("".join(pending).encode())
    return http_body("application/json", chunks)


def json_list(items: Iterable[str]) -> Iterator[str]:
    """The pieces of a JSON list of `items`, each JSON text already."""
    yield "["
    for i, item in enumerate(items):
        if i:
            yield ","
        yield item
    yield "]"


def usage(tokens: int) -> dict:
    return {"prompt_tokens": tokens, "total_tokens": tokens}


# Values rendered as JSON text per turn of the event loop. "%.9g" costs ~0.2 us a value: a
# 2,048 x 384 answer rendered at once held every other caller's call for ~180 ms (and Cohere's
# json.dumps of the same floats ~400 ms); in slices of this many each waits ~2 ms at most.
VALUES_PER_TURN = 8192


async def json_rows(vectors: np.ndarray, value_format: str) -> list[str]:
    """Each row of a 2-D array as a JSON list, `value_format` ("%.9g", "%d") per value: one `%` over
    a whole row, VALUES_PER_TURN values per turn of the event loop."""
    rows, width = vectors.shape
    if width == 0:
        return ["[]"] * rows
    row_format = "[" + ",".join([value_format] * width) + "]"
    step = max(1, VALUES_PER_TURN // width)
    out: list[str] = []
    for start in range(0, rows, step):
        if start:
            await asyncio.sleep(0)  # the calls waiting on the loop go first
        out.extend(row_format % tuple(row) for row in vectors[start : start + step].tolist())
    return out


async def float_rows(model: str, vectors: np.ndarray) -> list[str]:
    """Each row of a 2-D float array as a JSON list, "%.9g" per value (see render_embeddings)."""
    if not np.isfinite(vectors).all():  # "%.9g" would print nan, which is not JSON
        raise BackendError(f"model {model} produced non-finite embedding values")
    return await json_rows(vectors, "%.9g")


async def nested_float_rows(model: str, arrays: list[np.ndarray]) -> list[str]:
    """Each 2-D array (an input's vectors) as a JSON list of float_rows lists, all of them rendered
    as one array's rows (a slice of them per turn of the event loop)."""
    if not arrays:
        return []
    rows = iter(await float_rows(model, np.concatenate(arrays)))
    return ["[" + ",".join(next(rows) for _ in range(len(a))) + "]" for a in arrays]


def base64_rows(vectors: np.ndarray | list[np.ndarray]) -> list[str]:
    """Each row as a JSON string: base64 of its little-endian float32 bytes (what the OpenAI SDK decodes)."""
    return ['"' + base64.b64encode(row.astype("<f4").tobytes()).decode() + '"' for row in vectors]


async def render_embeddings(model: str, vectors, encoding_format: str, tokens: int) -> Serialized:
    """The OpenAI embeddings response: one vector per input.

    Floats print as "%.9g", which round-trips float32 exactly: one `%` over a
    whole row is ~3x faster than json.dumps of the list (whose 17-digit doubles
    are also 60% bigger), and on par with Envoy printing a repeated float."""
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


async def _embedding_list(model: str, rows: list[str], tokens: int) -> Serialized:
    """The one envelope of every embeddings answer (one vector or several per input), built as
    text around rows already rendered as JSON values."""
    tail = json.dumps({"model": model, "usage": usage(tokens)}, ensure_ascii=False, separators=(",", ":"))[1:]
    data = (f'{{"object":"embedding","index":{i},"embedding":{row}}}' for i, row in enumerate(rows))
    return await json_answer(itertools.chain(['{"object":"list","data":'], json_list(data), [",", tail]))
