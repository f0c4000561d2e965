"""TokenFloor (server/models/token_floor.py): the token count --max-request-tokens refuses on before
tokenizing is never above the real count, for every kind of tokenizer served (WordPiece, byte-level
BPE, SentencePiece Unigram; the tokenizers the test families and the bundled MiniLM use), on hostile
text too; and tokenizers it cannot bound get no floor (0) rather than a wrong one."""

from __future__ import annotations

import random

import pytest
from support.corpus import sentences
from support.families import TOKENIZERS
from tokenizers import Tokenizer, models, normalizers, pre_tokenizers

from encoderd.server.models.token_floor import TokenFloor, token_floor_rule
from encoderd.workers.contract.model_files import default_model_path
from encoderd.workers.contract.tokenizer import load_tokenizer

# Words, and what tokenizers delete, split, merge or do not know: combining marks alone, controls
# (BERT's cleaning deletes U+000B, U+000C, U+0085, U+001C...), zero-width and odd whitespace,
# CJK, emoji, underscores, a word past WordPiece's 100 characters, runs of spaces.
PIECES = [
    "the",
    "cat",
    "Quantum",
    "chromodynamics",
    "don't",
    "re-run",
    "(x+y)=z",
    "e.g.",
    "東京",
    "😀",
    "ĉƒ",
    "\u0301",
    "a\u0301",
    "\x0b",
    "\x0c",
    "\x85",
    "\x1c",
    "\x00",
    "\u200b",
    "\ufffd",
    "_",
    "__init__",
    "42",
    "3.14",
    "x" * 130,
    "\u00a0",
    "\u3000",
    "\u2028",
    "\t",
    "\n",
    "\r\n",
    "  ",
    "...",
    "—",
    "ǅ",
    "Ⅻ",
    "١٢",
]
SEPARATORS = [" ", " ", " ", "", "\t", "\n", "\u00a0", "\x0b", "\u200b"]


def _hostile(rnd: random.Random) -> str:
    return "".join(rnd.choice(PIECES) + rnd.choice(SEPARATORS) for _ in range(rnd.randint(1, 40)))


def _served() -> dict[str, Tokenizer]:
    tokenizers = {name: build()[0] for name, build in TOKENIZERS.items()}
    minilm = load_tokenizer(default_model_path())
    minilm.no_truncation()  # the real count, not the model's first 128 tokens
    return {**tokenizers, "minilm (WordPiece)": minilm}


SERVED = _served()


@pytest.mark.parametrize("name", sorted(SERVED))
def test_the_floor_is_never_above_the_real_count(name):
    tokenizer = SERVED[name]
    floor = TokenFloor(tokenizer)
    assert floor.why.startswith("each word is at least one token"), floor.why  # a floor, not 0
    rnd = random.Random(42)
    for _ in range(3000):
        text = _hostile(rnd)
        real = len(tokenizer.encode(text, add_special_tokens=False).ids)
        words = floor.tokens([text], None)
        assert words <= real, (text, real)
        assert words <= (len(text) + 1) // 2  # what may_exceed takes as the most there can be
        assert words <= len(text.split())  # what TokenFloor.over takes as the most there can be


def test_the_floor_is_most_of_a_real_vocabularys_count_of_english():
    """Close enough to refuse what matters (the test families' vocabularies are a few hundred
    pieces, so their counts of English are far above the floor: the real MiniLM's is not)."""
    tokenizer = SERVED["minilm (WordPiece)"]
    english = " ".join(sentences(50, max_words=40, seed=1))
    real = len(tokenizer.encode(english, add_special_tokens=False).ids)
    assert real * 0.6 <= TokenFloor(tokenizer).tokens([english], None) <= real


def test_pairs_truncation_and_the_budget_bound_the_count():
    floor = TokenFloor(SERVED["minilm (WordPiece)"])
    docs = ["one two three four five"] * 10
    assert floor.tokens(docs, None) == 50
    assert floor.tokens(docs, 4) == 40  # each at most the model's maximum
    assert floor.tokens(docs, None, pairs_with="a query") == 70  # the query is in every pair
    assert floor.tokens(docs, 6, pairs_with="a query") == 60
    assert floor.tokens(docs, None, stop_above=12) == 15  # counting stopped past the budget
    # Counted only when the lengths allow more than the budget: 10 x (23 + 1) // 2 = 120 at most.
    assert floor.may_exceed(docs, None, "", 119) and not floor.may_exceed(docs, None, "", 120)
    assert not floor.may_exceed(docs, 4, "", 40) and floor.may_exceed(docs, 5, "", 40)
    # The floor when over the budget, else 0 (at or under it: nothing to refuse).
    assert floor.over(docs, None, "", 49) == 50 and floor.over(docs, None, "", 50) == 0
    assert floor.over(docs, 6, "a query", 59) == 60 and floor.over(docs, 6, "a query", 60) == 0
    # Runs over the budget, words not: counted, and not over.
    assert floor.over(["-- ... !!"] * 10, None, "", 5) == 0


def test_the_runs_bound_the_words_where_str_split_separates_at_more_than_the_floor():
    """str.split separates at every character the floor's separators hold and more (U+000B,
    U+001C, U+0085...): a run of the floor's may be split further, never joined."""
    floor = TokenFloor(SERVED["minilm (WordPiece)"])
    odd = "a\x0bb\x1cc\x85d e\u00a0f\u3000g_h -- ~x"
    assert floor.tokens([odd], None) <= len(odd.split())


def _tokenizer(pre=None, norm=None, model=None) -> Tokenizer:
    tok = Tokenizer(model or models.WordPiece({"[UNK]": 0, "a": 1}, unk_token="[UNK]"))
    if pre:
        tok.pre_tokenizer = pre
    if norm:
        tok.normalizer = norm
    return tok


@pytest.mark.parametrize(
    "tokenizer, why",
    [
        (_tokenizer(), "does not surely split at whitespace"),  # no pre-tokenizer: pieces span spaces
        (_tokenizer(pre_tokenizers.Split(r"\s+", "removed")), "does not surely split"),  # CLIP's kind
        (_tokenizer(pre_tokenizers.Metaspace(split=False)), "does not surely split"),
        (_tokenizer(pre_tokenizers.ByteLevel(use_regex=False)), "does not surely split"),
        (
            _tokenizer(pre_tokenizers.Metaspace(), normalizers.Replace(" ", "\u2581")),  # Llama's
            "normalizer (Replace)",
        ),
        (_tokenizer(pre_tokenizers.WhitespaceSplit(), model=models.BPE()), "no unknown token"),
    ],
)
def test_tokenizers_it_cannot_bound_get_no_floor(tokenizer, why):
    separator, reason = token_floor_rule(tokenizer)
    assert separator is None and why in reason
    assert TokenFloor(tokenizer).tokens(["many words here"] * 100, None) == 0


def test_xlm_r_runs_of_spaces_made_one_keep_the_floor():
    norm = normalizers.Sequence([normalizers.NFKC(), normalizers.Replace(" {2,}", " ")])
    assert token_floor_rule(_tokenizer(pre_tokenizers.Metaspace(), norm))[0] == "space"
