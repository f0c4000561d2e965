"""EmbedStream's groups (server/api/streaming.py): an item's own fault fails that item alone, named
by its id, whatever group it travelled in."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import numpy as np

from encoderd.server.api.streaming import _Stream
from encoderd.server.base.errors import InvalidInput
from encoderd.server.models.result_cache import TokenCount
from encoderd.v1 import encoderd_pb2 as pb

LIMIT = 100  # characters


class OneGroupRegistry:
    """Embeds a group as the real registry does, refusing the whole group for one over-long text."""

    config = SimpleNamespace(max_input_chars=LIMIT)
    model = SimpleNamespace(spec=SimpleNamespace(name="m", normalize=True, truncate_dim=0), output_dim=4)

    def __init__(self):
        self.groups: list[list[str]] = []

    def get(self, name, kinds):
        return self.model

    def prompt_text(self, model, prompt, prompt_name):
        return ""

    async def embed(self, name, texts, options, names=()):
        self.groups.append(list(texts))
        for text, item in zip(texts, names, strict=True):
            if text.startswith("long"):
                raise InvalidInput(f"{item} is longer than the model's maximum")
        return self.model, np.ones((len(texts), 4), np.float32), TokenCount([3] * len(texts))


async def test_a_bad_item_fails_alone_and_is_named_by_its_id():
    registry = OneGroupRegistry()
    messages = [
        pb.EmbedStreamRequest(id="a", input="fine"),
        pb.EmbedStreamRequest(id="huge", input="x" * (LIMIT + 1)),
        pb.EmbedStreamRequest(id="long", input="long text"),
        pb.EmbedStreamRequest(id="empty", input=""),
        pb.EmbedStreamRequest(id="d", input="also fine"),
    ]
    stream = _Stream(registry, messages[0], window=16, draining=asyncio.Event())
    await stream._embed(messages)
    answers = {}
    while not stream.results.empty():
        answer = stream.results.get_nowait()
        answers[answer.id] = answer
    assert sorted(answers) == ["a", "d", "empty", "huge", "long"]  # one answer each
    for item_id in "ad":
        assert not answers[item_id].HasField("error") and answers[item_id].prompt_tokens == 3
    assert answers["huge"].error.message == f"item 'huge' has {LIMIT + 1} characters; the limit is {LIMIT}"
    assert answers["long"].error.message == "item 'long' is longer than the model's maximum"
    assert answers["empty"].error.message == "empty input"
    # The group failed for one item; each was then embedded alone.
    assert registry.groups == [["fine", "long text", "also fine"], ["fine"], ["long text"], ["also fine"]]
