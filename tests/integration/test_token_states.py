"""TEI's /embed_all on a plain embedder: every engine's token states (one last hidden state
per token, special tokens included, after truncation; not pooled) equal transformers'
AutoModel last_hidden_state on the same tokens. In-process backends, no server (the served
route is checked in tests/integration/test_compat_clients.py)."""

from __future__ import annotations

import itertools
from pathlib import Path
from unittest import mock

import numpy as np
import pytest
import torch
from support.corpus import sentences

from encoderd.workers.backends import BackendOptions, create_backend, packed_encoder
from encoderd.workers.backends.base import run_to_end
from encoderd.workers.contract.model_files import default_model_path
from encoderd.workers.contract.protocol import Ragged, TokenBatch
from encoderd.workers.contract.spec_reader import load_model_spec

# Short and long, unsorted (so a padded engine pads inside the batch); the last is cut at 256 tokens.
TEXTS = [*sentences(4, max_words=40, seed=3), " ".join(sentences(30, max_words=40, seed=4))]


@pytest.fixture(scope="module")
def spec():
    return load_model_spec("minilm", default_model_path())


@pytest.fixture(scope="module")
def batch(spec) -> TokenBatch:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(Path(spec.path) / "tokenizer.json"))
    tok.enable_truncation(spec.max_length)
    tok.no_padding()
    ids = [e.ids for e in tok.encode_batch(TEXTS)]
    assert len(ids[-1]) == spec.max_length and len({len(i) for i in ids}) >= 3
    packed = TokenBatch.from_sequences(0, ids)
    packed.token_states = True
    return packed


@pytest.fixture(scope="module")
def reference(spec, batch) -> list[np.ndarray]:
    """transformers' last_hidden_state of each input alone (no padding at all), float32."""
    from transformers import AutoModel

    model = AutoModel.from_pretrained(spec.path, dtype=torch.float32).eval()
    bounds = batch.cu_seqlens.tolist()
    with torch.inference_mode():
        return [
            model(input_ids=torch.from_numpy(batch.input_ids[a:b]).long()[None]).last_hidden_state[0].numpy()
            for a, b in itertools.pairwise(bounds)
        ]


def _check(got, reference: list[np.ndarray], atol: float) -> None:
    assert isinstance(got, Ragged)
    rows = got.split()
    assert [r.shape for r in rows] == [r.shape for r in reference]
    for row, want in zip(rows, reference, strict=True):
        assert row.dtype == np.float32
        np.testing.assert_allclose(row, want, atol=atol)


def _torch(spec, packed: bool):
    backend = create_backend("torch", spec, BackendOptions(threads=1))
    with mock.patch.object(packed_encoder, "usable", return_value=packed):
        backend.load()
    assert (backend.packed is not None) is packed
    return backend


@pytest.mark.parametrize("packed", [True, False], ids=["packed", "padded"])
def test_torch_token_states_equal_transformers(spec, batch, reference, packed):
    backend = _torch(spec, packed)
    _check(backend.forward(batch), reference, 1e-4)
    _check(run_to_end(backend.forward_in_steps(batch)), reference, 1e-4)  # a bulk batch, in steps
    first, rest = batch.split(2)  # what the worker's pacing and out-of-memory halving cut
    _check(Ragged.join([backend.forward(first), backend.forward(rest)]), reference, 1e-4)
    pooled = batch.split(len(reference))[0]
    pooled.token_states = False  # the same backend still pools the next batch
    assert backend.forward(pooled).shape == (len(reference), spec.hidden_size)


@pytest.mark.parametrize("engine,library", [("onnx", "onnxruntime"), ("ctranslate2", "ctranslate2")])
def test_converted_engines_token_states_equal_transformers(spec, batch, reference, engine, library, tmp_path):
    pytest.importorskip(library)
    backend = create_backend(engine, spec, BackendOptions(threads=1, cache_dir=str(tmp_path)))
    backend.load()
    _check(backend.forward(batch), reference, 1e-4)
