"""Issue 8, pure parts: one modality per batch, media packing, the ragged wire
format, kind detection, and the MaxSim / sparse maths."""

import json
from collections import deque

import numpy as np
import pytest

from encoderd.server.base.errors import InvalidInput
from encoderd.server.main.flag_values import parse_model
from encoderd.server.models.media import Content, MediaLimits, data_uri_bytes, media_bytes
from encoderd.server.models.multimodal import maxsim_scores, sparsify
from encoderd.server.scheduling.batching import BatchLimits, MediaItem, WorkItem, pack, take_batch
from encoderd.workers.contract import protocol
from encoderd.workers.contract.model_spec import ModelKind, ModelLoadError
from encoderd.workers.contract.spec_reader import detect_kind, load_model_spec


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


def page(grid, i=0):
    """A ColQwen2-style page: its patch rows (h x w of them), a grid, and the processor's tokens
    (a 3-token prompt around h x w / 4 image tokens): its cost."""
    rows = grid[1] * grid[2]
    ids = np.full(3 + rows // 4, i, np.int32)
    return MediaItem(
        ids, None, Req(), i, features=np.full((rows, 6), i, np.float32), cost=len(ids), grid=np.array(grid, np.int32)
    )


def test_pages_are_length_sorted_and_budgeted_by_their_tokens():
    """Pages of different resolutions cost their own tokens (19, 4, 11, 5 here) and are sorted and
    cut like texts: a padded batch costs its size x its longest page."""

    def pages():
        return deque([page((1, 8, 8), 0), page((1, 2, 2), 1), page((1, 4, 8), 2), page((1, 2, 4), 3)])

    assert [p.length for p in pages()] == [19, 4, 11, 5]
    unpadded = BatchLimits(max_batch_tokens=40, padded=False, mixed_modalities=True)
    assert [i.index for i in take_batch(pages(), unpadded)] == [1, 3, 2, 0]  # 4 + 5 + 11 + 19 = 39
    queue, padded = pages(), BatchLimits(max_batch_tokens=40, padded=True, mixed_modalities=True)
    assert [i.index for i in take_batch(queue, padded)] == [0]  # with the others: 4 x 19 > 40
    assert [i.index for i in take_batch(queue, padded)] == [1, 3, 2]  # 3 x 11 = 33


def test_pages_with_grids_and_tokens_round_trip():
    """Patch rows back to back, one grid and one token sequence per page (ColQwen2's media batch)."""
    packed = pack([page((1, 2, 4), 0), page((1, 4, 4), 1)], 5)
    assert isinstance(packed, protocol.MediaBatch)
    assert packed.features.shape == (24, 6) and packed.size == 2
    assert packed.token_cu.tolist() == [0, 5, 12] and packed.grids.tolist() == [[1, 2, 4], [1, 4, 4]]
    back = protocol.batch_from_frames(*protocol.decode(_wire(protocol.encode_batch(packed)))[1:])
    np.testing.assert_array_equal(back.features, packed.features)
    np.testing.assert_array_equal(back.token_ids, packed.token_ids)
    assert back.token_cu.tolist() == [0, 5, 12] and back.grids.tolist() == [[1, 2, 4], [1, 4, 4]] and back.size == 2


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


def test_colpali_checkpoints_are_detected_and_kinds_parse():
    assert detect_kind({"architectures": ["ColPaliForRetrieval"], "model_type": "colpali"}) == ModelKind.COLPALI
    assert detect_kind({"architectures": ["ColQwen2ForRetrieval"], "model_type": "colqwen2"}) == ModelKind.COLPALI
    assert parse_model("splade=/m/bert:sparse").kind == "sparse"
    assert parse_model("/m/clip:colpali@cuda:1").kind == "colpali"
    assert parse_model("/m/clip:clip_patches").kind == "clip_patches"


def _config_dir(tmp_path, config: dict):
    (tmp_path / "config.json").write_text(json.dumps(config))
    return str(tmp_path)


def test_colpali_on_a_clip_model_is_the_deprecated_name_of_clip_patches(tmp_path, caplog):
    """Configs written before real ColPali was served say :colpali for per-patch CLIP vectors: still
    served so, with a warning that names the new kind."""
    path = _config_dir(tmp_path, {"architectures": ["CLIPModel"], "model_type": "clip", "projection_dim": 16})
    with caplog.at_level("WARNING"):
        spec = load_model_spec("m", path, ModelKind.COLPALI)
    assert spec.kind == ModelKind.CLIP_PATCHES and spec.hidden_size == 16
    assert ":clip_patches" in caplog.text and "deprecated" in caplog.text


def test_colpali_kind_on_another_model_is_refused(tmp_path):
    path = _config_dir(tmp_path, {"architectures": ["BertModel"], "model_type": "bert"})
    with pytest.raises(ModelLoadError, match="ColPaliForRetrieval and ColQwen2ForRetrieval"):
        load_model_spec("m", path, ModelKind.COLPALI)


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


def test_a_retrieval_models_warm_up_runs_query_lengths_not_its_context(models_dir):
    """ColQwen2's max_length is Qwen2-VL's context: warming up two inputs of it took a 2B model over
    ten minutes. The warm-up runs query lengths (pages go through the fidelity self-check)."""
    from support.multimodal_models import build_colqwen2

    from encoderd.workers.backends import BackendOptions, create_backend
    from encoderd.workers.backends.retrieval import WARMUP_QUERY_TOKENS
    from encoderd.workers.contract.spec_reader import load_model_spec

    spec = load_model_spec("colqwen2", str(build_colqwen2(models_dir / "colqwen2")))
    backend = create_backend("torch", spec, BackendOptions(device="cpu", dtype="float32", threads=1))
    backend.load()
    forward, lengths = backend.forward, []

    def recorded(batch):
        lengths.append(int(batch.lengths.max()))
        if lengths[-1] > WARMUP_QUERY_TOKENS:
            raise AssertionError(f"a warm-up batch of {lengths[-1]} tokens")
        return forward(batch)

    backend.forward = recorded  # type: ignore[method-assign]
    backend.warmup(32768)
    assert lengths and max(lengths) == WARMUP_QUERY_TOKENS
