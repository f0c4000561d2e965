"""An embedding model's token states: every input token's last hidden state, as TEI's
/embed_all returns them for a plain embedder.

What the encoder computes before pooling, for all of an input's tokens (special tokens
included, after truncation): not pooled, not normalized, no Dense module. The worker
computes them in batches of their own (batching.WorkItem.token_states) and sends them
back ragged, one (tokens, hidden) array per input. Identical inputs in flight are computed
once, keyed apart from the pooled vectors of the same texts; they are not kept in the LRU.
"""

from __future__ import annotations

from typing import cast

import numpy as np

from ..workers.contract.model_spec import ModelKind
from .engine import Engine, ServedModel
from .result_cache import result_key
from .scheduler import Priority

KEY = "token_states"  # the result cache's name for this output


async def embed_token_states(
    engine: Engine,
    name: str,
    texts,
    *,
    truncate: bool = True,
    side: str = "right",
    prompt_name: str = "",
    priority: Priority = Priority.INTERACTIVE,
) -> tuple[ServedModel, list[np.ndarray], int]:
    """Per input, its (tokens, hidden) float32 last hidden states, and the token count."""
    model = engine.get(name, ModelKind.EMBEDDING)
    model.scheduler.refuse_if_full(len(texts))  # a flood is refused before any other work
    texts = engine.check_inputs(texts)
    prefix = engine.prompt_text(model, "", prompt_name)
    if prefix:
        texts = [prefix + t for t in texts]

    async def compute(indices: list[int]):
        batch = [texts[i] for i in indices]
        with engine.admit(model, batch, truncate=truncate):
            tokens = await model.tokenizer.encode(batch, truncate=truncate, side=side, bulk=priority == Priority.BULK)
        engine.check_token_budget(0, tokens.total_tokens)
        return await model.compute(tokens, priority, token_states=True), tokens.lengths

    keys = [result_key(KEY, side, str(truncate), t) for t in texts]
    # Not kept in the LRU: one input's states are ~tokens x a pooled vector's bytes (256 x 1.5 KB for
    # MiniLM), which an LRU sized in entries for vectors would turn into gigabytes.
    rows, n_tokens = await model.results.resolve(keys, compute, stack=False, remember=False)
    return model, cast("list[np.ndarray]", rows), n_tokens  # stack=False: the rows, as a list
