"""ColPali and ColQwen2 models with seeded random weights, built offline: tiny ones for the tests
(tests/support/multimodal_models.py) and real-size ones for `python -m encoderd.bench.colpali`.

Speed depends on the architecture and its sizes, not on trained weights. Real sizes:

  colpali    vidore/colpali-v1.3's: PaliGemma-3B, a SigLIP-so400m tower (27 layers, hidden 1152,
             448 px in 14 px patches: 1024 image tokens) and Gemma-2B (18 layers, hidden 2048,
             FFN 16384, 8 heads, 1 KV head, vocabulary 257216); 128-d output.
  colqwen2   vidore/colqwen2-v1.0's: Qwen2-VL-2B, a 32-layer vision tower (1280 wide, 14 px patches
             merged 2x2: one image token per 28x28 pixels, up to 768 per page) and a 28-layer
             language model (hidden 1536, FFN 8960, 12 heads, 2 KV heads, vocabulary 151936); 128-d.

Tiny: two layers of each tower, 16-d output; ColPali at 32 px (16 image tokens), ColQwen2 at
4 px patches (one image token per 8x8 pixels, 64 to 4096 pixels a page). The tokenizers are BPE
over a small vocabulary written here (printable ASCII, newline, a few whole words) with the real
special tokens; at real size the model's vocabulary keeps its real size (the embedding table is real).
Both processors (ColPaliProcessor, ColQwen2Processor) are saved beside the weights.
"""

from __future__ import annotations

from pathlib import Path

# Words the tokenizers merge whole, so queries tokenize into a few tokens each.
WORDS = (
    *("a", "the", "photo", "of", "cat", "dog", "red", "blue", "car", "page", "with", "text", "chart"),
    *("question", "query", "invoice", "total", "figure", "table", "report"),
)
QWEN_SPECIALS = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
)


def _save_seeded(model_class, config, out: Path) -> None:
    """The model with transformers' own initialization (its distributions per tensor), seeded, saved.

    Made on the meta device, then given memory and initialized once: constructed directly, every
    nn.Linear and nn.Embedding draws its own default init before transformers' _init_weights draws
    again, twice the work over 2-3 B weights. (A full-size copy is ~9-12 GB in float32:
    bench/colpali.py builds it in a process of its own, which gives the memory back on exit.)"""
    import torch

    with torch.device("meta"):
        model = model_class(config)
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    model.init_weights()  # transformers' _init_weights over every module (buffers too), then tying
    model.eval().save_pretrained(out)


def _word_merges(vocab: dict[str, int], space: str) -> list[tuple[str, str]]:
    """One merge chain per word in WORDS, with its leading space symbol; adds the merged tokens."""
    merges: list[tuple[str, str]] = []
    for word in WORDS:
        current = space
        for char in word:
            merges.append((current, char))
            current += char
            vocab.setdefault(current, len(vocab))
    return merges


# ------------------------------------------------------------------ ColPali
def _gemma_tokenizer():
    """Gemma-style BPE: <pad> <eos> <bos> <unk> <mask>, printable ASCII (space as "▁"), newline."""
    from transformers import GemmaTokenizer

    vocab = {token: i for i, token in enumerate(["<pad>", "<eos>", "<bos>", "<unk>", "<mask>"])}
    for code in range(32, 127):
        vocab.setdefault("▁" if code == 32 else chr(code), len(vocab))
    vocab.setdefault("\n", len(vocab))
    merges = _word_merges(vocab, "▁")
    return GemmaTokenizer(vocab=vocab, merges=merges)  # type: ignore[arg-type]  # pairs, as its BPE model takes


def _colpali_sizes(real: bool, vocab_size: int) -> tuple[dict, dict, int, int]:
    """(vision_config, text_config, image size, embedding dim)."""
    if real:
        vision = {"hidden_size": 1152, "intermediate_size": 4304, "num_hidden_layers": 27, "num_attention_heads": 16}
        vision |= {"image_size": 448, "patch_size": 14, "projection_dim": 2048}
        text = {"vocab_size": 257216, "hidden_size": 2048, "intermediate_size": 16384, "num_hidden_layers": 18}
        text |= {"num_attention_heads": 8, "num_key_value_heads": 1, "head_dim": 256, "max_position_embeddings": 8192}
        return vision, text, 448, 128
    vision = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2}
    vision |= {"image_size": 32, "patch_size": 8, "projection_dim": 48}
    text = {"vocab_size": vocab_size, "hidden_size": 48, "intermediate_size": 96, "num_hidden_layers": 2}
    text |= {"num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 24, "max_position_embeddings": 256}
    return vision, text, 32, 16


def write_colpali(out: Path, real: bool = False) -> None:
    """ColPaliForRetrieval over PaliGemma, and its ColPaliProcessor, into `out`."""
    from transformers import ColPaliConfig, ColPaliForRetrieval, ColPaliProcessor, SiglipImageProcessor

    tokenizer = _gemma_tokenizer()
    vision, text, size, dim = _colpali_sizes(real, 0)
    patches = (size // vision["patch_size"]) ** 2
    images = SiglipImageProcessor(size={"height": size, "width": size}, image_seq_length=patches)
    processor = ColPaliProcessor(image_processor=images, tokenizer=tokenizer)  # adds <image>, <locNNNN>...
    vision, text, size, dim = _colpali_sizes(real, len(processor.tokenizer))
    config = ColPaliConfig(
        vlm_config={
            "model_type": "paligemma",
            "image_token_id": processor.image_token_id,
            "vision_config": {"model_type": "siglip_vision_model", **vision},
            "text_config": {"model_type": "gemma", "pad_token_id": 0, "bos_token_id": 2, "eos_token_id": 1, **text},
            "projection_dim": text["hidden_size"],
            "hidden_size": text["hidden_size"],
        },
        embedding_dim=dim,
    )
    _save_seeded(ColPaliForRetrieval, config, out)
    processor.save_pretrained(out)


# ------------------------------------------------------------------ ColQwen2
def _qwen_tokenizer():
    """Qwen2 byte-level BPE: the 256 byte symbols, the word merges ("Ġ" spaces), Qwen2-VL's specials."""
    from tokenizers.pre_tokenizers import ByteLevel
    from transformers import Qwen2Tokenizer

    vocab = {symbol: i for i, symbol in enumerate(sorted(ByteLevel.alphabet()))}
    merges = _word_merges(vocab, "Ġ")
    # <|endoftext|>: unknown, end and padding. (Pairs are what its BPE model takes; the stubs say strings.)
    tokenizer = Qwen2Tokenizer(vocab=vocab, merges=merges)  # type: ignore[arg-type]
    tokenizer.add_special_tokens({"additional_special_tokens": list(QWEN_SPECIALS[1:])})
    return tokenizer


def _colqwen2_sizes(real: bool, vocab_size: int) -> tuple[dict, dict, dict, int]:
    """(vision_config, text_config, image processor settings, embedding dim)."""
    if real:
        vision = {"depth": 32, "embed_dim": 1280, "hidden_size": 1536, "num_heads": 16, "patch_size": 14}
        text = {"vocab_size": 151936, "hidden_size": 1536, "intermediate_size": 8960, "num_hidden_layers": 28}
        text |= {"num_attention_heads": 12, "num_key_value_heads": 2, "max_position_embeddings": 32768}
        rope = {"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [16, 24, 24]}
        images = {"patch_size": 14, "min_pixels": 4 * 28 * 28, "max_pixels": 768 * 28 * 28}
        return vision, {**text, "rope_parameters": rope}, images, 128
    vision = {"depth": 2, "embed_dim": 32, "hidden_size": 48, "num_heads": 2, "patch_size": 4}
    text = {"vocab_size": vocab_size, "hidden_size": 48, "intermediate_size": 96, "num_hidden_layers": 2}
    text |= {"num_attention_heads": 2, "num_key_value_heads": 1, "max_position_embeddings": 512}
    rope = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [4, 4, 4]}
    images = {"patch_size": 4, "min_pixels": 16 * 16, "max_pixels": 64 * 64}
    return vision, {**text, "rope_parameters": rope}, images, 16


def write_colqwen2(out: Path, real: bool = False) -> None:
    """ColQwen2ForRetrieval over Qwen2-VL, and its ColQwen2Processor, into `out`."""
    from transformers import ColQwen2Config, ColQwen2ForRetrieval, ColQwen2Processor, Qwen2VLImageProcessor

    tokenizer = _qwen_tokenizer()
    vision, text, image_settings, dim = _colqwen2_sizes(real, len(tokenizer))
    images = Qwen2VLImageProcessor(merge_size=2, temporal_patch_size=2, **image_settings)
    processor = ColQwen2Processor(image_processor=images, tokenizer=tokenizer)
    ids = {token: tokenizer.convert_tokens_to_ids(token) for token in QWEN_SPECIALS}
    specials = {"pad_token_id": ids["<|endoftext|>"], "bos_token_id": ids["<|endoftext|>"]}
    config = ColQwen2Config(
        vlm_config={
            "model_type": "qwen2_vl",
            "image_token_id": ids["<|image_pad|>"],
            "video_token_id": ids["<|video_pad|>"],
            "vision_start_token_id": ids["<|vision_start|>"],
            "vision_end_token_id": ids["<|vision_end|>"],
            "vision_config": {"spatial_merge_size": 2, "temporal_patch_size": 2, **vision},
            "text_config": {**text, **specials, "eos_token_id": ids["<|im_end|>"]},
        },
        embedding_dim=dim,
    )
    _save_seeded(ColQwen2ForRetrieval, config, out)
    processor.save_pretrained(out)
