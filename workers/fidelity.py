"""The start-up fidelity self-check: does the configured engine x dtype compute what the model
computes?

After load and warm-up every worker runs the calibration set (workers/calibration.py) through
its backend's `forward` and compares the outputs with a float32 reference of the same weights:
the plain transformers forward, padded, float32, on CPU; pooled in numpy with the model's
pooling (embeddings) or its logits (rerankers, classifiers). The reference is deliberately not
the torch engine's own padding-free path, so a torch float32 worker checks that path too. It is
computed once and cached with workers/model_cache.py under the kind "fidelity", keyed by
everything it depends on; a cached reference costs a file read, not a torch import.

Floors, by the precision the backend computes in (FLOORS):

  metric          kinds                     float32   float16/bfloat16   int8*, float8
  min_cosine      embedding                 0.9999    0.999              0.99     (>=)
  max_prob_diff   reranker, classifier      0.001     0.01               0.06     (<=)
  max_logit_diff  reranker, classifier      0.004     0.04               0.24     (<=)
  kendall_tau     reranker                  0.99      0.97               0.88     (>=)
  top1_agreement  classifier                0.97      0.94               0.9      (>=)

Each figure compares what requests are served. min_cosine: the worst cosine over the set between
served (pooled, unnormalized: cosine is scale-free) and reference vectors, over the served width (a
truncate_dim model's first dimensions). max_prob_diff: where the model serves probabilities (its
ScoreActivation: sigmoid, or softmax over the labels), the most an input's measured logit error can
move its probability wherever on the curve its score lies (max_prob_shift; never less than the
difference at the set's own scores): traffic's scores are not the set's, and a set whose scores sit
in sigmoid's flat tails hides a logit error. max_logit_diff: the largest absolute
difference of a logit, where the model serves its logits (Identity: a CrossEncoder saved so, a
regression head); its ceilings are the probability ceilings carried over through sigmoid's
steepest slope (1/4): a logit within 4c moves no sigmoid probability by more than c.
kendall_tau: rank agreement of all the pairs' scores (one swapped pair of the 48 is 0.998).
top1_agreement: the share of inputs whose best label is the reference's (one flip of 56 is 0.982).

ColPali / ColQwen2 (colpali) models are checked on their multi-vector output: calibration queries
and drawn pages (calibration.retrieval_queries, calibration.pages) built by the model's processor
and batched as the frontend batches them, against transformers' own loop in float32, one input at
a time: `model(**processor(...)).embeddings`. min_cosine is then the worst cosine over every row
(each query token's and page token's vector), under the embedding floors.

Multi-modal (clip, clap), the other multi-vector kinds (colbert, clip_patches) and sparse models
are not checked: the torch engine is the only one computing them, and the report says "unchecked".
"""

from __future__ import annotations

import gc
import hashlib
import logging
import os
import time
from dataclasses import dataclass

import msgspec
import numpy as np

from . import calibration, memory
from .contract.config import default_cache_dir
from .contract.model_spec import ModelKind, ModelSpec, ScoreActivation
from .contract.protocol import FidelityFigure, TokenBatch
from .model_cache import cached_build, fingerprint_model, library_versions

log = logging.getLogger("encoderd.fidelity")

REFERENCE_FILE = "reference.npy"
CHECKED_KINDS = (ModelKind.EMBEDDING, ModelKind.RERANKER, ModelKind.CLASSIFIER, ModelKind.COLPALI)
# The first metric of a reranker or classifier is its score metric (SCORE_METRICS), by what it serves.
METRICS = {
    ModelKind.EMBEDDING: ("min_cosine",),
    ModelKind.COLPALI: ("min_cosine",),  # over every row of every query and page
    ModelKind.RERANKER: ("max_prob_diff", "kendall_tau"),
    ModelKind.CLASSIFIER: ("max_prob_diff", "top1_agreement"),
}
SCORE_METRICS = {
    ScoreActivation.SIGMOID: "max_prob_diff",
    ScoreActivation.SOFTMAX: "max_prob_diff",
    ScoreActivation.IDENTITY: "max_logit_diff",
}
# A bound on these metrics is a ceiling; on every other metric it is a floor.
CEILING_METRICS = ("max_prob_diff", "max_logit_diff")
_PROBABILITY_FLOORS = {
    "float32": {"min_cosine": 0.9999, "max_prob_diff": 0.001, "kendall_tau": 0.99, "top1_agreement": 0.97},
    "half": {"min_cosine": 0.999, "max_prob_diff": 0.01, "kendall_tau": 0.97, "top1_agreement": 0.94},
    "int8": {"min_cosine": 0.99, "max_prob_diff": 0.06, "kendall_tau": 0.88, "top1_agreement": 0.9},
}
# Sigmoid's steepest slope is 1/4: logits within 4c move no probability by more than c.
FLOORS = {
    row: {**floors, "max_logit_diff": round(4 * floors["max_prob_diff"], 6)}
    for row, floors in _PROBABILITY_FLOORS.items()
}
PASSED, LOW, UNCHECKED = "passed", "low", "unchecked"
REMEDY = (
    "use --dtype float32, another --engine, or pass --allow-low-fidelity "
    "(ENCODERD_ALLOW_LOW_FIDELITY=1) to serve it anyway"
)


class LowFidelity(Exception):
    """The model computes too far from its float32 reference to be served."""


@dataclass(frozen=True)
class Report:
    status: str  # PASSED, LOW (served: --allow-low-fidelity) or UNCHECKED
    figures: tuple[FidelityFigure, ...]
    inputs: int = 0
    seconds: float = 0.0
    reference_cached: bool = False
    # The served model's speed on the calibration batches (real text, batched as the frontend
    # batches it, after the warm-up): what the frontend's admission counts with until it has
    # measured the worker under load (server/scheduling/admission.py). 0: not measured.
    tokens_per_s: float = 0.0


# ------------------------------------------------------------------ metrics
def precision(dtype: str) -> str:
    """The FLOORS row of a resolved --dtype."""
    if dtype.startswith("int8") or dtype == "float8":  # 8-bit linears, either way (float8_linear.py)
        return "int8"
    return "half" if dtype in ("float16", "bfloat16") else "float32"


def min_cosine(got: np.ndarray, want: np.ndarray) -> float:
    got, want = got.astype(np.float64), want.astype(np.float64)
    norms = np.linalg.norm(got, axis=1) * np.linalg.norm(want, axis=1)
    return float(np.min((got * want).sum(axis=1) / np.maximum(norms, 1e-30)))


def served_scores(logits: np.ndarray, activation: ScoreActivation) -> np.ndarray:
    """What the frontend serves for these logits (server/models/postprocess.py scores): a sigmoid per
    logit, a softmax over the labels, or the logits themselves."""
    logits = logits.astype(np.float64)
    if activation == ScoreActivation.IDENTITY:
        return logits
    if activation == ScoreActivation.SIGMOID:
        return 1 / (1 + np.exp(-logits))
    shifted = np.exp(logits - logits.max(axis=1, keepdims=True))
    return shifted / shifted.sum(axis=1, keepdims=True)


def served_difference(got: np.ndarray, want: np.ndarray, activation: ScoreActivation) -> float:
    """The largest difference of a served score (probability or logit) at these inputs' own scores."""
    return float(np.max(np.abs(served_scores(got, activation) - served_scores(want, activation))))


def max_prob_shift(got: np.ndarray, want: np.ndarray, activation: ScoreActivation) -> float:
    """The most the measured logit errors can move a served probability wherever on the curve a
    score lies: each input's error times the activation's steepest slope (1/4). A sigmoid's
    probability moves by at most |error| / 4; a softmax's by at most (largest - smallest error
    over the labels) / 4, adding one number to every logit changing nothing. The probability
    differences at the set's own scores say less: where those sit in sigmoid's flat tails (a tiny
    deberta-v2 reranker's 48 calibration pairs between logits -11.6 and -0.6), a 0.87 logit error
    showed as 0.011 there and as 0.124 on a holdout pair scored at -0.25 (issue 43)."""
    error = got.astype(np.float64) - want.astype(np.float64)
    spread = error.max(axis=1) - error.min(axis=1) if activation == ScoreActivation.SOFTMAX else np.abs(error)
    return float(np.max(spread)) / 4 if spread.size else 0.0


def kendall_tau(got: np.ndarray, want: np.ndarray) -> float:
    """(concordant - discordant) / all pairs; a pair tied in either ranking counts as neither."""
    got, want = np.ravel(got), np.ravel(want)
    upper = np.triu_indices(len(got), k=1)
    agreement = np.sign(got[:, None] - got[None, :]) * np.sign(want[:, None] - want[None, :])
    return float(agreement[upper].mean()) if len(got) > 1 else 1.0


def top1_agreement(got: np.ndarray, want: np.ndarray) -> float:
    return float(np.mean(got.argmax(axis=1) == want.argmax(axis=1)))


def measure(spec: ModelSpec, got: np.ndarray, want: np.ndarray) -> dict[str, float]:
    """The metrics of what `spec`'s model serves (METRICS, SCORE_METRICS): the backend's outputs
    `got` against the reference `want`."""
    if spec.kind == ModelKind.COLPALI:  # every row of every query and page
        return {"min_cosine": min_cosine(got, want)}
    if spec.kind == ModelKind.EMBEDDING:
        # With Dense modules the backend's outputs are their input (the worker applies them in float32
        # after): all of it counts; without, the served width is a prefix of them.
        width = got.shape[1] if spec.dense else spec.served_width(got.shape[1])
        return {"min_cosine": min_cosine(got[:, :width], want[:, :width])}
    served = served_difference(got, want, spec.score_activation)
    if spec.score_activation != ScoreActivation.IDENTITY:
        served = max(served, max_prob_shift(got, want, spec.score_activation))
    figures = {SCORE_METRICS[spec.score_activation]: served}
    if spec.kind == ModelKind.RERANKER:
        figures["kendall_tau"] = kendall_tau(got[:, 0], want[:, 0])
    else:
        figures["top1_agreement"] = top1_agreement(got, want)
    return figures


def judge(figures: dict[str, float], dtype: str) -> tuple[FidelityFigure, ...]:
    """Each figure with its bound for this dtype and whether it holds."""
    bounds = FLOORS[precision(dtype)]
    judged = []
    for metric, value in figures.items():
        bound = bounds[metric]
        ok = value <= bound if metric in CEILING_METRICS else value >= bound
        judged.append(FidelityFigure(metric, round(value, 6), bound, bool(ok)))
    return tuple(judged)


def describe(figures: tuple[FidelityFigure, ...]) -> str:
    """'min_cosine 0.99712 (floor 0.99)' for the log."""
    return ", ".join(
        f"{f.metric} {f.value:.5f} ({'ceiling' if f.metric in CEILING_METRICS else 'floor'} {f.bound})" for f in figures
    )


# ---------------------------------------------------------------- reference
def reference(
    spec: ModelSpec, batches: list[TokenBatch], cache_dir: str, trust_remote_code: bool = False
) -> tuple[np.ndarray, bool]:
    """The float32 reference outputs of the calibration set, and whether they came from the cache."""
    key = {
        "model": fingerprint_model(spec.path),
        "model_kind": spec.kind.value,
        "pooling": msgspec.json.encode(spec.pooling).decode(),
        "max_length": spec.max_length,
        "calibration": calibration.VERSION,
        # The very tokens: a reference of other ids (another tokenizer build) compares nothing.
        "tokens": _tokens_digest(batches),
        "versions": library_versions("torch", "transformers", "tokenizers"),
    }
    entry = cached_build(
        cache_dir or default_cache_dir(),
        "fidelity",
        f"{spec.name}-reference",
        key,
        lambda out: np.save(out / REFERENCE_FILE, _compute_reference(spec, batches, trust_remote_code)),
    )
    return np.load(entry.path / REFERENCE_FILE), entry.hit


def _tokens_digest(batches: list[TokenBatch]) -> str:
    digest = hashlib.sha256()
    for batch in batches:
        for part in (batch.input_ids, batch.cu_seqlens, batch.token_type_ids):
            digest.update(b"-" if part is None else np.ascontiguousarray(part, dtype=np.int32).tobytes())
    return digest.hexdigest()


def _compute_reference(spec: ModelSpec, batches: list[TokenBatch], trust_remote_code: bool) -> np.ndarray:
    """transformers' own padded forward in float32 on CPU."""
    import inspect

    import torch

    from .backends.base import from_pretrained, padded
    from .backends.torch_heads import model_class
    from .pooling import pool

    log.info("computing the float32 reference of %s for the fidelity self-check (once; cached)", spec.name)
    model = from_pretrained(model_class(spec.kind), spec.path, trust_remote_code, dtype=torch.float32).eval()
    pad_id = model.config.pad_token_id or 0  # decoder classifiers read the last non-pad token
    takes_types = "token_type_ids" in inspect.signature(model.forward).parameters
    from .contract.cpu_cores import cpu_budget

    torch.set_num_threads(cpu_budget().usable)  # not 64 threads in a 2-CPU container
    outputs = []
    with torch.inference_mode():
        for batch in batches:
            ids, mask, types = padded(batch)
            ids[mask == 0] = pad_id
            inputs = {"input_ids": torch.from_numpy(ids), "attention_mask": torch.from_numpy(mask)}
            if takes_types:
                inputs["token_type_ids"] = torch.from_numpy(types if types is not None else np.zeros_like(ids))
            out = model(**inputs)
            if spec.kind == ModelKind.EMBEDDING:
                outputs.append(pool(out.last_hidden_state.numpy(), mask, spec.pooling))
            else:
                outputs.append(out.logits.float().numpy())
    return np.concatenate(outputs).astype(np.float32)


# ------------------------------------------------------- ColPali / ColQwen2
def _retrieval_reference_entry(spec: ModelSpec, options, processor=None):
    """The cache entry of a colpali model's float32 reference rows (computed here on a miss)."""
    from transformers import AutoProcessor

    trust = options.trust_remote_code
    processor = processor or AutoProcessor.from_pretrained(spec.path, trust_remote_code=trust)
    queries = calibration.retrieval_queries()
    key = {
        "model": fingerprint_model(spec.path),
        "model_kind": spec.kind.value,
        "calibration": calibration.VERSION,
        "inputs": hashlib.sha256(repr((queries, calibration.PAGES)).encode()).hexdigest(),
        "versions": library_versions("torch", "transformers", "tokenizers", "pillow", "torchvision"),
    }
    return cached_build(
        options.cache_dir or default_cache_dir(),
        "fidelity",
        f"{spec.name}-reference",
        key,
        lambda out: np.save(
            out / REFERENCE_FILE, _retrieval_reference(spec, processor, queries, calibration.pages(), trust)
        ),
    )


def _retrieval_served(backend, spec: ModelSpec) -> np.ndarray:
    """The served rows of the calibration set: every query's, then every page's."""
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(spec.path, trust_remote_code=backend.options.trust_remote_code)
    queries, pages = calibration.retrieval_queries(), calibration.pages()
    served = [
        backend.forward(calibration.retrieval_query_batch(processor, queries)),
        backend.forward_media(calibration.retrieval_page_batch(processor, pages)),
    ]
    return np.concatenate([rows.values for rows in served])


def _retrieval_reference(spec: ModelSpec, processor, queries: list[str], pages: list, trust: bool) -> np.ndarray:
    """transformers' own loop: model(**processor(...)).embeddings, one input at a time, float32 on CPU."""
    import torch

    from .backends.base import from_pretrained
    from .backends.torch_heads import model_class
    from .contract.cpu_cores import cpu_budget

    log.info("computing the float32 reference of %s for the fidelity self-check (once; cached)", spec.name)
    model = from_pretrained(model_class(spec.kind, spec.model_type), spec.path, trust, dtype=torch.float32).eval()
    torch.set_num_threads(cpu_budget().usable)
    inputs = [processor(text=[query]) for query in queries] + [processor(images=[page]) for page in pages]
    with torch.inference_mode():
        rows = [model(**built).embeddings[0].numpy() for built in inputs]
    return np.concatenate(rows).astype(np.float32)


# ---------------------------------------------------------------- the check
@dataclass(frozen=True)
class Reference:
    """The float32 reference of the calibration set, as prepare_reference found or made it."""

    rows: np.ndarray
    cached: bool  # found in the cache, not computed at this start
    batches: tuple[TokenBatch, ...] = ()  # the calibration batches it is of (colpali builds its own)


def prepare_reference(spec: ModelSpec, options) -> Reference | None:
    """The float32 reference (None for a kind the set does not cover), computed and cached on a miss.

    The worker calls it before the served model loads: the reference loads its own float32 copy of
    the weights, and made beside the served model a start-up held both (a Qwen2-VL-2B-sized ColQwen2
    peaked at ~18 GB in float32). Made first, and its copy freed (and the heap trimmed) before the
    served one loads, the peak is one copy. self_check takes what it returns, so the model files are
    hashed and the set tokenized once a start."""
    if spec.kind not in CHECKED_KINDS:
        return None
    if spec.kind == ModelKind.COLPALI:
        entry = _retrieval_reference_entry(spec, options)
        prepared = Reference(np.load(entry.path / REFERENCE_FILE), entry.hit)
    else:
        batches = calibration.batches(spec, options.max_batch_size, options.trust_remote_code)
        rows, hit = reference(spec, batches, options.cache_dir, options.trust_remote_code)
        prepared = Reference(rows, hit, tuple(batches))
    if not prepared.cached:
        gc.collect()
        memory.trim_heap()
    return prepared


def self_check(
    backend, spec: ModelSpec, allow_low: bool, fallback: str = "", prepared: Reference | None = None
) -> Report:
    """Run the calibration set through `backend`, compare with the reference, log the verdict.

    Below a floor: with `fallback` (a dtype the server chose itself, not the operator) it warns
    that it falls back to that and reports LOW; else raises LowFidelity unless `allow_low` (then
    it warns and reports LOW). `prepared`: the reference prepare_reference made before the model
    loaded (else it is prepared here)."""
    what = f"{spec.name} ({backend.engine} {backend.options.dtype} on {backend.options.device})"
    if spec.kind not in CHECKED_KINDS:
        log.info(
            "fidelity self-check: %s not checked: the calibration set covers embedding, reranker, "
            "classifier and colpali models, not %s",
            what,
            spec.kind.value,
        )
        return Report(UNCHECKED, ())
    started = time.perf_counter()
    prepared = prepared or prepare_reference(spec, backend.options)
    assert prepared is not None  # a checked kind always has one
    if spec.kind == ModelKind.COLPALI:
        got = _retrieval_served(backend, spec)
        inputs = len(calibration.retrieval_queries()) + len(calibration.PAGES)  # the rows are theirs
        tokens_per_s = 0.0  # queries and pages, not token batches: admission keeps its fixed first guess
    else:
        got, tokens_per_s = _served_timed(backend, prepared.batches)
        inputs = len(prepared.rows)
    figures = judge(measure(spec, got, prepared.rows), backend.options.dtype)
    status = PASSED if all(f.passed for f in figures) else LOW
    report = Report(status, figures, inputs, time.perf_counter() - started, prepared.cached, tokens_per_s)
    _log_verdict(report, what, allow_low, fallback)
    return report


def _served_timed(backend, batches: tuple[TokenBatch, ...]) -> tuple[np.ndarray, float]:
    """The served rows of the calibration batches, and the tokens per second they took. On a CPU,
    timed by the process's CPU time over its threads where that is shorter than the wall clock: the
    speed with its cores to itself. A worker loads at --worker-nice beside the other workers' loads
    and whatever else the host runs; on 2 shared Zen 5 cores the wall clock said 1.7-2.1k tokens/s
    for a MiniLM worker that serves 5-11k."""
    wall, cpu = time.perf_counter(), time.process_time()
    got = np.concatenate([backend.forward(batch) for batch in batches])
    seconds = time.perf_counter() - wall
    if backend.options.device == "cpu":
        threads = backend.options.threads or len(os.sched_getaffinity(0))
        seconds = min(seconds, (time.process_time() - cpu) / threads)
    return got, sum(len(batch.input_ids) for batch in batches) / seconds if seconds > 0 else 0.0


def _log_verdict(report: Report, what: str, allow_low: bool, fallback: str = "") -> None:
    reference = "cached" if report.reference_cached else "computed"
    timing = f"{report.inputs} inputs, {report.seconds:.1f}s, reference {reference}"
    if report.tokens_per_s:
        timing += f", served {report.tokens_per_s:,.0f} tokens/s"
    if report.status == PASSED:
        log.info("fidelity self-check passed: %s: %s [%s]", what, describe(report.figures), timing)
        return
    failed = describe(tuple(f for f in report.figures if not f.passed))
    line = f"fidelity self-check FAILED: {what} computes too far from float32: {failed} [{timing}]"
    if fallback:
        log.warning("%s; --dtype auto falls back to %s", line, fallback)
        return
    if not allow_low:
        log.error("%s; not serving it: %s", line, REMEDY)
        raise LowFidelity(f"{line}; {REMEDY}")
    log.warning("%s; serving it anyway (--allow-low-fidelity)", line)
