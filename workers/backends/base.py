"""The interface every engine implements. Backends see token batches only,
never requests or sockets."""

from __future__ import annotations

import abc
from collections.abc import Generator

import numpy as np

from ..contract.config import BackendOptions
from ..contract.errors import Unsupported
from ..contract.model_spec import ModelKind, ModelSpec
from ..contract.protocol import MediaBatch, Ragged, TokenBatch
from ..contract.spec_reader import require_known_architectures


def from_pretrained(model_class, path: str, trust_remote_code: bool, **kwargs):
    """`model_class.from_pretrained` (a transformers Auto class) with the operator's --trust-remote-code,
    refusing a checkpoint that transformers would load as a class other than the one it was saved from."""
    require_known_architectures(path, trust_remote_code)
    return model_class.from_pretrained(path, trust_remote_code=trust_remote_code, **kwargs)


class Backend(abc.ABC):
    engine: str = ""
    # Padded backends compute batch x longest tokens; the scheduler budgets for it.
    is_padded: bool = True

    @property
    def urgent_lane(self) -> bool:
        """Whether a second thread may compute an urgent batch while another batch computes
        (workers/process.py). Only where each forward runs on the calling thread alone: a CPU
        engine with one intra-op thread (the process-wide thread count must not change under
        the other lane's feet), thread-safe for concurrent calls, and tested so
        (tests/integration/test_preemption.py): torch."""
        return False

    def __init__(self, spec: ModelSpec, options: BackendOptions):
        self.spec = spec
        self.options = options

    @abc.abstractmethod
    def load(self) -> None:
        """Load weights onto the device."""

    @abc.abstractmethod
    def forward(self, batch: TokenBatch) -> np.ndarray | Ragged:
        """Embedding models: pooled, unnormalized (n, dim), or with batch.token_states every token's
        last hidden state (a protocol.Ragged, see token_states). Others: logits (n, labels).
        Multi-vector and sparse kinds return a protocol.Ragged instead."""

    def forward_in_steps(self, batch: TokenBatch) -> Generator[None, None, np.ndarray | Ragged]:
        """`forward` as a generator that yields between steps (the torch padding-free forward:
        its layers) and returns the output: the worker runs urgent batches at those points.
        Engines that cannot stop midway compute it in one step."""
        return self.forward(batch)
        yield  # a generator function, with no pause points

    def forward_media(self, batch: MediaBatch):
        """Image / audio batches (multi-modal kinds): (n, dim) embeddings or a Ragged of vectors."""
        raise Unsupported(f"the {self.engine} engine computes no {batch.modality} inputs; use --engine torch")

    @property
    @abc.abstractmethod
    def output_dim(self) -> int: ...

    def release_memory(self) -> None:  # noqa: B027 - optional hook: most backends cache no device memory
        """Give cached device memory back (after an out-of-memory error)."""

    def warmup(self, max_length: int) -> None:
        """Run the shapes the first requests will hit, so they pay no first-call cost."""
        for n, length in ((1, 8), (8, min(64, max_length)), (2, max_length)):
            lengths = np.full(n, length, dtype=np.int32)
            cu = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
            ids = np.full(int(cu[-1]), 100, dtype=np.int32)
            self.forward(TokenBatch(-1, ids, cu))


def run_to_end(steps: Generator):
    """What a step generator (Backend.forward_in_steps) returns, run without pauses."""
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return done.value


# What the exported/converted engines (onnx, ctranslate2, tensorrt) compute: pooled
# hidden states or logits. Multi-modal, multi-vector and sparse kinds are torch's alone.
TEXT_KINDS = ("embedding", "reranker", "classifier")


# Model families (config.json's model_type) and kinds each converting engine computes exactly:
# tests/integration/test_families.py checks every entry against transformers / sentence-transformers
# on tiny random models of the family, and that everything else is refused. torch runs transformers'
# own modules, so it serves every family. An engine is never trusted on a family it was not checked on:
# a converter that accepts a model can still compute something else (a lost mask, other positions).
ENGINE_FAMILIES: dict[str, dict[str, tuple[str, ...]]] = {
    "onnx": dict.fromkeys(
        ("bert", "camembert", "deberta-v2", "distilbert", "modernbert", "mpnet", "qwen3", "roberta", "xlm-roberta"),
        TEXT_KINDS,
    ),
    # CTranslate2's converter knows these encoders; its DistilBERT has no head we can apply (pre_classifier + ReLU).
    # CamemBERT is not claimed: its converter rebuilds the vocabulary in CamemBERT's own fairseq layout and
    # rejects the test model's, so it is unverified here.
    "ctranslate2": {"bert": TEXT_KINDS, "roberta": TEXT_KINDS, "xlm-roberta": TEXT_KINDS, "distilbert": ("embedding",)},
    # The onnx export under TensorRT: only the families the GPU tests (tests/integration/test_engines.py) cover.
    "tensorrt": {"bert": TEXT_KINDS},
}


def engines_serving(spec: ModelSpec) -> list[str]:
    return ["torch"] + [
        e for e, families in ENGINE_FAMILIES.items() if spec.kind.value in families.get(spec.model_type, ())
    ]


def require_family(spec: ModelSpec, engine: str) -> None:
    """Fail at load, naming the engines that can serve it, for a family (or a family's kind) this
    engine was not verified to compute exactly."""
    if spec.kind.value in ENGINE_FAMILIES[engine].get(spec.model_type, ()):
        return
    family = spec.model_type or "unknown-family (config.json has no model_type)"
    served = ", ".join(sorted(f for f, kinds in ENGINE_FAMILIES[engine].items() if spec.kind.value in kinds))
    raise ValueError(
        f"the {engine} engine does not serve {spec.name}, a {family} {spec.kind.value} model: it "
        f"computes {spec.kind.value} models of {served} only. Engines that serve {family} "
        f"{spec.kind.value} models: {', '.join(engines_serving(spec))}"
    )


def require_text_kind(spec: ModelSpec, engine: str) -> None:
    """Fail at load, naming the way out, for a kind this engine does not compute."""
    if spec.kind.value not in TEXT_KINDS:
        raise ValueError(
            f"the {engine} engine serves {', '.join(TEXT_KINDS)} models; {spec.name} is "
            f"{spec.kind.a_model}: use --engine torch (or auto)"
        )


def wants_token_states(spec: ModelSpec, batch: TokenBatch) -> bool:
    """Whether `batch` asks for token states; only an embedding model has them to give (the
    frontend asks no other kind: this guards the wire contract)."""
    if batch.token_states and spec.kind != ModelKind.EMBEDDING:
        raise Unsupported(f"token states are an embedding model's output; {spec.name} is {spec.kind.a_model}")
    return batch.token_states


def token_states(hidden: np.ndarray, batch: TokenBatch) -> Ragged:
    """A right-padded (n, L, d) last hidden state -> each input's real tokens' rows, as float32
    (input 0's tokens first, as packed): nothing pooled, normalized or projected."""
    mask = np.arange(hidden.shape[1]) < batch.lengths[:, None]
    return Ragged(np.ascontiguousarray(hidden[mask], dtype=np.float32), batch.cu_seqlens.astype(np.int32))


def padded(batch: TokenBatch, pad_token_id: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """Packed tokens -> (input_ids, attention_mask, token_type_ids), each (n, longest), right-padded
    with pad_token_id: decoder classifiers (Qwen3ForSequenceClassification...) score each row's last
    token that is not the pad token, whatever the mask says, so any other fill is read as text."""
    lengths = batch.lengths
    mask = np.arange(int(lengths.max())) < lengths[:, None]
    ids = np.full(mask.shape, pad_token_id, dtype=np.int64)
    ids[mask] = batch.input_ids  # row-major order matches the packing
    types = None
    if batch.token_type_ids is not None:
        types = np.zeros(mask.shape, dtype=np.int64)
        types[mask] = batch.token_type_ids
    return ids, mask.astype(np.int64), types
