"""An embedding model's token states: every input token's last hidden state, as TEI's
/embed_all returns them for a plain embedder.

What the encoder computes before pooling, for all of an input's tokens (special tokens
included, after truncation): not pooled, not normalized, no Dense module. The worker
computes them in batches of their own (batching.WorkItem.token_states) and sends them
back ragged, one (tokens, hidden) array per input. Identical inputs in flight are computed
once, keyed apart from the pooled vectors of the same texts; they are not kept in the LRU
(compute.TOKEN_STATES).
"""

from __future__ import annotations

from typing import cast

import numpy as np

from ...workers.contract.model_spec import ModelKind
from ..models import compute
from ..models.registry import ModelRegistry
from ..models.request_options import EmbedOptions
from ..models.served import ServedModel


async def embed_token_states(
    registry: ModelRegistry,
    name: str,
    texts,
    options: EmbedOptions,
) -> tuple[ServedModel, list[np.ndarray], int]:
    """Per input, its (tokens, hidden) float32 last hidden states, and the token count (the prompt
    by its name, TEI's only way to name one)."""
    model = registry.get(name, ModelKind.EMBEDDING)
    prefix = registry.prompt_text(model, "", options.prompt_name)
    rows, n_tokens = await compute.run(
        registry,
        model,
        texts,
        compute.TOKEN_STATES,
        truncate=options.truncate,
        side=options.side,
        prefix=prefix,
        priority=options.priority,
    )
    return model, cast("list[np.ndarray]", rows), n_tokens  # ragged: the rows, as a list
