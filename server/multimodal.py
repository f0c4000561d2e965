"""Multi-modal, multi-vector and sparse operations on served models.

A request's inputs, texts and media in any order, become queue items of their
own modality: texts are tokenized, media fetched, decoded and preprocessed in
the media thread pools. They then share the model's scheduler and worker with
every other request, as text does; a batch holds one modality (batching.py),
and the request's rows are reassembled in input order.

What comes back depends on the model kind (workers/backends/torch_heads.py):
one vector per input (embedding, clip, clap), one unit vector per token or
patch (colbert, colpali), or a sparse vocabulary vector (sparse).
"""

from __future__ import annotations

import asyncio
import hashlib
from typing import cast

import numpy as np

from ..workers.contract.model_spec import MULTI_VECTOR_KINDS, ModelKind, modalities
from .batching import MediaItem, WorkItem
from .engine import Engine, ServedModel
from .errors import InvalidInput
from .media import Content, media_bytes
from .result_cache import result_key
from .scheduler import PendingRequest, Priority

SINGLE_VECTOR_KINDS = (ModelKind.EMBEDDING, ModelKind.CLIP, ModelKind.CLAP)
_NO_IDS = np.zeros(0, dtype=np.int32)
_A = {"text": "a text", "image": "an image", "audio": "audio"}


# ------------------------------------------------------------- operations
async def embed_contents(
    engine: Engine,
    name: str,
    contents: list[Content],
    *,
    truncate: bool = True,
    side: str = "right",
    priority: Priority = Priority.INTERACTIVE,
) -> tuple[ServedModel, np.ndarray, int]:
    """One vector (n, dim) per input, as the model computes it (normalizing is the caller's), and the usage."""
    model = engine.get(name, SINGLE_VECTOR_KINDS)
    rows, usage = await _compute(engine, model, contents, truncate=truncate, side=side, priority=priority)
    return model, rows, usage


async def embed_multivector(
    engine: Engine,
    name: str,
    contents: list[Content],
    *,
    truncate: bool = True,
    prompt: str = "",
    priority: Priority = Priority.INTERACTIVE,
) -> tuple[ServedModel, list[np.ndarray], int]:
    """Per input, its (rows, dim) unit vectors, and the usage."""
    model = engine.get(name, MULTI_VECTOR_KINDS)
    rows, usage = await _compute(
        engine, model, contents, truncate=truncate, prefix=prompt, priority=priority, ragged=True
    )
    return model, rows, usage


async def maxsim(
    engine: Engine,
    name: str,
    query: str,
    documents: list[Content],
    *,
    truncate: bool = True,
    query_prompt: str = "",
    document_prompt: str = "",
    priority: Priority = Priority.INTERACTIVE,
) -> tuple[ServedModel, np.ndarray, int]:
    """Late-interaction scores (n,) of the documents for the query, and the usage."""
    if not query:
        raise InvalidInput("`query` is empty")
    model = engine.get(name, MULTI_VECTOR_KINDS)
    # Concurrently, so the query can ride in the documents' first batch.
    (query_rows, query_usage), (rows, usage) = await asyncio.gather(
        _compute(
            engine,
            model,
            [Content(text=query)],
            truncate=truncate,
            prefix=query_prompt,
            priority=priority,
            ragged=True,
            what="query",
        ),
        _compute(
            engine,
            model,
            documents,
            truncate=truncate,
            prefix=document_prompt,
            priority=priority,
            ragged=True,
            what="documents",
        ),
    )
    loop = asyncio.get_running_loop()
    scores = await loop.run_in_executor(engine.media_pool, maxsim_scores, query_rows[0], rows)
    return model, scores, query_usage + usage


async def embed_sparse(
    engine: Engine,
    name: str,
    texts,
    *,
    truncate: bool = True,
    side: str = "right",
    prompt: str = "",
    priority: Priority = Priority.INTERACTIVE,
    top_k: int = 0,
    threshold: float = 0.0,
) -> tuple[ServedModel, list[tuple[np.ndarray, np.ndarray]], int]:
    """Per input, its sparse vector as (ascending indices, weights), and the usage."""
    if top_k < 0:
        raise InvalidInput(f"`top_k` must be positive or 0 (all), not {top_k}")
    if not np.isfinite(threshold) or threshold < 0:
        raise InvalidInput(f"`threshold` must be a finite number >= 0, not {threshold}")
    model = engine.get(name, ModelKind.SPARSE)
    contents = [Content(text=t) for t in texts]
    rows, usage = await _compute(
        engine, model, contents, truncate=truncate, side=side, prefix=prompt, priority=priority, ragged=True
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
def _check(engine: Engine, model: ServedModel, contents: list[Content], what: str) -> None:
    if not contents:
        raise InvalidInput(f"`{what}` is empty: send at least one")
    if len(contents) > engine.config.max_inputs_per_request:
        raise InvalidInput(f"too many {what}: {len(contents)} > {engine.config.max_inputs_per_request} per request")
    takes = modalities(model.spec.kind)
    for i, content in enumerate(contents):
        if content.modality not in takes:
            raise InvalidInput(
                f"{what}[{i}] is {_A[content.modality]}, but model {model.spec.name!r} "
                f"({model.spec.kind.value}) takes {' and '.join(takes)}"
            )
        if content.modality == "text":
            engine.check_inputs([content.text], f"{what}[{i}]")


async def _compute(
    engine: Engine,
    model: ServedModel,
    contents: list[Content],
    *,
    truncate: bool,
    priority: Priority,
    side: str = "right",
    prefix: str = "",
    ragged: bool = False,
    what: str = "inputs",
) -> tuple:
    """Rows for every input, in order, and the usage, through the result cache
    (identical inputs in flight are computed once)."""
    _check(engine, model, contents, what)
    if prefix:
        engine.check_text(prefix, f"the {what} prompt")
    loop = asyncio.get_running_loop()
    # Media bytes first (fetches run concurrently, off the loop): the cache keys on their digest.
    blobs = await asyncio.gather(
        *(
            loop.run_in_executor(engine.fetch_pool, media_bytes, c, engine.media_limits, f"{what}[{i}]")
            for i, c in enumerate(contents)
            if c.modality != "text"
        )
    )
    media = iter(blobs)
    payloads: list[str | bytes] = [
        prefix + content.text if content.modality == "text" else next(media) for content in contents
    ]
    # A text's payload is its str, a media input's its bytes.
    keys = [
        result_key("embed", side, str(truncate), p)
        if isinstance(p, str)
        else result_key(c.modality, hashlib.blake2b(p, digest_size=20).hexdigest())
        for c, p in zip(contents, payloads, strict=True)
    ]

    async def compute(indices: list[int]):
        request = PendingRequest(len(indices), ragged)
        inputs = [(contents[i].modality, payloads[i], f"{what}[{i}]") for i in indices]
        items, costs = await _work_items(
            engine, model, inputs, request, truncate=truncate, side=side, bulk=priority == Priority.BULK
        )
        return await model.scheduler.run(items, request, priority), costs

    return await model.results.resolve(keys, compute, stack=not ragged)


async def _work_items(
    engine: Engine,
    model: ServedModel,
    inputs: list[tuple[str, str | bytes, str]],
    request: PendingRequest,
    *,
    truncate: bool,
    side: str,
    bulk: bool,
) -> tuple[list[WorkItem], np.ndarray]:
    """Queue items for (modality, text or bytes, name) inputs, and each one's cost."""
    items: list = [None] * len(inputs)
    costs = np.zeros(len(inputs), dtype=np.int64)
    texts = [j for j, (modality, _, _) in enumerate(inputs) if modality == "text"]
    media = [j for j, (modality, _, _) in enumerate(inputs) if modality != "text"]
    if texts:
        batch = cast("list[str]", [inputs[j][1] for j in texts])  # a text input's payload is its str
        with engine.admit(model, batch, truncate=truncate):
            tokens = await model.tokenizer.encode(batch, truncate=truncate, side=side, bulk=bulk)
        engine.check_token_budget(0, tokens.total_tokens)
        for j, ids in zip(texts, tokens.ids, strict=True):
            items[j], costs[j] = WorkItem(ids, None, request, j), len(ids)
    loop = asyncio.get_running_loop()
    done = await asyncio.gather(
        *(loop.run_in_executor(engine.media_pool, model.media[inputs[j][0]], inputs[j][1], inputs[j][2]) for j in media)
    )
    for j, (features, flag, cost) in zip(media, done, strict=True):
        items[j] = MediaItem(_NO_IDS, None, request, j, features=features, flag=flag, cost=cost, modality=inputs[j][0])
        costs[j] = cost
    return items, costs
