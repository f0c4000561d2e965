"""A served model: what it is made of (ServedModel: its spec, tokenizer, worker replicas, scheduler,
result cache, prompts, media preprocessors) and how its parts start (the workers, with progress
lines; the scheduler over them). The registry (registry.py) holds the served models; compute.py
and model_resolver.py work on one, below the registry.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from ...workers.contract.model_spec import ModelKind, ModelSpec, modalities
from ...workers.contract.protocol import WorkerReady
from ..base.config import ServerConfig
from ..scheduling.batching import BatchLimits
from ..scheduling.scheduler import ModelScheduler
from ..scheduling.worker_client import WorkerClient
from .postprocess import check_dimensions
from .request_options import EmbedOptions
from .result_cache import ResultCache
from .tokenization import ModelTokenizer

log = logging.getLogger("encoderd.engine")

PROGRESS_EVERY_S = 10.0  # between "still loading" lines while a model's workers start


async def start_reporting_progress(name: str, replicas: Sequence[WorkerClient]) -> list[WorkerReady]:
    """Start a model's workers, saying every PROGRESS_EVERY_S that they are still at it: a load, an
    export or a warm-up can take minutes, and a log file or a journal shows no progress bar."""
    task = asyncio.ensure_future(asyncio.gather(*(replica.start() for replica in replicas)))
    began = time.perf_counter()
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=PROGRESS_EVERY_S)
            if done:
                return task.result()
            waiting = sum(not r.ready for r in replicas)
            log.info(
                "model %s: %d of %d worker(s) still loading after %.0fs (their lines say which step)",
                name,
                waiting,
                len(replicas),
                time.perf_counter() - began,
            )
    except asyncio.CancelledError:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        raise


@dataclass
class ServedModel:
    spec: ModelSpec
    tokenizer: ModelTokenizer
    replicas: list[WorkerClient]
    scheduler: ModelScheduler
    engine: str
    dtype: str
    results: ResultCache
    prompts: dict[str, str]
    media: dict = field(default_factory=dict)  # modality -> preprocessor (server/models/media.py), media kinds only
    fidelity_status: str = ""  # the first replica's start-up self-check (workers/fidelity.py)
    fidelity: tuple = ()  # its protocol.FidelityFigure's

    @property
    def ready(self) -> bool:
        return self.scheduler.ready

    @property
    def output_dim(self) -> int:
        infos = [r.ready_info for r in self.replicas if r.ready_info]
        if infos:
            return self.spec.served_width(infos[0].output_dim)
        return (
            len(self.spec.labels)
            if self.spec.kind in (ModelKind.RERANKER, ModelKind.CLASSIFIER)
            else self.spec.served_width(self.spec.hidden_size)
        )


def check_width(model: ServedModel, options: EmbedOptions) -> None:
    """`dimensions` within the model's width, before any work (the vectors would be refused after)."""
    check_dimensions(options.dimensions, model.output_dim, options.dimensions_field)


def start_scheduler(spec: ModelSpec, replicas: list[WorkerClient], cfg: ServerConfig, padded: bool) -> ModelScheduler:
    """The model's queue and batcher over its replicas, started: its batch limits (bulk ones too)
    and queue bounds from its configuration."""
    mixed = len(modalities(spec.kind)) > 1
    limits = BatchLimits(cfg.batch_size, cfg.batch_tokens, padded=padded, mixed_modalities=mixed)
    lane_size = cfg.lane_batch_size(padded)
    lane_limits = BatchLimits(lane_size, cfg.lane_batch_tokens(padded), padded=padded, mixed_modalities=mixed)
    bulk_tokens = cfg.live_bulk_batch_tokens(padded)
    bulk_limits = BatchLimits(lane_size, bulk_tokens, padded=padded, mixed_modalities=mixed)
    scheduler = ModelScheduler(
        spec.name,
        replicas,
        limits,
        lane_limits=lane_limits,
        bulk_limits=bulk_limits,
        batch_delay=cfg.batch_delay_ms / 1000,
        max_queued=cfg.max_queued_inputs,
        max_queued_tokens=cfg.max_queued_tokens,
        max_queue_wait=cfg.max_queue_wait,
        split_large=True,
    )
    scheduler.start()
    return scheduler
