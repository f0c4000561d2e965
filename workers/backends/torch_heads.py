"""What the torch engine computes for the multi-modal, multi-vector and sparse kinds.

Text batches arrive padded (input_ids, attention_mask); media batches as one
float32 tensor. Per kind:

  clip      projected text / image embedding (CLIPModel.get_*_features), unnormalized;
  clap      projected text / audio embedding (ClapModel normalizes them itself);
  clip_patches  one unit vector per text token and per image patch (CLS included), each
            hidden state put through the tower's final norm and CLIP's projection into the
            joint space: ColPali's late-interaction semantics on a CLIP model;
  colpali   ColPaliForRetrieval / ColQwen2ForRetrieval as transformers computes them: the
            model's `embeddings` (unit vectors) at every real position of the sequence its
            processor built, a query's (prefix, text, augmentation tokens) or a page's (image
            tokens and the visual prompt); retrieval.py;
  colbert   one unit vector per token: the encoder's last hidden states through the
            model's ColBERT projection when it has one;
  sparse    SPLADE: max over the sequence of log(1 + relu(MLM logits)), masked;
            only the non-zero entries travel back.

Multi-vector and sparse outputs are ragged (protocol.Ragged): only real tokens
are kept, so no padding crosses the wire.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from ..contract.errors import InputRefused
from ..contract.model_spec import RETRIEVAL_CLASSES, ModelKind, ModelLoadError
from ..contract.protocol import MediaBatch, Ragged
from . import retrieval

# Most MLM logits (rows x length x vocabulary) one SPLADE step holds: 64 Mi floats, 256 MiB in float32.
SPARSE_LOGITS_BUDGET = 64 * 1024 * 1024


def model_class(kind: ModelKind, model_type: str = ""):
    import transformers
    from transformers import AutoModel, AutoModelForMaskedLM, AutoModelForSequenceClassification

    if kind == ModelKind.COLPALI:  # no Auto class maps them: by the model_type the spec checked
        return getattr(transformers, RETRIEVAL_CLASSES[model_type])
    if kind in (ModelKind.RERANKER, ModelKind.CLASSIFIER):
        return AutoModelForSequenceClassification
    if kind == ModelKind.SPARSE:
        return AutoModelForMaskedLM
    return AutoModel


# ------------------------------------------------------------------ ColBERT
def load_colbert_projection(model_dir: str) -> torch.nn.Linear | None:
    """The linear map ColBERT puts after the encoder, if the model has one:
    a sentence-transformers / PyLate Dense module (modules.json), or the
    `linear.weight` Stanford's HF_ColBERT saves beside the encoder's weights."""
    root = Path(model_dir)
    modules = json.loads((root / "modules.json").read_text()) if (root / "modules.json").exists() else []
    for module in modules:
        if module.get("type", "").endswith("Dense"):
            return _dense_module(root / module.get("path", ""))
    weights = _tensors(root / "model.safetensors", ("linear.weight", "linear.bias"))
    return _linear(weights) if "linear.weight" in weights else None


def _dense_module(path: Path) -> torch.nn.Linear:
    config = json.loads((path / "config.json").read_text())
    activation = config.get("activation_function", "torch.nn.modules.linear.Identity")
    if not activation.endswith("Identity"):
        raise ModelLoadError(
            f"{path}: a ColBERT projection with activation {activation} is not supported (Identity only)"
        )
    weights = _tensors(path / "model.safetensors", ("linear.weight", "linear.bias"))
    if not weights and (path / "pytorch_model.bin").exists():
        weights = torch.load(path / "pytorch_model.bin", map_location="cpu", weights_only=True)
    if "linear.weight" not in weights:
        raise ModelLoadError(f"{path}: Dense module without linear.weight")
    return _linear(weights)


def _tensors(path: Path, names: tuple[str, ...]) -> dict[str, torch.Tensor]:
    if not path.exists():
        return {}
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        return {name: f.get_tensor(name) for name in names if name in f.keys()}  # noqa: SIM118 - safe_open has no __contains__


def _linear(weights: dict[str, torch.Tensor]) -> torch.nn.Linear:
    weight = weights["linear.weight"]
    layer = torch.nn.Linear(weight.shape[1], weight.shape[0], bias="linear.bias" in weights)
    with torch.no_grad():
        layer.weight.copy_(weight)
        if "linear.bias" in weights:
            layer.bias.copy_(weights["linear.bias"])
    return layer


# ------------------------------------------------------------------ outputs
def output_dim(model, kind: ModelKind, projection: torch.nn.Linear | None) -> int:
    if kind in (ModelKind.CLIP, ModelKind.CLAP, ModelKind.CLIP_PATCHES):
        return model.config.projection_dim
    if kind == ModelKind.COLPALI:
        return model.config.embedding_dim
    if kind == ModelKind.SPARSE:
        return model.config.vocab_size
    if kind == ModelKind.COLBERT and projection is not None:
        return projection.out_features
    return model.config.hidden_size


def unit_rows(vectors: torch.Tensor, mask: torch.Tensor) -> Ragged:
    """(n, L, d) vectors and an (n, L) mask -> the real positions' vectors, L2-normalized, ragged."""
    keep = mask.bool()
    rows = F.normalize(vectors[keep].float(), dim=-1)  # row-major: input 0's tokens first, as packed
    cu = torch.zeros(mask.shape[0] + 1, dtype=torch.int32)
    torch.cumsum(keep.sum(dim=1).cpu(), dim=0, out=cu[1:])
    return Ragged(rows.cpu().numpy(), cu.numpy())


def splade(model, inputs: dict[str, torch.Tensor]) -> Ragged:
    """SPLADE vectors of a padded batch, in row chunks so the logits stay within budget."""
    n, length = inputs["input_ids"].shape
    step = max(1, SPARSE_LOGITS_BUDGET // (length * model.config.vocab_size))
    pooled = []
    for start in range(0, n, step):
        chunk = {k: v[start : start + step] for k, v in inputs.items()}
        logits = model(**chunk).logits
        # Weights are >= 0, so zeroing the padding cannot change the max.
        weights = torch.log1p(torch.relu(logits.float())) * chunk["attention_mask"].unsqueeze(-1)
        pooled.append(weights.max(dim=1).values)
    dense = torch.cat(pooled)
    where = dense.nonzero()  # (nnz, 2), row-major: by input, then ascending vocabulary id
    cu = torch.zeros(n + 1, dtype=torch.int32)
    torch.cumsum(torch.bincount(where[:, 0], minlength=n).cpu(), dim=0, out=cu[1:])
    values = dense[where[:, 0], where[:, 1]]
    return Ragged(values.cpu().numpy()[:, None], cu.numpy(), where[:, 1].to(torch.int32).cpu().numpy())


def forward_text(backend, inputs: dict[str, torch.Tensor]):
    """Text batches of the kinds this module serves."""
    kind, model = backend.spec.kind, backend.model
    text = {"input_ids": inputs["input_ids"], "attention_mask": inputs["attention_mask"]}
    if kind in (ModelKind.CLIP, ModelKind.CLAP):
        return model.get_text_features(**text).pooler_output.float().cpu().numpy()
    if kind == ModelKind.COLPALI:
        return retrieval.query_rows(model, text)
    if kind == ModelKind.CLIP_PATCHES:
        hidden = model.get_text_features(**text).last_hidden_state  # after the text tower's final norm
        return unit_rows(model.text_projection(hidden), text["attention_mask"])
    if kind == ModelKind.COLBERT:
        hidden = model(**inputs).last_hidden_state
        if backend.projection is not None:
            hidden = backend.projection(hidden)
        return unit_rows(hidden, text["attention_mask"])
    if kind == ModelKind.SPARSE:
        return splade(model, inputs)
    raise ValueError(f"no text head for {kind.value} models")


def forward_media(backend, batch: MediaBatch):
    """Image / audio batches: one tensor (n, *shape) from the frontend's preprocessing."""
    kind, model = backend.spec.kind, backend.model
    features = torch.tensor(batch.features, dtype=backend.model.dtype, device=backend.device)
    if batch.modality == "image" and kind == ModelKind.CLIP:
        return model.get_image_features(pixel_values=features).pooler_output.float().cpu().numpy()
    if batch.modality == "image" and kind == ModelKind.COLPALI:
        return retrieval.page_rows(model, batch, backend.device)
    if batch.modality == "image" and kind == ModelKind.CLIP_PATCHES:
        hidden = model.get_image_features(pixel_values=features).last_hidden_state
        patches = model.visual_projection(model.vision_model.post_layernorm(hidden))
        return unit_rows(patches, torch.ones(patches.shape[:2], dtype=torch.int64, device=patches.device))
    if batch.modality == "audio" and kind == ModelKind.CLAP:
        flags = batch.flags if batch.flags is not None else np.zeros(batch.size, dtype=np.int32)
        is_longer = torch.tensor(flags, dtype=torch.bool, device=backend.device)[:, None]
        return (
            model.get_audio_features(input_features=features, is_longer=is_longer).pooler_output.float().cpu().numpy()
        )
    raise InputRefused(f"{kind.value} models take no {batch.modality} input")


def media_warmup_shapes(model, kind: ModelKind, model_dir: str) -> dict[str, tuple[int, ...]]:
    """One input's shape per media modality, for warm-up (best effort: {} when unknown)."""
    if kind in (ModelKind.CLIP, ModelKind.CLIP_PATCHES):
        size = model.config.vision_config.image_size
        return {"image": (model.config.vision_config.num_channels, size, size)}
    if kind == ModelKind.CLAP:
        path = Path(model_dir) / "preprocessor_config.json"
        config = json.loads(path.read_text()) if path.exists() else {}
        if {"nb_max_samples", "hop_length", "feature_size"} <= config.keys():
            channels = 4 if model.config.audio_config.enable_fusion else 1
            frames = config["nb_max_samples"] // config["hop_length"] + 1
            return {"audio": (channels, frames, config["feature_size"])}
    return {}
