"""Batching policy, and nothing else: pure, synchronous, unit-testable.

The queue holds single inputs. A batch is cut from a window at the head of
the queue: the window is sorted by length (padded backends waste little),
cut into consecutive chunks that fit the token and size budgets, and the
chunk holding the oldest input is taken, so the queue always drains in
arrival order while batches stay tight.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import ClassVar, Protocol, cast

import numpy as np

from ...workers.contract.protocol import MediaBatch, TokenBatch
from .timing import Interval


class RequestLike(Protocol):
    """What the scheduler needs of a request (scheduler.PendingRequest)."""

    computing: list[Interval]  # when each batch holding its inputs ran (timing.py)

    @property
    def done(self) -> bool: ...

    def fill(self, index: int, row: np.ndarray) -> None: ...

    def fail(self, error: Exception) -> None: ...


@dataclass(slots=True, eq=False)
class WorkItem:
    ids: np.ndarray  # int32 token ids of one input
    type_ids: np.ndarray | None  # int32 segment ids (pairs), else None
    request: RequestLike
    index: int  # position among the request's inputs
    enqueued: float = 0.0  # monotonic time it was queued
    attempts: int = 0  # batches it rode in that were lost with their worker
    # An embedding model's token states (TEI's /embed_all), not its pooled vector: batched apart.
    token_states: bool = False
    # Who sent it, where callers take turns (the SPLIT queue: interleave_callers); None: unknown.
    caller: Hashable | None = None
    modality: ClassVar[str] = "text"  # a batch holds one modality (MediaItem overrides it)

    @property
    def length(self) -> int:
        return len(self.ids)

    @property
    def output(self) -> tuple[str, bool]:
        """What the worker computes for it; a batch holds items of one output only."""
        return self.modality, self.token_states


@dataclass(slots=True, eq=False)
class MediaItem(WorkItem):
    """A preprocessed image or audio clip. Its `cost`, in token-equivalents
    (server/models/media.py says how each modality counts), stands in for the token
    length everywhere the scheduler budgets: batches, queue bounds, load."""

    features: np.ndarray | None = None  # float32, one fixed shape per model and modality (with a grid: rows)
    flag: int = 0  # per-input flag for the worker (CLAP: is_longer)
    grid: np.ndarray | None = None  # int32 (3,): a ColQwen2 page's patch grid; its features are patch rows
    cost: int = 1
    # Per item here, one per class for text: a field may stand in for the base's class variable.
    modality: str = "image"  # type: ignore[misc]

    @property
    def length(self) -> int:
        return self.cost


@dataclass(frozen=True, slots=True)
class BatchLimits:
    max_batch_size: int = 64
    max_batch_tokens: int = 8192
    padded: bool = True  # cost = size x longest; else the sum of lengths
    window: int = 512  # inputs considered together when sorting
    mixed_modalities: bool = False  # the model takes text and media: one modality per batch

    def cost(self, size: int, longest: int, total: int) -> int:
        return size * longest if self.padded else total


def take_batch(queue: deque[WorkItem], limits: BatchLimits) -> list[WorkItem]:
    """Remove and return the next batch (sorted by length), or [] if none is queued.

    Inputs whose request is already done (cancelled, deadline passed, failed)
    are dropped here, before they cost compute.
    """
    window: list[WorkItem] = []
    while queue and len(window) < limits.window:
        item = queue.popleft()
        if not item.request.done:
            window.append(item)
    if not window:
        return []
    candidates: Sequence[int] = range(len(window))
    first = window[0].output
    if limits.mixed_modalities or any(item.token_states != first[1] for item in window):
        # One output per batch (modality, token states or not), the oldest input's; the others
        # wait in arrival order.
        candidates = [i for i in candidates if window[i].output == first]
    order = sorted(candidates, key=lambda i: window[i].length)
    chosen = _chunk_holding(order, window, limits, oldest=0)
    taken = set(chosen)
    queue.extendleft(reversed([item for i, item in enumerate(window) if i not in taken]))
    return [window[i] for i in chosen]


def _chunk_holding(order: list[int], window: list[WorkItem], limits: BatchLimits, oldest: int) -> list[int]:
    chunk: list[int] = []
    total = 0
    for i in order:
        length = window[i].length
        fits = (
            len(chunk) < limits.max_batch_size
            and limits.cost(len(chunk) + 1, length, total + length) <= limits.max_batch_tokens
        )
        if chunk and not fits:
            if oldest in chunk:
                return chunk
            chunk, total = [], 0
        chunk.append(i)
        total += length
    return chunk


def interleave_callers(queue: deque[WorkItem], items: list[WorkItem], turn: int) -> deque[WorkItem]:
    """`queue` with `items` added so that its callers take turns of `turn` inputs each, in the order
    they first appear (the head's caller goes on first): a second caller's big request starts
    within a round instead of after all of the first one's, and each caller's own inputs keep
    their order (one caller's two requests still run one after the other)."""
    lanes: dict[Hashable | None, list[WorkItem]] = {}
    for item in itertools.chain(queue, items):
        lanes.setdefault(item.caller, []).append(item)
    if len(lanes) == 1:
        queue.extend(items)
        return queue
    merged: deque[WorkItem] = deque()
    for start in itertools.count(0, turn):
        turns = [lane[start : start + turn] for lane in lanes.values() if start < len(lane)]
        if not turns:
            return merged
        for piece in turns:
            merged.extend(piece)
    return merged  # unreachable: count() never ends; mypy wants a return


def queued_cost_reaches_budget(queue: deque[WorkItem], limits: BatchLimits) -> bool:
    """Whether enough is queued to fill a batch: then waiting longer gains nothing."""
    if len(queue) >= limits.max_batch_size:
        return True
    return sum(item.length for item in queue) >= limits.max_batch_tokens


def pack(
    batch: list[WorkItem], batch_id: int, urgent: bool = False, ahead_of_bulk: bool = False
) -> TokenBatch | MediaBatch:
    """Concatenate a batch's token ids into the wire format's packed arrays; `urgent` marks
    interactive text work, which the worker may run between the layers of a bulk batch;
    `ahead_of_bulk`, bulk-lane text work the worker takes before the bulk batches queued there."""
    if batch[0].modality != "text":  # one modality per batch: all media items
        media = pack_media(cast("list[MediaItem]", batch), batch_id)
        media.ahead_of_bulk = ahead_of_bulk
        return media
    types = None
    if any(item.type_ids is not None for item in batch):  # a classifier's text pairs batched with single texts
        types = [item.type_ids if item.type_ids is not None else np.zeros_like(item.ids) for item in batch]
    packed = TokenBatch.from_sequences(batch_id, [item.ids for item in batch], types)
    packed.urgent = urgent
    packed.ahead_of_bulk = ahead_of_bulk
    packed.token_states = batch[0].token_states  # one output per batch (take_batch)
    return packed


def pack_media(batch: list[MediaItem], batch_id: int) -> MediaBatch:
    """Stack a media batch's tensors (one shape per modality) into one frame, or with grids put
    their patch rows back to back; the token sequences built around them (ColPali, ColQwen2)
    packed as a text batch's."""
    # A media item is made with its features (multimodal.py); None is only the field's default.
    features = cast("list[np.ndarray]", [item.features for item in batch])
    flags = np.fromiter((item.flag for item in batch), dtype=np.int32, count=len(batch))
    grids = None
    if batch[0].grid is not None:  # one model per queue: all its images have grids, or none
        grids = np.stack(cast("list[np.ndarray]", [item.grid for item in batch])).astype(np.int32)
    token_ids = token_cu = None
    if len(batch[0].ids):
        tokens = TokenBatch.from_sequences(batch_id, [item.ids for item in batch])
        token_ids, token_cu = tokens.input_ids, tokens.cu_seqlens
    stacked = np.concatenate(features) if grids is not None else np.stack(features)
    return MediaBatch(batch_id, batch[0].modality, stacked, flags if flags.any() else None, token_ids, token_cu, grids)
