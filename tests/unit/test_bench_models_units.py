"""`encoderd bench --models base`: the XLM-R cross-encoder's tokenizer, written offline (the 1.1 GB
model itself is built only by the benchmark)."""

from __future__ import annotations

import random

from encoderd.bench.corpus import _sentence, make_queries
from encoderd.bench.models import _xlmr_tokenizer


def test_xlmr_tokenizer_is_deterministic_and_covers_the_corpus():
    rng = random.Random(0)
    texts = [_sentence(rng) for _ in range(50)] + make_queries(20, 0)
    first, second = _xlmr_tokenizer(), _xlmr_tokenizer()
    assert first.to_str() == second.to_str()  # two builds, one tokenizer: the benchmark is reproducible
    encodings = first.encode_batch(texts)
    assert all(3 not in e.ids for e in encodings)  # no <unk>: every character is in the vocabulary
    words = sum(len(t.split()) for t in texts)
    tokens = sum(len(e.ids) - 2 for e in encodings)
    assert words <= tokens <= 2 * words  # about a token a word, as XLM-R's on English (not characters)


def test_xlmr_tokenizer_pairs_use_xlmr_template():
    pair = _xlmr_tokenizer().encode("how do I reset my password", "The committee announced the budget.")
    assert pair.ids[0] == 0 and pair.ids[-1] == 2 and pair.tokens.count("</s>") == 3  # <s> A </s></s> B </s>
