"""An embedding model's sentence-transformers modules (modules.json and each module's config.json),
read into what encoderd runs after the transformer: pooling, Dense, Normalize.

Older and current sentence-transformers releases write different formats; both are read. A module
encoderd cannot reproduce exactly is refused (ModelLoadError), never approximated.
"""

from __future__ import annotations

from pathlib import Path

import msgspec

from .model_files import read_json
from .model_spec import DENSE_ACTIVATIONS, DenseModule, ModelLoadError, Pooling

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


def check_transformer(model_dir: Path, module: dict) -> None:
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


class Pipeline(msgspec.Struct, frozen=True):
    """An embedding model's sentence-transformers modules, as encoderd runs them."""

    pooling: tuple[Pooling, ...] = (Pooling.MEAN,)
    include_prompt: bool = True
    dense: tuple[DenseModule, ...] = ()
    normalize: bool = False


def embedding_pipeline(model_dir: Path, modules: list[dict], hidden_size: int) -> Pipeline:
    """Transformer, Pooling, then any Dense / Normalize / Dropout modules; anything else is refused.
    No modules.json: what SentenceTransformer builds for a plain transformers model (mean pooling)."""
    if not modules:
        return Pipeline()
    check_transformer(model_dir, modules[0])
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
    return Pipeline(pooling, include_prompt, tuple(dense), normalize_next)


def _check_widths(model_dir: Path, width: int, dense: list[DenseModule]) -> None:
    for module in dense:
        if width and module.in_features != width:
            raise ModelLoadError(
                f"{module.path}: Dense takes {module.in_features} features but receives {width} "
                f"(pooled or projected before it) in {model_dir}"
            )
        width = module.out_features


def check_head_modules(model_dir: Path, modules: list[dict]) -> None:
    """A reranker or classifier runs the transformers head alone: modules after it would be skipped."""
    for module in modules[1:]:
        raise _module_error(
            model_dir,
            module,
            "follows the classification model; encoderd computes the transformers sequence-classification head only",
        )
