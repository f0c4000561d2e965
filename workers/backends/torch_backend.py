"""PyTorch engine: transformers models with SDPA attention, CPU or CUDA."""

from __future__ import annotations

import contextlib
import inspect
import logging
import os

import numpy as np
import torch

from .. import calibration
from ..contract import hardware
from ..contract.model_spec import ModelKind, Pooling, pooling_modes
from ..contract.protocol import MediaBatch, Ragged, TokenBatch
from . import (
    float8_linear,
    host_kernels,
    int8_linear,
    packed_encoder,
    packed_linear,
    packed_pieces,
    retrieval,
    torch_heads,
)
from .base import Backend, from_pretrained, padded, run_to_end, token_states, wants_token_states

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
# int8 (CPU): loaded in float32, then its linears quantized (int8_linear.py).
INT8 = "int8"
# float8 (CUDA, compute capability 8.9+): loaded in bfloat16, then its linears quantized (float8_linear.py).
FLOAT8 = "float8"
# The quantized dtypes: what each is loaded in before its linears are swapped.
QUANTIZED = {INT8: torch.float32, FLOAT8: torch.bfloat16}
# Kinds computed right here (pooled hidden states, logits); the others in torch_heads.
_POOLED_KINDS = (ModelKind.EMBEDDING, ModelKind.RERANKER, ModelKind.CLASSIFIER)
# CPU batches of fewer (padded) tokens run on one thread: the worker's OpenMP threads wait
# passively (see workers/process.py), and waking one for each of a forward's ~60 ops costs more
# than a second core returns on a short query. MiniLM packed forward, 1 vs 2 threads, p50:
# back to back 14 tokens 6.0 vs 7.0 ms, 20: 7.5 vs 7.5, 40: 11.6 vs 9.6; one query every 20 ms
# (threads asleep in between) 10 tokens 6.6 vs 7.1, 40: 13.2 vs 13.7, 90: 26 vs 18.
SINGLE_THREAD_TOKENS = 32


def pool(hidden: torch.Tensor, mask: torch.Tensor, pooling: Pooling | tuple[Pooling, ...]) -> torch.Tensor:
    """sentence-transformers Pooling semantics over a padded (n, L, d) batch, in float32 (as
    packed_pieces.mean_tokens: sums in bfloat16 drift); several modes concatenated."""
    hidden = hidden.float()
    return torch.cat([_pool_one(hidden, mask, mode) for mode in pooling_modes(pooling)], dim=1)


def _pool_one(hidden: torch.Tensor, mask: torch.Tensor, mode: Pooling) -> torch.Tensor:
    if mode == Pooling.CLS:
        return hidden[:, 0]
    if mode == Pooling.LAST_TOKEN:
        last = mask.sum(dim=1) - 1
        return hidden[torch.arange(hidden.shape[0], device=hidden.device), last]
    m = mask.unsqueeze(-1).to(hidden.dtype)
    if mode == Pooling.MAX:
        return hidden.masked_fill(m == 0, torch.finfo(hidden.dtype).min).max(dim=1).values
    if mode == Pooling.WEIGHTED_MEAN:  # position weights 1, 2, 3... (right padding: from the first token)
        m = m * torch.arange(1, hidden.shape[1] + 1, device=hidden.device, dtype=hidden.dtype)[None, :, None]
    count = m.sum(dim=1).clamp(min=1e-9)
    return (hidden * m).sum(dim=1) / (count.sqrt() if mode == Pooling.MEAN_SQRT_LEN else count)


class TorchBackend(Backend):
    engine = "torch"

    def load(self) -> None:
        if self.options.dtype not in (*DTYPES, *QUANTIZED):
            raise ValueError(
                f"the torch engine supports dtypes {sorted((*DTYPES, *QUANTIZED))}, not {self.options.dtype!r}"
            )
        self.device = torch.device(self.options.device)
        host_kernels.CACHE_DIR = self.options.cache_dir  # the host kernels' build, kept for the next worker
        if self.options.dtype == INT8 and self.device.type != "cpu":
            raise ValueError("the torch engine computes int8 on CPU only; on CUDA: --engine ctranslate2 --dtype int8")
        if self.options.dtype == FLOAT8 and self.device.type != "cuda":  # hardware.check_dtype says why
            raise ValueError("the torch engine computes float8 on CUDA only (compute capability 8.9 or newer)")
        weights = DTYPES.get(self.options.dtype) or QUANTIZED[self.options.dtype]
        self.threads = self.options.threads or len(os.sched_getaffinity(0))
        if self.device.type == "cpu":
            torch.set_num_threads(self.threads)
        model_class = torch_heads.model_class(self.spec.kind, self.spec.model_type)
        load = (model_class, self.spec.path, self.options.trust_remote_code)
        try:
            model = from_pretrained(*load, dtype=weights, attn_implementation="sdpa")
        except ValueError:  # some towers (CLAP's audio Swin) have no SDPA path: their own attention then
            model = from_pretrained(*load, dtype=weights)
        self.model = model.to(self.device).eval()
        self._takes_token_types = "token_type_ids" in inspect.signature(self.model.forward).parameters
        usable = not self.options.compile and packed_encoder.usable(self.model, self.spec.kind, self.device, weights)
        self.packed = packed_encoder.PackedEncoder(self.model, self.spec.kind) if usable else None
        if self.options.compile:
            # Inductor fuses and packs weights itself; it compiles in the warm-up forward passes.
            log.info("torch.compile (dynamic shapes): the warm-up compiles the model, ~30 s on 2 cores")
            self.model = torch.compile(self.model, dynamic=True)
        elif self.device.type == "cpu":
            packed_linear.prepack_for_cpu(self.model, weights)
            if self.packed is not None and weights == torch.bfloat16:
                host_kernels.kernels()  # built now, logged, rather than in the first request
        self.projection = None
        if self.spec.kind == ModelKind.COLBERT:
            projection = torch_heads.load_colbert_projection(self.spec.path)
            self.projection = projection.to(self.device, weights) if projection else None
        if self.options.dtype == INT8:
            self._quantize_int8()
        elif self.options.dtype == FLOAT8:
            owners = [self.packed.pieces] if self.packed is not None else []
            swapped, kept = float8_linear.quantize(self.model, owners)
            log.info("float8: %d linear layers in e4m3 (per-token x per-channel scales), %d kept", swapped, kept)
        if self.packed is not None:
            self.packed.linears_final()
        self.is_padded = self.packed is None  # the scheduler then budgets real tokens, not size x longest
        log.info("%s forward", f"padding-free (packed tokens, {self.packed.family})" if self.packed else "padded")
        self._dim = (
            self.model.config.num_labels
            if self.spec.kind in (ModelKind.RERANKER, ModelKind.CLASSIFIER)
            else torch_heads.output_dim(self.model, self.spec.kind, self.projection)
        )

    def _quantize_int8(self) -> None:
        """Every linear to int8 per hardware.torch_int8_recipe, SmoothQuant ranges from the
        calibration set (workers/calibration.py) run through the float32 model first."""
        recipe = hardware.torch_int8_recipe()

        def calibrate() -> None:
            with self.packed.real_rows_only() if self.packed is not None else contextlib.nullcontext():
                for batch in calibration.batches(self.spec, trust_remote_code=self.options.trust_remote_code):
                    self.forward(batch)

        owners = [self.packed.pieces] if self.packed is not None else []
        count = int8_linear.quantize(self.model, owners, recipe, calibrate)
        rest = hardware.torch_int8_rest_dtype()
        if rest == "bfloat16":  # the Int8Linears keep their int8 weights and float32 scales
            self.model.to(torch.bfloat16)
            if self.projection is not None:
                self.projection.to(torch.bfloat16)
        host_kernels.kernels()  # built now, logged, rather than in the first request
        described = hardware.cpu().describe()
        log.info("int8: %d linear layers quantized (%s, the rest in %s: %s)", count, recipe.name, rest, described)

    @property
    def output_dim(self) -> int:
        return self._dim

    @property
    def urgent_lane(self) -> bool:
        # torch.compile'd graphs are not re-entrant across threads; eager modules in inference mode are.
        return self.device.type == "cpu" and self.threads == 1 and not self.options.compile

    def release_memory(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    @torch.inference_mode()
    def forward(self, batch: TokenBatch) -> np.ndarray | Ragged:
        if self.packed is not None:
            return self._forward_packed(batch)
        ids, mask, types = padded(batch, self.spec.pad_token_id)
        self._size_threads(ids.size)
        inputs = {
            "input_ids": torch.from_numpy(ids).to(self.device),
            "attention_mask": torch.from_numpy(mask).to(self.device),
        }
        if self._takes_token_types:
            inputs["token_type_ids"] = (
                torch.from_numpy(types) if types is not None else torch.zeros_like(inputs["input_ids"], device="cpu")
            ).to(self.device)
        if self.spec.kind not in _POOLED_KINDS:
            return torch_heads.forward_text(self, inputs)
        out = self.model(**inputs)
        if wants_token_states(self.spec, batch):
            return token_states(out.last_hidden_state.float().cpu().numpy(), batch)
        if self.spec.kind == ModelKind.EMBEDDING:
            result = pool(out.last_hidden_state, inputs["attention_mask"], self.spec.pooling)
        else:
            result = out.logits
        return result.float().cpu().numpy()

    def _forward_packed(self, batch: TokenBatch) -> np.ndarray | Ragged:
        return run_to_end(self._packed_steps(batch))

    def forward_in_steps(self, batch: TokenBatch):
        if self.packed is None:
            return (yield from super().forward_in_steps(batch))
        return (yield from self._packed_steps(batch))

    def _packed_steps(self, batch: TokenBatch):
        """The padding-free forward, pausing after each layer."""
        packed = self.packed
        assert packed is not None  # called only for a model it could pack
        with torch.inference_mode():
            ids = torch.from_numpy(batch.input_ids).to(self.device, torch.long)
            cu_seqlens = torch.from_numpy(batch.cu_seqlens).to(self.device)
            types = (
                None
                if batch.token_type_ids is None
                else torch.from_numpy(batch.token_type_ids).to(self.device, torch.long)
            )
            batch_view = packed_pieces.PackedBatch.of(ids, cu_seqlens, types)
            layers = packed.hidden_states(batch_view)
            while True:
                self._size_threads(len(batch.input_ids))  # each step: a batch run in a pause may change it
                try:
                    next(layers)
                except StopIteration as done:
                    hidden = done.value
                    break
                yield
            if wants_token_states(self.spec, batch):  # already one row per token, inputs back to back
                return Ragged(hidden.float().cpu().numpy(), batch.cu_seqlens.astype(np.int32))
            if self.spec.kind == ModelKind.EMBEDDING:
                result = packed.pool(hidden, cu_seqlens, self.spec.pooling)
            else:
                result = packed.logits(hidden, batch_view)
            return result.float().cpu().numpy()

    def _size_threads(self, tokens: int | None) -> None:
        """CPU: one thread for a batch of fewer than SINGLE_THREAD_TOKENS tokens, else all of the
        worker's (tokens None: media batches, always all)."""
        if self.device.type == "cpu":
            small = tokens is not None and tokens < SINGLE_THREAD_TOKENS
            torch.set_num_threads(1 if small else self.threads)

    @torch.inference_mode()
    def forward_media(self, batch: MediaBatch):
        self._size_threads(None)
        return torch_heads.forward_media(self, batch)

    def warmup(self, max_length: int) -> None:
        if self.spec.kind == ModelKind.COLPALI:  # queries only: pages go through the fidelity self-check next
            max_length = min(max_length, retrieval.WARMUP_QUERY_TOKENS)
        super().warmup(max_length)
        shapes = torch_heads.media_warmup_shapes(self.model, self.spec.kind, self.spec.path)
        for modality, shape in shapes.items():
            for n in (1, 4):
                self.forward_media(MediaBatch(-1, modality, np.zeros((n, *shape), dtype=np.float32)))
