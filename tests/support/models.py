"""Deterministic test models built offline from the bundled MiniLM weights.

The encoder body is the real all-MiniLM-L6-v2; only the classification
heads are new, drawn from a seeded generator, so every run builds the same
model bit for bit.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from encoderd.workers.model_spec import default_model_path

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json")


def _build_sequence_classifier(out_dir: Path, labels: list[str]) -> Path:
    import torch
    from transformers import AutoModelForSequenceClassification

    out_dir = Path(out_dir)
    if (out_dir / "config.json").exists():
        return out_dir
    torch.manual_seed(0)
    model = AutoModelForSequenceClassification.from_pretrained(
        default_model_path(), num_labels=len(labels),
        id2label=dict(enumerate(labels)), label2id={label: i for i, label in enumerate(labels)})
    with torch.no_grad():  # a head with some spread, so scores are not all ~0.5
        model.classifier.weight.normal_(0, 0.5, generator=torch.Generator().manual_seed(1))
        model.classifier.bias.zero_()
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    model.save_pretrained(tmp)
    for name in TOKENIZER_FILES:
        shutil.copy(Path(default_model_path()) / name, tmp / name)
    tmp.rename(out_dir)
    return out_dir


def build_reranker(out_dir: Path) -> Path:
    """A one-label cross-encoder (MiniLM body + seeded head)."""
    return _build_sequence_classifier(out_dir, ["LABEL_0"])


def build_classifier(out_dir: Path) -> Path:
    """A three-label sentiment-style classifier (MiniLM body + seeded head)."""
    return _build_sequence_classifier(out_dir, ["negative", "neutral", "positive"])
