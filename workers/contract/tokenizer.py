"""A model's tokenizer, built the way sentence-transformers builds it: transformers' AutoTokenizer.

The worker builds it (it imports transformers anyway; the frontend of a text model never does) and
sends it to the frontend in its READY message (workers/process.py), which tokenizes every request
with it (server/models/tokenization.py); the worker tokenizes its calibration set with the same one
(workers/calibration.py), so the int8 and fidelity figures are computed on exactly the tokens
requests will carry.

Not tokenizer.json as it is: for some families transformers rebuilds the pipeline from the
vocabulary (XLM-RoBERTa, CamemBERT, DeBERTa-v2 in transformers 5: whitespace split, then
Metaspace), and reading the file alone added tokens for trailing or repeated whitespace that the
reference never sees ("a " -> an extra "▁"; cosine 0.58-0.93 on such texts).
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

from tokenizers import Tokenizer, normalizers

from .model_spec import RETRIEVAL_CLASSES, ModelLoadError


def load_tokenizer(model_dir: str, lowercase: bool = False, trust_remote_code: bool = False) -> Tokenizer:
    """The model's fast tokenizer, a fresh copy (callers set its padding and truncation)."""
    return Tokenizer.from_str(tokenizer_json(model_dir, lowercase, trust_remote_code))


@functools.lru_cache(maxsize=4)
def tokenizer_json(model_dir: str, lowercase: bool = False, trust_remote_code: bool = False) -> str:
    """The tokenizer as JSON: what AutoTokenizer builds from `model_dir`; `lowercase`
    (sentence-transformers' do_lower_case) lower-cases texts first, as sentence-transformers does:
    a Lowercase normalizer ahead of the tokenizer's own."""
    path = Path(model_dir) / "tokenizer.json"
    if path.exists():  # a broken file named here: the tokenizers library names none in its errors
        try:
            Tokenizer.from_file(str(path))
        except Exception as exc:  # noqa: BLE001 - any parse error
            raise ModelLoadError(
                f"{path}: not a readable tokenizer.json ({exc}); replace it from the model's repository"
            ) from None
    loaded = _transformers_tokenizer(model_dir, trust_remote_code)
    tokenizer = getattr(loaded, "backend_tokenizer", None)
    if not isinstance(tokenizer, Tokenizer):
        raise ModelLoadError(
            f"{model_dir}: transformers loads its tokenizer as {type(loaded).__name__}, which has no fast "
            "(tokenizers) form; encoderd tokenizes with the tokenizers library only"
        )
    if lowercase and not _lowercases(tokenizer.normalizer):
        rest = tokenizer.normalizer
        # A normalizers.Sequence iterates over its parts; the tokenizers stubs do not say so.
        rest = [] if rest is None else list(rest) if isinstance(rest, normalizers.Sequence) else [rest]  # type: ignore[call-overload]
        tokenizer.normalizer = normalizers.Sequence([normalizers.Lowercase(), *rest])
    return tokenizer.to_str()


def _transformers_tokenizer(model_dir: str, trust_remote_code: bool):
    """AutoTokenizer's; for ColPali / ColQwen2 the one their processor holds: ColPaliProcessor adds
    its <image> and location tokens and turns the automatic <bos> off (it writes <bos> into the
    query text itself), so AutoTokenizer alone would tokenize queries differently."""
    from transformers import AutoProcessor, AutoTokenizer

    config = json.loads((Path(model_dir) / "config.json").read_text())
    if config.get("model_type") in RETRIEVAL_CLASSES:
        return AutoProcessor.from_pretrained(model_dir, trust_remote_code=trust_remote_code).tokenizer
    return AutoTokenizer.from_pretrained(model_dir, trust_remote_code=trust_remote_code)


def _lowercases(normalizer) -> bool:
    """Whether a Lowercase normalizer is there already; the same test sentence-transformers makes
    (a BertNormalizer's own lowercase does not count: it adds a Lowercase then too, harmlessly)."""
    if isinstance(normalizer, normalizers.Sequence):
        return any(isinstance(n, normalizers.Lowercase) for n in normalizer)  # type: ignore[attr-defined]  # iterable, unstubbed
    return isinstance(normalizer, normalizers.Lowercase)
