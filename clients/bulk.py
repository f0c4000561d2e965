"""Embed an iterable of millions of texts through EmbedStream, resumably.

    from encoderd.clients.bulk import embed_to_jsonl
    embed_to_jsonl("127.0.0.1:50051", ((doc_id, text) for ...), "out.jsonl")

Results stream back as batches finish (out of order, tagged by id); the
server's flow control paces the upload. `embed_to_jsonl` appends each result
as it arrives and, run again on the same file, skips the ids already there.
"""

from __future__ import annotations

import base64
import json
import os
import sys
import time
from collections.abc import AsyncIterator, Iterable, Iterator
from dataclasses import dataclass

import grpc
import numpy as np

from ..v1 import encoderd_pb2 as pb
from ..v1 import encoderd_pb2_grpc
from . import vectors
from .errors import from_rpc_error


@dataclass(frozen=True)
class StreamResult:
    id: str
    vector: np.ndarray | None  # float32, or None when the input failed
    error: str | None = None
    tokens: int = 0  # the input's token count, its prompt included (0 when it failed)


class Progress:
    """A one-line progress report on stderr, at most once a second."""

    def __init__(self, total: int | None, enabled: bool):
        self.total, self.enabled = total, enabled
        self.done = 0
        self.started = self.last = time.monotonic()

    def step(self) -> None:
        self.done += 1
        now = time.monotonic()
        if self.enabled and now - self.last >= 1:
            self.last = now
            self._print(now)

    def close(self) -> None:
        if self.enabled:
            self._print(time.monotonic())
            print(file=sys.stderr)

    def _print(self, now: float) -> None:
        rate = self.done / max(now - self.started, 1e-9)
        of = f"/{self.total}" if self.total else ""
        print(f"\rembedded {self.done}{of} inputs ({rate:,.0f}/s)", end="", file=sys.stderr, flush=True)


def _requests(items: Iterable[tuple[str, str]], model: str, skip: set[str], options: dict) -> Iterator:
    first = True
    for item_id, text in items:
        if item_id in skip:
            continue
        yield pb.EmbedStreamRequest(model=model, id=item_id, input=text, **(options if first else {}))
        first = False


def _result(response: pb.EmbedStreamResponse, dtype: int) -> StreamResult:
    if response.HasField("error"):
        return StreamResult(response.id, None, response.error.message)
    return StreamResult(response.id, vectors.decode(response.embedding, dtype), tokens=response.prompt_tokens)


def _prepare(options: dict) -> tuple[int, tuple | None]:
    """Normalizes `output_dtype` in place; returns it and the call metadata."""
    api_key = options.pop("api_key", None)
    if "output_dtype" in options:
        options["output_dtype"] = vectors.output_dtype(options["output_dtype"])
    dtype = options.get("output_dtype", pb.OUTPUT_DTYPE_UNSPECIFIED)
    return dtype, ((("authorization", f"Bearer {api_key}"),) if api_key else None)


def embed_iterable(
    target: str | grpc.Channel,
    items: Iterable[tuple[str, str]],
    *,
    model: str = "",
    skip_ids: Iterable[str] = (),
    progress: bool = True,
    total: int | None = None,
    **options,
) -> Iterator[StreamResult]:
    """Yield a StreamResult per (id, text) item, in completion order.

    `options` are EmbedStreamRequest fields (normalize, dimensions, prompt_name, output_dtype as
    a name such as "int8" or the enum, ...) and `api_key`. A failed stream raises an EncoderdError
    (not retried: run embed_to_jsonl again to resume).
    """
    dtype, metadata = _prepare(options)
    channel = grpc.insecure_channel(target) if isinstance(target, str) else target
    stub = encoderd_pb2_grpc.EncoderStub(channel)
    bar = Progress(total, progress)
    call = stub.EmbedStream(_requests(items, model, set(skip_ids), options), metadata=metadata)
    try:
        for response in call:
            bar.step()
            yield _result(response, dtype)
    except grpc.RpcError as error:
        raise from_rpc_error(error) from None
    finally:
        call.cancel()  # an abandoned iteration must not leave the stream open
        bar.close()
        if isinstance(target, str):
            channel.close()


async def aembed_iterable(
    channel: grpc.aio.Channel,
    items: Iterable[tuple[str, str]],
    *,
    model: str = "",
    skip_ids: Iterable[str] = (),
    **options,
) -> AsyncIterator[StreamResult]:
    """embed_iterable for asyncio, over a grpc.aio channel."""
    dtype, metadata = _prepare(options)
    call = encoderd_pb2_grpc.EncoderStub(channel).EmbedStream(
        _requests(items, model, set(skip_ids), options), metadata=metadata
    )
    try:
        async for response in call:
            yield _result(response, dtype)
    except grpc.RpcError as error:
        raise from_rpc_error(error) from None
    finally:
        call.cancel()  # an abandoned iteration must not leave the stream open


def done_ids(path: str) -> set[str]:
    """Ids already written to a results file (a torn last line is ignored)."""
    if not os.path.exists(path):
        return set()
    ids = set()
    with open(path) as f:
        for line in f:
            try:
                ids.add(json.loads(line)["id"])
            except (json.JSONDecodeError, KeyError):
                continue
    return ids


def embed_to_jsonl(target: str, items: Iterable[tuple[str, str]], path: str, **kwargs) -> int:
    """Append {"id", "embedding": base64 float32 | "error"} lines; resumes where a previous run stopped.

    Returns how many results were written by this run.
    """
    written = 0
    with open(path, "a") as out:
        for result in embed_iterable(target, items, skip_ids=done_ids(path), **kwargs):
            record: dict[str, str | None] = {"id": result.id}
            if result.vector is not None:
                record["embedding"] = base64.b64encode(result.vector.astype("<f4").tobytes()).decode()
            else:
                record["error"] = result.error
            out.write(json.dumps(record) + "\n")
            written += 1
    return written
