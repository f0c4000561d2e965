"""Issue 17: token-id inputs get the model's special tokens unless they carry them already,
for any tokenizer layout (BERT's [CLS] x [SEP], RoBERTa's <s> x </s>, an EOS only, none)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers, processors

from encoderd.server.models.tokenization import ModelTokenizer

VOCAB = {"<unk>": 0, "<s>": 1, "</s>": 2, "a": 3, "b": 4, "c": 5}


def _tokenizer(post_processor) -> Tokenizer:
    tokenizer = Tokenizer(models.WordLevel(VOCAB, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    if post_processor is not None:
        tokenizer.post_processor = post_processor
    return tokenizer


LAYOUTS = {
    "both": (processors.TemplateProcessing(single="<s> $A </s>", special_tokens=[("<s>", 1), ("</s>", 2)]), [1], [2]),
    "eos": (processors.TemplateProcessing(single="$A </s>", special_tokens=[("</s>", 2)]), [], [2]),
    "none": (None, [], []),
}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_special_tokens_are_added_once_and_kept_when_cut(layout):
    post_processor, prefix, suffix = LAYOUTS[layout]
    tokenizer = ModelTokenizer(_tokenizer(post_processor), 6, ThreadPoolExecutor(1))
    assert tokenizer.special_affixes == (prefix, suffix)
    assert tokenizer.with_special_tokens([3, 4]) == [*prefix, 3, 4, *suffix]
    assert tokenizer.with_special_tokens([*prefix, 3, 4, *suffix]) == [*prefix, 3, 4, *suffix]  # carried already
    cut = tokenizer.with_special_tokens([5] * 20)
    assert len(cut) == 6 and cut[: len(prefix)] == prefix and cut[len(cut) - len(suffix) :] == suffix
    # The same ids the text path computes, truncation included.
    assert tokenizer.with_special_tokens([3, 4, 5]) == tokenizer.untruncated.encode("a b c").ids
