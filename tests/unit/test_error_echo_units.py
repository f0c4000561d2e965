"""Bounded error echoes (#42 item 1): what a client sent is quoted in part with its length, and a
status message, whatever it holds, is cut to a ceiling of UTF-8 bytes at a character's end."""

from __future__ import annotations

import pytest

from encoderd.server.base.errors import ECHO_CHARS, STATUS_MESSAGE_BYTES, ModelNotFound, echo, status_message
from encoderd.server.models.model_resolver import resolve


def test_a_short_value_is_quoted_whole_and_a_long_one_by_its_start_and_length():
    assert echo("bge-small") == "'bge-small'"
    long = "é" * 1_000_000
    quoted = echo(long)
    assert quoted.startswith(repr("é" * ECHO_CHARS)) and "(1000000 characters)" in quoted
    assert len(quoted) < 3 * ECHO_CHARS


def test_a_status_message_is_cut_at_the_ceiling_where_a_character_ends():
    assert status_message("short") == "short"
    for char in ("x", "é", "東", "😀"):
        message = status_message("model " + char * 100_000 + " is not served")
        data = message.encode()  # valid UTF-8: no character split
        assert len(data) <= STATUS_MESSAGE_BYTES and message.endswith(
            "(message cut: " + f"{len(('model ' + char * 100_000 + ' is not served').encode())} bytes)"
        )


def test_an_unknown_model_is_named_in_part():
    with pytest.raises(ModelNotFound) as refused:
        resolve({}, (), "m" * 1_000_000, None, (), "this call")
    assert len(str(refused.value)) < 200 and "(1000000 characters)" in str(refused.value)
