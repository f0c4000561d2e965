"""CTranslate2 engine: the transformer encoder in CTranslate2, pooling and
classification heads in numpy.

What CTranslate2's Encoder returns: `last_hidden_state` and, for BERT,
`pooler_output` (tanh(dense(CLS))). It has no classifier output, so for
rerankers and classifiers the head is saved from the transformers checkpoint
next to the conversion and applied here in float32 numpy, starting from the
CLS hidden state:

  * BERT-style (`classifier` is a Linear over the pooler):
      logits = classifier(tanh(pooler.dense(h_cls)))
  * RoBERTa / XLM-RoBERTa-style (`classifier.dense`, `classifier.out_proj`):
      logits = out_proj(tanh(dense(h_cls)))

Any other head (DistilBERT's pre_classifier+ReLU, ...) fails at load with a
message naming the engines that can serve it. Heads run in float32 even for
int8 compute types: they are a few hundred FLOPs per input.
"""

from __future__ import annotations

import itertools
import logging
import os
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np

from ..contract.config import default_cache_dir
from ..contract.model_spec import ModelKind
from ..contract.protocol import Ragged, TokenBatch
from ..model_cache import cached_build, fingerprint_model, library_versions
from ..pooling import pool
from .base import Backend, from_pretrained, require_family, require_text_kind, token_states, wants_token_states

log = logging.getLogger(__name__)

HEAD_FILE = "encoderd-head.npz"
# Heads computing out_proj(tanh(dense(h_cls))) in transformers.
TANH_HEADS = ("RobertaClassificationHead", "XLMRobertaClassificationHead", "CamembertClassificationHead")
# (--dtype, on a GPU?) -> CTranslate2 compute type; the weights are stored converted to it.
COMPUTE_TYPES = {
    ("float32", False): "float32",
    ("float32", True): "float32",
    ("float16", True): "float16",
    ("bfloat16", True): "bfloat16",
    ("int8", False): "int8",
    ("int8", True): "int8_float16",
    ("int8_float32", False): "int8_float32",
    ("int8_float32", True): "int8_float32",
    ("int8_float16", True): "int8_float16",
}


def compute_type(dtype: str, device: str) -> str:
    import ctranslate2

    on_gpu = device.startswith("cuda")
    wanted = COMPUTE_TYPES.get((dtype, on_gpu))
    device_type = "cuda" if on_gpu else "cpu"
    supported = (
        sorted(ctranslate2.get_supported_compute_types(device_type))
        if (not on_gpu or ctranslate2.get_cuda_device_count() > 0)
        else []
    )
    if wanted is None or wanted not in supported:
        valid = sorted(d for (d, gpu), ct in COMPUTE_TYPES.items() if gpu == on_gpu and ct in supported)
        raise ValueError(
            f"the ctranslate2 engine cannot run --dtype {dtype} on {device}"
            + (f"; choose one of {', '.join(valid)}" if valid else ": ctranslate2 sees no CUDA device")
        )
    return wanted


# ------------------------------------------------------------------ head
def _linear(layer) -> tuple[np.ndarray, np.ndarray]:
    # Copies: CTranslate2 quantizes the tensors it is given in place (the BERT pooler is among them).
    return layer.weight.detach().float().numpy().copy(), layer.bias.detach().float().numpy().copy()


def extract_head(model) -> dict[str, np.ndarray]:
    """The classification head of a *ForSequenceClassification model as
    arrays w0, b0, w1, b1: logits = w1 @ tanh(w0 @ h_cls + b0) + b1."""
    import torch

    head = getattr(model, "classifier", None)
    pooler = getattr(model.base_model, "pooler", None)
    # Matched by structure *and* activation: ELECTRA's head also has dense/out_proj but uses GELU.
    if (
        isinstance(head, torch.nn.Linear)
        and pooler is not None
        and isinstance(getattr(pooler, "activation", None), torch.nn.Tanh)
    ):
        first, second = _linear(pooler.dense), _linear(head)
    elif head is not None and type(head).__name__ in TANH_HEADS:
        first, second = _linear(head.dense), _linear(head.out_proj)
    else:
        raise ValueError(
            f"the ctranslate2 engine cannot apply the classification head of {type(model).__name__} "
            "(it knows BERT and RoBERTa-style heads); serve this model with --engine onnx or torch"
        )
    return {"w0": first[0], "b0": first[1], "w1": second[0], "b1": second[1]}


def apply_head(head: dict[str, np.ndarray], cls_hidden: np.ndarray) -> np.ndarray:
    hidden = np.tanh(cls_hidden @ head["w0"].T + head["b0"])
    return (hidden @ head["w1"].T + head["b1"]).astype(np.float32)


# ------------------------------------------------------------ conversion
def _for_loader(model, model_class):
    """What CTranslate2's loader for this architecture reads: the model itself,
    its bare encoder (BertModel, RobertaModel), or an object holding the encoder
    under the attribute the loader expects (its XLM-R loader reads `model.roberta`)."""
    if isinstance(model, model_class):
        return model
    if isinstance(model.base_model, model_class):
        return model.base_model
    return SimpleNamespace(**{model_class.base_model_prefix: model.base_model, "config": model.config})


def convert(model_dir: str, kind: ModelKind, quantization: str, out_dir: Path, trust_remote_code: bool = False) -> None:
    """Convert with CTranslate2's TransformersConverter; for classifiers also save the head."""
    import torch
    from ctranslate2.converters import TransformersConverter
    from transformers import AutoModel, AutoModelForSequenceClassification

    model_class = AutoModel if kind == ModelKind.EMBEDDING else AutoModelForSequenceClassification
    model = from_pretrained(model_class, model_dir, trust_remote_code, dtype=torch.float32).eval()
    if not type(model).__module__.startswith("transformers."):
        # CTranslate2 converts the weights into its own implementation of the stock architecture:
        # whatever the repository's code computes differently would be lost.
        raise ValueError(
            f"{type(model).__name__} is the model repository's own code, which CTranslate2 cannot "
            "reproduce; serve this model with --engine torch"
        )
    head = extract_head(model) if kind != ModelKind.EMBEDDING else None
    if not hasattr(model.config, "position_embedding_type"):
        # transformers 5 dropped the attribute (absolute positions are all it implements);
        # CTranslate2 4.8's BERT/RoBERTa loaders still assert it is "absolute".
        model.config.position_embedding_type = "absolute"

    class _Converter(TransformersConverter):
        # Hand CTranslate2 the model loaded above rather than letting it load the checkpoint again.
        def load_model(self, loader_class, path, **kwargs):
            return _for_loader(model, loader_class)

    _Converter(model_dir).convert(str(out_dir), quantization=quantization, force=True)
    if head is not None:
        np.savez(out_dir / HEAD_FILE, **head)  # type: ignore[arg-type]  # numpy's stub reads **head as allow_pickle


def ensure_converted(spec, ctype: str, cache_dir: str, trust_remote_code: bool = False) -> tuple[Path, bool]:
    key = {
        "model": fingerprint_model(spec.path),
        "kind": spec.kind.value,
        "dtype": ctype,
        "versions": library_versions("ctranslate2", "torch", "transformers"),
    }

    def build(out: Path) -> None:
        log.info("converting %s to CTranslate2 (%s) ...", spec.name, ctype)
        started = time.perf_counter()
        try:
            convert(spec.path, spec.kind, ctype, out, trust_remote_code)
        except ValueError as exc:  # CTranslate2's "No conversion is registered for ..." and ours
            raise ValueError(f"the ctranslate2 engine cannot convert {spec.name}: {exc}") from exc
        log.info("converted %s to CTranslate2 in %.1fs", spec.name, time.perf_counter() - started)

    entry = cached_build(cache_dir or default_cache_dir(), "ct2", f"{spec.name}-{ctype}", key, build)
    return entry.path, entry.hit


class CT2Backend(Backend):
    engine = "ctranslate2"

    def load(self) -> None:
        import ctranslate2

        require_text_kind(self.spec, self.engine)
        require_family(self.spec, self.engine)
        ctype = compute_type(self.options.dtype, self.options.device)
        path, self.cache_hit = ensure_converted(
            self.spec, ctype, self.options.cache_dir, self.options.trust_remote_code
        )
        self._on_gpu = self.options.device.startswith("cuda")
        self.encoder = ctranslate2.Encoder(
            str(path),
            device="cuda" if self._on_gpu else "cpu",
            compute_type=ctype,
            device_index=int(self.options.device.partition(":")[2] or 0),
            intra_threads=self.options.threads or len(os.sched_getaffinity(0)),
        )
        self.head = dict(np.load(path / HEAD_FILE)) if self.spec.kind != ModelKind.EMBEDDING else None
        self._dim = self.spec.hidden_size if self.head is None else int(self.head["w1"].shape[0])
        log.info("ctranslate2 encoder on %s, compute type %s (%s)", self.options.device, ctype, path)

    @property
    def output_dim(self) -> int:
        return self._dim

    def forward(self, batch: TokenBatch) -> np.ndarray | Ragged:
        # Ragged lists (not a padded array) so CTranslate2 moves them to whichever device it runs on.
        bounds = batch.cu_seqlens
        ids = [batch.input_ids[a:b].tolist() for a, b in itertools.pairwise(bounds)]
        types = None
        if batch.token_type_ids is not None:
            types = [batch.token_type_ids[a:b].tolist() for a, b in itertools.pairwise(bounds)]
        hidden = self._to_numpy(self.encoder.forward_batch(ids, token_type_ids=types).last_hidden_state)
        if wants_token_states(self.spec, batch):
            return token_states(hidden, batch)
        if self.head is not None:
            return apply_head(self.head, hidden[:, 0])
        mask = np.arange(hidden.shape[1]) < batch.lengths[:, None]
        return pool(hidden, mask, self.spec.pooling)

    def _to_numpy(self, view) -> np.ndarray:
        if self._on_gpu:  # StorageView exposes __cuda_array_interface__; torch copies it to the host
            import torch

            return torch.as_tensor(view).float().cpu().numpy()
        return np.array(view, dtype=np.float32)
