"""PyTorch engine: transformers models with SDPA attention, CPU or CUDA."""

from __future__ import annotations

import inspect
import logging
import os

import numpy as np
import torch

from ..model_spec import ModelKind, Pooling
from ..protocol import TokenBatch
from .base import Backend, padded

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def pool(hidden: torch.Tensor, mask: torch.Tensor, pooling: Pooling) -> torch.Tensor:
    """sentence-transformers Pooling semantics over a padded (n, L, d) batch."""
    if pooling == Pooling.CLS:
        return hidden[:, 0]
    if pooling == Pooling.LAST_TOKEN:
        last = mask.sum(dim=1) - 1
        return hidden[torch.arange(hidden.shape[0], device=hidden.device), last]
    m = mask.unsqueeze(-1).to(hidden.dtype)
    if pooling == Pooling.MAX:
        return hidden.masked_fill(m == 0, torch.finfo(hidden.dtype).min).max(dim=1).values
    return (hidden * m).sum(dim=1) / m.sum(dim=1).clamp(min=1e-9)


class TorchBackend(Backend):
    engine = "torch"

    def load(self) -> None:
        from transformers import AutoModel, AutoModelForSequenceClassification

        if self.options.dtype not in DTYPES:
            raise ValueError(f"the torch engine supports dtypes {sorted(DTYPES)}, not {self.options.dtype!r}")
        self.device = torch.device(self.options.device)
        if self.device.type == "cpu":
            torch.set_num_threads(self.options.threads or len(os.sched_getaffinity(0)))
        model_class = AutoModel if self.spec.kind == ModelKind.EMBEDDING else AutoModelForSequenceClassification
        model = model_class.from_pretrained(self.spec.path, dtype=DTYPES[self.options.dtype], attn_implementation="sdpa")
        self.model = model.to(self.device).eval()
        self._takes_token_types = "token_type_ids" in inspect.signature(self.model.forward).parameters
        self._dim = (self.model.config.hidden_size if self.spec.kind == ModelKind.EMBEDDING
                     else self.model.config.num_labels)

    @property
    def output_dim(self) -> int:
        return self._dim

    @torch.inference_mode()
    def forward(self, batch: TokenBatch) -> np.ndarray:
        ids, mask, types = padded(batch)
        inputs = {"input_ids": torch.from_numpy(ids).to(self.device),
                  "attention_mask": torch.from_numpy(mask).to(self.device)}
        if self._takes_token_types:
            inputs["token_type_ids"] = (torch.from_numpy(types) if types is not None
                                        else torch.zeros_like(inputs["input_ids"], device="cpu")).to(self.device)
        out = self.model(**inputs)
        if self.spec.kind == ModelKind.EMBEDDING:
            result = pool(out.last_hidden_state, inputs["attention_mask"], self.spec.pooling)
        else:
            result = out.logits
        return result.float().cpu().numpy()
