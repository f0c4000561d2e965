"""The settings sentence-transformers (6.3) reads from a model directory besides its modules'
configs, each served as it applies it or refused at start naming the key and its file.

config_sentence_transformers.json (SentenceTransformer / CrossEncoder `_parse_model_config`):
  prompts, default_prompt_name   served (prefixed to the text)
  truncate_dim                   served: the embedding is cut after the model's Normalize, not
                                 re-normalized (server/models/postprocess.py); embedding models only
  activation_fn                  served (a reranker's or classifier's score; spec_reader.py)
  similarity_fn_name             changes no vector (only SentenceTransformer.similarity)
  keep_in_fp32_modules           a CrossEncoder's reduced-precision hint: --dtype float32 computes every
                                 module in float32, a reduced --dtype is governed by the self-check
  requirements                   the package versions the model needs, checked as sentence-transformers
                                 checks them (an unmet one refuses the model)
  __version__, model_type        informational
  Other keys sentence-transformers ignores, and so does encoderd.

sentence_bert_config.json (the Transformer module's init arguments; sentence-transformers fails on
a key it does not know, so encoderd refuses those too):
  max_seq_length, processor_kwargs/tokenizer_args model_max_length: the maximum length (spec_reader.py)
  do_lower_case: texts lower-cased; transformer_task, modality_config, module_output_name: checked
  in st_pipeline.py; unpad_inputs: speed only. Refused unless empty or at their defaults: any other
  processor/model/config argument, processing_kwargs, query_length, document_length, query_expansion,
  tokenizer_name_or_path. model_kwargs may choose the attention kernel and dtype (not the vector).

tokenizer_config.json: transformers builds the tokenizer from it (AutoTokenizer, as
sentence-transformers does; workers/contract/tokenizer.py), which covers lower-casing, special
tokens and BOS/EOS. What lives outside that tokenizer: model_max_length (the maximum length),
truncation_side (left: refused; encoderd's default side is right), split_special_tokens (true:
refused), model_input_names without token_type_ids (refused for a reranker whose model reads
segment types: sentence-transformers would pass none), padding_side (no vector depends on it).
"""

from __future__ import annotations

from importlib import metadata
from pathlib import Path
from typing import Any

import msgspec

from .model_files import read_json
from .model_spec import ModelLoadError

ST_CONFIG = "config_sentence_transformers.json"
TRANSFORMER_CONFIG = "sentence_bert_config.json"
TOKENIZER_CONFIG = "tokenizer_config.json"

# sentence_bert_config.json: keys served or checked elsewhere, and keys that change no vector.
_TRANSFORMER_KEYS_SERVED = {
    "max_seq_length",
    "do_lower_case",
    "transformer_task",
    "modality_config",
    "module_output_name",
    "unpad_inputs",
}
# Keys sentence-transformers accepts whose non-default values encoderd does not compute.
_TRANSFORMER_KEYS_AT_DEFAULT = ("processing_kwargs", "query_length", "document_length", "query_expansion")
_KWARGS_KEYS = {  # current name -> legacy name, each a dict forwarded to transformers
    "processor_kwargs": "tokenizer_args",
    "model_kwargs": "model_args",
    "config_kwargs": "config_args",
}
# What each kwargs dict may hold: the maximum length (served), the attention kernel and load dtype
# (not the vector: encoderd computes at its own --dtype and checks it against float32);
# trust_remote_code is dropped by sentence-transformers itself.
_KWARGS_SERVED = {
    "processor_kwargs": {"model_max_length", "trust_remote_code"},
    "model_kwargs": {"attn_implementation", "torch_dtype", "dtype", "trust_remote_code"},
    "config_kwargs": {"trust_remote_code"},
}


class SavedSettings(msgspec.Struct, frozen=True):
    """What config_sentence_transformers.json says about serving the model."""

    prompts: dict[str, str] = {}
    default_prompt_name: str | None = None
    truncate_dim: int = 0  # 0: none


def _read(path: Path) -> dict:
    config = read_json(path)
    return config if isinstance(config, dict) else {}


def saved_settings(model_dir: Path, embedding: bool) -> SavedSettings:
    """config_sentence_transformers.json, checked; `embedding`: a dense embedding model (the only
    kind sentence-transformers applies truncate_dim to among those encoderd serves)."""
    path = model_dir / ST_CONFIG
    config = _read(path)
    _check_requirements(path, config.get("requirements"))
    return SavedSettings(
        prompts={str(k): str(v) for k, v in (config.get("prompts") or {}).items()},
        default_prompt_name=config.get("default_prompt_name") or None,
        truncate_dim=_truncate_dim(path, config.get("truncate_dim"), embedding),
    )


def _truncate_dim(path: Path, value: Any, embedding: bool) -> int:
    if value is None:
        return 0
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ModelLoadError(f"{path}: truncate_dim {value!r} is not a positive number of dimensions")
    if not embedding:
        raise ModelLoadError(
            f"{path}: truncate_dim {value} applies to dense embedding models here; encoderd does not "
            f"cut this kind's outputs (sentence-transformers' multi-vector encoder re-normalizes each "
            f"token instead)"
        )
    return value


def _check_requirements(path: Path, requirements: Any) -> None:
    """The model's `requirements` ({package: specifier or {specifier, reason}}), as sentence-
    transformers checks them: an unparsable entry is skipped, an unmet one refuses the model."""
    from packaging.specifiers import InvalidSpecifier, SpecifierSet
    from packaging.version import InvalidVersion, Version

    if not isinstance(requirements, dict):
        return
    unmet = []
    for named, requirement in requirements.items():
        package = "torch" if named == "pytorch" else str(named)  # as the __version__ block spells torch
        specifier = requirement.get("specifier", "") if isinstance(requirement, dict) else requirement
        installed = _installed_version(package)
        try:
            if installed is not None and SpecifierSet(str(specifier), prereleases=True).contains(Version(installed)):
                continue
        except (InvalidSpecifier, InvalidVersion):
            continue
        unmet.append(f"{package}{specifier} ({installed or 'not installed'})")
    if unmet:
        raise ModelLoadError(f"{path}: requirements not met: {', '.join(unmet)}")


def _installed_version(package: str) -> str | None:
    if package == "python":
        import platform

        return platform.python_version()
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def check_transformer_settings(model_dir: Path) -> int | None:
    """sentence_bert_config.json's keys, each served or refused; returns the maximum length its
    processor_kwargs set (sentence-transformers' first choice), else None."""
    path = model_dir / TRANSFORMER_CONFIG
    config = _read(path)
    known = _TRANSFORMER_KEYS_SERVED | set(_TRANSFORMER_KEYS_AT_DEFAULT) | {"tokenizer_name_or_path"}
    known |= set(_KWARGS_KEYS) | set(_KWARGS_KEYS.values())
    unknown = sorted(set(config) - known)
    if unknown:
        raise ModelLoadError(
            f"{path}: unknown setting(s) {', '.join(unknown)} (sentence-transformers itself refuses them)"
        )
    for key in _TRANSFORMER_KEYS_AT_DEFAULT:
        if config.get(key):
            raise ModelLoadError(f"{path}: {key} {config[key]!r} is not computed by encoderd")
    if config.get("tokenizer_name_or_path") not in (None, "", "."):
        raise ModelLoadError(
            f"{path}: tokenizer_name_or_path {config['tokenizer_name_or_path']!r}: encoderd uses the "
            f"tokenizer in the model directory only"
        )
    max_length = None
    for current, legacy in _KWARGS_KEYS.items():
        arguments = config.get(current) or config.get(legacy) or {}
        unserved = sorted(set(arguments) - _KWARGS_SERVED[current])
        if unserved:
            raise ModelLoadError(
                f"{path}: {current if current in config else legacy} sets {', '.join(unserved)}, which "
                f"encoderd does not apply"
            )
        if current == "processor_kwargs" and isinstance(arguments.get("model_max_length"), int):
            max_length = arguments["model_max_length"]
    return max_length


def lowercase(model_dir: Path) -> bool:
    """Older releases keep do_lower_case in sentence_bert_config.json (current ones put a Lowercase
    normalizer into tokenizer.json, which the frontend's tokenizer then has anyway)."""
    return bool(read_json(model_dir / TRANSFORMER_CONFIG).get("do_lower_case", False))


def check_tokenizer_settings(model_dir: Path, config: dict, pairs: bool) -> None:
    """tokenizer_config.json's keys that live outside the tokenizer transformers builds.
    `config`: config.json; `pairs`: the model scores (query, passage) pairs."""
    path = model_dir / TOKENIZER_CONFIG
    settings = _read(path)
    if settings.get("truncation_side", "right") != "right":
        raise ModelLoadError(
            f"{path}: truncation_side {settings['truncation_side']!r}: encoderd cuts over-long inputs "
            f"from the right unless a request asks otherwise"
        )
    if settings.get("split_special_tokens"):
        raise ModelLoadError(f"{path}: split_special_tokens true is not computed by encoderd")
    names = settings.get("model_input_names")
    type_vocab = (config.get("text_config") or config).get("type_vocab_size") or 0
    if pairs and names is not None and "token_type_ids" not in names and type_vocab > 1:
        raise ModelLoadError(
            f"{path}: model_input_names {names!r} leave out token_type_ids, so sentence-transformers "
            f"scores pairs with every segment type 0; encoderd passes the pair's segment types"
        )
