"""Issue 43 item 3: a reranker or classifier that passes the fidelity self-check stays within its
ceiling off the calibration set, or the check refuses it.

The seeded tiny int8 heads that passed the check while their served probabilities broke the 0.06
ceiling on the holdout (bench/fidelity_holdout.py): a deberta-v2 reranker (check 0.011, holdout
0.124) and a qwen3 classifier (0.046 / 0.110). Their logit errors carry over from the set to the
holdout (0.87 / 0.98 and 0.22 / 0.27); the set's scores sat where sigmoid is flat. The holdout's
reference is transformers' own forward on each input alone (no padding), float32.
"""

from __future__ import annotations

import inspect

import numpy as np
import pytest
import torch
import transformers
from support.families import build

from encoderd.bench.fidelity_holdout import holdout_inputs
from encoderd.workers import fidelity
from encoderd.workers.backends import BackendOptions, create_backend
from encoderd.workers.contract.model_spec import ModelKind
from encoderd.workers.contract.protocol import TokenBatch
from encoderd.workers.contract.spec_reader import load_model_spec
from encoderd.workers.contract.tokenizer import load_tokenizer

# Each builds, quantizes and checks a tiny model, then runs 148 holdout pairs: ~1 min on a quiet 2-core
# host; a shared one took 4-6 min.
pytestmark = pytest.mark.timeout(600)
CEILING = fidelity.FLOORS["int8"]["max_prob_diff"]


def holdout_logits(spec, backend) -> tuple[np.ndarray, np.ndarray]:
    """(served, reference) logits of the holdout, in its order: the backend in batches of 16, and
    transformers' float32 forward one input at a time."""
    tokenizer = load_tokenizer(spec.path, spec.lowercase)
    tokenizer.no_padding()
    tokenizer.enable_truncation(spec.max_length)
    encodings = tokenizer.encode_batch(holdout_inputs(spec.kind))
    ids = [np.asarray(e.ids, dtype=np.int32) for e in encodings]
    types = [np.asarray(e.type_ids, dtype=np.int32) for e in encodings] if spec.kind == ModelKind.RERANKER else None
    starts = range(0, len(ids), 16)
    served = np.concatenate(
        [backend.forward(TokenBatch.from_sequences(-1, ids[i : i + 16], types and types[i : i + 16])) for i in starts]
    )
    model = transformers.AutoModelForSequenceClassification.from_pretrained(spec.path, dtype=torch.float32).eval()
    takes_types = types is not None and "token_type_ids" in inspect.signature(model.forward).parameters
    with torch.inference_mode():
        reference = np.concatenate(
            [
                model(
                    input_ids=torch.from_numpy(ids[i][None].astype(np.int64)),
                    **({"token_type_ids": torch.from_numpy(types[i][None].astype(np.int64))} if takes_types else {}),
                ).logits.numpy()
                for i in range(len(ids))
            ]
        )
    return served, reference


@pytest.mark.parametrize("family,kind", [("deberta-v2", "reranker"), ("qwen3", "classifier")])
def test_an_int8_head_that_passes_the_check_holds_off_the_set(family, kind, tmp_path_factory):
    """Fails on the old code: both passed the check (max_prob_diff at the set's own scores) and served
    the holdout 0.124 and 0.110 from transformers' probabilities."""
    spec = load_model_spec("m", str(build(family, kind, tmp_path_factory.mktemp(f"{family}-{kind}") / "model")))
    cache = str(tmp_path_factory.mktemp("cache"))
    backend = create_backend("torch", spec, BackendOptions(dtype="int8", threads=2, cache_dir=cache, max_batch_size=16))
    backend.load()
    report = fidelity.self_check(backend, spec, allow_low=True)
    if report.status != fidelity.PASSED:
        return  # refused without --allow-low-fidelity: never served so
    served, reference = holdout_logits(spec, backend)
    difference = fidelity.served_difference(served, reference, spec.score_activation)
    assert difference <= CEILING, f"passed the check ({fidelity.describe(report.figures)}) but served {difference}"
