"""The one compute path every operation takes, whatever its kind or modality:

    check → key → dedup / cache → work items (tokenize, or decode media) → schedule → reassemble

An operation (embed, rerank, classify, token states, media, multi-vector, sparse) only says
what it computes: its inputs (texts, text pairs, token ids, media), the options that shape the
raw output (truncation, its side, a query the inputs pair with) and which output (`Output`).
Post-processing (normalize, dimensions, scores) is the caller's, after: not part of the key.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections.abc import Iterable, Sequence
from concurrent.futures import Executor
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import numpy as np

from ...workers.contract.model_spec import modalities
from ..base.config import MAX_MESSAGE_BYTES
from ..base.errors import BackendError, InvalidInput
from ..scheduling.batching import MediaItem, WorkItem
from ..scheduling.scheduler import PendingRequest, Priority
from ..scheduling.timing import CALL_TIMING
from .media import Content, MediaLimits, media_bytes
from .result_cache import TokenCount, result_key, result_keys
from .served import ServedModel
from .tokenization import InputTooLong

if TYPE_CHECKING:
    from ..base.config import ServerConfig


class Serving(Protocol):
    """What the compute path needs of its caller, the registry (registry.py, which satisfies it):
    named here so that this module sits below the registry and never imports it."""

    @property
    def config(self) -> ServerConfig: ...
    @property
    def media_pool(self) -> Executor: ...  # decoding and preprocessing, off the event loop
    @property
    def fetch_pool(self) -> Executor: ...  # URL fetches
    @property
    def media_limits(self) -> MediaLimits: ...

    async def check_token_floor(
        self, model: ServedModel, texts: list[str], *, truncate: bool = False, pairs_with: str = ""
    ) -> None: ...
    def check_token_budget(self, floor: int, exact: int | None = None) -> None: ...
    def admit(
        self, model: ServedModel, texts: list[str], *, truncate: bool = True, pairs_with: str = "", priority: Priority
    ) -> AbstractContextManager: ...


@dataclass(frozen=True)
class Output:
    """What the worker computes per input, and how the result cache holds it."""

    name: str  # the result cache's namespace: the same text keys apart per output
    ragged: bool = False  # one array per input of its own shape (multi-vector, sparse, token states)
    token_states: bool = False  # an embedder's unpooled last hidden states (batched apart)
    remember: bool = True  # kept in the LRU (False: only shared while in flight)


POOLED = Output("embed")  # one vector per input (embedders, clip, clap)
PAIR_LOGITS = Output("pair")  # a reranker's logits per (query, document)
CLASS_LOGITS = Output("classify")  # a classifier's logits per text or text pair
MULTI_VECTOR = Output("embed", ragged=True)  # colbert / colpali / clip_patches rows, sparse
# Not kept in the LRU: one input's states are ~tokens x a pooled vector's bytes (256 x 1.5 KB for
# MiniLM), which an LRU sized in entries for vectors would turn into gigabytes.
TOKEN_STATES = Output("token_states", ragged=True, token_states=True, remember=False)


@dataclass(frozen=True)
class TokenIds:
    """A pre-tokenized input (OpenAI token-id input), its model's special tokens already added."""

    ids: np.ndarray  # int32


@dataclass(frozen=True)
class _Media:
    modality: str
    data: bytes  # the encoded file


# A text, a (text, text_pair) pair, token ids, or a Content (a text, an image or audio clip).
Input = str | tuple[str, str] | TokenIds | Content
# What an input's key and work item are made of: a text (its prompt included), a text pair, token
# ids, or a media input's encoded file.
_Payload = str | tuple[str, str] | TokenIds | _Media
_A = {"text": "a text", "image": "an image", "audio": "audio"}


async def run(
    registry: Serving,
    model: ServedModel,
    inputs: Iterable[Input],
    output: Output,
    *,
    truncate: bool = True,
    side: str = "right",
    prefix: str = "",
    pairs_with: str | None = None,
    priority: Priority = Priority.INTERACTIVE,
    what: str = "inputs",
    names: Sequence[str] = (),
) -> tuple[np.ndarray | list, TokenCount]:
    """Rows for every input, in order (stacked, or a list when `output.ragged`), and the token
    count (the total; each input's in `.per_input`). `prefix` (a prompt) goes before every text;
    `pairs_with`: each input is a document paired with this query. Errors name input i `what[i]`, or
    `names[i]` when given. Identical inputs in flight are computed once."""
    inputs = list(inputs)
    model.scheduler.refuse_if_full(len(inputs), priority)  # a flood is refused before any other work
    spec = model.spec
    check_inputs(registry.config, inputs, what, modalities(spec.kind), f"{spec.name!r} ({spec.kind.value})")
    check_prompted(inputs, prefix, what)
    payloads = await _payloads(registry, inputs, prefix, what)
    names = names or [f"{what}[{i}]" for i in range(len(inputs))]
    keys = _keys(output, payloads, truncate, side, pairs_with)

    async def compute_some(indices: list[int]) -> tuple[np.ndarray, np.ndarray]:  # ragged: a list of rows
        request = PendingRequest(len(indices), output.ragged)
        chosen = [(payloads[i], names[i]) for i in indices]
        items, costs = await _work_items(
            registry,
            model,
            chosen,
            request,
            output,
            truncate=truncate,
            side=side,
            pairs_with=pairs_with,
            priority=priority,
        )
        rows = await model.scheduler.run(items, request, priority)
        _refuse_non_finite(spec.name, rows, [names[i] for i in indices])  # before the cache keeps them
        return rows, costs

    return await model.results.resolve(keys, compute_some, stack=not output.ragged, remember=output.remember)


def _refuse_non_finite(model_name: str, rows: np.ndarray | list, names: list[str]) -> None:
    """A row holding NaN or infinity (an overflow in the model: extreme weights, inputs far out of
    range, a reduced dtype's range) is an error, never an answer: a client would store it as a
    vector, and REST could not even print it as JSON. Stacked rows are checked in one pass, and
    row by row only to name the bad ones: on the event loop, the row-by-row check held every other
    caller's query ~10 ms behind a 2,048-input answer (issue 42 item 3)."""
    if isinstance(rows, np.ndarray) and np.isfinite(rows).all():
        return
    bad = [name for name, row in zip(names, rows, strict=True) if not _finite(row)]
    if bad:
        raise BackendError(
            f"model {model_name} computed non-finite values (NaN or infinity) for {', '.join(bad[:5])}"
            f"{' and more' if len(bad) > 5 else ''}; refused rather than returned"
        )


def _finite(row) -> bool:
    """An array, or a tuple of them (a sparse row: indices, weights), with no NaN or infinity."""
    parts = row if isinstance(row, tuple | list) else (row,)
    return all(np.asarray(part).dtype.kind != "f" or np.isfinite(part).all() for part in parts)


def check_inputs(
    config: ServerConfig, inputs: list, what: str = "inputs", takes: Sequence[str] = ("text",), model: str = ""
) -> list:
    """Count, modality and text limits of a request's inputs (texts, text pairs, token ids, contents);
    `takes`: the modalities of `model` (its name and kind, for the message)."""
    if not inputs:
        raise InvalidInput(f"`{what}` is empty: send at least one")
    if len(inputs) > config.max_inputs_per_request:
        raise InvalidInput(f"too many {what}: {len(inputs)} > {config.max_inputs_per_request} per request")
    for i, given in enumerate(inputs):
        name = f"{what}[{i}]"
        item = given
        if isinstance(given, Content):
            if given.modality not in takes:
                raise InvalidInput(f"{name} is {_A[given.modality]}, but model {model} takes {' and '.join(takes)}")
            item = given.text if given.modality == "text" else None
        if isinstance(item, TokenIds) or item is None:
            continue
        for part in item if isinstance(item, tuple) else (item,):  # a (text, text_pair) pair: both
            if not part:
                raise InvalidInput(f"{name} is an empty string")
            check_text(config, part, name)
    return inputs


def check_prompted(inputs: list, prompt: str, what: str = "inputs") -> None:
    """The request's texts with the prompt before each, at most MAX_MESSAGE_BYTES characters in all:
    as many as one message can carry. Each text field is held to --max-input-chars alone, and the
    prompt is repeated: 1,000,000 characters before each of 2,048 inputs built 2 GB of texts (and
    their cache keys) in the frontend before the token budget refused the request."""
    if not prompt:
        return
    texts = [text for x in inputs if (text := _prompted_text(x)) is not None]
    total = len(prompt) * len(texts) + sum(map(len, texts))
    if total > MAX_MESSAGE_BYTES:
        raise InvalidInput(
            f"the prompt ({len(prompt)} characters) before each of the {len(texts)} {what} makes {total} "
            f"characters; the limit is {MAX_MESSAGE_BYTES} per request: shorten the prompt or split the request"
        )


def _prompted_text(given) -> str | None:
    """The text the prompt goes before (a text input's), or None: pairs, token ids and media take none."""
    if isinstance(given, Content):
        return given.text if given.modality == "text" else None
    return given if isinstance(given, str) else None


def check_text(config: ServerConfig, text, what: str) -> str:
    """The character limit, for every text field a request carries (inputs, documents, query, prompt)."""
    if len(text) > config.max_input_chars:
        raise InvalidInput(f"{what} has {len(text)} characters; the limit is {config.max_input_chars}")
    return text


async def _payloads(registry: Serving, inputs: list[Input], prefix: str, what: str) -> list[_Payload]:
    """Texts with their prompt; media bytes given, in a data: URI or fetched (concurrently, off the
    loop): the cache keys on their digest."""
    loop = asyncio.get_running_loop()
    fetches = {
        i: loop.run_in_executor(registry.fetch_pool, media_bytes, x, registry.media_limits, f"{what}[{i}]")
        for i, x in enumerate(inputs)
        if isinstance(x, Content) and x.modality != "text"
    }
    blobs = dict(zip(fetches, await asyncio.gather(*fetches.values()), strict=True))
    payloads: list[_Payload] = []
    for i, x in enumerate(inputs):
        if (text := _prompted_text(x)) is not None:
            payloads.append(prefix + text)
        else:
            payloads.append(_Media(x.modality, blobs[i]) if isinstance(x, Content) else x)
    return payloads


def _keys(output: Output, payloads: list[_Payload], truncate: bool, side: str, pairs_with: str | None) -> list[bytes]:
    """Each input's result-cache key: its text (or text pair) after what shapes its output (the
    output, truncation, the query it is paired with), hashed once for the whole request."""
    query = () if pairs_with is None else (pairs_with,)
    texts = [p if isinstance(p, tuple) else (p,) for p in payloads if isinstance(p, str | tuple)]
    by_text = iter(result_keys((output.name, side, str(truncate), *query), texts))
    return [next(by_text) if isinstance(p, str | tuple) else _other_key(output, p) for p in payloads]


def _other_key(output: Output, payload: _Media | TokenIds) -> bytes:
    if isinstance(payload, _Media):
        return result_key(payload.modality, hashlib.blake2b(payload.data, digest_size=20).hexdigest())
    return result_key(output.name, "ids", payload.ids.tobytes().hex())


async def _work_items(
    registry: Serving,
    model: ServedModel,
    inputs: list[tuple[_Payload, str]],
    request: PendingRequest,
    output: Output,
    *,
    truncate: bool,
    side: str,
    pairs_with: str | None,
    priority: Priority,
) -> tuple[list[WorkItem], np.ndarray]:
    """Queue items for (payload, name) inputs, and each one's cost in tokens (or token-equivalents)."""
    items: list = [None] * len(inputs)
    costs = np.zeros(len(inputs), dtype=np.int64)
    texts = [j for j, (p, _) in enumerate(inputs) if isinstance(p, str | tuple)]
    n_tokens = 0  # texts' and token ids', held to --max-request-tokens (media costs are no tokens)
    if texts:
        batch: list = [inputs[j][0] for j in texts]
        estimated = ["".join(t) if isinstance(t, tuple) else t for t in batch]
        await registry.check_token_floor(model, estimated, truncate=truncate, pairs_with=pairs_with or "")
        with registry.admit(
            model, estimated, truncate=truncate, pairs_with=pairs_with or "", priority=priority
        ) as tokenized:
            since = time.monotonic()
            try:
                tokens = await model.tokenizer.encode(
                    batch, truncate=truncate, side=side, pairs_with=pairs_with, bulk=priority == Priority.BULK
                )
            except InputTooLong as too_long:  # named as the request names it, not by its place in this batch
                raise InvalidInput(too_long.named([inputs[j][1] for j in texts])) from None
            tokenized(tokens.total_tokens)
            if (timing := CALL_TIMING.get()) is not None:
                timing.tokenized(since)
        n_tokens += tokens.total_tokens
        no_types: list[np.ndarray | None] = [None] * len(texts)
        types: Sequence[np.ndarray | None] = tokens.type_ids or no_types
        for j, ids, type_ids in zip(texts, tokens.ids, types, strict=True):
            items[j] = WorkItem(ids, type_ids, request, j, token_states=output.token_states)
    for j, (payload, _) in enumerate(inputs):
        if isinstance(payload, TokenIds):
            items[j] = WorkItem(payload.ids, None, request, j, token_states=output.token_states)
            n_tokens += len(payload.ids)
    registry.check_token_budget(0, n_tokens)
    media = [(j, p, name) for j, (p, name) in enumerate(inputs) if isinstance(p, _Media)]
    loop = asyncio.get_running_loop()
    done = await asyncio.gather(
        *(loop.run_in_executor(registry.media_pool, model.media[p.modality], p.data, name) for _, p, name in media)
    )
    for (j, p, _), ready in zip(media, done, strict=True):
        ids = _NO_IDS if ready.ids is None else ready.ids
        items[j] = MediaItem(
            ids,
            None,
            request,
            j,
            features=ready.features,
            flag=ready.flag,
            cost=ready.cost,
            modality=p.modality,
            grid=ready.grid,
        )
    for j, item in enumerate(items):
        costs[j] = item.length  # tokens; a media item's cost in token-equivalents
    return items, costs


_NO_IDS = np.zeros(0, dtype=np.int32)
