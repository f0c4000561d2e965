"""REST answers rendered as JSON text a slice at a time (server/api/rest.py, json_rows): the same
values as the arrays, float32 exactly, for every shape, and the event loop's other calls run between
the slices of a big answer."""

from __future__ import annotations

import asyncio
import json

import numpy as np
import pytest
from google.api import httpbody_pb2

from encoderd.server.api import cohere_embed, rest
from encoderd.server.base.errors import BackendError

WIDTH = 384
ROWS_PER_TURN = rest.VALUES_PER_TURN // WIDTH


def _float32_extremes(rows: int, width: int) -> np.ndarray:
    """Random rows, with the float32 values hardest to print first: the smallest subnormal, the
    largest finite, negative zero, values either side of %g's switch to exponents."""
    vectors = np.random.default_rng(0).standard_normal((rows, width)).astype(np.float32)
    hard = np.array(
        [1e-45, -1e-45, 3.4028235e38, -0.0, 1e-4, 9.9999997e-5, 1e9, 123456789.0, 1.0, 1 / 3], dtype=np.float32
    )
    vectors.flat[: min(len(hard), vectors.size)] = hard[: vectors.size]
    return vectors


@pytest.mark.parametrize("shape", [(2 * ROWS_PER_TURN + 3, WIDTH), (1, 1024), (3, 1), (0, WIDTH), (2, 0), (1, 40_000)])
async def test_float_rows_read_back_as_the_same_float32(shape):
    vectors = _float32_extremes(*shape)
    rows = await rest.float_rows("m", vectors)
    assert len(rows) == shape[0]
    # Integral values print without a point ("-0", "1"): read as numbers, not Python ints.
    parsed = np.array([json.loads(row, parse_int=float) for row in rows], dtype=np.float32).reshape(shape)
    assert parsed.tobytes() == vectors.tobytes()  # bit for bit: -0.0 stays negative


async def test_integer_rows_are_the_integers():
    values = np.random.default_rng(1).integers(-128, 128, size=(2 * ROWS_PER_TURN + 1, WIDTH))
    assert [json.loads(row) for row in await rest.json_rows(values)] == values.tolist()


async def test_non_finite_values_are_an_error_not_json_that_says_nan():
    vectors = np.ones((2, 4), np.float32)
    vectors[1, 2] = np.nan
    with pytest.raises(BackendError, match="non-finite"):
        await rest.float_rows("m", vectors)


async def test_nested_rows_keep_each_inputs_vectors_together():
    arrays = [_float32_extremes(n, 8) for n in (3, 0, ROWS_PER_TURN * 4, 1)]
    rendered = await rest.nested_float_rows("m", arrays)
    assert [np.array(json.loads(r, parse_int=float), dtype=np.float32).reshape(-1, 8).tobytes() for r in rendered] == [
        a.tobytes() for a in arrays
    ]
    assert await rest.nested_float_rows("m", []) == []


async def test_other_calls_run_between_the_slices_of_a_big_answer():
    """The order is the event loop's own (tasks run in the order they were woken), no timing: a
    call woken while the big answer renders runs before the answer is done; with one slice it does
    not need to."""
    for rows, other_first in ((3 * ROWS_PER_TURN, True), (ROWS_PER_TURN, False)):
        order: list[str] = []

        async def render(rows=rows, order=order):
            await rest.float_rows("m", np.ones((rows, WIDTH), np.float32))
            order.append("answer")

        async def other(order=order):
            order.append("other call")

        rendering = asyncio.create_task(render())
        other_call = asyncio.create_task(other())
        await asyncio.gather(rendering, other_call)
        assert order == (["other call", "answer"] if other_first else ["answer", "other call"])


def _body(answer) -> httpbody_pb2.HttpBody:
    """A big answer's HttpBody, read back from the wire format it was written in."""
    return httpbody_pb2.HttpBody.FromString(answer.wire)


async def test_a_body_with_rendered_json_is_the_document_with_that_value():
    document = {"id": "x", "texts": ['"quoted" é']}
    body = _body(await rest.json_body_with(document, "embeddings", [b"[[1,2.5]", b",[3,4]]"]))
    assert body.content_type == "application/json"
    assert json.loads(body.data) == {"id": "x", "texts": ['"quoted" é'], "embeddings": [[1, 2.5], [3, 4]]}
    assert json.loads(_body(await rest.json_body_with({}, "k", [b"[]"])).data) == {"k": []}


async def test_a_big_answer_is_assembled_a_slice_at_a_time_into_the_same_bytes():
    """The loop turns every BYTES_PER_TURN of pieces; the body is the pieces joined, and the message
    is what protobuf writes for it (an empty body too)."""
    pieces = [b"[", *(f'"{"é" * 1000}{i}",'.encode() for i in range(3 * rest.BYTES_PER_TURN // 2000)), b"0]"]
    order: list[str] = []

    async def assemble():
        answer = await rest.json_answer(pieces)
        order.append("answer")
        return answer

    async def other():
        order.append("other call")

    answer, _ = await asyncio.gather(assemble(), other())
    assert order == ["other call", "answer"]
    expected = httpbody_pb2.HttpBody(content_type="application/json", data=b"".join(pieces))
    assert _body(answer) == expected
    assert _body(await rest.json_answer([])) == httpbody_pb2.HttpBody(content_type="application/json")


async def test_openai_embeddings_answer_is_the_openai_shape():
    vectors = np.random.default_rng(3).standard_normal((2 * ROWS_PER_TURN + 1, WIDTH)).astype(np.float32)
    answer = json.loads(_body(await rest.render_embeddings("m", vectors, "float", 7)).data)
    assert [(e["object"], e["index"]) for e in answer["data"]] == [("embedding", i) for i in range(len(vectors))]
    assert np.array([e["embedding"] for e in answer["data"]], dtype=np.float32).tobytes() == vectors.tobytes()
    assert answer["object"] == "list" and answer["model"] == "m"
    assert answer["usage"] == {"prompt_tokens": 7, "total_tokens": 7}


async def test_cohere_embeddings_by_type_are_the_values_of_each_type():
    vectors = np.random.default_rng(2).standard_normal((2 * ROWS_PER_TURN + 1, WIDTH)).astype(np.float32)
    vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
    types = ("float", "int8", "uint8", "binary", "ubinary", "base64")
    got = json.loads(b"".join(await cohere_embed.by_type("m", vectors, types)))
    assert list(got) == list(types)
    assert np.array(got["float"], dtype=np.float32).tobytes() == vectors.tobytes()
    for kind in ("int8", "uint8", "binary", "ubinary"):
        assert got[kind] == cohere_embed.postprocess.quantize(vectors, kind).astype(np.int64).tolist()
    assert got["base64"] == [json.loads(row) for row in rest.base64_rows(vectors)]
    assert got["int8"] and all(isinstance(v, int) for v in got["int8"][0])
