"""The served models and the operations on them, independent of any API.

Each ServedModel owns a tokenizer, a scheduler and one worker process. The
gRPC service (and through Envoy, REST) calls Engine.embed/score/classify.
"""

from __future__ import annotations

import asyncio
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from ..workers.backends.base import BackendOptions
from ..workers.model_spec import ModelKind, ModelSpec, load_model_spec, resolve_model_path
from ..workers.process import WorkerConfig
from . import metrics
from .batching import BatchLimits, WorkItem
from .config import ModelConfig, ServerConfig
from .errors import InvalidInput, ModelNotFound, WrongModelKind
from .scheduler import ModelScheduler, PendingRequest
from .tokenization import ModelTokenizer, Tokenized
from .worker_client import WorkerClient

log = logging.getLogger("encoderd.engine")


@dataclass
class ServedModel:
    spec: ModelSpec
    tokenizer: ModelTokenizer
    worker: WorkerClient
    scheduler: ModelScheduler
    engine: str
    device: str
    dtype: str

    @property
    def output_dim(self) -> int:
        info = self.worker.ready_info
        return info.output_dim if info else (self.spec.hidden_size if self.spec.kind == ModelKind.EMBEDDING
                                             else len(self.spec.labels))

    async def compute(self, tokens: Tokenized) -> np.ndarray:
        request = PendingRequest(len(tokens.ids))
        types = tokens.type_ids or [None] * len(tokens.ids)
        items = [WorkItem(ids, t, request, i) for i, (ids, t) in enumerate(zip(tokens.ids, types))]
        return await self.scheduler.run(items, request)


class Engine:
    def __init__(self, config: ServerConfig, on_model_state=lambda name, ready: None):
        self.config = config
        self.models: dict[str, ServedModel] = {}
        self._on_model_state = on_model_state
        self._tokenizer_pool = ThreadPoolExecutor(config.tokenizer_threads, thread_name_prefix="tokenizer")

    # -------------------------------------------------------------- lifecycle
    async def start(self) -> None:
        """Load every model concurrently; each in its own worker process."""
        models = await asyncio.gather(*(self._start_model(m) for m in self.config.models))
        self.models = {m.spec.name: m for m in models}

    async def _start_model(self, model: ModelConfig) -> ServedModel:
        cfg = self.config
        loop = asyncio.get_running_loop()
        path = await loop.run_in_executor(None, resolve_model_path, model.source)
        spec = load_model_spec(model.name, path, ModelKind(model.kind) if model.kind else None)
        tokenizer = ModelTokenizer(path, spec.max_length, self._tokenizer_pool)
        options = BackendOptions(device=cfg.device, dtype=cfg.dtype, threads=cfg.cpu_threads)
        label = f"{spec.name}:{cfg.device}"

        def make_config(batch_address: str, result_address: str) -> WorkerConfig:
            return WorkerConfig(spec, cfg.engine, options, batch_address, result_address, cfg.log_level, label)

        def on_state(ready: bool) -> None:
            metrics.WORKER_UP.labels(spec.name).set(int(ready))
            self._on_model_state(spec.name, ready)

        worker = WorkerClient(make_config, label, on_state, start_timeout=cfg.worker_start_timeout)
        started = time.perf_counter()
        log.info("starting worker for %s (%s, kind=%s)", spec.name, path, spec.kind.value)
        ready = await worker.start()
        log.info("model %s ready in %.1fs (pid %d, %s/%s/%s)", spec.name, time.perf_counter() - started,
                 ready.pid, ready.engine, ready.device, ready.dtype)
        limits = BatchLimits(cfg.max_batch_size, cfg.max_batch_tokens, padded=ready.is_padded)
        scheduler = ModelScheduler(spec.name, worker, limits, batch_delay=cfg.batch_delay_ms / 1000,
                                   max_queued=cfg.max_queued_inputs)
        scheduler.start()
        return ServedModel(spec, tokenizer, worker, scheduler, ready.engine, ready.device, ready.dtype)

    async def stop(self) -> None:
        for model in self.models.values():
            await model.scheduler.stop()
        await asyncio.gather(*(m.worker.stop() for m in self.models.values()), return_exceptions=True)
        self._tokenizer_pool.shutdown(wait=False, cancel_futures=True)

    # ------------------------------------------------------------- operations
    def get(self, name: str, kind: ModelKind | None = None) -> ServedModel:
        if not name and len(self.models) == 1:
            model = next(iter(self.models.values()))
        elif name in self.models:
            model = self.models[name]
        elif not name:
            raise InvalidInput(f"the request names no model and several are served: set `model` to one of "
                               f"{', '.join(sorted(self.models))}")
        else:
            raise ModelNotFound(f"model {name!r} is not served here; served models: {', '.join(sorted(self.models))}")
        if kind is not None and model.spec.kind != kind:
            raise WrongModelKind(f"model {model.spec.name!r} is a {model.spec.kind.value} model; "
                                 f"this call needs a {kind.value} model")
        return model

    def check_inputs(self, texts, what: str = "inputs") -> list[str]:
        texts = list(texts)
        if not texts:
            raise InvalidInput(f"`{what}` is empty: send at least one")
        if len(texts) > self.config.max_inputs_per_request:
            raise InvalidInput(f"too many {what}: {len(texts)} > {self.config.max_inputs_per_request} per request")
        for i, text in enumerate(texts):
            if not text:
                raise InvalidInput(f"{what}[{i}] is an empty string")
            if len(text) > self.config.max_input_chars:
                raise InvalidInput(f"{what}[{i}] has {len(text)} characters; the limit is {self.config.max_input_chars}")
        return texts

    async def embed(self, name: str, texts, *, truncate: bool = True, side: str = "right",
                    prompt: str = "") -> tuple[ServedModel, np.ndarray, int]:
        """Pooled, unnormalized embeddings (n, dim) and the token count."""
        model = self.get(name, ModelKind.EMBEDDING)
        texts = self.check_inputs(texts)
        if prompt:
            texts = [prompt + t for t in texts]
        tokens = await model.tokenizer.encode(texts, truncate=truncate, side=side)
        return model, await model.compute(tokens), tokens.total_tokens

    async def score_pairs(self, name: str, query: str, documents, *, truncate: bool = True
                          ) -> tuple[ServedModel, np.ndarray, int]:
        """Cross-encoder logits (n,) of (query, document) pairs and the token count."""
        model = self.get(name, ModelKind.RERANKER)
        if not query:
            raise InvalidInput("`query` is empty")
        documents = self.check_inputs(documents, "documents")
        tokens = await model.tokenizer.encode(documents, truncate=truncate, pairs_with=query)
        logits = await model.compute(tokens)
        return model, logits[:, 0], tokens.total_tokens

    async def classify(self, name: str, texts, *, truncate: bool = True) -> tuple[ServedModel, np.ndarray, int]:
        """Classifier logits (n, labels) and the token count."""
        model = self.get(name, ModelKind.CLASSIFIER)
        texts = self.check_inputs(texts)
        tokens = await model.tokenizer.encode(texts, truncate=truncate)
        return model, await model.compute(tokens), tokens.total_tokens
