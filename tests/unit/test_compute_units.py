"""The one input checker of the compute path (server/models/compute.py), for every kind of input."""

from __future__ import annotations

import re

import numpy as np
import pytest

from encoderd.server.base.config import ServerConfig
from encoderd.server.base.errors import BackendError, InvalidInput
from encoderd.server.models import compute
from encoderd.server.models.compute import TokenIds, check_inputs
from encoderd.server.models.media import Content

CONFIG = ServerConfig((), max_inputs_per_request=3, max_input_chars=10)
CLIP = ("text", "image")


@pytest.mark.parametrize(
    ("inputs", "takes", "message"),
    [
        ([], ("text",), "`inputs` is empty: send at least one"),
        (["a"] * 4, ("text",), "too many inputs: 4 > 3 per request"),
        (["a", ""], ("text",), "inputs[1] is an empty string"),
        (["a", "x" * 11], ("text",), "inputs[1] has 11 characters; the limit is 10"),
        ([("a", "")], ("text",), "inputs[0] is an empty string"),  # a (text, text_pair) pair: both parts
        ([("a", "x" * 11)], ("text",), "inputs[0] has 11 characters"),
        ([Content(text="")], CLIP, "inputs[0] is an empty string"),
        ([Content(text="a"), Content("audio", data=b"RIFF")], CLIP, "inputs[1] is audio, but model 'm' (clip)"),
        ([Content("image", data=b"png")], ("text",), "inputs[0] is an image, but model 'm' (clip) takes text"),
    ],
)
def test_refusals_name_the_input_and_the_limit(inputs, takes, message):
    with pytest.raises(InvalidInput, match=re.escape(message)):
        check_inputs(CONFIG, inputs, "inputs", takes, "'m' (clip)")


def test_what_passes():
    ids = TokenIds(np.array([101, 102], dtype=np.int32))
    inputs = ["a", ("a", "b"), Content("image", data=b"x" * 100)]  # a media input's size is not a text's
    assert check_inputs(CONFIG, inputs, "inputs", CLIP) == inputs
    assert check_inputs(CONFIG, [ids], "documents") == [ids]
    with pytest.raises(InvalidInput, match="`documents` is empty"):
        check_inputs(CONFIG, [], "documents")


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_rows_are_refused_by_name_stacked_or_ragged(bad):
    """Stacked rows are checked in one pass (on the event loop: no loop over 2,048 rows), and the
    message still names every bad input; ragged rows (multi-vector, sparse) row by row."""
    stacked = np.ones((4, 3), np.float32)
    compute._refuse_non_finite("m", stacked, [f"inputs[{i}]" for i in range(4)])  # finite: no error
    stacked[1, 2] = stacked[3, 0] = bad
    with pytest.raises(BackendError, match=r"for inputs\[1\], inputs\[3\];"):
        compute._refuse_non_finite("m", stacked, [f"inputs[{i}]" for i in range(4)])
    ragged = [np.ones((2, 3), np.float32), (np.arange(2), np.array([1.0, bad], np.float32))]
    with pytest.raises(BackendError, match=r"for docs\[1\];"):
        compute._refuse_non_finite("m", ragged, ["docs[0]", "docs[1]"])


def test_a_prompt_repeated_before_every_input_counts_every_time():
    """check_prompted: the texts with the prompt before each hold at most what one message carries
    (MAX_MESSAGE_BYTES characters); pairs, token ids and media take no prompt."""
    limit = compute.MAX_MESSAGE_BYTES
    prompt = "p" * (limit // 64)
    compute.check_prompted(["x"] * 63, prompt)  # 63 prompts and 63 characters: under the limit
    with pytest.raises(InvalidInput, match=r"the prompt \(\d+ characters\) before each of the 64 inputs makes"):
        compute.check_prompted(["x"] * 64, prompt)
    with pytest.raises(InvalidInput, match="before each of the 64 inputs"):
        compute.check_prompted(["x"] * 32 + [Content("text", "x")] * 32, prompt)
    others = [("a", "b"), TokenIds(np.array([1, 2], dtype=np.int32)), Content("image", data=b"\x89PNG")] * 100
    compute.check_prompted(["x"] * 63 + others, prompt)
    compute.check_prompted(["x" * 1000] * 2048, "")  # no prompt: the per-field limits alone
