"""The measurements: bulk (concurrent clients, or one EmbedStream), single queries and rerank calls,
each one target at a time, each giving one Row."""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass, field

import numpy as np

from .corpus import Workload
from .flops import FlopModel
from .metrics import scrape, server_counters
from .options import log
from .processes import CpuProbe, busy
from .targets import GrpcTarget, SentenceTransformersTarget


@dataclass
class Row:
    mode: str
    engine: str
    protocol: str
    inputs_per_s: float = 0.0
    tokens_per_s: float = 0.0
    p50_ms: float = 0.0
    p95_ms: float = 0.0
    p99_ms: float = 0.0
    calls: int = 0
    errors: int = 0
    wall_s: float = 0.0
    padding_ratio: float | None = None
    flop_utilisation: float | None = None
    worker_busy: float | None = None
    frontend_ms_per_input: float | None = None  # the frontend's CPU time per input answered
    cpu_cores: dict = field(default_factory=dict)
    server: dict = field(default_factory=dict)
    notes: str = ""


def percentiles(latencies: list[float], row: Row) -> None:
    if latencies:
        ms = np.array(latencies) * 1e3
        row.p50_ms, row.p95_ms, row.p99_ms = (round(float(np.percentile(ms, q)), 2) for q in (50, 95, 99))


async def _bulk_client(embed, work: Workload, args, state: dict) -> None:
    n = len(work.corpus)
    while time.monotonic() < state["deadline"] and (not args.bulk_requests or state["issued"] < args.bulk_requests):
        k = state["issued"]
        state["issued"] += 1
        idx = [(k * args.batch + j) % n for j in range(args.batch)]  # a sliding window over the shuffled corpus
        t0 = time.monotonic()
        try:
            got = await embed([work.corpus[i] for i in idx])
            ok = got == len(idx)
        except Exception as exc:  # noqa: BLE001 - counted and reported, never fatal: a benchmark keeps going
            ok, state["last_error"] = False, f"{type(exc).__name__}: {str(exc)[:200]}"
        t1 = time.monotonic()
        if not ok:
            state["errors"] += 1
        elif state["window"][0] <= t1 <= state["deadline"]:
            state["done"].append((t1, t1 - t0, len(idx), int(work.real[idx].sum())))


async def _window(state: dict, clients: list, probe: CpuProbe | None) -> tuple[dict, dict | None, dict | None]:
    """Run the clients; snapshot CPU when the measurement window opens and closes; then drain."""
    tasks = [asyncio.ensure_future(c) for c in clients]
    await asyncio.sleep(max(0.0, state["window"][0] - time.monotonic()))
    snap0 = probe.snapshot() if probe else None
    # The window closes at the deadline, or earlier when a request cap drained all clients.
    all_done = asyncio.gather(*tasks)
    with contextlib.suppress(asyncio.TimeoutError):
        await asyncio.wait_for(asyncio.shield(all_done), max(0.0, state["deadline"] - time.monotonic()))
    snap1 = probe.snapshot() if probe else None
    state["closed"] = time.monotonic()
    log(f"  window closed; draining {state['issued']} issued requests")
    await asyncio.wait_for(all_done, 900)  # in-flight work finishes so the next target starts on a quiet server
    return state, snap0, snap1


def _new_state(args) -> dict:
    start = time.monotonic()
    return {
        "issued": 0,
        "errors": 0,
        "done": [],
        "window": (start + args.bulk_warmup, 0.0),
        "deadline": start + args.bulk_warmup + args.bulk_seconds,
    }


async def _bulk(target, work: Workload, args, probe: CpuProbe | None):
    state = _new_state(args)
    async with target.session() as embed:
        return await _window(state, [_bulk_client(embed, work, args, state) for _ in range(args.concurrency)], probe)


async def _stream_bulk(target: GrpcTarget, work: Workload, args, probe: CpuProbe | None):
    """One EmbedStream (the ingestion path): the server's flow-control window paces the upload."""
    state = _new_state(args)
    async with target.aio_stub() as (stub, pb):
        return await _window(state, [_stream_client(stub, pb, target.embed_model, work, args, state)], probe)


async def _stream_client(stub, pb, model: str, work: Workload, args, state: dict) -> None:
    n, sent = len(work.corpus), {}
    cap = args.bulk_requests * args.batch if args.bulk_requests else 10**9
    # grpc.aio drains the request iterator into its send buffers as fast as it can, so the client bounds
    # what it has in flight itself: C x B inputs, as many as the unary clients keep in flight together.
    window = asyncio.Semaphore(args.concurrency * args.batch)

    async def requests():
        while time.monotonic() < state["deadline"] and state["issued"] < cap:
            await window.acquire()
            k = state["issued"]
            state["issued"] += 1
            sent[k] = time.monotonic()
            yield pb.EmbedStreamRequest(model=model if k == 0 else "", id=str(k), input=work.corpus[k % n])

    try:
        async for reply in stub.EmbedStream(requests(), timeout=900):
            window.release()
            t1, k = time.monotonic(), int(reply.id)
            t0 = sent.pop(k, t1)
            if reply.HasField("error"):
                state["errors"], state["last_error"] = state["errors"] + 1, reply.error.message[:200]
            elif state["window"][0] <= t1 <= state["deadline"]:
                state["done"].append((t1, t1 - t0, 1, int(work.real[k % n])))
    except Exception as exc:  # noqa: BLE001 - counted and reported, never fatal: a benchmark keeps going
        state["errors"], state["last_error"] = state["errors"] + 1, f"{type(exc).__name__}: {str(exc)[:200]}"


def run_bulk(
    name: str,
    target,
    work: Workload,
    args,
    probe: CpuProbe | None,
    metrics_url: str | None,
    model: str,
    flops: FlopModel,
    peak: float | None,
    worker_threads: int,
    stream: bool = False,
) -> Row:
    how = "one EmbedStream" if stream else f"{args.concurrency} clients x {args.batch} inputs"
    protocol = "grpc-stream" if stream else target.protocol
    log(
        f"bulk {name}/{protocol}: {how}, "
        + (
            f"{args.bulk_requests * args.batch} inputs"
            if args.bulk_requests
            else f"{args.bulk_warmup:g}s warm-up + {args.bulk_seconds:g}s window"
        )
    )
    before = scrape(metrics_url)
    driver = _stream_bulk if stream else _bulk
    state, snap0, snap1 = asyncio.run(driver(target, work, args, probe))
    row = Row("bulk", name, protocol, errors=state["errors"])
    done = state["done"]
    wall = (min(state["deadline"], state["closed"]) - state["window"][0]) if done else 1.0
    row.calls, row.wall_s = len(done), round(wall, 2)
    row.inputs_per_s = round(sum(d[2] for d in done) / wall, 2)
    row.tokens_per_s = round(sum(d[3] for d in done) / wall, 1)
    percentiles([d[1] for d in done], row)
    row.flop_utilisation = _utilisation(_useful_flops(work, done, flops, wall), peak)
    row.server = server_counters(before, scrape(metrics_url), model)
    row.padding_ratio = row.server.get("padding_ratio")
    if snap0 and snap1:
        row.cpu_cores = CpuProbe.cores(snap0, snap1)
        row.worker_busy = busy(row.cpu_cores, "worker", worker_threads)
        row.frontend_ms_per_input = _per_input_ms(row.cpu_cores.get("frontend"), row.inputs_per_s)
    if state.get("last_error"):
        row.notes = state["last_error"]
    return row


def _per_input_ms(cores: float | None, inputs_per_s: float) -> float | None:
    """CPU milliseconds per input of a process group using `cores` on average at this rate: with it,
    the cores one frontend needs to feed a faster worker (rate x this)."""
    return round(cores / inputs_per_s * 1e3, 4) if cores is not None and inputs_per_s else None


def _useful_flops(work: Workload, done, flops: FlopModel, wall: float) -> float:
    # Per-request FLOPs would need the indices; tokens/s x the corpus' mean FLOPs per real token is exact
    # in expectation because every request is a slice of the same shuffled mix.
    per_token = flops.flops(work.real) / float(work.real.sum())
    return per_token * sum(d[3] for d in done) / wall


def _utilisation(flops_per_second: float, peak: float | None) -> float | None:
    """Useful FLOP/s over the measured matmul peak of the served dtype; None for int8 (no peak measured)."""
    return None if peak is None else round(flops_per_second / (peak * 1e9), 4)


def run_bulk_in_process(
    st: SentenceTransformersTarget, work: Workload, args, flops: FlopModel, peak: float | None, threads: int
) -> Row:
    """The same inputs, in windows of C x B (what a server holds at once), encode() sorting each window."""
    window, n = args.concurrency * args.batch, len(work.corpus)
    total = args.bulk_requests * args.batch if args.bulk_requests else 10**9
    log(f"bulk sentence-transformers/in-process: windows of {window} inputs, batch {args.batch}")
    inputs = tokens = 0
    padding = []
    probe = CpuProbe({})
    snap0 = probe.snapshot()
    for w in range(10_000):  # bounded; stops on the work or the time limit
        idx = [(w * window + j) % n for j in range(min(window, total - inputs))]
        texts = [work.corpus[i] for i in idx]
        st.embed(texts, args.batch)
        inputs, tokens = inputs + len(idx), tokens + int(work.real[idx].sum())
        padding.append(st.padding_ratio(texts, work.real[idx], args.batch))
        if inputs >= total or time.monotonic() - snap0["t"] >= args.bulk_seconds:
            break
    snap1 = probe.snapshot()
    wall = snap1["t"] - snap0["t"]
    row = Row(
        "bulk",
        "sentence-transformers",
        "in-process",
        calls=w + 1,
        wall_s=round(wall, 2),
        inputs_per_s=round(inputs / wall, 2),
        tokens_per_s=round(tokens / wall, 1),
        padding_ratio=round(float(np.mean(padding)), 4),
        cpu_cores=CpuProbe.cores(snap0, snap1),
    )
    row.flop_utilisation = _utilisation(flops.flops(work.real) / float(work.real.sum()) * tokens / wall, peak)
    row.worker_busy = busy(row.cpu_cores, "client", threads)
    return row


@dataclass
class Sequential:
    latencies: list[float]
    errors: int
    last_error: str
    wall: float
    cpu_cores: dict


def _sequential(call, items, probe: CpuProbe | None, warmup: int) -> Sequential:
    for item in items[:warmup]:  # connections, lazy allocations: not measured
        with contextlib.suppress(Exception):
            call(item)
    probe = probe or CpuProbe({})
    snap0 = probe.snapshot()
    latencies, errors, last_error = [], 0, ""
    for item in items:
        t0 = time.perf_counter()
        try:
            call(item)
            latencies.append(time.perf_counter() - t0)
        except Exception as exc:  # noqa: BLE001 - counted and reported, never fatal
            errors, last_error = errors + 1, f"{type(exc).__name__}: {str(exc)[:200]}"
    snap1 = probe.snapshot()
    return Sequential(latencies, errors, last_error, snap1["t"] - snap0["t"], CpuProbe.cores(snap0, snap1))


def run_single(name: str, target, work: Workload, args, probe: CpuProbe | None, threads: int) -> Row:
    log(f"single {name}/{target.protocol}: {args.single_calls} sequential one-query calls")
    items = [work.queries[i % len(work.queries)] for i in range(args.single_calls)]
    run = _sequential(lambda q: target.embed([q]), items, probe, warmup=3)
    tokens = sum(int(work.query_real[i % len(work.queries)]) for i in range(len(run.latencies)))
    row = Row(
        "single",
        name,
        target.protocol,
        calls=len(run.latencies),
        errors=run.errors,
        notes=run.last_error,
        inputs_per_s=round(len(run.latencies) / run.wall, 2),
        tokens_per_s=round(tokens / run.wall, 1),
        cpu_cores=run.cpu_cores,
        worker_busy=busy(run.cpu_cores, "worker", threads),
    )
    percentiles(run.latencies, row)
    return row


def run_rerank(
    name: str, target, work: Workload, args, probe: CpuProbe | None, flops: FlopModel, peak: float | None, threads: int
) -> Row:
    log(f"rerank {name}/{target.protocol}: {args.rerank_calls} sequential calls, query + {args.rerank_docs} passages")
    sets = work.rerank_sets
    run = _sequential(lambda s: target.rerank(s[0], s[1]), sets, probe, warmup=1)
    tokens = np.concatenate([s[2] for s in sets])
    row = Row(
        "rerank",
        name,
        target.protocol,
        calls=len(run.latencies),
        errors=run.errors,
        notes=run.last_error,
        inputs_per_s=round(len(run.latencies) * args.rerank_docs / run.wall, 2),
        tokens_per_s=round(float(tokens.sum()) / run.wall, 1),
        cpu_cores=run.cpu_cores,
        worker_busy=busy(run.cpu_cores, "rerank_worker", threads),
    )
    row.flop_utilisation = _utilisation(flops.flops(tokens) / run.wall, peak)
    percentiles(run.latencies, row)
    return row
