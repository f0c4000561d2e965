"""The frontend <-> worker wire contract over ZeroMQ. numpy + msgspec only.

Every message is a multipart ZeroMQ message:

    frame 0   one byte, the MessageType
    frame 1   a msgpack header (one of the Structs below)
    frame 2.. raw array buffers, described by the header (no pickle)

Batches carry token ids packed back to back (int32) and `cu_seqlens`
(int32, n+1 offsets, the FlashAttention varlen convention); results carry one
float32 array of shape (n, dim).

A text batch may ask an embedding model for its token states instead of pooled
vectors: every token's last hidden state, which comes back ragged (below).

Media batches (images, audio) carry instead one float32 array (n, *shape) of
preprocessed inputs, all of one shape (the frontend resized / padded them), and
optionally one int32 flag per input. Vision-language retrieval models (ColPali,
ColQwen2) also take the token sequence their processor built around each image,
packed like a text batch's (ids, cu_seqlens); ColQwen2's pages differ in size, so
their features come as the inputs' patch rows back to back, (rows, *shape), with
an int32 (n, 3) grid per input (temporal, height, width patches: rows = their product).

Ragged results (a vector per token or patch; sparse vectors) carry float32 values (rows, cols), int32 `cu_seqlens`
(n+1) saying which rows belong to which input, and for sparse vectors the int32
dimension of each value.
"""

from __future__ import annotations

import enum
import itertools

import msgspec
import numpy as np

from .errors import ErrorCode


class MessageType(enum.IntEnum):
    BATCH = 1  # frontend -> worker
    RESULT = 2  # worker -> frontend: one batch's outputs, or its error
    READY = 3  # worker -> frontend: loaded and warmed up
    FATAL = 4  # worker -> frontend: cannot go on (load failed); the process exits
    HEARTBEAT = 5  # worker -> frontend: alive, sent every HEARTBEAT_INTERVAL seconds while it computes too


HEARTBEAT_INTERVAL = 0.5  # seconds; the frontend's --worker-stall-timeout is a multiple of it


class BatchHeader(msgspec.Struct, array_like=True, gc=False):
    batch_id: int
    has_token_types: bool
    # A media batch: its modality ("image", "audio"), one input's shape, and whether flags follow.
    modality: str = "text"
    shape: tuple[int, ...] = ()
    has_flags: bool = False
    urgent: bool = False  # interactive work: the worker runs it between the layers of a bulk batch
    token_states: bool = False  # an embedding model's unpooled last hidden states (TokenBatch.token_states)
    has_tokens: bool = False  # a media batch: each input's token sequence follows (MediaBatch.token_ids)
    has_grids: bool = False  # a media batch of patch rows: each input's grid follows (MediaBatch.grids)
    ahead_of_bulk: bool = False  # bulk-lane work taken before queued bulk batches (TokenBatch.ahead_of_bulk)


class ResultHeader(msgspec.Struct, array_like=True, gc=False):
    batch_id: int
    rows: int = 0
    cols: int = 0
    error: str = ""
    compute_ns: int = 0
    # Ragged results: the number of inputs (0 = one dense row each), and whether indices follow.
    inputs: int = 0
    sparse: bool = False
    code: ErrorCode = ErrorCode.NONE  # why the batch failed, when `error` says it did


class FidelityFigure(msgspec.Struct, array_like=True, gc=False, frozen=True):
    """One figure of the start-up fidelity self-check (workers/fidelity.py)."""

    metric: str  # min_cosine, max_prob_diff, max_logit_diff, kendall_tau, top1_agreement
    value: float
    bound: float  # this dtype's floor (max_prob_diff, max_logit_diff: their ceiling)
    passed: bool


class WorkerReady(msgspec.Struct, array_like=True, gc=False):
    pid: int
    output_dim: int
    engine: str
    device: str
    dtype: str
    is_padded: bool
    fidelity_status: str = ""  # passed, low (served with --allow-low-fidelity), unchecked
    fidelity: tuple[FidelityFigure, ...] = ()
    urgent_lane: bool = False  # urgent batches computed on their own thread (workers/process.py)
    # The tokenizer every request is tokenized with, as the worker built it (workers/contract/tokenizer.py).
    tokenizer_json: str = ""
    # Tokens per second on the fidelity self-check's calibration batches (0: not measured): the
    # frontend's first drain-rate estimate (server/scheduling/admission.py).
    tokens_per_s: float = 0.0


class WorkerFatal(msgspec.Struct, array_like=True, gc=False):
    pid: int
    message: str


class WorkerHeartbeat(msgspec.Struct, array_like=True, gc=False):
    pid: int


class TokenBatch(msgspec.Struct, gc=False):
    """A batch of tokenized sequences, packed without padding."""

    batch_id: int
    input_ids: np.ndarray  # int32, all sequences concatenated
    cu_seqlens: np.ndarray  # int32, n + 1 offsets into input_ids
    token_type_ids: np.ndarray | None = None  # int32 like input_ids; pairs only
    urgent: bool = False  # interactive: may pause a bulk batch between layers (workers/process.py)
    # Embedding models: per input, every token's last hidden state (a Ragged of (tokens, hidden)),
    # not pooled, no Dense modules (TEI's /embed_all). A batch holds one kind of output.
    token_states: bool = False
    # A split interactive request's batch (server/scheduling/scheduler.py, Priority.SPLIT): computed in
    # the bulk lane like bulk work, but taken before the bulk batches queued there (prefetched ones).
    ahead_of_bulk: bool = False

    @property
    def size(self) -> int:
        return len(self.cu_seqlens) - 1

    @property
    def lengths(self) -> np.ndarray:
        return np.diff(self.cu_seqlens)

    @classmethod
    def from_sequences(cls, batch_id: int, ids: list, types: list | None = None) -> TokenBatch:
        """Pack per-sequence token ids (and token types, for pairs) back to back."""
        cu = np.zeros(len(ids) + 1, dtype=np.int32)
        np.cumsum([len(s) for s in ids], out=cu[1:])
        packed_types = None if types is None else np.concatenate(types).astype(np.int32, copy=False)
        return cls(batch_id, np.concatenate(ids).astype(np.int32, copy=False), cu, packed_types)

    def split(self, at: int) -> tuple[TokenBatch, TokenBatch]:
        """The first `at` sequences and the rest, as two batches (views, no copies)."""
        cut = int(self.cu_seqlens[at])
        types = self.token_type_ids
        first = TokenBatch(
            self.batch_id,
            self.input_ids[:cut],
            self.cu_seqlens[: at + 1],
            None if types is None else types[:cut],
            self.urgent,
            self.token_states,
            self.ahead_of_bulk,
        )
        rest = TokenBatch(
            self.batch_id,
            self.input_ids[cut:],
            self.cu_seqlens[at:] - cut,
            None if types is None else types[cut:],
            self.urgent,
            self.token_states,
            self.ahead_of_bulk,
        )
        return first, rest

    def runs(self, max_padded_tokens: int) -> list[TokenBatch]:
        """Consecutive sub-batches, each as large as fits in `max_padded_tokens` once padded
        (rows x its longest row), at least one sequence each."""
        parts, rest = [], self
        while rest.size > 1:
            padded_sizes = np.maximum.accumulate(rest.lengths) * np.arange(1, rest.size + 1)
            at = max(1, int(np.searchsorted(padded_sizes, max_padded_tokens, side="right")))
            if at >= rest.size:
                break
            part, rest = rest.split(at)
            parts.append(part)
        return [*parts, rest]


class MediaBatch(msgspec.Struct, gc=False):
    """A batch of preprocessed media inputs of one modality and one shape."""

    batch_id: int
    modality: str  # "image" | "audio"
    features: np.ndarray  # float32 (n, *shape): pixel values, audio features; with grids (rows, *shape)
    flags: np.ndarray | None = None  # int32 (n,), one per input (CLAP: is_longer)
    token_ids: np.ndarray | None = None  # int32, each input's token sequence back to back (ColPali, ColQwen2)
    token_cu: np.ndarray | None = None  # int32 (n + 1) offsets into token_ids
    grids: np.ndarray | None = None  # int32 (n, 3): each input's patch grid; its features are rows
    ahead_of_bulk: bool = False  # a split request's batch, as TokenBatch.ahead_of_bulk

    @property
    def size(self) -> int:
        return len(self.grids) if self.grids is not None else self.features.shape[0]


class Ragged(msgspec.Struct, gc=False):
    """Outputs of a different length per input, concatenated: token / patch
    vectors (multi-vector), or the non-zero entries of sparse vectors."""

    values: np.ndarray  # float32 (rows, cols)
    cu_seqlens: np.ndarray  # int32 (n + 1): input i owns rows cu[i]:cu[i+1]
    indices: np.ndarray | None = None  # int32 (rows,): sparse, the dimension of each value (cols == 1)

    def split(self) -> list:
        """Per input: a (rows_i, cols) array, or for sparse vectors an (indices, values) pair."""
        bounds = self.cu_seqlens.tolist()
        spans = itertools.pairwise(bounds)
        if self.indices is None:
            return [self.values[a:b] for a, b in spans]
        flat = self.values.reshape(-1)
        return [(self.indices[a:b], flat[a:b]) for a, b in spans]

    @classmethod
    def join(cls, parts: list[Ragged]) -> Ragged:
        """The outputs of consecutive sub-batches as one (inputs in order)."""
        offsets = np.cumsum([0] + [len(p.values) for p in parts[:-1]])
        cu = np.concatenate(
            [parts[0].cu_seqlens[:1]] + [p.cu_seqlens[1:] + o for p, o in zip(parts, offsets, strict=True)]
        )
        indices = None if parts[0].indices is None else np.concatenate([p.indices for p in parts])
        return cls(np.concatenate([p.values for p in parts]), cu.astype(np.int32), indices)


def join_outputs(outputs: list):
    """The outputs of consecutive sub-batches (arrays, or Ragged) as the whole batch's."""
    if len(outputs) == 1:
        return outputs[0]
    return Ragged.join(outputs) if isinstance(outputs[0], Ragged) else np.concatenate(outputs)


_encoder = msgspec.msgpack.Encoder()
_HEADER_TYPES = {
    MessageType.BATCH: BatchHeader,
    MessageType.RESULT: ResultHeader,
    MessageType.READY: WorkerReady,
    MessageType.FATAL: WorkerFatal,
    MessageType.HEARTBEAT: WorkerHeartbeat,
}
# What decode() returns: the header type is the one _HEADER_TYPES names for the message's type.
Header = BatchHeader | ResultHeader | WorkerReady | WorkerFatal | WorkerHeartbeat
_CONTROL_TYPES = {
    WorkerReady: MessageType.READY,
    WorkerFatal: MessageType.FATAL,
    WorkerHeartbeat: MessageType.HEARTBEAT,
}
_decoders = {t: msgspec.msgpack.Decoder(cls) for t, cls in _HEADER_TYPES.items()}


def _type_frame(kind: MessageType) -> bytes:
    return bytes([kind])


def encode_batch(batch: TokenBatch | MediaBatch) -> list:
    if isinstance(batch, MediaBatch):
        return _encode_media_batch(batch)
    header = BatchHeader(
        batch.batch_id,
        batch.token_type_ids is not None,
        urgent=batch.urgent,
        token_states=batch.token_states,
        ahead_of_bulk=batch.ahead_of_bulk,
    )
    frames = [
        _type_frame(MessageType.BATCH),
        _encoder.encode(header),
        np.ascontiguousarray(batch.input_ids, np.int32),
        np.ascontiguousarray(batch.cu_seqlens, np.int32),
    ]
    if batch.token_type_ids is not None:
        frames.append(np.ascontiguousarray(batch.token_type_ids, np.int32))
    return frames


def _encode_media_batch(batch: MediaBatch) -> list:
    features = np.ascontiguousarray(batch.features, np.float32)
    header = BatchHeader(
        batch.batch_id,
        False,
        batch.modality,
        features.shape[1:],
        batch.flags is not None,
        has_tokens=batch.token_ids is not None,
        has_grids=batch.grids is not None,
        ahead_of_bulk=batch.ahead_of_bulk,
    )
    frames = [_type_frame(MessageType.BATCH), _encoder.encode(header), features]
    if batch.flags is not None:
        frames.append(np.ascontiguousarray(batch.flags, np.int32))
    if batch.token_ids is not None:
        frames += [np.ascontiguousarray(batch.token_ids, np.int32), np.ascontiguousarray(batch.token_cu, np.int32)]
    if batch.grids is not None:
        frames.append(np.ascontiguousarray(batch.grids, np.int32))
    return frames


def encode_result(batch_id: int, output: np.ndarray | Ragged, compute_ns: int = 0) -> list:
    if isinstance(output, Ragged):
        return _encode_ragged_result(batch_id, output, compute_ns)
    output = np.ascontiguousarray(output, dtype=np.float32)
    header = ResultHeader(batch_id, output.shape[0], output.shape[1], compute_ns=compute_ns)
    return [_type_frame(MessageType.RESULT), _encoder.encode(header), output]


def _encode_ragged_result(batch_id: int, output: Ragged, compute_ns: int) -> list:
    values = np.ascontiguousarray(output.values, dtype=np.float32)
    values = values.reshape(len(values), -1)
    header = ResultHeader(
        batch_id,
        values.shape[0],
        values.shape[1],
        compute_ns=compute_ns,
        inputs=len(output.cu_seqlens) - 1,
        sparse=output.indices is not None,
    )
    frames = [
        _type_frame(MessageType.RESULT),
        _encoder.encode(header),
        values,
        np.ascontiguousarray(output.cu_seqlens, np.int32),
    ]
    if output.indices is not None:
        frames.append(np.ascontiguousarray(output.indices, np.int32))
    return frames


def encode_error(batch_id: int, message: str, code: ErrorCode = ErrorCode.INTERNAL) -> list:
    header = ResultHeader(batch_id, error=message or "error", code=code)
    return [_type_frame(MessageType.RESULT), _encoder.encode(header)]


def encode_control(message: WorkerReady | WorkerFatal | WorkerHeartbeat) -> list:
    return [_type_frame(_CONTROL_TYPES[type(message)]), _encoder.encode(message)]


def decode(frames: list) -> tuple[MessageType, Header, list]:
    """Split a multipart message into its type, decoded header and raw frames."""
    kind = MessageType(bytes(frames[0])[0])
    return kind, _decoders[kind].decode(frames[1]), frames[2:]


def _array(frame, dtype) -> np.ndarray:
    # The received buffer stays alive as long as the array does; copy nothing.
    return np.frombuffer(memoryview(frame), dtype=dtype)


def batch_from_frames(header: BatchHeader, frames: list) -> TokenBatch | MediaBatch:
    if header.modality != "text":
        return _media_batch(header, frames)
    types = _array(frames[2], np.int32) if header.has_token_types else None
    return TokenBatch(
        header.batch_id,
        _array(frames[0], np.int32),
        _array(frames[1], np.int32),
        types,
        header.urgent,
        header.token_states,
        header.ahead_of_bulk,
    )


def _media_batch(header: BatchHeader, frames: list) -> MediaBatch:
    rest = iter(frames[1:])
    features = _array(frames[0], np.float32).reshape(-1, *header.shape)
    flags = _array(next(rest), np.int32) if header.has_flags else None
    token_ids = token_cu = None
    if header.has_tokens:
        token_ids, token_cu = _array(next(rest), np.int32), _array(next(rest), np.int32)
    grids = _array(next(rest), np.int32).reshape(-1, 3) if header.has_grids else None
    return MediaBatch(
        header.batch_id, header.modality, features, flags, token_ids, token_cu, grids, header.ahead_of_bulk
    )


def result_array(header: ResultHeader, frames: list) -> np.ndarray | list:
    """Dense results: the (n, dim) array. Ragged ones: one entry per input (see Ragged.split)."""
    values = _array(frames[0], np.float32).reshape(header.rows, header.cols)
    if not header.inputs:
        return values
    indices = _array(frames[2], np.int32) if header.sparse else None
    return Ragged(values, _array(frames[1], np.int32), indices).split()
