"""The served models and the operations on them, independent of any API.

Each ServedModel owns a tokenizer, a result cache, a scheduler and its worker
processes (one per replica). The gRPC servicers (and through Envoy, REST)
call ModelRegistry.embed / score_pairs / classify (server/models/multimodal.py: media and
multi-vector), which all compute through server/models/compute.py.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import cast

import numpy as np
from tokenizers import Tokenizer

from ...workers.contract.config import BackendOptions, WorkerConfig
from ...workers.contract.model_files import resolve_model_path
from ...workers.contract.model_spec import ModelKind, ModelSpec, Pooling, check_prompts
from ...workers.contract.protocol import HEARTBEAT_INTERVAL
from ...workers.contract.spec_reader import load_model_spec
from ..base import metrics
from ..base.config import ModelConfig, ServerConfig
from ..base.errors import InvalidInput, echo
from ..scheduling.placement import Placement, plan_replicas
from ..scheduling.scheduler import Priority
from ..scheduling.worker_client import WorkerClient
from ..scheduling.zygote_client import shared_zygote
from . import compute
from .choices import explain
from .media import MediaLimits
from .model_resolver import resolve
from .preprocessors import load_preprocessors
from .request_options import ClassifyOptions, EmbedOptions, RerankOptions
from .result_cache import ResultCache, TokenCount
from .served import ServedModel, check_width, start_reporting_progress, start_scheduler
from .tokenization import ModelTokenizer, tokenize_on_the_calling_thread

log = logging.getLogger("encoderd.engine")


def _niced_pool(threads: int, prefix: str, nice: int) -> ThreadPoolExecutor:
    """A tokenizer pool whose threads run `nice` (--worker-nice) nicer than the event loop, as the
    workers do: tokenizing a request is throughput work, and the loop keeps its core for live queries
    (tokenized on the loop itself), answers and refusals. At the loop's own priority, a 200,000-character
    rerank query sent back to back (~0.15 s of tokenizing each) took a core from the workers: other
    callers' single queries went from p99 ~10 ms to 83-127 ms, 36-48 ms with the pool niced (2 shared
    Zen 5 cores, `python -m encoderd.bench.hostile --probes long-query`). Linux nice values are per thread."""

    def lower_this_thread() -> None:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + nice))

    return ThreadPoolExecutor(threads, thread_name_prefix=prefix, initializer=lower_this_thread if nice else None)


class ModelRegistry:
    def __init__(self, config: ServerConfig, on_model_state=lambda name, ready: None):
        self.config = config
        self.models: dict[str, ServedModel] = {}
        self.loading = {m.name for m in config.models}  # configured, not yet served: calls get UNAVAILABLE
        self._on_model_state = on_model_state
        self._workers: list[WorkerClient] = []  # every worker started, so a failed start can stop them all
        tokenize_on_the_calling_thread()  # the pools' nice values hold for the tokenizing itself
        self._tokenizer_pool = _niced_pool(config.tokenizer_threads, "tokenizer", config.worker_nice)
        self._bulk_tokenizer_pool = _niced_pool(1, "tokenizer-bulk", config.worker_nice)
        # Media decoding and preprocessing (server/models/media.py): blocking CPU work, off the event loop; URL
        # fetches wait on the network instead, in their own pool, so slow hosts never stall the decoding.
        self.media_pool = ThreadPoolExecutor(config.media_threads, thread_name_prefix="media")
        self.fetch_pool = ThreadPoolExecutor(16, thread_name_prefix="media-fetch")
        self.media_limits = MediaLimits(config.media_max_bytes, config.media_fetch_timeout, config.media_urls)
        self.zygote = shared_zygote(config)  # forks the CPU workers (workers/zygote.py)

    # -------------------------------------------------------------- lifecycle
    async def start(self) -> None:
        """Load every model concurrently; each in its own worker process. When one fails, the others
        stop too: no worker outlives a failed start (the in-process API's caller lives on)."""
        if self.zygote:
            self.zygote.start()  # (the CLI has launched it already)
        starts = [asyncio.ensure_future(self._start_model(m)) for m in self.config.models]
        try:
            models = await asyncio.gather(*starts)
        except BaseException:
            for start in starts:
                start.cancel()
            await asyncio.gather(*starts, return_exceptions=True)
            await asyncio.gather(*(w.stop() for w in self._workers), return_exceptions=True)
            if self.zygote:
                self.zygote.stop()
            raise
        self.models = {m.spec.name: m for m in models}
        self.loading.clear()

    async def _start_model(self, model: ModelConfig) -> ServedModel:
        cfg = self.config.for_model(model)  # its engine, dtype, replicas, batch limits...: own, else the server's
        loop = asyncio.get_running_loop()
        path = await loop.run_in_executor(None, resolve_model_path, model.source, model.revision, cfg.cache_dir)
        spec = load_model_spec(
            model.name,
            path,
            ModelKind(model.kind) if model.kind else None,
            pooling=Pooling(model.pooling) if model.pooling else None,
            max_length=model.max_length,
            trust_remote_code=cfg.trust_remote_code,
        )
        prompts = {**spec.prompts, **dict(cfg.prompts)}
        check_prompts(spec, prompts)
        # Image processors / feature extractors import transformers (seconds): off the loop, while workers start.
        media = loop.run_in_executor(None, load_preprocessors, spec, self.media_limits)
        placements = plan_replicas(cfg.device, cfg.replicas, cfg.cpu_threads)
        replicas = [self._replica(spec, placement, cfg) for placement in placements]
        started = time.perf_counter()
        log.info("starting %d worker(s) for %s (%s, kind=%s)", len(replicas), spec.name, path, spec.kind.value)
        infos = await start_reporting_progress(spec.name, replicas)
        log.info(
            "model %s ready in %.1fs (pids %s, %s/%s; fidelity %s%s)",
            spec.name,
            time.perf_counter() - started,
            ",".join(str(i.pid) for i in infos),
            infos[0].engine,
            infos[0].dtype,
            infos[0].fidelity_status,
            "".join(f", {f.metric} {f.value:.5f}" for f in infos[0].fidelity),
        )
        log.info("chose %s", explain(spec.name, cfg, placements, infos[0].engine, infos[0].dtype))
        # The worker's tokenizer (transformers builds it, as for sentence-transformers), not one read here.
        tokenizer = ModelTokenizer(
            Tokenizer.from_str(infos[0].tokenizer_json),
            spec.max_length,
            self._tokenizer_pool,
            self._bulk_tokenizer_pool,
            model=spec.name,
            serving_queries=self.serving_queries,
        )
        metrics.MODEL_LOAD_SECONDS.labels(spec.name).set(time.perf_counter() - started)
        metrics.observe_fidelity(spec.name, infos[0].fidelity)
        scheduler = start_scheduler(spec, replicas, cfg, padded=any(i.is_padded for i in infos))
        return ServedModel(
            spec,
            tokenizer,
            replicas,
            scheduler,
            infos[0].engine,
            infos[0].dtype,
            ResultCache(spec.name, cfg.cache_size),
            prompts,
            await media,
            infos[0].fidelity_status,
            infos[0].fidelity,
        )

    def _replica(self, spec: ModelSpec, placement: Placement, cfg: ServerConfig) -> WorkerClient:
        options = BackendOptions(
            device=placement.device,
            dtype=cfg.dtype,
            threads=placement.threads,
            cache_dir=cfg.cache_dir,
            max_batch_size=cfg.batch_size,
            compile=cfg.torch_compile,
            trust_remote_code=cfg.trust_remote_code,
        )
        label = f"{spec.name}@{placement.label}"

        def make_config(batch_address: str, result_address: str) -> WorkerConfig:
            return WorkerConfig(
                spec,
                cfg.engine,
                options,
                batch_address,
                result_address,
                cfg.log_level,
                label,
                cpu_affinity=placement.cores,
                log_format=cfg.log_format,
                allow_low_fidelity=cfg.allow_low_fidelity,
                heartbeat_interval=HEARTBEAT_INTERVAL if cfg.worker_stall_timeout else 0.0,
                nice=cfg.worker_nice,
            )

        restarts_counted = 0
        metrics.WORKER_RESTARTS.labels(spec.name, label)  # export the series at 0, so increase() sees the first

        def on_state(ready: bool) -> None:
            nonlocal restarts_counted
            metrics.WORKER_UP.labels(spec.name, label).set(int(ready))
            # WorkerClient counts each death it restarts from; mirror that count into Prometheus.
            if worker.restarts > restarts_counted:
                metrics.WORKER_RESTARTS.labels(spec.name, label).inc(worker.restarts - restarts_counted)
                restarts_counted = worker.restarts
            self._on_model_state(spec.name, self.models[spec.name].ready if spec.name in self.models else ready)

        worker = WorkerClient(
            make_config,
            label,
            on_state,
            start_timeout=cfg.worker_start_timeout,
            stall_timeout=cfg.worker_stall_timeout,
            zygote=self.zygote,
        )
        self._workers.append(worker)
        return worker

    async def stop(self) -> None:
        for model in self.models.values():
            await model.scheduler.stop()
        await asyncio.gather(*(r.stop() for m in self.models.values() for r in m.replicas), return_exceptions=True)
        if self.zygote:
            self.zygote.stop()
        for pool in (self._tokenizer_pool, self._bulk_tokenizer_pool):
            pool.shutdown(wait=False, cancel_futures=True)
        self.media_pool.shutdown(wait=False, cancel_futures=True)
        self.fetch_pool.shutdown(wait=False, cancel_futures=True)

    # ------------------------------------------------------------- operations
    def get(
        self,
        name: str,
        kinds: ModelKind | Sequence[ModelKind] | None = None,
        prefer: Sequence[ModelKind] = (),
        call: str = "this call",
    ) -> ServedModel:
        """The served model a request means (server/models/model_resolver.py)."""
        kinds = (kinds,) if isinstance(kinds, ModelKind) else kinds
        return resolve(self.models, self.loading, name, kinds, prefer, call)

    def check_inputs(self, texts, what: str = "inputs") -> list:
        return compute.check_inputs(self.config, list(texts), what)

    def check_text(self, text: str, what: str) -> str:
        return compute.check_text(self.config, text, what)

    async def check_token_floor(
        self, model: ServedModel, texts: list[str], *, truncate: bool = False, pairs_with: str = ""
    ) -> None:
        """--max-request-tokens before any tokenization: refused when even the fewest tokens the
        texts can become (server/models/token_floor.py) are over it. Words are counted only when
        the texts are long enough to be over it (TokenFloor.over), in the tokenizer pool, off the loop."""
        budget = self.config.max_request_tokens
        floor = model.tokenizer.floor
        cap = model.spec.max_length if truncate else None
        if budget and floor.may_exceed(texts, cap, pairs_with, budget):
            over = functools.partial(floor.over, texts, cap, pairs_with, budget)
            self.check_token_budget(await asyncio.get_running_loop().run_in_executor(self._tokenizer_pool, over))

    def check_token_budget(self, floor: int, exact: int | None = None) -> None:
        """--max-request-tokens: a floor counted before any work, the exact count after tokenization
        (before any compute)."""
        budget = self.config.max_request_tokens
        count = floor if exact is None else exact
        if budget and count > budget:
            kind = "at least" if exact is None else ""
            raise InvalidInput(
                f"the request holds {kind} {count} tokens; the limit is {budget} per request "
                "(--max-request-tokens): split it".replace("  ", " ")
            )

    def serving_queries(self) -> bool:
        """Whether any model serves live queries now: its tokenizer pool is shared, and a big request's
        tokenizing then leaves their compute a core (tokenization.CHUNKS_IN_FLIGHT)."""
        return any(model.scheduler.serving_queries() for model in self.models.values())

    def admit(
        self,
        model: ServedModel,
        texts: list[str],
        *,
        truncate: bool = True,
        pairs_with: str = "",
        priority: Priority = Priority.INTERACTIVE,
    ):
        """Queue admission before tokenization (after check_token_floor): refused at once when the
        request is over its model's queue bounds or the wait the server allows, else a reservation
        held until its inputs are queued (so a flood cannot pile up unbounded in the tokenizer pool)."""
        cap = model.spec.max_length if truncate else None
        return model.scheduler.reserve(len(texts), estimate_tokens(texts, cap, len(pairs_with)), priority)

    def prompt_text(self, model: ServedModel, prompt: str = "", prompt_name: str = "") -> str:
        """The instruction prefix: explicit text, else a named prompt, else the model's default."""
        if prompt and prompt_name:
            raise InvalidInput("set `prompt` or `prompt_name`, not both")
        if prompt_name:
            if prompt_name not in model.prompts:
                raise InvalidInput(
                    f"model {model.spec.name!r} has no prompt named {echo(prompt_name)}; it has: "
                    f"{', '.join(sorted(model.prompts)) or 'none'}"
                )
            text = model.prompts[prompt_name]
        else:
            text = self.check_text(prompt, "`prompt`") or model.prompts.get(model.spec.default_prompt_name or "", "")
        if text and not model.spec.include_prompt:
            # Its pooling skips the prompt's tokens, which encoderd does not compute (see check_prompts).
            raise InvalidInput(
                f"model {model.spec.name!r} takes no prompt: its pooling excludes prompt tokens "
                "(include_prompt: false), which encoderd does not compute"
            )
        return text

    async def embed(
        self, name: str, texts, options: EmbedOptions, names: Sequence[str] = ()
    ) -> tuple[ServedModel, np.ndarray, TokenCount]:
        """Pooled, unnormalized embeddings (n, dim) and the token count (clip / clap: their text tower's;
        each text's in `.per_input`). `names`: what errors call each text (default inputs[i]).
        Post-processing (normalize, dimensions, output dtype) is the caller's, from the same options."""
        # Named none: the embedding model, not a clip or clap served beside it.
        model = self.get(name, (ModelKind.EMBEDDING, ModelKind.CLIP, ModelKind.CLAP), prefer=(ModelKind.EMBEDDING,))
        check_width(model, options)
        prefix = self.prompt_text(model, options.prompt, options.prompt_name)
        rows, n_tokens = await compute.run(
            self,
            model,
            texts,
            compute.POOLED,
            truncate=options.truncate,
            side=options.side,
            prefix=prefix,
            priority=options.priority,
            names=names,
        )
        return model, cast("np.ndarray", rows), n_tokens

    async def embed_ids(self, name: str, id_lists, options: EmbedOptions) -> tuple[ServedModel, np.ndarray, int]:
        """`embed` for pre-tokenized inputs (OpenAI token-id input). Clients tokenize without the
        model's special tokens (OpenAI's do), which the model needs: they are added unless the ids
        already carry them, and over-long ids are cut between them, as texts are (the ids are used
        as given: of the options, only the priority applies)."""
        model = self.get(name, ModelKind.EMBEDDING)
        check_width(model, options)
        id_lists = self.check_inputs(id_lists)
        vocab = model.tokenizer.untruncated.get_vocab_size(with_added_tokens=True)
        ids = []
        for i, seq in enumerate(id_lists):
            # Checked as floats: JSON numbers arrive as doubles, and 1e300 must not wrap around.
            values = np.asarray(seq, dtype=np.float64)
            if not ((values >= 0) & (values < vocab) & (values == np.floor(values))).all():
                raise InvalidInput(
                    f"inputs[{i}] holds a value that is not a token id: ids are integers in [0, {vocab})"
                )
            ids.append(
                compute.TokenIds(
                    np.asarray(model.tokenizer.with_special_tokens(values.astype(np.int64).tolist()), dtype=np.int32)
                )
            )
        rows, n_tokens = await compute.run(self, model, ids, compute.POOLED, priority=options.priority)
        return model, cast("np.ndarray", rows), n_tokens

    async def score_pairs(
        self, name: str, query: str, documents, options: RerankOptions
    ) -> tuple[ServedModel, np.ndarray, int]:
        """Cross-encoder logits (n,) of (query, document) pairs and the token count."""
        model = self.get(name, ModelKind.RERANKER)
        if not query:
            raise InvalidInput("`query` is empty")
        self.check_text(query, "`query`")
        logits, n_tokens = await compute.run(
            self,
            model,
            documents,
            compute.PAIR_LOGITS,
            truncate=options.truncate,
            side=options.side,
            pairs_with=query,
            priority=options.priority,
            what="documents",
        )
        return model, cast("np.ndarray", logits)[:, 0], n_tokens

    async def classify(
        self, name: str, texts, options: ClassifyOptions, kinds: tuple[ModelKind, ...] = (ModelKind.CLASSIFIER,)
    ) -> tuple[ServedModel, np.ndarray, int]:
        """Classifier logits (n, labels) and the token count. An input is a text or a (text,
        text_pair) pair (TEI's /predict), which the model reads as its tokenizer pairs them; TEI's
        /predict also takes a reranker (`kinds`): a classifier of one label."""
        model = self.get(name, kinds)
        logits, n_tokens = await compute.run(
            self,
            model,
            texts,
            compute.CLASS_LOGITS,
            truncate=options.truncate,
            side=options.side,
            priority=options.priority,
        )
        return model, cast("np.ndarray", logits), n_tokens


# A generous characters-per-token figure (English runs ~4 characters a token, code and CJK fewer):
# what a request reserves of its model's queue until it is tokenized. A guess, not a bound: the
# token budget refuses on TokenFloor (server/models/token_floor.py), which is one.
CHARS_PER_TOKEN = 8


def estimate_tokens(texts: list[str], cap: int | None, pair_chars: int = 0) -> int:
    """A guess of a request's tokens without tokenizing, for its queue reservation: characters /
    CHARS_PER_TOKEN per input (plus its pair's query), at most `cap` (the model's maximum when
    truncating)."""
    return sum(min(cap or 1 << 62, (len(t) + pair_chars) // CHARS_PER_TOKEN + 1) for t in texts)
