"""ONNX Runtime engine: CPU (float32, int8) and CUDA (float32, float16), on the graphs
onnx_export.py builds and caches.

The graph ends at the encoder's hidden states (embeddings) or the logits (rerankers, classifiers);
pooling happens in numpy (workers.pooling), so one export serves every pooling mode.
"""

from __future__ import annotations

import logging
from typing import ClassVar

import numpy as np

from ..contract.model_spec import ModelKind
from ..contract.protocol import Ragged, TokenBatch, join_outputs
from ..pooling import pool
from .base import Backend, padded, require_family, require_text_kind, token_states, wants_token_states
from .onnx_export import ensure_onnx_model
from .onnx_session import check_onnxruntime_install, create_session, device_index, require_provider

log = logging.getLogger(__name__)

# On CPU a padded batch runs in pieces of at most this many tokens (rows x longest): ONNX Runtime
# computed a length-sorted batch of 32 texts of 5-500 tokens at a third of the speed of the same
# texts one by one, while 25 short queries still gain from sharing each weight read. One thread,
# MiniLM, Intel Xeon with AMX: 1-12 / 10-40 words / 5-500 tokens at 1.07x / 1.16x / 3.0x the whole
# batch's tokens/s (pieces of 128 and 512 tokens: within 5% of 256).
CPU_RUN_TOKENS = 256


class OnnxBackend(Backend):
    engine = "onnx"
    # CPU: float32 and dynamic int8; CUDA: float32 and float16.
    dtypes: ClassVar[dict[str, tuple[str, ...]]] = {"cpu": ("float32", "int8"), "cuda": ("float32", "float16")}

    def load(self) -> None:
        require_text_kind(self.spec, self.engine)
        require_family(self.spec, self.engine)
        check_onnxruntime_install()
        self._check_dtype()
        providers = self._providers()
        model_file, self.cache_hit = ensure_onnx_model(
            self.spec, self.options.dtype, self.options.cache_dir, self.options.trust_remote_code
        )
        self.session = create_session(model_file, providers, self.options.threads)
        self._check_session(providers)
        self._inputs = {i.name for i in self.session.get_inputs()}
        self._dim = int(self.session.get_outputs()[0].shape[-1])
        log.info("onnx session on %s (%s)", ", ".join(self.session.get_providers()), model_file)

    def _device_type(self) -> str:
        return "cuda" if self.options.device.startswith("cuda") else self.options.device

    def _check_dtype(self) -> None:
        device = self._device_type()
        if device not in self.dtypes:
            raise ValueError(f"the {self.engine} engine runs on cpu or cuda, not {self.options.device!r}")
        if self.options.dtype not in self.dtypes[device]:
            raise ValueError(
                f"the {self.engine} engine on {device} supports dtypes {', '.join(self.dtypes[device])}, "
                f"not {self.options.dtype!r} (int8 is CPU dynamic quantization; float16 needs CUDA)"
            )

    def _providers(self) -> list:
        if self._device_type() == "cpu":
            return ["CPUExecutionProvider"]
        require_provider(
            "CUDAExecutionProvider",
            "For --device cuda install onnxruntime-gpu "
            "(`pip install '<encoderd checkout>[onnx-gpu]'`) in an environment without onnxruntime.",
        )
        return [("CUDAExecutionProvider", {"device_id": device_index(self.options.device)}), "CPUExecutionProvider"]

    def _check_session(self, providers: list) -> None:
        # onnxruntime falls back to CPU, with only a log line, when a GPU provider's
        # libraries (CUDA, cuDNN, TensorRT) fail to load; serving on CPU silently is worse than failing.
        wanted = providers[0] if isinstance(providers[0], str) else providers[0][0]
        if wanted not in self.session.get_providers():
            raise RuntimeError(
                f"onnxruntime could not start {wanted} (session has {self.session.get_providers()}): "
                "its CUDA/cuDNN/TensorRT libraries are missing or do not match this onnxruntime build"
            )

    @property
    def output_dim(self) -> int:
        return self._dim

    def forward(self, batch: TokenBatch) -> np.ndarray | Ragged:
        if self.options.dtype == "int8":
            # Dynamic int8 scales a whole activation tensor by one number, so in a batch a sequence's
            # vector would depend on its neighbours (down to 0.93 cosine to its own answer alone, under
            # the 0.99 floor beside long texts): one sequence per run makes every answer its own.
            runs = batch.runs(1)
        elif self._device_type() == "cpu":
            runs = batch.runs(CPU_RUN_TOKENS)
        else:
            runs = [batch]
        return join_outputs([self._run(run) for run in runs])

    def _run(self, batch: TokenBatch) -> np.ndarray | Ragged:
        ids, mask, types = padded(batch, self.spec.pad_token_id)
        feed = {"input_ids": ids, "attention_mask": mask}
        if "token_type_ids" in self._inputs:
            feed["token_type_ids"] = types if types is not None else np.zeros_like(ids)
        out = self.session.run(None, feed)[0]
        if wants_token_states(self.spec, batch):  # the graph ends at last_hidden_state (export_onnx)
            return token_states(out, batch)
        if self.spec.kind == ModelKind.EMBEDDING:
            return pool(out, mask, self.spec.pooling)
        return out.astype(np.float32, copy=False)
