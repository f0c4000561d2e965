"""A model directory read into its ModelSpec, without importing torch.

The frontend needs the kind, the tokenizer and the post-processing; the worker needs the pooling and
the modules after it. Both read them here, from the files sentence-transformers and transformers
write: config.json (here), modules.json and each module's config.json (st_pipeline.py),
config_sentence_transformers.json, sentence_bert_config.json and tokenizer_config.json
(st_config.py). A model encoderd cannot reproduce exactly is refused (ModelLoadError), never
approximated: a silently different vector is worse than a model that does not load.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path

import msgspec

from .model_files import read_json
from .model_spec import (
    DUAL_ENCODER_KINDS,
    RETRIEVAL_CLASSES,
    ModelKind,
    ModelLoadError,
    ModelSpec,
    Pooling,
    ScoreActivation,
    check_prompts,
)
from .st_config import check_tokenizer_settings, check_transformer_settings, lowercase, saved_settings
from .st_pipeline import Pipeline, check_head_modules, check_transformer, embedding_pipeline

log = logging.getLogger(__name__)


def _pad_token_id(config: dict) -> int:
    pad = _text_config(config).get("pad_token_id")
    return pad if isinstance(pad, int) else 0


def detect_kind(config: dict, modules: Sequence[dict] = ()) -> ModelKind:
    architectures = config.get("architectures") or []
    module_types = [m.get("type", "") for m in modules]
    if any(a.endswith("ForSequenceClassification") for a in architectures):
        n_labels = len(config.get("id2label") or {}) or config.get("num_labels", 2)
        return ModelKind.RERANKER if n_labels == 1 else ModelKind.CLASSIFIER
    if config.get("model_type") in RETRIEVAL_CLASSES or any(a in RETRIEVAL_CLASSES.values() for a in architectures):
        return ModelKind.COLPALI
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


def _cross_encoder_activation(model_dir: Path, config: dict) -> ScoreActivation | None:
    """The activation a sentence-transformers CrossEncoder config names, where its releases put it:
    config_sentence_transformers.json (v5+; read, as sentence-transformers does, only beside a
    modules.json), config.json's `sentence_transformers` (v4), or config.json's
    `sbert_ce_default_activation_function` (older); None when none does."""
    saved = read_json(model_dir / "config_sentence_transformers.json") if (model_dir / "modules.json").exists() else {}
    named = (
        saved.get("activation_fn")
        or (config.get("sentence_transformers") or {}).get("activation_fn")
        or config.get("sbert_ce_default_activation_function")
    )
    if not named:
        return None
    known = {"Sigmoid": ScoreActivation.SIGMOID, "Identity": ScoreActivation.IDENTITY}
    short = str(named).rpartition(".")[2]
    if not str(named).startswith("torch.nn.") or short not in known:
        raise ModelLoadError(
            f"{model_dir}: the cross-encoder config names activation {named!r}; encoderd applies "
            f"torch.nn Sigmoid or Identity only"
        )
    return known[short]


_PROBLEM_TYPES = {
    "single_label_classification": ScoreActivation.SOFTMAX,
    "multi_label_classification": ScoreActivation.SIGMOID,
    "regression": ScoreActivation.IDENTITY,
}


def _score_activation(model_dir: Path, config: dict, kind: ModelKind) -> ScoreActivation:
    """One label (a cross-encoder): sigmoid, or the activation its CrossEncoder config names.
    Several: by `problem_type`, as transformers' text-classification pipeline reads it; without
    one, a CrossEncoder's Sigmoid (labels scored alone), else softmax. A CrossEncoder's Identity
    (its default for several labels: predict returns logits) is what Classify's raw_scores gives."""
    if kind == ModelKind.RERANKER:
        return _cross_encoder_activation(model_dir, config) or ScoreActivation.SIGMOID
    if kind != ModelKind.CLASSIFIER:
        return ScoreActivation.SIGMOID  # not used
    problem = config.get("problem_type")
    if problem is None:
        named = _cross_encoder_activation(model_dir, config)
        return ScoreActivation.SIGMOID if named == ScoreActivation.SIGMOID else ScoreActivation.SOFTMAX
    if problem not in _PROBLEM_TYPES:
        raise ModelLoadError(
            f"{model_dir / 'config.json'}: problem_type {problem!r} is not one encoderd knows "
            f"({', '.join(_PROBLEM_TYPES)})"
        )
    return _PROBLEM_TYPES[problem]


def _text_config(config: dict) -> dict:
    """The text tower's settings: dual encoders keep them apart, ColPali / ColQwen2 inside their VLM's."""
    return (config.get("vlm_config") or {}).get("text_config") or config.get("text_config") or config


def _position_limit(config: dict) -> int:
    """The most tokens the model's position table holds."""
    text_config = _text_config(config)
    position_limit = text_config.get("max_position_embeddings") or 512
    # RoBERTa-style models (MPNet, CLAP's text tower too) number positions from pad_token_id + 1.
    if text_config.get("model_type") in ("roberta", "xlm-roberta", "camembert", "mpnet", "clap_text_model"):
        position_limit -= 2
    return position_limit


def _max_length(model_dir: Path, config: dict) -> int:
    """sentence-transformers' order: its Transformer's processor_kwargs, max_seq_length, then the
    tokenizer's model_max_length; never past the position table."""
    st_config = read_json(model_dir / "sentence_bert_config.json")
    tok_config = read_json(model_dir / "tokenizer_config.json")
    candidates = [
        check_transformer_settings(model_dir),
        st_config.get("max_seq_length"),
        tok_config.get("model_max_length"),
    ]
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
            "only for a repository you trust. Without that code the model would load as a different class."
        )


def require_known_architectures(path: str, trust_remote_code: bool) -> None:
    """Worker side, before transformers loads weights (imports transformers): every architecture
    config.json names is a transformers class or trusted repository code. A checkpoint saved from
    any other class would load as the stock class of its model_type, its own layers dropped."""
    import transformers

    config = read_json(Path(path) / "config.json")
    require_trusted_code(path, config, trust_remote_code)
    known = set(dir(transformers))
    unknown = [a for a in config.get("architectures") or [] if a not in known and a not in _OWN_ARCHITECTURES]
    if unknown and not config.get("auto_map"):
        raise ModelLoadError(
            f"{path}: config.json names architecture {', '.join(unknown)}, which transformers "
            f"{transformers.__version__} does not define, and ships no code for it (no auto_map, so "
            f"{TRUST_REMOTE_CODE_FLAG} cannot help): serve it with a transformers release that has it"
        )


def _with_overrides(spec: ModelSpec, config: dict, pooling: Pooling | None, max_length: int | None) -> ModelSpec:
    """The operator's --pooling / --max-length over what the model's files say, checked against the model."""
    if pooling is not None and spec.kind != ModelKind.EMBEDDING:
        raise ModelLoadError(
            f"--pooling {pooling.value} for {spec.name}: pooling applies to embedding models, "
            f"and {spec.name} is {spec.kind.a_model}"
        )
    if max_length is not None:
        limit = _position_limit(config)
        if not MIN_MAX_LENGTH <= max_length <= limit:
            raise ModelLoadError(
                f"--max-length {max_length} for {spec.name}: its position table holds {limit} "
                f"tokens; choose {MIN_MAX_LENGTH}..{limit}"
            )
    if pooling is not None:
        # One mode instead of the model's own: the pooled width changes with the number of modes.
        if spec.dense and len(spec.pooling) != 1:
            raise ModelLoadError(
                f"--pooling {pooling.value} for {spec.name}: its Dense module reads the "
                f"concatenation of {len(spec.pooling)} pooling modes; one mode would not fit it"
            )
        width = spec.hidden_size if spec.dense else spec.hidden_size // len(spec.pooling)
        spec = msgspec.structs.replace(spec, pooling=(pooling,), hidden_size=width)
    return msgspec.structs.replace(spec, max_length=max_length or spec.max_length)


def _output_size(config: dict, kind: ModelKind, pipeline: Pipeline) -> int:
    """The output width before the worker reports it (a ColBERT projection may change it)."""
    if kind in DUAL_ENCODER_KINDS:
        return int(config.get("projection_dim") or 0)
    if kind == ModelKind.COLPALI:
        return int(config.get("embedding_dim") or 128)
    if kind == ModelKind.SPARSE:
        return int(config.get("vocab_size") or 0)
    if pipeline.dense:
        return pipeline.dense[-1].out_features
    hidden = int(config.get("hidden_size") or config.get("d_model") or config.get("dim") or 0)  # dim: DistilBERT
    return hidden * len(pipeline.pooling)


def _retrieval_kind(path: str, config: dict, kind: ModelKind) -> ModelKind:
    """`colpali` asked of a CLIP model is the per-patch CLIP mode's old name: still served, as
    clip_patches, with a warning; asked of any other model that is not ColPali / ColQwen2, refused."""
    if kind != ModelKind.COLPALI or config.get("model_type") in RETRIEVAL_CLASSES:
        return kind
    if config.get("model_type") == "clip" or "CLIPModel" in (config.get("architectures") or []):
        log.warning(
            "%s: the :colpali kind on a CLIP model is deprecated; it is now called :clip_patches (per-patch "
            "CLIP vectors). :colpali serves ColPali / ColQwen2 retrieval checkpoints",
            path,
        )
        return ModelKind.CLIP_PATCHES
    raise ModelLoadError(
        f"{path}: the colpali kind serves ColPaliForRetrieval and ColQwen2ForRetrieval checkpoints "
        f"(model_type colpali, colqwen2), not model_type {config.get('model_type')!r}; for per-patch "
        "vectors of a CLIP model use :clip_patches"
    )


def load_model_spec(
    name: str,
    path: str,
    kind: ModelKind | None = None,
    *,
    pooling: Pooling | None = None,
    max_length: int | None = None,
    trust_remote_code: bool = False,
) -> ModelSpec:
    """The spec from the model's files; `pooling` and `max_length` override them (serve flags)."""
    model_dir = Path(path)
    config = read_json(model_dir / "config.json")
    modules: list[dict] = read_json(model_dir / "modules.json") or []
    if not config:
        if modules:  # a sentence-transformers model whose first module is no transformers model
            check_transformer(model_dir, modules[0])
        raise ModelLoadError(f"{path} has no config.json: not a transformers model directory")
    require_trusted_code(path, config, trust_remote_code)
    kind = _retrieval_kind(path, config, kind or detect_kind(config, modules))
    id2label = config.get("id2label") or {}
    labels = (
        tuple(str(id2label[k]) for k in sorted(id2label, key=int))
        if kind in (ModelKind.RERANKER, ModelKind.CLASSIFIER)
        else ()
    )
    pipeline = Pipeline()
    if kind == ModelKind.EMBEDDING:
        pipeline = embedding_pipeline(model_dir, modules, int(config.get("hidden_size") or 0))
    elif kind in (ModelKind.RERANKER, ModelKind.CLASSIFIER):
        check_head_modules(model_dir, modules)
    saved = saved_settings(model_dir, kind == ModelKind.EMBEDDING)
    check_tokenizer_settings(model_dir, config, pairs=kind == ModelKind.RERANKER)
    spec = ModelSpec(
        name=name,
        path=str(model_dir),
        kind=kind,
        max_length=_max_length(model_dir, config),
        pooling=pipeline.pooling,
        # Dual encoders compare across modalities by cosine: unit vectors unless a request says otherwise.
        normalize=pipeline.normalize
        or kind in (*DUAL_ENCODER_KINDS, ModelKind.COLPALI)
        or (kind != ModelKind.EMBEDDING and any(m.get("type", "").endswith("Normalize") for m in modules)),
        labels=labels,
        hidden_size=_output_size(config, kind, pipeline),
        prompts=saved.prompts,
        default_prompt_name=saved.default_prompt_name,
        include_prompt=pipeline.include_prompt,
        dense=pipeline.dense,
        lowercase=lowercase(model_dir),
        score_activation=_score_activation(model_dir, config, kind),
        model_type=str(config.get("model_type") or ""),
        pad_token_id=_pad_token_id(config),
        truncate_dim=saved.truncate_dim,
    )
    spec = _with_overrides(spec, config, pooling, max_length)
    check_prompts(spec, spec.prompts)
    return spec
