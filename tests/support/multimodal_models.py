"""Tiny multi-modal, multi-vector and sparse test models, built offline and deterministically.

Every model is a transformers config with seeded random weights, saved with
`save_pretrained` beside its tokenizer and processor files, so the server and
the tests' direct transformers forward read exactly the same directory:

  clip      CLIPModel (text and vision towers of two layers), a byte-level BPE
            CLIP tokenizer generated here, a CLIPImageProcessor that resizes
            (shortest edge 40), center-crops (32x32) and normalizes;
  clap      ClapModel with feature fusion (laion/clap-htsat-fused's layout, tiny),
            the bundled MiniLM WordPiece tokenizer, a ClapFeatureExtractor at 16 kHz
            with 1 s windows;
  colbert   a two-layer BERT and a PyLate-style Dense projection (32 -> 16), MiniLM tokenizer;
  sparse    a two-layer BertForMaskedLM over MiniLM's vocabulary, MiniLM tokenizer.
  colpali, colqwen2   ColPaliForRetrieval / ColQwen2ForRetrieval, tiny (encoderd.bench.retrieval_models).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from encoderd.workers.contract.model_files import default_model_path

MINILM_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json")
CLIP_WORDS = ("a", "the", "photo", "of", "cat", "dog", "red", "blue", "car", "page", "with", "text", "chart")


def _build_once(out_dir: Path, build) -> Path:
    """Build into a temporary directory and rename it: concurrent or interrupted runs never see half a model."""
    out_dir = Path(out_dir)
    if not (out_dir / "config.json").exists():
        tmp = out_dir.with_name(out_dir.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        build(tmp)
        tmp.rename(out_dir)
    return out_dir


def _copy_minilm_tokenizer(out_dir: Path) -> None:
    for name in MINILM_TOKENIZER_FILES:
        shutil.copy(Path(default_model_path()) / name, out_dir / name)


def _seed() -> None:
    import torch

    torch.manual_seed(0)


# ---------------------------------------------------------------- CLIP
def clip_tokenizer():
    """A CLIP byte-level BPE tokenizer over a tiny vocabulary: the 2 x 256 byte
    symbols (plain and word-final), one merge chain per word in CLIP_WORDS, and
    CLIP's start / end tokens (the end token is also padding, as in CLIP)."""
    from tokenizers.pre_tokenizers import ByteLevel
    from transformers import CLIPTokenizer

    alphabet = sorted(ByteLevel.alphabet())
    vocab = {symbol: i for i, symbol in enumerate(alphabet + [a + "</w>" for a in alphabet])}
    merges = []
    for word in CLIP_WORDS:
        pieces = [*list(word[:-1]), word[-1] + "</w>"]
        current = pieces[0]
        for piece in pieces[1:]:
            if (current, piece) not in merges:
                merges.append((current, piece))
            current += piece
            vocab.setdefault(current, len(vocab))
    vocab["<|startoftext|>"] = len(vocab)
    vocab["<|endoftext|>"] = len(vocab)
    return CLIPTokenizer(vocab=vocab, merges=merges)


def build_clip(out_dir: Path) -> Path:
    def build(tmp: Path) -> None:
        from transformers import CLIPConfig, CLIPImageProcessor, CLIPModel, CLIPProcessor

        tokenizer = clip_tokenizer()
        config = CLIPConfig(
            text_config={
                "vocab_size": len(tokenizer),
                "hidden_size": 32,
                "intermediate_size": 64,
                "num_hidden_layers": 2,
                "num_attention_heads": 2,
                "max_position_embeddings": 77,
                "bos_token_id": tokenizer.bos_token_id,
                "eos_token_id": tokenizer.eos_token_id,
                "pad_token_id": tokenizer.pad_token_id,
            },
            vision_config={
                "hidden_size": 32,
                "intermediate_size": 64,
                "num_hidden_layers": 2,
                "num_attention_heads": 2,
                "image_size": 32,
                "patch_size": 8,
            },
            projection_dim=16,
        )
        _seed()
        CLIPModel(config).eval().save_pretrained(tmp)
        images = CLIPImageProcessor(size={"shortest_edge": 40}, crop_size={"height": 32, "width": 32})
        CLIPProcessor(image_processor=images, tokenizer=tokenizer).save_pretrained(tmp)

    return _build_once(out_dir, build)


# ---------------------------------------------------------------- CLAP
CLAP_SAMPLING_RATE = 16000


def build_clap(out_dir: Path) -> Path:
    def build(tmp: Path) -> None:
        from transformers import ClapConfig, ClapFeatureExtractor, ClapModel

        config = ClapConfig(
            text_config={
                "vocab_size": 30522,
                "hidden_size": 32,
                "intermediate_size": 64,
                "num_hidden_layers": 2,
                "num_attention_heads": 2,
                "max_position_embeddings": 514,
                "type_vocab_size": 1,
                "pad_token_id": 0,
            },  # MiniLM's [PAD]: the text tower derives positions from it
            audio_config={
                "spec_size": 64,
                "num_mel_bins": 64,
                "window_size": 4,
                "patch_size": 4,
                "patch_stride": (4, 4),
                "depths": [1, 1],
                "num_attention_heads": [2, 2],
                "patch_embeds_hidden_size": 16,
                "hidden_size": 32,
                "enable_fusion": True,
                "fusion_type": "aff_2d",
            },
            projection_dim=16,
        )
        _seed()
        ClapModel(config).eval().save_pretrained(tmp)
        # feature_size 64: CLAP's fusion path hard-codes 64 mel bins.
        ClapFeatureExtractor(
            feature_size=64,
            sampling_rate=CLAP_SAMPLING_RATE,
            hop_length=320,
            max_length_s=1,
            fft_window_size=512,
            frequency_min=50,
            frequency_max=8000,
            truncation="fusion",
            padding="repeatpad",
        ).save_pretrained(tmp)
        _copy_minilm_tokenizer(tmp)

    return _build_once(out_dir, build)


# ---------------------------------------------------------------- text towers
def _tiny_bert(**extra):
    from transformers import BertConfig

    return BertConfig(
        vocab_size=30522,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        max_position_embeddings=512,
        **extra,
    )


def build_colbert(out_dir: Path) -> Path:
    """A PyLate-layout ColBERT: the encoder, then 1_Dense (no bias, identity), as modules.json says."""

    def build(tmp: Path) -> None:
        import torch
        from sentence_transformers.sentence_transformer.modules import Dense
        from transformers import BertModel

        _seed()
        BertModel(_tiny_bert()).eval().save_pretrained(tmp)
        dense = Dense(32, 16, bias=False, activation_function=torch.nn.Identity())
        with torch.no_grad():
            dense.linear.weight.normal_(0, 0.3, generator=torch.Generator().manual_seed(2))
        (tmp / "1_Dense").mkdir()
        dense.save(str(tmp / "1_Dense"))
        modules = [
            {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
            {"idx": 1, "name": "1", "path": "1_Dense", "type": "pylate.models.Dense.Dense"},
        ]
        (tmp / "modules.json").write_text(json.dumps(modules, indent=2))
        _copy_minilm_tokenizer(tmp)

    return _build_once(out_dir, build)


def build_sparse(out_dir: Path) -> Path:
    """A masked-LM over MiniLM's vocabulary; served as SPLADE with the :sparse kind."""

    def build(tmp: Path) -> None:
        from transformers import BertForMaskedLM

        _seed()
        BertForMaskedLM(_tiny_bert()).eval().save_pretrained(tmp)
        _copy_minilm_tokenizer(tmp)

    return _build_once(out_dir, build)


# ---------------------------------------------------------------- ColPali / ColQwen2
def build_colpali(out_dir: Path) -> Path:
    """ColPaliForRetrieval, tiny (encoderd.bench.retrieval_models says how it is made)."""
    from encoderd.bench.retrieval_models import write_colpali

    return _build_once(out_dir, write_colpali)


def build_colqwen2(out_dir: Path) -> Path:
    """ColQwen2ForRetrieval, tiny (encoderd.bench.retrieval_models says how it is made)."""
    from encoderd.bench.retrieval_models import write_colqwen2

    return _build_once(out_dir, write_colqwen2)
