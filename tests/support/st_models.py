"""sentence-transformers model directories built offline from the bundled MiniLM: the real encoder
weights (linked, not copied) under module configs written as older and current
sentence-transformers releases write them, with seeded Dense weights.

Formats:
  * "old" (sentence-transformers 2.x-4.x): module types `sentence_transformers.models.X`, Pooling's
    boolean `pooling_mode_*_tokens` keys, Dense weights in pytorch_model.bin, max_seq_length and
    do_lower_case in sentence_bert_config.json;
  * "new" (as sentence-transformers 6.2 saves): module types under `sentence_transformers.base.modules`
    and `sentence_transformers.sentence_transformer.modules`, `"pooling_mode": "cls"` (or a list),
    model.safetensors, the maximum length in tokenizer_config.json.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from encoderd.workers.contract.model_files import default_model_path

HIDDEN = 384
TYPES = {
    "old": {name: f"sentence_transformers.models.{name}" for name in ("Transformer", "Pooling", "Dense", "Normalize")},
    "new": {
        "Transformer": "sentence_transformers.base.modules.transformer.Transformer",
        "Pooling": "sentence_transformers.sentence_transformer.modules.pooling.Pooling",
        "Dense": "sentence_transformers.base.modules.dense.Dense",
        "Normalize": "sentence_transformers.base.modules.normalize.Normalize",
    },
}
LEGACY_POOLING_KEYS = {
    "cls": "pooling_mode_cls_token",
    "max": "pooling_mode_max_tokens",
    "mean": "pooling_mode_mean_tokens",
    "mean_sqrt_len_tokens": "pooling_mode_mean_sqrt_len_tokens",
    "weightedmean": "pooling_mode_weightedmean_tokens",
    "lasttoken": "pooling_mode_lasttoken",
}
ENCODER_FILES = ("config.json", "model.safetensors", "vocab.txt", "special_tokens_map.json")
NORMALIZE = "normalize"


@dataclass(frozen=True)
class Dense:
    out_features: int
    activation: str = "Tanh"  # a torch.nn class name
    bias: bool = True
    residual: bool = False  # sentence-transformers 6 use_residual


def build_st_model(
    out_dir: Path,
    *,
    fmt: str,
    pooling: tuple[str, ...] = ("mean",),
    modules: tuple = (),
    lowercase: bool = False,
    cased_tokenizer: bool = False,
    include_prompt: bool = True,
    max_seq_length: int = 128,
    prompts: dict | None = None,
    seed: int = 0,
) -> Path:
    """A Transformer + Pooling + `modules` (Dense(...) or NORMALIZE, in order) model in `fmt`.

    cased_tokenizer: the tokenizer keeps case (MiniLM's lower-cases), so do_lower_case matters."""
    out_dir = Path(out_dir)
    if (out_dir / "modules.json").exists():
        return out_dir
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    source = Path(default_model_path())
    for name in ENCODER_FILES:
        os.symlink(source / name, tmp / name)
    _write_tokenizer(source, tmp, cased_tokenizer, max_seq_length if fmt == "new" else None)
    entries = [{"idx": 0, "name": "0", "path": "", "type": TYPES[fmt]["Transformer"]}, _module(fmt, 1, "Pooling")]
    _write_json(tmp / "1_Pooling" / "config.json", _pooling_config(fmt, pooling, include_prompt))
    width = HIDDEN * len(pooling)
    for index, module in enumerate(modules, start=2):
        if module == NORMALIZE:
            entries.append(_module(fmt, index, "Normalize"))
            _write_json(
                tmp / f"{index}_Normalize" / "config.json",
                {}
                if fmt == "old"
                else {"module_input_name": "sentence_embedding", "module_output_name": "sentence_embedding"},
            )
        else:
            entries.append(_module(fmt, index, "Dense"))
            _write_dense(tmp / f"{index}_Dense", fmt, width, module, seed + index)
            width = module.out_features
    _write_json(tmp / "modules.json", entries)
    _write_json(tmp / "sentence_bert_config.json", _transformer_config(fmt, max_seq_length, lowercase))
    _write_json(tmp / "config_sentence_transformers.json", {"prompts": prompts or {}, "default_prompt_name": None})
    tmp.rename(out_dir)
    return out_dir


def _module(fmt: str, index: int, kind: str) -> dict:
    return {"idx": index, "name": str(index), "path": f"{index}_{kind}", "type": TYPES[fmt][kind]}


def _write_json(path: Path, data) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2))


def _write_tokenizer(source: Path, out: Path, cased: bool, model_max_length: int | None) -> None:
    tokenizer = json.loads((source / "tokenizer.json").read_text())
    tokenizer_config = json.loads((source / "tokenizer_config.json").read_text())
    if cased:
        tokenizer["normalizer"]["lowercase"] = False
        tokenizer_config["do_lower_case"] = False
    if model_max_length:  # where current releases keep max_seq_length
        tokenizer_config["model_max_length"] = model_max_length
    _write_json(out / "tokenizer.json", tokenizer)
    _write_json(out / "tokenizer_config.json", tokenizer_config)


def _pooling_config(fmt: str, pooling: tuple[str, ...], include_prompt: bool) -> dict:
    if fmt == "new":
        return {
            "embedding_dimension": HIDDEN,
            "pooling_mode": pooling[0] if len(pooling) == 1 else list(pooling),
            "include_prompt": include_prompt,
        }
    if list(pooling) != [mode for mode in LEGACY_POOLING_KEYS if mode in pooling]:
        raise ValueError("the old format's booleans concatenate in their fixed order: list the modes that way")
    return {
        "word_embedding_dimension": HIDDEN,
        **{key: mode in pooling for mode, key in LEGACY_POOLING_KEYS.items()},
        "include_prompt": include_prompt,
    }


def _transformer_config(fmt: str, max_seq_length: int, lowercase: bool) -> dict:
    if fmt == "old":
        return {"max_seq_length": max_seq_length, "do_lower_case": lowercase}
    if lowercase:
        raise ValueError("current releases put lower-casing into tokenizer.json, not a config key")
    return {
        "transformer_task": "feature-extraction",
        "modality_config": {"text": {"method": "forward", "method_output_name": "last_hidden_state"}},
        "module_output_name": "token_embeddings",
    }


def _write_dense(directory: Path, fmt: str, in_features: int, dense: Dense, seed: int) -> None:
    import torch

    activation = getattr(torch.nn, dense.activation)
    config = {
        "in_features": in_features,
        "out_features": dense.out_features,
        "bias": dense.bias,
        "activation_function": f"{activation.__module__}.{activation.__name__}",
    }
    if fmt == "new":
        config.update(module_input_name="sentence_embedding", module_output_name="sentence_embedding")
        if dense.residual:
            config["use_residual"] = True
    elif dense.residual:
        raise ValueError("use_residual exists in current releases only")
    generator = torch.Generator().manual_seed(seed)
    # Scaled so pre-activations spread over ~[-2, 2] on MiniLM's pooled vectors: saturating
    # activations then still separate texts.
    scale = in_features**-0.5
    weights = {"linear.weight": torch.randn(dense.out_features, in_features, generator=generator) * 3 * scale}
    if dense.bias:
        weights["linear.bias"] = torch.randn(dense.out_features, generator=generator) * 0.1
    if dense.residual and in_features != dense.out_features:
        weights["residual.weight"] = torch.randn(dense.out_features, in_features, generator=generator) * scale
    _write_json(directory / "config.json", config)
    if fmt == "new":
        from safetensors.torch import save_file

        save_file(weights, str(directory / "model.safetensors"))
    else:
        torch.save(weights, directory / "pytorch_model.bin")


def build_head_model(
    out_dir: Path,
    labels: tuple[str, ...],
    *,
    problem_type: str | None = None,
    cross_encoder_activation: str | None = None,
    where: str = "current",
    seed: int = 3,
) -> Path:
    """MiniLM + a seeded sequence-classification head: `problem_type` as transformers writes it;
    cross_encoder_activation: a torch.nn class name a sentence-transformers CrossEncoder config names,
    `where` its releases put it: "current" (config_sentence_transformers.json, v5+), "v4"
    (config.json `sentence_transformers.activation_fn`), "legacy" (`sbert_ce_default_activation_function`)."""
    import torch
    from transformers import AutoModelForSequenceClassification

    out_dir = Path(out_dir)
    if (out_dir / "config.json").exists():
        return out_dir
    model = AutoModelForSequenceClassification.from_pretrained(
        default_model_path(),
        num_labels=len(labels),
        problem_type=problem_type,
        id2label=dict(enumerate(labels)),
        label2id={label: i for i, label in enumerate(labels)},
    ).eval()
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # logits over several units, so activations differ visibly
        model.classifier.weight.copy_(torch.randn(model.classifier.weight.shape, generator=generator) * 2)
        model.classifier.bias.copy_(torch.randn(model.classifier.bias.shape, generator=generator))
    activation_path = ""
    if cross_encoder_activation:
        activation = getattr(torch.nn, cross_encoder_activation)
        activation_path = f"{activation.__module__}.{activation.__name__}"
        if where == "v4":
            model.config.sentence_transformers = {"activation_fn": activation_path}
        elif where == "legacy":
            model.config.sbert_ce_default_activation_function = activation_path
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    if activation_path and where == "current":  # as CrossEncoder.save writes it: with its modules
        _write_json(
            tmp / "config_sentence_transformers.json",
            {"activation_fn": activation_path, "model_type": "CrossEncoder", "prompts": {}},
        )
        _write_json(tmp / "modules.json", [{"idx": 0, "name": "0", "path": "", "type": TYPES["new"]["Transformer"]}])
        _write_json(
            tmp / "sentence_bert_config.json",
            {
                "transformer_task": "sequence-classification",
                "modality_config": {"text": {"method": "forward", "method_output_name": "logits"}},
                "module_output_name": "scores",
            },
        )
    for name in ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json"):
        shutil.copy(Path(default_model_path()) / name, tmp / name)
    tmp.rename(out_dir)
    return out_dir
