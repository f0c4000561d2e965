"""Tiny random models of every family users bring, built offline and deterministically.

Each family is a 2-layer, 64-wide model of its real architecture with its own kind of
tokenizer (a real `tokenizer.json` trained here on the test corpus, with the family's
special tokens and post-processor template, and a tokenizer_config.json that
AutoTokenizer reads), saved as:

  embedding   the bare model + sentence-transformers files (modules.json,
              1_Pooling/config.json, sentence_bert_config.json), pooling as the family's
              popular checkpoints do, then Normalize;
  reranker    *ForSequenceClassification with one label;
  classifier  *ForSequenceClassification with three labels.

  bert         MiniLM's WordPiece tokenizer, mean pooling (all-MiniLM, e5)
  xlm-roberta  Unigram, `<s> A </s></s> B </s>`, CLS pooling (bge-m3, bge-reranker)
  camembert    XLM-R's tokenizer and code path under its own model_type, mean pooling (sentence-camembert)
  roberta      byte-level BPE, RobertaProcessing, mean pooling
  distilbert   MiniLM's WordPiece tokenizer, no token types, mean pooling (msmarco-distilbert)
  mpnet        WordPiece, `<s> A </s></s> B </s>`, relative position buckets, mean pooling
               (all-mpnet-base-v2)
  modernbert   byte-level BPE, `[CLS] A [SEP] B [SEP]`, mean pooling; one global and one
               sliding-window (local) attention layer, like ModernBERT's alternation; heads
               pooling by mean (reranker) and CLS (classifier)
  deberta-v2   Unigram, `[CLS] A [SEP] B [SEP]`, relative attention (DeBERTa-v3 settings)
  qwen3        byte-level BPE, text then `<|endoftext|>`, last-token pooling, left padding
               (Qwen3-Embedding); Qwen3ForSequenceClassification scores the last non-pad token
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

from encoderd.workers.contract.model_files import default_model_path

from .corpus import sentences

KINDS = ("embedding", "reranker", "classifier")
LABELS = {"reranker": ["LABEL_0"], "classifier": ["negative", "neutral", "positive"]}
MAX_POSITIONS = 512
# transformers' default (0.02) leaves a random model's features nearly equal for every input: rerank
# scores then tie within 1e-5 and an ordering check measures noise. At 0.3 they spread over 1-8 logits.
INIT_RANGE = 0.3


@dataclass(frozen=True)
class Family:
    name: str
    config_class: str
    base_class: str  # the embedder (AutoModel's class)
    classifier_class: str  # *ForSequenceClassification
    config: dict  # architecture settings beyond the shared tiny sizes
    pooling: str  # sentence-transformers pooling mode of the embedder
    tokenizer: str  # key of TOKENIZERS
    by_kind: dict | None = None  # kind -> config.json settings of that kind only


# RoBERTa, XLM-R and CamemBERT: fairseq positions start after the pad id, one token type.
ROBERTA_LAYOUT = {
    "max_position_embeddings": MAX_POSITIONS + 2,
    "type_vocab_size": 1,
    "pad_token_id": 1,
    "bos_token_id": 0,
    "eos_token_id": 2,
}


def _tiny(**extra) -> dict:
    return dict(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=128,
        initializer_range=INIT_RANGE,
        **extra,
    )


FAMILIES = {
    f.name: f
    for f in [
        Family(
            "bert",
            "BertConfig",
            "BertModel",
            "BertForSequenceClassification",
            _tiny(max_position_embeddings=MAX_POSITIONS, type_vocab_size=2, pad_token_id=0),
            "mean",
            "bert",
        ),
        Family(
            "xlm-roberta",
            "XLMRobertaConfig",
            "XLMRobertaModel",
            "XLMRobertaForSequenceClassification",
            _tiny(**ROBERTA_LAYOUT),
            "cls",
            "xlm-roberta",
        ),
        Family(
            "camembert",
            "CamembertConfig",
            "CamembertModel",
            "CamembertForSequenceClassification",
            _tiny(**ROBERTA_LAYOUT),
            "mean",
            "camembert",
        ),
        Family(
            "roberta",
            "RobertaConfig",
            "RobertaModel",
            "RobertaForSequenceClassification",
            _tiny(**ROBERTA_LAYOUT),
            "mean",
            "roberta",
        ),
        Family(
            "distilbert",
            "DistilBertConfig",
            "DistilBertModel",
            "DistilBertForSequenceClassification",
            {
                "dim": 64,
                "n_layers": 2,
                "n_heads": 4,
                "hidden_dim": 128,
                "initializer_range": INIT_RANGE,
                "max_position_embeddings": MAX_POSITIONS,
                "pad_token_id": 0,
            },
            "mean",
            "distilbert",
        ),
        Family(
            "mpnet",
            "MPNetConfig",
            "MPNetModel",
            "MPNetForSequenceClassification",
            _tiny(max_position_embeddings=MAX_POSITIONS + 2, pad_token_id=1, bos_token_id=0, eos_token_id=2),
            "mean",
            "mpnet",
        ),
        Family(
            "modernbert",
            "ModernBertConfig",
            "ModernBertModel",
            "ModernBertForSequenceClassification",
            _tiny(
                max_position_embeddings=MAX_POSITIONS,
                local_attention=64,
                layer_types=["full_attention", "sliding_attention"],
                pad_token_id=3,
                cls_token_id=1,
                sep_token_id=2,
                bos_token_id=1,
                eos_token_id=2,
            ),
            "mean",
            "bert-style-bpe",
            # The head pools itself: mean over the mask for the reranker (gte-reranker-modernbert), CLS otherwise.
            {"reranker": {"classifier_pooling": "mean"}, "classifier": {"classifier_pooling": "cls"}},
        ),
        Family(
            "deberta-v2",
            "DebertaV2Config",
            "DebertaV2Model",
            "DebertaV2ForSequenceClassification",
            _tiny(
                max_position_embeddings=MAX_POSITIONS,
                type_vocab_size=0,
                relative_attention=True,
                position_buckets=64,
                max_relative_positions=-1,
                position_biased_input=False,
                pos_att_type=["p2c", "c2p"],
                norm_rel_ebd="layer_norm",
                share_att_key=True,
                pad_token_id=0,
            ),
            "mean",
            "deberta-v2",
        ),
        Family(
            "qwen3",
            "Qwen3Config",
            "Qwen3Model",
            "Qwen3ForSequenceClassification",
            _tiny(
                num_key_value_heads=2,
                head_dim=16,
                max_position_embeddings=MAX_POSITIONS,
                tie_word_embeddings=True,
                hidden_act="silu",
                rms_norm_eps=1e-6,
                use_cache=False,
            ),
            "lasttoken",
            "qwen3",
            # Qwen3-Embedding's config.json names the causal LM it was trained from.
            {"embedding": {"architectures": ["Qwen3ForCausalLM"]}},
        ),
    ]
}


# ------------------------------------------------------------------ tokenizers
def _training_text() -> list[str]:
    return [*sentences(400, max_words=60, seed=3), "0123456789 .,;:!?'\"()[]{}<>-_/\\@#$%^&*+=~`|"]


def _bpe(specials: list[str]):
    """Byte-level BPE (RoBERTa, ModernBERT, Qwen): every byte is in the alphabet, so no input is unknown."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(
        _training_text(),
        trainers.BpeTrainer(
            vocab_size=600,
            special_tokens=specials,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        ),
    )
    return tok


def _unigram(specials: list[str], unk: str):
    """SentencePiece-style Unigram over Metaspace (XLM-R, DeBERTa-v3). The vocabulary is written, not
    trained (the trainer breaks ties by hash order, so two builds would differ): the corpus words,
    likelier than any split of them, and every character, so any other word splits into pieces."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers

    from .corpus import WORDS

    chars = sorted(set("".join(_training_text())) - {" "})
    pieces = (
        [(s, 0.0) for s in specials]
        + [(f"\u2581{w}", -5.0) for w in sorted(set(WORDS))]
        + [("\u2581", -8.0)]
        + [(c, -10.0 - i / 100) for i, c in enumerate(chars)]
    )
    tok = Tokenizer(models.Unigram(pieces, unk_id=specials.index(unk)))
    tok.normalizer = normalizers.NFKC()
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    tok.add_special_tokens(specials)
    return tok


def _template(tok, single: str, pair: str, specials: list[str]) -> None:
    from tokenizers import processors

    tok.post_processor = processors.TemplateProcessing(
        single=single, pair=pair, special_tokens=[(s, tok.token_to_id(s)) for s in specials]
    )


def _xlm_roberta_tokenizer():
    tok = _unigram(["<s>", "<pad>", "</s>", "<unk>", "<mask>"], unk="<unk>")
    _template(tok, "<s> $A </s>", "<s> $A </s> </s> $B </s>", ["<s>", "</s>"])  # type ids all 0, as XLM-R's
    return tok, {
        "tokenizer_class": "XLMRobertaTokenizer",
        "bos_token": "<s>",
        "eos_token": "</s>",
        "cls_token": "<s>",
        "sep_token": "</s>",
        "pad_token": "<pad>",
        "unk_token": "<unk>",
        "mask_token": "<mask>",
    }


def _camembert_tokenizer():
    tok, config = _xlm_roberta_tokenizer()  # CamemBERT's is XLM-R's (SentencePiece, same template)
    return tok, {**config, "tokenizer_class": "CamembertTokenizer"}


def _roberta_tokenizer():
    from tokenizers import processors

    tok = _bpe(["<s>", "<pad>", "</s>", "<unk>", "<mask>"])
    tok.post_processor = processors.RobertaProcessing(("</s>", 2), ("<s>", 0), add_prefix_space=False)
    return tok, {
        "tokenizer_class": "RobertaTokenizer",
        "bos_token": "<s>",
        "eos_token": "</s>",
        "cls_token": "<s>",
        "sep_token": "</s>",
        "pad_token": "<pad>",
        "unk_token": "<unk>",
        "mask_token": "<mask>",
        "add_prefix_space": False,
    }


_BERT_SPECIALS = {
    "cls_token": "[CLS]",
    "sep_token": "[SEP]",
    "pad_token": "[PAD]",
    "unk_token": "[UNK]",
    "mask_token": "[MASK]",
}


def _bert_style_bpe_tokenizer():
    """ModernBERT's: byte-level BPE with BERT's special tokens and template."""
    tok = _bpe(["[UNK]", "[CLS]", "[SEP]", "[PAD]", "[MASK]"])
    _template(tok, "[CLS] $A [SEP]", "[CLS] $A [SEP] $B:1 [SEP]:1", ["[CLS]", "[SEP]"])
    return tok, {"tokenizer_class": "PreTrainedTokenizerFast", **_BERT_SPECIALS}


def _deberta_tokenizer():
    tok = _unigram(["[PAD]", "[CLS]", "[SEP]", "[UNK]", "[MASK]"], unk="[UNK]")
    _template(tok, "[CLS] $A [SEP]", "[CLS] $A [SEP] $B:1 [SEP]:1", ["[CLS]", "[SEP]"])
    return tok, {"tokenizer_class": "DebertaV2Tokenizer", **_BERT_SPECIALS}


def _qwen3_tokenizer():
    tok = _bpe([])
    tok.add_special_tokens(
        ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    )  # after the vocabulary, as Qwen's: pad id != 0
    _template(tok, "$A <|endoftext|>", "$A <|endoftext|> $B:1 <|endoftext|>:1", ["<|endoftext|>"])
    # Qwen3-Embedding pads on the left; the server pads on the right: equal under causal attention + RoPE.
    return tok, {
        "tokenizer_class": "Qwen2Tokenizer",
        "eos_token": "<|endoftext|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "bos_token": None,
        "padding_side": "left",
    }


def _mpnet_tokenizer():
    """MPNet's: lower-cased WordPiece with RoBERTa's special tokens and template. The vocabulary is
    written, not trained (the WordPiece trainer breaks ties by hash order): the corpus words whole,
    and every character alone and as a continuation, so any other word splits into pieces."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers

    from .corpus import WORDS

    chars = sorted(set("".join(_training_text()).lower()) - {" "})
    pieces = ["<s>", "<pad>", "</s>", "<unk>", "<mask>"] + chars + [f"##{c}" for c in chars] + sorted(set(WORDS))
    pieces = list(dict.fromkeys(pieces))  # one-letter words are characters already
    tok = Tokenizer(models.WordPiece({p: i for i, p in enumerate(pieces)}, unk_token="<unk>"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece()
    tok.add_special_tokens(pieces[:5])
    _template(tok, "<s> $A </s>", "<s> $A </s> </s> $B </s>", ["<s>", "</s>"])
    return tok, {
        "tokenizer_class": "MPNetTokenizer",
        "bos_token": "<s>",
        "eos_token": "</s>",
        "cls_token": "<s>",
        "sep_token": "</s>",
        "pad_token": "<pad>",
        "unk_token": "<unk>",
        "mask_token": "<mask>",
        "do_lower_case": True,
    }


TOKENIZERS = {
    "xlm-roberta": _xlm_roberta_tokenizer,
    "roberta": _roberta_tokenizer,
    "bert-style-bpe": _bert_style_bpe_tokenizer,
    "deberta-v2": _deberta_tokenizer,
    "qwen3": _qwen3_tokenizer,
    "mpnet": _mpnet_tokenizer,
    "camembert": _camembert_tokenizer,
}


def _minilm_tokenizer(out: Path, tokenizer_class: str) -> int:
    """The bundled MiniLM's WordPiece files (BERT's vocabulary, special tokens and template)."""
    for name in ("tokenizer.json", "vocab.txt", "special_tokens_map.json"):
        shutil.copy(Path(default_model_path()) / name, out / name)
    config = json.loads((Path(default_model_path()) / "tokenizer_config.json").read_text())
    (out / "tokenizer_config.json").write_text(json.dumps({**config, "tokenizer_class": tokenizer_class}))
    return 30522


def _save_tokenizer(family: Family, out: Path) -> int:
    """Write tokenizer.json and tokenizer_config.json; returns the vocabulary size."""
    if family.tokenizer in ("bert", "distilbert"):
        return _minilm_tokenizer(out, {"bert": "BertTokenizer", "distilbert": "DistilBertTokenizer"}[family.tokenizer])
    tok, config = TOKENIZERS[family.tokenizer]()
    tok.save(str(out / "tokenizer.json"))
    config = {"model_max_length": MAX_POSITIONS, **{k: v for k, v in config.items() if v is not None}}
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=1))
    return tok.get_vocab_size()


def _special_ids(out: Path, family: Family) -> dict:
    """Config ids of the special tokens the tokenizer really has (Qwen3's pad and eos)."""
    if family.name != "qwen3":
        return {}
    from tokenizers import Tokenizer

    eos = Tokenizer.from_file(str(out / "tokenizer.json")).token_to_id("<|endoftext|>")
    return {"pad_token_id": eos, "eos_token_id": eos, "bos_token_id": eos}


# ------------------------------------------------------------------ models
def _sentence_transformers_files(out: Path, pooling: str) -> None:
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"},
    ]
    (out / "modules.json").write_text(json.dumps(modules, indent=1))
    (out / "sentence_bert_config.json").write_text(
        json.dumps({"max_seq_length": MAX_POSITIONS, "do_lower_case": False})
    )
    (out / "1_Pooling").mkdir()
    modes = {
        "pooling_mode_cls_token": pooling == "cls",
        "pooling_mode_mean_tokens": pooling == "mean",
        "pooling_mode_max_tokens": False,
        "pooling_mode_lasttoken": pooling == "lasttoken",
    }
    (out / "1_Pooling" / "config.json").write_text(json.dumps({"word_embedding_dimension": 64, **modes}))
    (out / "2_Normalize").mkdir()


def _update_json(path: Path, settings: dict) -> None:
    path.write_text(json.dumps({**json.loads(path.read_text()), **settings}, indent=1))


def build(family_name: str, kind: str, out_dir: Path) -> Path:
    """The tiny `family_name` model of `kind` in out_dir (reused when already built)."""
    import torch
    import transformers

    family = FAMILIES[family_name]
    out_dir = Path(out_dir)
    if (out_dir / "config.json").exists():
        return out_dir
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    vocab = _save_tokenizer(family, tmp)
    labels = LABELS.get(kind, [])
    head = (
        {
            "num_labels": len(labels),
            "id2label": dict(enumerate(labels)),
            "label2id": {label: i for i, label in enumerate(labels)},
        }
        if labels
        else {}
    )
    config = getattr(transformers, family.config_class)(
        vocab_size=vocab, **family.config, **_special_ids(tmp, family), **head
    )
    torch.manual_seed(0)
    model = getattr(transformers, family.classifier_class if labels else family.base_class)(config).eval()
    model.save_pretrained(tmp)
    _update_json(
        tmp / "config.json", (family.by_kind or {}).get(kind, {})
    )  # after save_pretrained, which sets architectures
    if not labels:
        _sentence_transformers_files(tmp, family.pooling)
    tmp.rename(out_dir)
    return out_dir
