"""The fewest tokens a text can become, counted without tokenizing it.

--max-request-tokens refuses a request before any tokenization when this floor is over the budget,
so a refusal on it is never wrong, and a request surely over the budget (1,000 documents x 2,000
characters) costs no tokenizing (it was tokenized first: 3.3 s and +138 MB in the frontend).

Why a floor and not a characters-per-token guess: a guess (8 characters a token) is not below the
true count for every text, and an upper bound (a token covers at least one character, or one byte
for byte-level BPE) can only admit, never refuse. The floor is the number of words: runs between
whitespace that hold a letter or digit. It holds for a tokenizer when
  - its pre-tokenizer splits at whitespace (BertPreTokenizer, Whitespace, WhitespaceSplit,
    ByteLevel's regex, Metaspace's split at spaces), so two words never share a piece, and pieces
    are only ever split further;
  - its normalizer keeps letters, digits and whitespace (Unicode forms, lowercasing, accent
    stripping, BERT's cleaning, SentencePiece's charsmap, XLM-R's runs of spaces made one): a
    word reaches the model non-empty and apart from the next;
  - its model turns every non-empty piece into at least one token (WordPiece, Unigram and
    WordLevel have an unknown token; BPE needs one, byte fallback or byte-level input, else it
    drops characters it does not know).
BERT's cleaning deletes control characters (U+000B, U+000C, U+0085 among them) and Metaspace
splits at U+0020 only, so only what every one of them keeps as a separator separates words here.
Any other tokenizer (CLIP's Split regex, Llama's Replace normalizer) gets no floor: 0, and only
the exact count after tokenization applies (token_floor_rule says why).
"""

from __future__ import annotations

import itertools
import json
import re
from collections.abc import Sequence

from tokenizers import Tokenizer

# Whitespace that BERT's normalizer keeps as a space (Unicode White_Space less the controls it
# deletes) and every whitespace-splitting pre-tokenizer splits at.
_WHITESPACE = "\t\n\r \u00a0\u1680\u2000-\u200a\u2028\u2029\u202f\u205f\u3000"
_WORDS = {
    "whitespace": re.compile(rf"[^\W_][^{_WHITESPACE}]*"),
    "space": re.compile(r"[^\W_][^ ]*"),  # Metaspace: only U+0020 becomes its separator
}

_KEEPS_LETTERS = {"BertNormalizer", "NFC", "NFD", "NFKC", "NFKD", "Lowercase", "StripAccents", "Strip"}
_KEEPS_LETTERS |= {"Prepend", "Precompiled", "Nmt"}
_SPLITS_AT_WHITESPACE = {"BertPreTokenizer", "Whitespace", "WhitespaceSplit"}


def _parts(component: dict | None, key: str) -> list[dict]:
    """A normalizer or pre-tokenizer as the list of its steps (a Sequence's, in order)."""
    if not component:
        return []
    if component.get("type") == "Sequence":
        return [p for step in component.get(key, []) for p in _parts(step, key)]
    return [component]


def _spaces_to_a_space(normalizer: dict) -> bool:
    """A Replace of runs of spaces by one (XLM-R's " {2,}"): it neither joins nor removes words."""
    pattern = normalizer.get("pattern") or {}
    text = pattern.get("String", pattern.get("Regex", ""))
    return (
        normalizer.get("type") == "Replace"
        and normalizer.get("content") == " "
        and re.fullmatch(r" [ {},+*0-9]*", text or "x") is not None
    )


def _separator(pre_tokenizers: list[dict]) -> str | None:
    """Which whitespace the pre-tokenizer surely splits at: "whitespace", "space" or None."""
    kinds = set()
    for step in pre_tokenizers:
        kind = step.get("type")
        if kind in _SPLITS_AT_WHITESPACE or (kind == "ByteLevel" and step.get("use_regex", True)):
            kinds.add("whitespace")
        elif kind == "Metaspace" and step.get("split", True):
            kinds.add("space")
    return "whitespace" if "whitespace" in kinds else ("space" if kinds else None)


def token_floor_rule(tokenizer: Tokenizer) -> tuple[str | None, str]:
    """(the word separator the floor counts at, or None for no floor; why)."""
    spec = json.loads(tokenizer.to_str())
    pre = _parts(spec.get("pre_tokenizer"), "pretokenizers")
    separator = _separator(pre)
    if separator is None:
        return None, "its pre-tokenizer does not surely split at whitespace"
    normalizers = _parts(spec.get("normalizer"), "normalizers")
    odd = [n.get("type") for n in normalizers if n.get("type") not in _KEEPS_LETTERS and not _spaces_to_a_space(n)]
    if odd:
        return None, f"its normalizer ({', '.join(map(str, odd))}) may remove or join words"
    model = spec.get("model") or {}
    byte_level = any(step.get("type") == "ByteLevel" for step in pre)
    if model.get("type") == "BPE" and not (model.get("unk_token") or model.get("byte_fallback") or byte_level):
        return None, "its BPE model has no unknown token: it drops characters it does not know"
    if model.get("type") not in ("WordPiece", "Unigram", "WordLevel", "BPE"):
        return None, f"its model is {model.get('type')}"
    return separator, f"each word is at least one token ({model.get('type')}, split at {separator})"


class TokenFloor:
    """The floor of one model's tokenizer (see the module's docstring)."""

    def __init__(self, tokenizer: Tokenizer):
        separator, self.why = token_floor_rule(tokenizer)
        self._words = _WORDS[separator] if separator else None

    def words(self, text: str, at_most: int) -> int:
        """The words of `text`, counted up to `at_most` (so a long text costs no more than that)."""
        if self._words is None or at_most <= 0:
            return 0
        return sum(1 for _ in itertools.islice(self._words.finditer(text), at_most))

    def may_exceed(self, texts: Sequence[str], cap: int | None, pairs_with: str, budget: int) -> bool:
        """Whether the floor of `texts` can be over `budget` at all, from their lengths alone: a word
        takes a character and a separator, so a text of n characters holds at most (n + 1) // 2
        (and counts at most `cap`). Most requests are answered here, without counting words."""
        if self._words is None:
            return False
        each = cap or 1 << 62
        query = (len(pairs_with) + 1) // 2
        return sum(min(each, query + (len(t) + 1) // 2) for t in texts) > budget

    def over(self, texts: Sequence[str], cap: int | None, pairs_with: str, budget: int) -> int:
        """The floor of `texts` when it is over `budget` (counted as `tokens` counts it), else 0. The
        words are counted (a regex: ~35 ms of one core, holding the GIL, for 2,048 texts of ~350
        characters on a 2-vCPU Xeon) only when the whitespace-separated runs are over the budget
        too (str.split: ~7 ms there): each word lies in a run of its own, since str.split
        separates at every character either separator set holds (and more), so the runs are at
        least the words."""
        if self._words is None:
            return 0
        each = cap or 1 << 62
        query = len(pairs_with.split())
        runs = 0
        for text in texts:
            runs += min(each, query + len(text.split()))
            if runs > budget:
                floor = self.tokens(texts, cap, pairs_with, stop_above=budget)
                return floor if floor > budget else 0
        return 0

    def tokens(self, texts: Sequence[str], cap: int | None, pairs_with: str = "", stop_above: int = 0) -> int:
        """The fewest tokens `texts` (each paired with `pairs_with`) can become, each at most `cap`
        (the model's maximum, when truncating). Counting stops once the total is over
        `stop_above` (the budget), so what it costs is bounded by that, not by the request
        (at most ~0.2 s of one core for a 262,144 budget of English)."""
        if self._words is None:
            return 0
        limit = stop_above + 1 if stop_above else 1 << 62
        each = cap or limit
        query = self.words(pairs_with, each) if pairs_with else 0
        total = 0
        for text in texts:
            total += min(each, query + self.words(text, each - query))
            if total >= limit:
                break
        return total
