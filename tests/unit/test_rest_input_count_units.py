"""The early refusal's count of a REST `input` (server/api/rest.py, input_count): never more inputs
than the call holds (a call is never refused for inputs it does not have), checked against what
embedding_inputs and media_inputs read from the same values."""

from __future__ import annotations

import pytest
from google.protobuf import json_format, struct_pb2

from encoderd.server.api.rest import embedding_inputs, input_count, media_inputs
from encoderd.server.base.errors import InvalidInput


def _value(x) -> struct_pb2.Value:
    return json_format.ParseDict(x, struct_pb2.Value())


@pytest.mark.parametrize(
    "x",
    [
        "one text",
        ["a", "b", "c"],
        [101, 2023, 102],  # one token-id list
        [[101, 102], [101, 2023, 102]],  # two
        ["x"] * 32,
    ],
)
def test_the_count_is_what_the_call_holds(x):
    texts, ids = embedding_inputs(_value(x))
    assert input_count(_value(x)) == len(texts if texts is not None else ids)


def test_media_strings_count_one_each():
    assert input_count(_value(["data:a", "data:b"])) == len(media_inputs(_value(["data:a", "data:b"]), "image"))


@pytest.mark.parametrize("x", [None, [], 3.5, {"a": 1}])
def test_no_count_where_the_call_is_malformed_anyway(x):
    """0: the early check is skipped and the call's own reading refuses it (400)."""
    assert input_count(_value(x)) == 0
    with pytest.raises(InvalidInput):
        embedding_inputs(_value(x))


def test_a_list_malformed_after_its_first_element_counts_its_elements():
    """What the early refusal judges by under a flood; read when admitted, it is refused as malformed."""
    assert input_count(_value(["a query", 7])) == 2
    with pytest.raises(InvalidInput, match="mixes element types"):
        embedding_inputs(_value(["a query", 7]))
