"""A model's tokenizer, read the way sentence-transformers reads it.

The frontend tokenizes every request with it (server/models/tokenization.py); the worker tokenizes its
calibration set with it (workers/calibration.py), so the int8 and fidelity figures are computed on
exactly the tokens requests will carry.
"""

from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer, normalizers

from .model_spec import ModelLoadError


def load_tokenizer(model_dir: str, lowercase: bool = False, trust_remote_code: bool = False) -> Tokenizer:
    """The model's fast tokenizer; `lowercase` (sentence-transformers' do_lower_case) lower-cases texts
    first, as sentence-transformers does: a Lowercase normalizer ahead of the tokenizer's own."""
    path = Path(model_dir) / "tokenizer.json"
    if path.exists():
        try:
            tokenizer = Tokenizer.from_file(str(path))
        except Exception as exc:  # noqa: BLE001 - the tokenizers library names no file in its parse errors
            raise ModelLoadError(
                f"{path}: not a readable tokenizer.json ({exc}); replace it from the model's repository"
            ) from None
    else:  # Slow-tokenizer-only models: let transformers convert to a fast tokenizer.
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(
            model_dir, use_fast=True, trust_remote_code=trust_remote_code
        ).backend_tokenizer
    if lowercase and not _lowercases(tokenizer.normalizer):
        rest = tokenizer.normalizer
        # A normalizers.Sequence iterates over its parts; the tokenizers stubs do not say so.
        rest = [] if rest is None else list(rest) if isinstance(rest, normalizers.Sequence) else [rest]  # type: ignore[call-overload]
        tokenizer.normalizer = normalizers.Sequence([normalizers.Lowercase(), *rest])
    return tokenizer


def _lowercases(normalizer) -> bool:
    """Whether a Lowercase normalizer is there already; the same test sentence-transformers makes
    (a BertNormalizer's own lowercase does not count: it adds a Lowercase then too, harmlessly)."""
    if isinstance(normalizer, normalizers.Sequence):
        return any(isinstance(n, normalizers.Lowercase) for n in normalizer)  # type: ignore[attr-defined]  # iterable, unstubbed
    return isinstance(normalizer, normalizers.Lowercase)
