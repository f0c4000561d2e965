"""The in-process API (`import encoderd`): the server's model registry and worker processes, driven from
Python without gRPC. Options go through the server's own parser (server/main/flags.py), so a model runs
with exactly the settings `encoderd serve` would give it, and results are post-processed by the
same functions as the gRPC responses: the same numbers, as numpy arrays.

    import encoderd

    async with encoderd.AsyncEngine("mini=/models/all-MiniLM-L6-v2", "rr=/models/reranker:reranker",
                                    dtype="float32") as engine:
        vectors = await engine.embed(["a text", "another"], model="mini")
        ranked = await engine.rerank("a query", ["doc one", "doc two"], model="rr")
"""

from __future__ import annotations

import contextlib
import io
from dataclasses import dataclass

import numpy as np

from ..base.config import ServerConfig
from ..base.errors import EncoderdError, InvalidInput, echo
from ..models import request_options
from ..models.postprocess import QUANTIZERS, finish_requested, quantize, rank, scores
from ..models.registry import ModelRegistry
from ..models.request_options import ClassifyOptions, EmbedOptions, RerankOptions
from ..scheduling.scheduler import Priority
from .configure import config_from_args
from .flags import build_parser

OUTPUT_DTYPES = ("float32", *QUANTIZERS)
SIDES = ("right", "left")


@dataclass(frozen=True)
class Ranked:
    index: int  # the document's position in the request
    score: float
    document: str = ""


@dataclass(frozen=True)
class Tokens:
    ids: list[int]
    tokens: list[str]
    offsets: list[tuple[int, int]]  # character spans in the input


def server_config(models: tuple[str, ...] = (), config: str | None = None, **options) -> ServerConfig:
    """The ServerConfig `encoderd serve` builds from the same settings: `models` as --model values,
    `config` as --config, each option as its flag (`max_length=["mini=128"]` is --max-length mini=128;
    a list repeats the flag, True gives a switch). ENCODERD_* variables apply as for the server.
    A bad setting raises ValueError with the server's one-line message."""
    argv = ["serve", *(arg for m in models for arg in ("--model", m))]
    if config:
        argv += ["--config", config]
    for key, value in options.items():
        flag = "--" + key.replace("_", "-")
        for item in value if isinstance(value, (list, tuple)) else [value]:
            if item is True:
                argv.append(flag)
            elif item is not False and item is not None:
                argv += [flag, str(item)]
    errors = io.StringIO()
    try:
        with contextlib.redirect_stderr(errors):
            return config_from_args(build_parser().parse_args(argv))
    except SystemExit as exc:
        lines = errors.getvalue().strip().splitlines()
        raise ValueError(lines[-1] if lines else str(exc)) from None


class AsyncEngine:
    """Serve models in this process's event loop: start() (or `async with`), the calls, stop()."""

    def __init__(self, *models: str, config: str | None = None, **options):
        self.config = server_config(models, config, **options)
        self._registry: ModelRegistry | None = None

    async def start(self) -> AsyncEngine:
        """Start every model's workers (the frontend logs to the `encoderd.*` loggers: the caller's
        logging set-up decides what shows)."""
        registry = ModelRegistry(self.config)
        await registry.start()
        self._registry = registry
        return self

    async def stop(self) -> None:
        if self._registry is not None:
            registry, self._registry = self._registry, None
            await registry.stop()

    async def __aenter__(self) -> AsyncEngine:
        return await self.start()

    async def __aexit__(self, *exc) -> None:
        await self.stop()

    @property
    def registry(self) -> ModelRegistry:
        if self._registry is None:
            raise RuntimeError("the engine is not started: call `await engine.start()` or use `async with`")
        return self._registry

    @property
    def models(self) -> dict[str, str]:
        """Served name -> kind."""
        return {name: model.spec.kind.value for name, model in self.registry.models.items()}

    # ------------------------------------------------------------------ calls
    async def embed(
        self,
        texts: list[str],
        model: str = "",
        *,
        normalize: bool | None = None,
        dimensions: int = 0,
        output_dtype: str = "float32",
        truncate: bool = True,
        truncation_direction: str = "right",
        prompt: str = "",
        prompt_name: str = "",
        bulk: bool = False,
    ) -> np.ndarray:
        """(n, dim) float32 embeddings, L2-normalized when the model says so (as the server), or
        packed `output_dtype` rows (float16, int8, uint8, binary, ubinary) as the server sends them."""
        _one_of(output_dtype, OUTPUT_DTYPES, "output_dtype")
        _one_of(truncation_direction, SIDES, "truncation_direction")
        options = EmbedOptions(
            truncate=truncate,
            side=truncation_direction,
            priority=_priority(bulk),
            prompt=prompt,
            prompt_name=prompt_name,
            normalize=normalize,
            dimensions=dimensions,
            output_dtype=output_dtype,
        )
        served, pooled, _ = await self.registry.embed(model, texts, options)
        vectors = finish_requested(pooled, served.spec, options)
        return vectors if options.output_dtype == "float32" else quantize(vectors, options.output_dtype)

    async def rerank(
        self,
        query: str,
        documents: list[str],
        model: str = "",
        *,
        top_n: int = 0,
        raw_scores: bool = False,
        return_documents: bool = False,
        truncate: bool = True,
        bulk: bool = False,
    ) -> list[Ranked]:
        """The documents best first, scored by the model's activation (or raw logits)."""
        options = RerankOptions(truncate=truncate, priority=_priority(bulk), raw_scores=raw_scores)
        served, logits, _ = await self.registry.score_pairs(model, query, documents, options)
        values = scores(logits, served.spec.score_activation, options.raw_scores)
        order = rank(values, request_options.top_n(top_n))
        return [Ranked(int(i), float(values[i]), documents[i] if return_documents else "") for i in order]

    async def classify(
        self, texts: list[str], model: str = "", *, raw_scores: bool = False, truncate: bool = True, bulk: bool = False
    ) -> list[list[tuple[str, float]]]:
        """Per input, (label, score) pairs best first."""
        options = ClassifyOptions(truncate=truncate, priority=_priority(bulk), raw_scores=raw_scores)
        served, logits, _ = await self.registry.classify(model, texts, options)
        values = scores(logits, served.spec.score_activation, options.raw_scores)
        labels = served.spec.labels or tuple(f"LABEL_{i}" for i in range(values.shape[1]))
        return [[(labels[j], float(row[j])) for j in rank(row, 0)] for row in values]

    async def tokenize(self, texts: list[str], model: str = "", *, add_special_tokens: bool = True) -> list[Tokens]:
        registry = self.registry
        served = registry.get(model)
        texts = registry.check_inputs(texts)
        await registry.check_token_floor(served, texts)
        encodings = await served.tokenizer.tokenize(texts, add_special_tokens)
        registry.check_token_budget(0, sum(len(e.ids) for e in encodings))
        return [Tokens(list(e.ids), list(e.tokens), [(start, end) for start, end in e.offsets]) for e in encodings]


def _priority(bulk: bool) -> Priority:
    return Priority.BULK if bulk else Priority.INTERACTIVE


def _one_of(value: str, choices: tuple[str, ...], what: str) -> None:
    if value not in choices:
        raise InvalidInput(f"unknown {what} {echo(value)}: choose one of {', '.join(choices)}")


__all__ = ["AsyncEngine", "EncoderdError", "Ranked", "Tokens", "server_config"]
