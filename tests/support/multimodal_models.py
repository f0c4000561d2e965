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
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from encoderd.workers.contract.model_spec import default_model_path

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
# Words the retrieval tokenizers merge whole, so queries tokenize into a few tokens each.
RETRIEVAL_WORDS = (*CLIP_WORDS, "question", "query", "invoice", "total", "figure", "table", "report")


def _retrieval_vocab(specials: list[str], prefix: str) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """A BPE vocabulary: the special tokens, printable ASCII (spaces as `prefix`, Gemma's "▁" or
    byte-level's "Ġ"), newline, and one merge chain per word in RETRIEVAL_WORDS (with its space)."""
    vocab = {token: i for i, token in enumerate(specials)}
    for code in range(32, 127):
        vocab.setdefault(prefix if code == 32 else chr(code), len(vocab))
    vocab.setdefault("\n" if prefix == "▁" else "Ċ", len(vocab))
    merges: list[tuple[str, str]] = []
    for word in RETRIEVAL_WORDS:
        current = prefix
        for char in word:
            merges.append((current, char))
            current += char
            vocab.setdefault(current, len(vocab))
    return vocab, merges


def build_colpali(out_dir: Path) -> Path:
    """ColPaliForRetrieval over a tiny PaliGemma (SigLIP 32 px in 8 px patches: 16 image tokens;
    a two-layer Gemma), a Gemma-style BPE tokenizer and the ColPaliProcessor saved beside it."""

    def build(tmp: Path) -> None:
        from transformers import (
            ColPaliConfig,
            ColPaliForRetrieval,
            ColPaliProcessor,
            GemmaTokenizer,
            SiglipImageProcessor,
        )

        vocab, merges = _retrieval_vocab(["<pad>", "<eos>", "<bos>", "<unk>", "<mask>"], "▁")
        tokenizer = GemmaTokenizer(vocab=vocab, merges=merges)
        images = SiglipImageProcessor(size={"height": 32, "width": 32}, image_seq_length=16)
        processor = ColPaliProcessor(image_processor=images, tokenizer=tokenizer)  # adds <image>, <locNNNN>...
        config = ColPaliConfig(
            vlm_config={
                "model_type": "paligemma",
                "image_token_id": processor.image_token_id,
                "vision_config": {
                    "model_type": "siglip_vision_model",
                    "hidden_size": 32,
                    "intermediate_size": 64,
                    "num_hidden_layers": 2,
                    "num_attention_heads": 2,
                    "image_size": 32,
                    "patch_size": 8,
                    "projection_dim": 48,
                },
                "text_config": {
                    "model_type": "gemma",
                    "vocab_size": len(processor.tokenizer),
                    "hidden_size": 48,
                    "intermediate_size": 96,
                    "num_hidden_layers": 2,
                    "num_attention_heads": 2,
                    "num_key_value_heads": 1,
                    "head_dim": 24,
                    "max_position_embeddings": 256,
                    "pad_token_id": 0,
                    "bos_token_id": 2,
                    "eos_token_id": 1,
                },
                "projection_dim": 48,
                "hidden_size": 48,
            },
            embedding_dim=16,
        )
        _seed()
        ColPaliForRetrieval(config).eval().save_pretrained(tmp)
        processor.save_pretrained(tmp)

    return _build_once(out_dir, build)


QWEN_SPECIALS = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
)


def _qwen_tokenizer():
    """A Qwen2 byte-level BPE tokenizer: the 256 byte symbols, one merge chain per retrieval word
    (with its leading space, "Ġ"), and Qwen2-VL's special tokens (<|endoftext|> pads)."""
    from tokenizers.pre_tokenizers import ByteLevel
    from transformers import Qwen2Tokenizer

    vocab = {symbol: i for i, symbol in enumerate(sorted(ByteLevel.alphabet()))}
    merges: list[tuple[str, str]] = []
    for word in RETRIEVAL_WORDS:
        current = "Ġ"
        for char in word:
            merges.append((current, char))
            current += char
            vocab.setdefault(current, len(vocab))
    tokenizer = Qwen2Tokenizer(vocab=vocab, merges=merges)
    tokenizer.add_special_tokens({"additional_special_tokens": list(QWEN_SPECIALS[1:])})
    return tokenizer


def build_colqwen2(out_dir: Path) -> Path:
    """ColQwen2ForRetrieval over a tiny Qwen2-VL: 4 px patches merged 2x2, so a page costs one
    image token per 8x8 pixels at its own resolution (64 to 4096 pixels: 4 to 64 image tokens), a
    two-layer language model, a byte-level BPE tokenizer and the ColQwen2Processor beside it."""

    def build(tmp: Path) -> None:
        from transformers import ColQwen2Config, ColQwen2ForRetrieval, ColQwen2Processor, Qwen2VLImageProcessor

        tokenizer = _qwen_tokenizer()
        images = Qwen2VLImageProcessor(
            patch_size=4, merge_size=2, temporal_patch_size=2, min_pixels=16 * 16, max_pixels=64 * 64
        )
        processor = ColQwen2Processor(image_processor=images, tokenizer=tokenizer)
        ids = {token: tokenizer.convert_tokens_to_ids(token) for token in QWEN_SPECIALS}
        config = ColQwen2Config(
            vlm_config={
                "model_type": "qwen2_vl",
                "image_token_id": ids["<|image_pad|>"],
                "video_token_id": ids["<|video_pad|>"],
                "vision_start_token_id": ids["<|vision_start|>"],
                "vision_end_token_id": ids["<|vision_end|>"],
                "vision_config": {
                    "depth": 2,
                    "embed_dim": 32,
                    "hidden_size": 48,
                    "num_heads": 2,
                    "patch_size": 4,
                    "spatial_merge_size": 2,
                    "temporal_patch_size": 2,
                },
                "text_config": {
                    "vocab_size": len(tokenizer),
                    "hidden_size": 48,
                    "intermediate_size": 96,
                    "num_hidden_layers": 2,
                    "num_attention_heads": 2,
                    "num_key_value_heads": 1,
                    "max_position_embeddings": 512,
                    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [4, 4, 4]},
                    "pad_token_id": ids["<|endoftext|>"],
                    "bos_token_id": ids["<|endoftext|>"],
                    "eos_token_id": ids["<|im_end|>"],
                },
            },
            embedding_dim=16,
        )
        _seed()
        ColQwen2ForRetrieval(config).eval().save_pretrained(tmp)
        processor.save_pretrained(tmp)

    return _build_once(out_dir, build)
