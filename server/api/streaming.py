"""EmbedStream: bulk embedding over one bidirectional stream, with flow control.

    reader   client messages -> `incoming`, one window slot each (blocks when full)
    grouper  `incoming` -> groups of up to GROUP inputs -> one registry call each
    writer   finished results -> client, releasing a slot per result written

A slow reader blocks the writer, slots run out, the reader stops reading and
gRPC flow control pushes back on the client: the server never holds more than
`window` inputs of a stream.
"""

from __future__ import annotations

import asyncio
import contextlib

import grpc
from google.rpc import status_pb2

from ...v1 import encoderd_pb2 as pb
from ...workers.contract.model_spec import ModelKind
from ..base import metrics
from ..base.errors import EncoderdError, InvalidInput, Overloaded, Unavailable, echo, status_message
from ..models import postprocess, request_options
from ..models.compute import check_text
from ..models.served import check_width
from ..scheduling.scheduler import Priority
from .handlers import MalformedRequest
from .messages import embeddings_message

STOPPING = (
    "encoderd is stopping: the items answered on this stream are done; send the unanswered ones again "
    "(to another server)"
)
WINDOW = 1024  # inputs of one stream inside the server at once
GROUP = 64  # inputs sent to the scheduler together
_END = object()


def _name(message: pb.EmbedStreamRequest) -> str:
    return f"item {echo(message.id)}"


def _error(item_id: str, exc: Exception) -> pb.EmbedStreamResponse:
    code = exc.code if isinstance(exc, EncoderdError) else grpc.StatusCode.INTERNAL
    status = status_pb2.Status(code=code.value[0], message=status_message(str(exc)))
    return pb.EmbedStreamResponse(id=item_id, error=status)


class _Stream:
    def __init__(self, registry, first: pb.EmbedStreamRequest, window: int, draining: asyncio.Event):
        self.registry = registry
        self.draining = draining
        self.cut_short = False  # the server began to stop: no more items were read
        # Bad options, model or prompt name: the whole stream fails. A stream is bulk unless it says otherwise.
        self.options = request_options.from_embed(first, default_priority=Priority.BULK)
        self.model = registry.get(first.model, ModelKind.EMBEDDING)
        registry.prompt_text(self.model, self.options.prompt, self.options.prompt_name)
        check_width(self.model, self.options)
        self.slots = asyncio.Semaphore(window)
        self.incoming: asyncio.Queue = asyncio.Queue()
        self.results: asyncio.Queue = asyncio.Queue()
        self.groups: set[asyncio.Task] = set()
        self.held = 0  # window slots taken by inputs not yet answered

    async def read(self, first, requests) -> None:
        await self._admit(first)
        source = aiter(requests)
        while (message := await self._next(source)) is not _END:
            await self._admit(message)
        await self.incoming.put(_END)

    async def _next(self, source):
        """The client's next item, or _END at its end or once the server stops taking work (the
        items read by then are answered, then the stream ends UNAVAILABLE)."""
        item = asyncio.ensure_future(anext(source, _END))
        stopping = asyncio.ensure_future(self.draining.wait())
        await asyncio.wait((item, stopping), return_when=asyncio.FIRST_COMPLETED)
        stopping.cancel()
        if item.done():
            return item.result()
        item.cancel()
        self.cut_short = True
        return _END

    async def _admit(self, message) -> None:
        await self.slots.acquire()
        self.held += 1
        metrics.STREAM_INPUTS_IN_FLIGHT.inc()
        if isinstance(message, MalformedRequest):  # answered at once; the stream goes on
            await self.results.put(_error(message.id, InvalidInput(message.reason)))
        else:
            await self.incoming.put(message)

    async def group(self) -> None:
        ended = False
        while not ended:
            batch = []
            message = await self.incoming.get()
            while True:  # take what has already arrived, up to a group
                if message is _END:
                    ended = True
                    break
                batch.append(message)
                if len(batch) == GROUP or self.incoming.empty():
                    break
                message = self.incoming.get_nowait()
            if batch:
                task = asyncio.create_task(self._embed(batch))
                self.groups.add(task)
                task.add_done_callback(self.groups.discard)
        if self.groups:
            await asyncio.gather(*list(self.groups))
        await self.results.put(_END)

    async def _embed(self, batch: list[pb.EmbedStreamRequest]) -> None:
        good = []
        for message in batch:
            try:
                if not message.input:
                    raise InvalidInput("empty input")
                check_text(self.registry.config, message.input, _name(message))
            except InvalidInput as exc:
                await self.results.put(_error(message.id, exc))
            else:
                good.append(message)
        if good:
            await self._embed_group(good)

    async def _embed_group(self, good: list[pb.EmbedStreamRequest]) -> None:
        o = self.options
        texts, names = [m.input for m in good], [_name(m) for m in good]
        try:
            while True:
                try:
                    model, pooled, tokens = await self.registry.embed(self.model.spec.name, texts, o, names=names)
                    break
                except Overloaded:
                    await asyncio.sleep(0.05)  # bulk work waits for room instead of failing
                except InvalidInput:
                    if len(good) == 1:
                        raise
                    for message in good:  # one item's fault (too long, say): each alone, so it fails alone
                        await self._embed_group([message])
                    return
            vectors = postprocess.finish_requested(pooled, model.spec, o)
            answers = zip(good, embeddings_message(vectors, o.output_dtype), tokens.per_input, strict=True)
            for message, embedding, n_tokens in answers:
                await self.results.put(
                    pb.EmbedStreamResponse(id=message.id, embedding=embedding, prompt_tokens=n_tokens)
                )
        except Exception as exc:  # noqa: BLE001 - not swallowed: each message of the group is answered with it
            for message in good:
                await self.results.put(_error(message.id, exc))

    def release(self) -> None:
        self.slots.release()
        self.held -= 1
        metrics.STREAM_INPUTS_IN_FLIGHT.dec()


async def embed_stream(registry, first, requests, draining: asyncio.Event, window: int = WINDOW):
    """The EmbedStream servicer body: an async generator of responses. A bad first message
    (malformed, unknown model, bad prompt name) fails the whole stream with its status; a server
    that starts to stop ends it UNAVAILABLE once the items it read are answered."""
    if isinstance(first, MalformedRequest):
        raise InvalidInput(first.reason)
    stream = _Stream(registry, first, window, draining)
    tasks = [asyncio.create_task(stream.read(first, requests)), asyncio.create_task(stream.group())]
    try:
        while True:
            response = await stream.results.get()
            if response is _END:
                break
            yield response
            stream.release()
        await tasks[0]  # surface a broken client stream
        if stream.cut_short:
            raise Unavailable(STOPPING)
    finally:
        for task in (*tasks, *stream.groups):
            task.cancel()
        metrics.STREAM_INPUTS_IN_FLIGHT.dec(stream.held)  # unanswered inputs leave with the stream
        with contextlib.suppress(Exception):
            await asyncio.gather(*tasks, return_exceptions=True)
