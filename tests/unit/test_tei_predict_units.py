"""TEI's /predict input grammar (a text, a pair, a batch of one-text lists and pairs, as TEI's
own deserializer reads it) and the packing of a classifier batch that mixes pairs and texts."""

from __future__ import annotations

import numpy as np
import pytest
from google.protobuf import struct_pb2

from encoderd.server.api.tei import predict_inputs
from encoderd.server.base.errors import InvalidInput
from encoderd.server.scheduling.batching import WorkItem, pack


def _value(python) -> struct_pb2.Value:
    """`python` as the JSON value the transcoder hands over."""
    holder = struct_pb2.Struct()
    holder.update({"v": python})
    return holder.fields["v"]


@pytest.mark.parametrize(
    "inputs, want",
    [
        ("a", (["a"], False)),
        (["a"], (["a"], False)),
        (["a", "b"], ([("a", "b")], False)),
        ([["a"]], (["a"], True)),
        ([["a"], ["b", "c"], ["d"]], (["a", ("b", "c"), "d"], True)),
    ],
)
def test_predict_inputs_read_as_tei_reads_them(inputs, want):
    assert predict_inputs(_value(inputs)) == want


@pytest.mark.parametrize(
    "inputs", [[], ["a", "b", "c"], [["a", "b", "c"]], [["a"], "b"], [[]], [1], [["a", 2]], {"a": 1}, 3]
)
def test_predict_inputs_refuse_other_shapes(inputs):
    with pytest.raises(InvalidInput):
        predict_inputs(_value(inputs))


def test_a_batch_mixing_pairs_and_texts_gets_zero_types_for_the_texts():
    pair = WorkItem(np.array([1, 2, 3, 4], np.int32), np.array([0, 0, 1, 1], np.int32), None, 0)
    text = WorkItem(np.array([5, 6], np.int32), None, None, 0)
    for batch in ([pair, text], [text, pair]):  # whichever comes first
        packed = pack(batch, 1)
        want = np.concatenate([np.zeros(2) if item is text else item.type_ids for item in batch])
        np.testing.assert_array_equal(packed.token_type_ids, want)
    assert pack([text, text], 1).token_type_ids is None
