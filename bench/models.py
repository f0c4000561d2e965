"""Realistic-size models for `encoderd bench --models base`, built offline and deterministically.

Speed depends on the architecture and its sizes, not on trained weights, so these are the real
architectures at their real sizes with seeded random weights:

  bge-base-sized embedder     BertModel, 12 layers, hidden 768, FFN 3072, 12 heads, vocab 30522,
                              512 positions; MiniLM's WordPiece tokenizer (BERT's vocabulary);
                              CLS pooling then Normalize, as BAAI/bge-base-en-v1.5.
  bge-reranker-base-sized     XLMRobertaForSequenceClassification, 12 layers, hidden 768, FFN 3072,
  cross-encoder               vocab 250002, 514 positions, one label, as BAAI/bge-reranker-base; a
                              SentencePiece-style Unigram tokenizer written here from the bench
                              corpus's words (every character too, so any text encodes) with XLM-R's
                              special tokens and `<s> A </s></s> B </s>` template. Its vocabulary is
                              small, the model's stays 250002: the embedding table's size is real.

Each is written once under --cache-dir (about 0.4 and 1.1 GB).
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..workers.contract.model_files import default_model_path
from .corpus import _OBJECTS, _QUERIES, _SUBJECTS, _TAILS, _VERBS
from .options import log

BASE_SIZES: dict[str, Any] = {
    "num_hidden_layers": 12,
    "hidden_size": 768,
    "intermediate_size": 3072,
    "num_attention_heads": 12,
}
# `--models tiny`: the same architectures, tokenizers and heads, small enough for a CI run on 2 cores.
TINY_SIZES: dict[str, Any] = {
    "num_hidden_layers": 2,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 2,
}
_XLMR_SPECIALS = ["<s>", "<pad>", "</s>", "<unk>", "<mask>"]
_FORMAT = 1  # bump when what is built changes: the cached copy is then rebuilt


def build_base_embedder(cache: Path, tiny: bool = False) -> str:
    sizes = TINY_SIZES if tiny else BASE_SIZES
    name = "bge-tiny" if tiny else "bge-base-sized"
    return build_once(cache / name, lambda out: _write_base_embedder(out, sizes), str(_FORMAT))


def build_xlmr_reranker(cache: Path, tiny: bool = False) -> str:
    sizes = TINY_SIZES if tiny else BASE_SIZES
    name = "bge-reranker-tiny" if tiny else "bge-reranker-base-sized"
    return build_once(cache / name, lambda out: _write_xlmr_reranker(out, sizes), str(_FORMAT))


def build_once(out: Path, write: Callable[[Path], None], version: str) -> str:
    """`out`, written by `write` unless a copy stamped with `version` is there already: written
    into a temporary directory first, so an interrupted build is never taken for a finished one.
    (bench/colpali.py builds its ColPali / ColQwen2 models here too.)"""
    stamp = out / ".encoderd-bench-format"
    if stamp.exists() and stamp.read_text() == version:
        return str(out)
    log(f"building {out.name} (random weights; once)")
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    write(tmp)
    (tmp / ".encoderd-bench-format").write_text(version)
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return str(out)


def _write_base_embedder(out: Path, sizes: dict[str, Any]) -> None:
    import torch
    from transformers import BertConfig, BertModel

    minilm = Path(default_model_path())
    for name in ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json"):
        shutil.copy(minilm / name, out / name)
    config = BertConfig(vocab_size=30522, max_position_embeddings=512, type_vocab_size=2, **sizes)
    torch.manual_seed(0)
    BertModel(config).eval().save_pretrained(out)
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"},
    ]
    (out / "modules.json").write_text(json.dumps(modules, indent=1))
    (out / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 512, "do_lower_case": True}))
    (out / "1_Pooling").mkdir()
    (out / "1_Pooling" / "config.json").write_text(
        json.dumps(
            {
                "word_embedding_dimension": sizes["hidden_size"],
                "pooling_mode_cls_token": True,
                "pooling_mode_mean_tokens": False,
                "pooling_mode_max_tokens": False,
                "pooling_mode_mean_sqrt_len_tokens": False,
            }
        )
    )
    (out / "2_Normalize").mkdir()


def _write_xlmr_reranker(out: Path, sizes: dict[str, Any]) -> None:
    import torch
    from transformers import XLMRobertaConfig, XLMRobertaForSequenceClassification

    _xlmr_tokenizer().save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "XLMRobertaTokenizer",
                "model_max_length": 512,
                "bos_token": "<s>",
                "eos_token": "</s>",
                "cls_token": "<s>",
                "sep_token": "</s>",
                "pad_token": "<pad>",
                "unk_token": "<unk>",
                "mask_token": "<mask>",
            },
            indent=1,
        )
    )
    config = XLMRobertaConfig(
        vocab_size=250002,
        max_position_embeddings=514,
        type_vocab_size=1,
        pad_token_id=1,
        bos_token_id=0,
        eos_token_id=2,
        layer_norm_eps=1e-5,
        id2label={0: "LABEL_0"},
        label2id={"LABEL_0": 0},
        **sizes,
    )
    torch.manual_seed(0)
    XLMRobertaForSequenceClassification(config).eval().save_pretrained(out)


def _xlmr_tokenizer():
    """Unigram over Metaspace with a written vocabulary (a trained one breaks ties by hash order, so
    two builds would differ): the corpus and query words, likelier than any split, then characters."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

    text = " ".join(_SUBJECTS + _VERBS + _OBJECTS + _TAILS + _QUERIES)
    words = sorted({w.strip(".,?!:%") for w in text.split()} | {w.capitalize() for w in text.split()})
    chars = sorted(set(text + "0123456789 .,;:!?'\"()[]{}<>-_/\\@#$%^&*+=~`|ABCDEFGHIJKLMNOPQRSTUVWXYZ") - {" "})
    pieces = (
        [(s, 0.0) for s in _XLMR_SPECIALS]
        + [(f"\u2581{w}", -5.0) for w in words if w]
        + [("\u2581", -8.0)]
        + [(c, -10.0 - i / 100) for i, c in enumerate(chars)]
    )
    tok = Tokenizer(models.Unigram(pieces, unk_id=_XLMR_SPECIALS.index("<unk>")))
    tok.normalizer = normalizers.NFKC()
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    tok.add_special_tokens(_XLMR_SPECIALS)
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A </s>",
        pair="<s> $A </s> </s> $B </s>",
        special_tokens=[(s, _XLMR_SPECIALS.index(s)) for s in ("<s>", "</s>")],
    )
    return tok
