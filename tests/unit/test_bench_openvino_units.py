"""bench/openvino.py: the OpenVINO reference runs the same windows as the in-process
sentence-transformers reference, is timed only above its fidelity floor, and its vectors are compared
with float32 sentence-transformers on the same weights. The runs need the OpenVINO virtualenv
(`encoderd bench --openvino` makes it once, under ~/.cache/encoderd-bench); without it they skip."""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import pytest

from encoderd.bench.corpus import TokenCounter, Workload, make_corpus
from encoderd.bench.flops import FlopModel
from encoderd.bench.openvino import min_cosine, openvino_venv, reference_vectors, run_openvino, windows
from encoderd.workers.contract.model_files import default_model_path
from encoderd.workers.contract.spec_reader import load_model_spec

CACHE = Path.home() / ".cache" / "encoderd-bench"
VENV_READY = (CACHE / "venv-openvino" / ".encoderd-bench-ready").exists()


def _args(**kw) -> argparse.Namespace:
    base = {"concurrency": 2, "batch": 4, "bulk_requests": 3, "bulk_seconds": 600.0, "seed": 0, "cache_dir": CACHE}
    return argparse.Namespace(**{**base, **kw})


def _work(n: int) -> Workload:
    model = default_model_path()
    counter = TokenCounter(model)
    corpus = make_corpus(counter, n, seed=3)
    real = np.minimum(counter.lengths(corpus), load_model_spec("m", model).max_length)
    return Workload(corpus, real, [], np.zeros(0, dtype=np.int64), [])


def test_windows_are_the_in_process_reference_slices():
    # run_bulk_in_process: window w holds (w*C*B + j) % n, C*B at a time, until bulk_requests*B inputs.
    work = argparse.Namespace(corpus=[str(i) for i in range(5)])
    got = windows(work, _args())  # 3 requests x 4 = 12 inputs in windows of 8 over 5 texts
    assert got == [[0, 1, 2, 3, 4, 0, 1, 2], [3, 4, 0, 1]]


def test_min_cosine_is_the_worst_row():
    a = np.array([[1.0, 0.0], [0.0, 1.0]])
    b = np.array([[1.0, 0.0], [1.0, 1.0]])
    assert min_cosine(a, b) == pytest.approx(2**-0.5)


@pytest.mark.skipif(not VENV_READY, reason="no OpenVINO virtualenv (encoderd bench --openvino makes it)")
@pytest.mark.parametrize("name", ["openvino", "openvino-int8"])
def test_openvino_is_timed_above_its_floor_against_float32_sentence_transformers(name):
    work = _work(24)
    model = default_model_path()
    reference = reference_vectors(model, work.corpus, threads=1)
    peak = {"bfloat16": 1e3, "float32": 1e3}
    row = run_openvino(openvino_venv(CACHE), name, model, work, _args(), FlopModel.from_dir(model), peak, 1, reference)
    assert row.errors == 0, row.notes
    assert "skipped" not in row.notes and row.tokens_per_s > 0
    cosine = float(row.notes.split("float32 sentence-transformers ")[1].split()[0])
    assert cosine >= (0.999 if name == "openvino" else 0.99)


@pytest.mark.skipif(not VENV_READY, reason="no OpenVINO virtualenv (encoderd bench --openvino makes it)")
def test_a_variant_below_its_floor_is_reported_and_not_timed():
    work = _work(12)
    model = default_model_path()
    # The real float32 vectors, each paired with another input's: OpenVINO's then disagree.
    reference = np.roll(reference_vectors(model, work.corpus, threads=1), 1, axis=0)
    row = run_openvino(
        openvino_venv(CACHE), "openvino", model, work, _args(), FlopModel.from_dir(model), {}, 1, reference
    )
    assert row.notes.startswith("skipped, below its fidelity floor")
    assert row.tokens_per_s == 0 and row.calls == 0
