"""Multi-modal, multi-vector and sparse operations on served models.

A request's inputs, texts and media in any order, become queue items of their
own modality (server/models/compute.py, the path every operation takes): texts are
tokenized, media fetched, decoded and preprocessed in the media thread pools.
They then share the model's scheduler and worker with every other request, as
text does; a batch holds one modality (batching.py), and the request's rows
are reassembled in input order.

What comes back depends on the model kind (workers/backends/torch_heads.py):
one vector per input (embedding, clip, clap), one unit vector per token or
patch (colbert, clip_patches), one per position of the sequence a ColPali / ColQwen2
processor builds (colpali: server/models/retrieval.py), or a sparse vocabulary vector (sparse).
"""

from __future__ import annotations

import asyncio
from typing import cast

import numpy as np

from ...workers.contract.model_spec import MULTI_VECTOR_KINDS, ModelKind
from ..base.errors import InvalidInput
from ..scheduling.scheduler import Priority
from . import compute
from .media import Content
from .registry import ModelRegistry
from .request_options import EmbedOptions, RerankOptions
from .served import ServedModel, check_width

SINGLE_VECTOR_KINDS = (ModelKind.EMBEDDING, ModelKind.CLIP, ModelKind.CLAP)


# ------------------------------------------------------------- operations
async def embed_contents(
    registry: ModelRegistry,
    name: str,
    contents: list[Content],
    options: EmbedOptions,
) -> tuple[ServedModel, np.ndarray, int]:
    """One vector (n, dim) per input, as the model computes it (normalizing is the caller's), and the usage."""
    model = registry.get(name, SINGLE_VECTOR_KINDS)
    check_width(model, options)
    rows, usage = await compute.run(
        registry,
        model,
        contents,
        compute.POOLED,
        truncate=options.truncate,
        side=options.side,
        priority=options.priority,
    )
    return model, cast("np.ndarray", rows), usage


async def embed_multivector(
    registry: ModelRegistry,
    name: str,
    contents: list[Content],
    options: EmbedOptions,
) -> tuple[ServedModel, list[np.ndarray], int]:
    """Per input, its (rows, dim) unit vectors, and the usage. `options.prompt` is the prefix text
    itself; inputs are cut on the right."""
    model = registry.get(name, MULTI_VECTOR_KINDS)
    rows, usage = await _multi_vector(
        registry, model, contents, truncate=options.truncate, prompt=options.prompt, priority=options.priority
    )
    return model, rows, usage


async def maxsim(
    registry: ModelRegistry,
    name: str,
    query: str,
    documents: list[Content],
    options: RerankOptions,
    *,
    query_prompt: str = "",
    document_prompt: str = "",
) -> tuple[ServedModel, np.ndarray, int]:
    """Late-interaction scores (n,) of the documents for the query, and the usage."""
    if not query:
        raise InvalidInput("`query` is empty")
    model = registry.get(name, MULTI_VECTOR_KINDS)
    # Concurrently, so the query can ride in the documents' first batch.
    (query_rows, query_usage), (rows, usage) = await asyncio.gather(
        _multi_vector(
            registry,
            model,
            [Content(text=query)],
            truncate=options.truncate,
            prompt=query_prompt,
            priority=options.priority,
            what="query",
        ),
        _multi_vector(
            registry,
            model,
            documents,
            truncate=options.truncate,
            prompt=document_prompt,
            priority=options.priority,
            what="documents",
        ),
    )
    loop = asyncio.get_running_loop()
    scores = await loop.run_in_executor(registry.media_pool, maxsim_scores, query_rows[0], rows)
    return model, scores, query_usage + usage


async def embed_sparse(
    registry: ModelRegistry,
    name: str,
    texts,
    options: EmbedOptions,
    *,
    top_k: int = 0,
    threshold: float = 0.0,
) -> tuple[ServedModel, list[tuple[np.ndarray, np.ndarray]], int]:
    """Per input, its sparse vector as (ascending indices, weights), and the usage. `options.prompt`
    is the prefix text itself."""
    if top_k < 0:
        raise InvalidInput(f"`top_k` must be positive or 0 (all), not {top_k}")
    if not np.isfinite(threshold) or threshold < 0:
        raise InvalidInput(f"`threshold` must be a finite number >= 0, not {threshold}")
    model = registry.get(name, ModelKind.SPARSE)
    contents = [Content(text=t) for t in texts]
    rows, usage = await _multi_vector(
        registry,
        model,
        contents,
        truncate=options.truncate,
        side=options.side,
        prompt=options.prompt,
        priority=options.priority,
    )
    return model, [sparsify(indices, values, top_k, threshold) for indices, values in rows], usage


# ------------------------------------------------------------------ maths
def maxsim_scores(query: np.ndarray, documents: list[np.ndarray]) -> np.ndarray:
    """score(d) = sum over query vectors q of max over d's vectors v of q . v."""
    return np.array([float((query @ doc.T).max(axis=1).sum()) for doc in documents], dtype=np.float32)


def sparsify(indices: np.ndarray, values: np.ndarray, top_k: int, threshold: float) -> tuple[np.ndarray, np.ndarray]:
    keep = values > threshold
    indices, values = indices[keep], values[keep]
    if top_k and len(values) > top_k:
        best = np.sort(np.argpartition(-values, top_k - 1)[:top_k])  # sorted positions keep indices ascending
        indices, values = indices[best], values[best]
    return indices, values


# ------------------------------------------------------------- internals
async def _multi_vector(
    registry: ModelRegistry,
    model: ServedModel,
    contents: list[Content],
    *,
    truncate: bool,
    priority: Priority,
    side: str = "right",
    prompt: str = "",
    what: str = "inputs",
) -> tuple[list, int]:
    """Per input its rows (multi-vector) or (indices, weights) (sparse), and the usage."""
    if prompt:
        registry.check_text(prompt, f"the {what} prompt")
    inputs: list[compute.Input] = list(contents)
    if model.spec.kind == ModelKind.COLPALI:
        inputs, prompt = await _retrieval_queries(registry, model, contents, prompt, what), ""
    rows, usage = await compute.run(
        registry,
        model,
        inputs,
        compute.MULTI_VECTOR,
        truncate=truncate,
        side=side,
        prefix=prompt,
        priority=priority,
        what=what,
    )
    return cast("list", rows), usage


async def _retrieval_queries(
    registry: ModelRegistry, model: ServedModel, contents: list[Content], prompt: str, what: str
) -> list[compute.Input]:
    """A ColPali / ColQwen2 model's texts as the token ids its processor builds for a query (the
    prompt, if any, before the text); images as they are."""
    compute.check_inputs(registry.config, contents, what, ("text", "image"), f"{model.spec.name!r} (colpali)")
    processor = model.media["image"]
    texts = [i for i, content in enumerate(contents) if content.modality == "text"]
    loop = asyncio.get_running_loop()
    built = await asyncio.gather(
        *(loop.run_in_executor(registry.media_pool, processor.query_ids, prompt + contents[i].text) for i in texts)
    )
    inputs: list[compute.Input] = list(contents)
    for i, ids in zip(texts, built, strict=True):
        if len(ids) > model.spec.max_length:
            raise InvalidInput(
                f"{what}[{i}] is {len(ids)} tokens with the query prefix and augmentation tokens; the model "
                f"reads at most {model.spec.max_length} (cutting it would drop the augmentation tokens)"
            )
        inputs[i] = compute.TokenIds(ids)
    return inputs
