"""Issue 8, pure parts: one modality per batch, media packing, the ragged wire
format, kind detection, and the MaxSim / sparse maths."""

from collections import deque

import numpy as np
import pytest

from encoderd.server.api.errors import InvalidInput
from encoderd.server.models.media import Content, MediaLimits, data_uri_bytes, media_bytes
from encoderd.server.models.multimodal import maxsim_scores, sparsify
from encoderd.server.ops.cli import parse_model
from encoderd.server.scheduling.batching import BatchLimits, MediaItem, WorkItem, pack, take_batch
from encoderd.workers.contract import protocol
from encoderd.workers.contract.model_spec import ModelKind, ModelLoadError, detect_kind


class Req:
    done = False


def text(n, i=0):
    return WorkItem(np.arange(n, dtype=np.int32), None, Req(), i)


def image(cost, i=0, flag=0):
    return MediaItem(
        np.zeros(0, np.int32),
        None,
        Req(),
        i,
        features=np.full((3, 2, 2), i, np.float32),
        flag=flag,
        cost=cost,
        modality="image",
    )


def test_a_batch_holds_the_oldest_inputs_modality_and_the_rest_keeps_its_order():
    queue = deque([image(17, 0), text(5, 1), image(17, 2), text(3, 3), image(17, 4)])
    limits = BatchLimits(max_batch_size=8, max_batch_tokens=1000, mixed_modalities=True)
    assert [i.index for i in take_batch(queue, limits)] == [0, 2, 4]
    assert [i.index for i in queue] == [1, 3]
    assert [i.index for i in take_batch(queue, limits)] == [3, 1]  # texts, length-sorted


def test_media_cost_is_the_batch_budget():
    queue = deque([image(17, i) for i in range(5)])
    batch = take_batch(queue, BatchLimits(max_batch_tokens=40, mixed_modalities=True))
    assert len(batch) == 2 and len(queue) == 3  # 3 x 17 > 40


def test_pack_stacks_media_and_sends_flags_only_when_set():
    packed = pack([image(17, 0), image(17, 1)], 7)
    assert isinstance(packed, protocol.MediaBatch) and packed.flags is None
    assert packed.features.shape == (2, 3, 2, 2) and packed.features[1].max() == 1
    assert pack([image(17, 0), image(17, 1, flag=1)], 7).flags.tolist() == [0, 1]


def _wire(frames):
    return [f.tobytes() if isinstance(f, np.ndarray) else bytes(f) for f in frames]


def test_media_batches_round_trip_as_raw_float32_frames():
    batch = protocol.MediaBatch(3, "audio", np.random.rand(2, 4, 5, 6).astype(np.float32), np.array([1, 0], np.int32))
    kind, header, rest = protocol.decode(_wire(protocol.encode_batch(batch)))
    back = protocol.batch_from_frames(header, rest)
    assert kind == protocol.MessageType.BATCH and back.modality == "audio" and back.flags.tolist() == [1, 0]
    np.testing.assert_array_equal(back.features, batch.features)
    tokens = protocol.TokenBatch(4, np.arange(5, dtype=np.int32), np.array([0, 2, 5], np.int32))
    assert isinstance(
        protocol.batch_from_frames(*protocol.decode(_wire(protocol.encode_batch(tokens)))[1:]), protocol.TokenBatch
    )


def test_ragged_results_round_trip():
    values = np.random.rand(7, 3).astype(np.float32)
    multi = protocol.Ragged(values, np.array([0, 2, 2, 7], np.int32))
    _, header, rest = protocol.decode(_wire(protocol.encode_result(1, multi)))
    rows = protocol.result_array(header, rest)
    assert [r.shape for r in rows] == [(2, 3), (0, 3), (5, 3)]
    np.testing.assert_array_equal(np.concatenate(rows), values)
    sparse = protocol.Ragged(
        np.array([[0.5], [1.5], [2.5]], np.float32), np.array([0, 1, 3], np.int32), np.array([9, 2, 40], np.int32)
    )
    _, header, rest = protocol.decode(_wire(protocol.encode_result(1, sparse)))
    (i0, v0), (i1, v1) = protocol.result_array(header, rest)
    assert i0.tolist() == [9] and v0.tolist() == [0.5] and i1.tolist() == [2, 40] and v1.tolist() == [1.5, 2.5]


@pytest.mark.parametrize(
    "config,modules,kind",
    [
        ({"architectures": ["CLIPModel"]}, [], ModelKind.CLIP),
        ({"architectures": ["ClapModel"]}, [], ModelKind.CLAP),
        ({"architectures": ["BertModel"]}, [{"type": "pylate.models.Dense.Dense"}], ModelKind.COLBERT),
        ({"architectures": ["HF_ColBERT"]}, [], ModelKind.COLBERT),
        (
            {"architectures": ["BertForMaskedLM"]},
            [{"type": "sentence_transformers.sparse_encoder.models.SpladePooling"}],
            ModelKind.SPARSE,
        ),
        ({"architectures": ["BertForMaskedLM"]}, [], ModelKind.EMBEDDING),  # sparse only when asked
    ],
)
def test_kind_detection(config, modules, kind):
    assert detect_kind(config, modules) == kind


def test_colpali_checkpoints_are_refused_clearly_and_kinds_parse():
    with pytest.raises(ModelLoadError, match="serve a CLIP model with the :colpali kind"):
        detect_kind({"architectures": ["ColPaliForRetrieval"]})
    assert parse_model("splade=/m/bert:sparse").kind == "sparse"
    assert parse_model("/m/clip:colpali@cuda:1").kind == "colpali"


def test_media_sources():
    assert data_uri_bytes("data:text/plain,a%20b", "x") == b"a b"
    assert data_uri_bytes("data:image/png;base64,aGk=", "x") == b"hi"
    assert media_bytes(Content("image", url="aGk="), MediaLimits(), "x") == b"hi"  # bare base64 (REST)
    with pytest.raises(InvalidInput, match="limit is 1"):
        media_bytes(Content("image", data=b"ab"), MediaLimits(max_bytes=1), "x")
    with pytest.raises(InvalidInput, match="does not fetch URLs"):
        media_bytes(Content("image", url="http://127.0.0.1:9/x"), MediaLimits(allow_urls=False), "x")


def test_maxsim_and_sparsify():
    q = np.array([[1.0, 0.0], [0.0, 1.0]])
    docs = [np.array([[1.0, 0.0], [0.6, 0.8]]), np.array([[0.0, -1.0]])]
    np.testing.assert_allclose(maxsim_scores(q, docs), [1.8, -1.0], rtol=1e-6)
    indices, values = sparsify(np.array([1, 5, 9, 12]), np.array([0.2, 0.9, 0.05, 0.5]), top_k=2, threshold=0.1)
    assert indices.tolist() == [5, 12] and values.tolist() == [0.9, 0.5]
