"""Deterministic test models built offline from the bundled MiniLM weights.

The encoder body is the real all-MiniLM-L6-v2; only the classification
heads are new: computed (reranker) or drawn from a seeded generator
(classifier), so every run builds the same model.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np

from encoderd.workers.contract.model_files import default_model_path

from .corpus import sentences

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json")
# The reranker head's calibration pairs: fixed, and disjoint from the texts the tests score.
CALIBRATION_QUERIES = (
    "what is a cross encoder",
    "weather and finance news",
    "protein sequence attention kernel",
    "how fast can a search engine serve queries",
)
RERANKER_SCORE_STD = 3.0  # logits over the calibration pairs; tests turn sigmoids back into logits, so not 10


def _random_head(model) -> None:
    import torch

    with torch.no_grad():  # a head with some spread, so scores are not all ~0.5
        model.classifier.weight.normal_(0, 0.5, generator=torch.Generator().manual_seed(1))
        model.classifier.bias.zero_()


def _pooled_features(model, pairs: list[tuple[str, str]]) -> np.ndarray:
    """What the classification head reads: the BERT pooler output of each (query, passage)."""
    import torch
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(default_model_path())
    enc = tok(
        [q for q, _ in pairs], [p for _, p in pairs], padding=True, truncation=True, max_length=256, return_tensors="pt"
    )
    with torch.no_grad():
        return model.base_model(**enc).pooler_output.double().numpy()


def _principal_head(model) -> None:
    """Score along the first principal component of the pooled features of fixed calibration
    pairs, centred and scaled to RERANKER_SCORE_STD logits.

    A random head reads a direction the features barely vary along: the test texts score within
    ~1 logit (std 0.25), int8 noise of ~0.2 logit swaps near-ties, and the ordering tests measure
    that artefact rather than the engine. A trained cross-encoder's head reads the direction its
    fine-tuned features vary most along (relevance), spreading scores over several logits; the
    principal component stands in for it.
    """
    import torch

    pairs = [(q, p) for i, q in enumerate(CALIBRATION_QUERIES) for p in sentences(32, max_words=200, seed=101 + i)]
    features = _pooled_features(model, pairs)
    mean = features.mean(0)
    direction = np.linalg.svd(features - mean, full_matrices=False)[2][0]
    direction *= np.sign(direction[np.argmax(np.abs(direction))])  # SVD's sign is arbitrary: fix it
    weight = direction * RERANKER_SCORE_STD / ((features - mean) @ direction).std()
    with torch.no_grad():
        model.classifier.weight.copy_(torch.from_numpy(weight)[None])
        model.classifier.bias.fill_(float(-mean @ weight))


def _build_sequence_classifier(out_dir: Path, labels: list[str], set_head) -> Path:
    import torch
    from transformers import AutoModelForSequenceClassification

    out_dir = Path(out_dir)
    if (out_dir / "config.json").exists():
        return out_dir
    torch.manual_seed(0)
    model = AutoModelForSequenceClassification.from_pretrained(
        default_model_path(),
        num_labels=len(labels),
        id2label=dict(enumerate(labels)),
        label2id={label: i for i, label in enumerate(labels)},
    ).eval()
    set_head(model)
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    model.save_pretrained(tmp)
    for name in TOKENIZER_FILES:
        shutil.copy(Path(default_model_path()) / name, tmp / name)
    tmp.rename(out_dir)
    return out_dir


def build_reranker(out_dir: Path) -> Path:
    """A one-label cross-encoder (MiniLM body + a principal-component head, see _principal_head)."""
    return _build_sequence_classifier(out_dir, ["LABEL_0"], _principal_head)


def build_classifier(out_dir: Path) -> Path:
    """A three-label sentiment-style classifier (MiniLM body + seeded random head)."""
    return _build_sequence_classifier(out_dir, ["negative", "neutral", "positive"], _random_head)
