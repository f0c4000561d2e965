"""Refusal under a flood (issue 16, finding 2; issue 42, item 2): how fast a probe hears
RESOURCE_EXHAUSTED while many clients keep the server overloaded, how long the calls it accepted
took, and whether health checks were answered meanwhile.
Over 400 lines on purpose: one benchmark (servers, flood clients, probes, report) that one command
runs end to end; nothing else imports it.

    python -m encoderd.bench.flood [--clients 640] [--inputs 4] [--seconds 20] [--own-connections] [--floor]
                                   [--compare-ref REF] [--front MAX_REQUESTS] [--gateway MAX_IN_FLIGHT]
                                   [--flood-nice N] [--rest] [--max-queued-inputs N (0: the server's)]
                                   [--honour-retry-after] [--client-processes N]

Issue 42's floods, with the server's default flags:
    python -m encoderd.bench.flood --max-queued-inputs 0 --clients 600 --inputs 32
    python -m encoderd.bench.flood --max-queued-inputs 0 --clients 500 --inputs 32 --rest --client-processes 4

It starts `encoderd serve` (this checkout; with --compare-ref also the same command from git REF,
exported to a temporary folder) and, for each server in turn:
  idle    the probe alone: sequential one-input Embed calls, p50/p99;
  flood   C clients (in their own process, so the probe's own client loop is never the queue),
          each sending 4-input Embed calls back to back, while the probe (on a connection of its
          own) sends one call every 20 ms: the latency of its RESOURCE_EXHAUSTED answers, p50/p99.
          gRPC shares one TCP connection among a process's channels to the same address, so the
          C clients are C concurrent streams on one connection; with --own-connections each
          client opens its own (C connections, as C separate hosts would).
With --front N, each server is measured twice: directly, then with the probe and the flood
going through the shipped gRPC front (deploy/envoy/front.yaml, its limit of calls in flight
set to N): Envoy refuses past N itself, and the server sees at most N calls at a time. The
front runs one Envoy worker thread (--front-workers): on one small host it shares the cores
with the server, the flood and the probe.
Without --gateway each server runs with --no-rest: its gRPC port is the Python server's own.
With --gateway N, each server is also started as `encoderd serve` runs by default, REST on: its
own Envoy holds the gRPC port and passes calls to the server (`--rest-max-in-flight N`), the
same refusal before Python as the front's, with nothing to deploy (a ref from before that
layout has its Python server on the gRPC port either way).
The report counts the probe's refusals that Envoy answered itself ("by Envoy", with their p99):
the others passed its limit and the server refused them.
--flood-nice N runs the flood's process N nicer, as clients on other machines would not take
the server's cores (on one small host they do).
With --rest the flood (and the probe) send OpenAI `POST /v1/embeddings` calls through the server's
Envoy, REST on with its default --rest-max-in-flight: a refusal is HTTP 429. Each REST flood client
holds a connection (an httpx client) of its own; --client-processes N spreads the flood's clients
over N processes, an event loop each (one Python loop driving 500 REST clients, not the server, set
the pace: a refusal "took" seconds while Envoy had 7 requests in flight).
By default a refused flood client calls again at once, as issue 42's flood does: N such clients
keep the frontend busy refusing, and a refusal then takes about N / (refusals per second) (Little's
law), whatever one refusal costs. With --honour-retry-after each waits what the refusal's
retry-after trailer (REST: Retry-After header) asks, plus up to half again, as the Python client's
RetryPolicy does: the refusal rate falls to about N / retry-after, and so does the loop's queue.
Every flood call's latency is kept by its outcome: the report gives the accepted calls' p50/p99/max
(and, from their server-timing, their latency less their own compute: issue 42's bound is that
within --max-queue-wait)
and the refused ones' p50/p99 as the flood's clients saw them (their own event loop's delay
included), beside the probe's; "steady": the refusals of the calls sent after the flood's first
burst (every client's first call at once), while the probe ran; the accepted calls are also
given apart, those of the first burst (sent in its first second) and those of the steady state.
REST: how long Envoy waited for
the frontend's refusals (x-envoy-upstream-service-time), so the hop's share is seen. The frontend's
CPU time (and its Envoy's) per flood call, whatever its outcome, is steadier than a latency on a
shared host. A health checker (gRPC Health/Check; REST: GET /health) asks every
100 ms during the flood: how many it asked, how many were answered SERVING / 200, their p99.
Phases alternate between the servers (ref, this, ref, this), so both see the same machine load.
--floor also floods bench.grpc_floor, a grpc.aio server that refuses every call at once and does
nothing else, with the same clients (its retry-after: --floor-retry-after): the floor under the
refusal latencies, what grpc.aio and the clients themselves cost on this host. The first burst's
refusals are reported apart (p50/p99), as a retry policy does not change them.
A benchmark, not a test: it prints a table and asserts nothing.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import multiprocessing
import os
import random
import shlex
import ssl
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
from pathlib import Path

import grpc
import numpy as np
from grpc_health.v1 import health_pb2, health_pb2_grpc

from ..clients.errors import retry_after
from ..gateway.envoy import find_envoy
from ..v1 import encoderd_pb2 as pb
from ..v1 import encoderd_pb2_grpc
from .front import front_command, front_config
from .processes import Managed, cpu_seconds, descendant_named, free_port, grpc_serving, serve_command, wait_until

REPO_ROOT = Path(__file__).resolve().parents[1]
WORDS = "refusal under load must arrive at once while the queue is full of other work".split()


def _texts(n: int, seed: int) -> list[str]:
    rng = np.random.default_rng(seed)
    return [" ".join(rng.choice(WORDS, size=60)) for _ in range(n)]


def _count(counts: dict, outcome: str, started: float, timing: str | None = None) -> None:
    """One flood call's outcome: counted, and kept as (when it was sent, from the flood's start;
    its latency), so the report can tell the flood's first burst from its steady state. An answered
    call's server-timing (`timing`) also keeps its latency less its own compute (WAITED: what issue
    42 bounds by --max-queue-wait), the server's part of that (SERVER_WAITED) and the compute."""
    latency = time.monotonic() - started
    counts[outcome] = counts.get(outcome, 0) + 1
    sent_at = started - counts["began"]
    counts["latency"].setdefault(outcome, []).append((sent_at, latency))
    steps = server_timing(timing)
    if "compute" in steps:
        counts["latency"].setdefault(WAITED, []).append((sent_at, latency - steps["compute"]))
        counts["latency"].setdefault(SERVER_WAITED, []).append((sent_at, steps["total"] - steps["compute"]))
        counts["latency"].setdefault(COMPUTED, []).append((sent_at, steps["compute"]))


WAITED, SERVER_WAITED, COMPUTED = "OK less compute", "OK server less compute", "OK compute"


def server_timing(header: str | None) -> dict[str, float]:
    """A server-timing value (`queue;dur=1.2, compute;dur=3.4, total;dur=5.0`, ms) as seconds by name."""
    steps = {}
    for part in (header or "").split(","):
        name, _, duration = part.strip().partition(";dur=")
        if duration:
            steps[name] = float(duration) / 1000
    return steps


# A client that honours retry-after waits what the server asked, plus up to this share of it more
# (as the Python client's RetryPolicy does: clients refused together do not all return together).
RETRY_AFTER_JITTER = 0.5


async def _back_off(retry_after: float | None, honour: bool, stop_at: float) -> None:
    """After a refusal: a polite client waits what the server asked (never past the flood's end)."""
    if honour and retry_after:
        delay = retry_after * (1 + RETRY_AFTER_JITTER * random.random())
        await asyncio.sleep(max(0.0, min(delay, stop_at - time.monotonic())))


def _refused(counts: dict, retry_after: float | None) -> None:
    """Counts a refusal that said when to come back (a retry-after trailer, REST's Retry-After)."""
    if retry_after is not None:
        counts["with retry-after"] = counts.get("with retry-after", 0) + 1


def _next_texts(counts: dict, texts: list[str]) -> list[str]:
    """The next call's inputs, distinct from every other call's of every flood process (identical
    inputs would be computed once)."""
    counts["sent"] += 1
    return [f"{counts['tag']}.{counts['sent']} {t}" for t in texts]


async def _flood_client(
    address: str, stop_at: float, texts: list[str], counts: dict, own_connection: bool, honour: bool
) -> None:
    options = [("grpc.use_local_subchannel_pool", 1)] if own_connection else []
    async with grpc.aio.insecure_channel(address, options=options) as channel:
        stub = encoderd_pb2_grpc.EncoderStub(channel)
        while time.monotonic() < stop_at:
            request = pb.EmbedRequest(inputs=_next_texts(counts, texts))
            started = time.monotonic()
            try:
                call = stub.Embed(request, timeout=30)
                await call
                _count(counts, "OK", started, dict(await call.trailing_metadata()).get("server-timing"))
            except grpc.aio.AioRpcError as exc:
                _count(counts, exc.code().name, started)
                if exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
                    _refused(counts, retry_after(exc))
                await _back_off(retry_after(exc), honour, stop_at)


# HTTP statuses by the gRPC code names the report uses for both.
HTTP_OUTCOMES = {200: "OK", 429: "RESOURCE_EXHAUSTED", 503: "UNAVAILABLE", 504: "DEADLINE_EXCEEDED"}


async def _rest_flood_client(
    rest_url: str, stop_at: float, texts: list[str], counts: dict, honour: bool, tls: ssl.SSLContext
) -> None:
    """One REST caller on a keep-alive HTTP/1.1 connection of its own, spoken over asyncio streams.
    The flood's clients share the server's cores on one host, so what a call costs them is taken from
    the server: an httpx client per caller spent ~1 ms of its process's CPU a call (and one client's
    pool of hundreds of connections, scanned on every request, 65 % of it). `tls`: one context for all
    of a process's clients (each loading the CA store took ~100 ms)."""
    url = urllib.parse.urlsplit(rest_url)
    connection: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None = None
    try:
        while time.monotonic() < stop_at:
            if connection is None:
                connection = await asyncio.open_connection(
                    url.hostname, url.port, ssl=tls if url.scheme == "https" else None
                )
            body = json.dumps({"input": _next_texts(counts, texts)}).encode()
            started = time.monotonic()
            try:
                status, headers = await asyncio.wait_for(
                    http_exchange(*connection, http_request(url.netloc, "/v1/embeddings", body)), 30
                )
            except (TimeoutError, OSError, asyncio.IncompleteReadError, ValueError) as exc:
                # wait_for's TimeoutError is counted by what it means, not as an OSError.
                _count(counts, "client timeout" if isinstance(exc, TimeoutError) else type(exc).__name__, started)
                _close(connection)
                connection = None
                continue
            _count(counts, HTTP_OUTCOMES.get(status, f"HTTP {status}"), started, headers.get("server-timing"))
            if headers.get("connection") == "close":
                _close(connection)
                connection = None
            if status in (429, 503):
                asked = _seconds(headers.get("retry-after"))
                if status == 429:
                    _refused(counts, asked)
                    _upstream_time(counts, headers.get("x-envoy-upstream-service-time"))
                await _back_off(asked, honour, stop_at)
    finally:
        _close(connection)


def http_request(host: str, path: str, body: bytes, method: str = "POST") -> bytes:
    """One HTTP/1.1 request with a JSON body (for http_exchange)."""
    head = f"{method} {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
    return f"{head}Content-Length: {len(body)}\r\n\r\n".encode() + body


async def http_exchange(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, request: bytes) -> tuple[int, dict]:
    """Send one HTTP/1.1 request, read its whole response: the status and the headers (names in
    lower case); the body is read (Content-Length or chunked) and dropped."""
    writer.write(request)
    status_line = await reader.readline()
    if not status_line:
        raise asyncio.IncompleteReadError(b"", None)
    status = int(status_line.split()[1])
    headers = {}
    while (line := await reader.readline()) not in (b"\r\n", b"\n", b""):
        name, _, value = line.decode("latin-1").partition(":")
        headers[name.strip().lower()] = value.strip()
    if "content-length" in headers:
        await reader.readexactly(int(headers["content-length"]))
    elif headers.get("transfer-encoding", "").lower() == "chunked":
        while size := int((await reader.readline()).split(b";")[0], 16):
            await reader.readexactly(size + 2)  # the chunk and its CRLF
        await reader.readline()  # the CRLF after the last (empty) chunk
    return status, headers


def _close(connection: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None) -> None:
    if connection is not None:
        connection[1].close()


def _upstream_time(counts: dict, header: str | None) -> None:
    """Keeps how long Envoy waited for the frontend's refusal (its x-envoy-upstream-service-time,
    ms), as a latency of the outcome "upstream": the rest of the refusal's time was spent in
    Envoy, the network and the client's own event loop. Refusals Envoy made itself have none."""
    if header and header.isdigit():
        counts["latency"].setdefault("upstream", []).append((0.0, int(header) / 1000))


def _seconds(header: str | None) -> float | None:
    """Retry-After's delay-seconds form (the only one encoderd sends), else None."""
    try:
        return float(header) if header else None
    except ValueError:
        return None


@dataclasses.dataclass(frozen=True)
class Flood:
    """What a flood sends: `clients` callers in all, run on `processes` event loops (processes of
    their own), each sending `inputs`-input calls back to back from `began` (time.monotonic(), the
    same clock in every process) until `stop_at`; over REST (`rest_url`) or gRPC (`address`)."""

    address: str
    clients: int
    began: float
    stop_at: float
    inputs: int
    rest_url: str = ""
    honour: bool = False
    own_connections: bool = False
    nice: int = 0
    processes: int = 1

    def share(self, index: int) -> int:
        """How many of the clients process `index` runs."""
        return self.clients // self.processes + (index < self.clients % self.processes)


def _flood_process(flood: Flood, index: int, out) -> None:
    """Process `index`'s share of the flood's clients on one event loop; sends its counts back.
    With `rest_url`, REST clients on a connection each; with `honour`, each waits what a refusal's
    retry-after asks before its next call."""
    os.nice(flood.nice)
    counts: dict = {"sent": 0, "tag": index, "began": flood.began, "latency": {}}
    texts = _texts(flood.inputs, seed=5)
    clients = flood.share(index)
    tls = ssl.create_default_context()

    async def main():
        if flood.rest_url:
            await asyncio.gather(
                *(
                    _rest_flood_client(flood.rest_url, flood.stop_at, texts, counts, flood.honour, tls)
                    for _ in range(clients)
                )
            )
        else:
            await asyncio.gather(
                *(
                    _flood_client(flood.address, flood.stop_at, texts, counts, flood.own_connections, flood.honour)
                    for _ in range(clients)
                )
            )

    asyncio.run(main())
    del counts["tag"], counts["began"]
    out.put(counts)


def _merged(parts: list[dict]) -> dict:
    """The flood processes' counts as one: numbers added, latency lists joined."""
    merged: dict = {"latency": {}}
    for part in parts:
        for outcome, values in part.pop("latency").items():
            merged["latency"].setdefault(outcome, []).extend(values)
        for key, value in part.items():
            merged[key] = merged.get(key, 0) + value
    return merged


# What both Envoys say when they refuse past their limit of calls in flight (gateway/envoy.py,
# deploy/envoy/front.yaml); the server's own refusals name its queue bound instead.
ENVOY_REFUSAL = "in flight is reached"


def _rest_client(rest_url: str):
    """An httpx client that keeps its connection (None without REST): a new client per call would
    load the CA store and connect again each time, ~50-100 ms that the REST probe and health
    checker counted as the server's."""
    import httpx

    return httpx.Client(base_url=rest_url, trust_env=False) if rest_url else None


def _embed_one(stub, rest, text: str) -> tuple[str, str]:
    """(outcome, message) of a one-input call: over gRPC, or with `rest` (an httpx client), REST's
    POST /v1/embeddings."""
    if rest:
        response = rest.post("/v1/embeddings", json={"input": [text]}, timeout=30)
        message = response.json().get("error", {}).get("message", "") if response.status_code != 200 else ""
        return HTTP_OUTCOMES.get(response.status_code, f"HTTP {response.status_code}"), message
    try:
        stub.Embed(pb.EmbedRequest(inputs=[text]), timeout=30)
        return "OK", ""
    except grpc.RpcError as exc:
        return exc.code().name, exc.details() or ""


def _probe(
    stub, seconds: float, pause: float, rest=None
) -> tuple[list[float], list[float], list[float], dict[str, int]]:
    """(refusal latencies, those of the refusals Envoy answered, served latencies, other answers by
    status) of one-input calls sent every `pause` seconds."""
    refused: list[float] = []
    by_envoy: list[float] = []
    served: list[float] = []
    other: dict[str, int] = {}
    deadline = time.monotonic() + seconds
    i = 0
    while time.monotonic() < deadline:
        i += 1
        started = time.perf_counter()
        outcome, message = _embed_one(stub, rest, f"probe {i} {time.time()}")
        if outcome == "OK":
            served.append(time.perf_counter() - started)
        elif outcome == "RESOURCE_EXHAUSTED":
            refused.append(time.perf_counter() - started)
            if ENVOY_REFUSAL in message:
                by_envoy.append(refused[-1])
        else:
            other[outcome] = other.get(outcome, 0) + 1
        time.sleep(pause)
    return refused, by_envoy, served, other


class HealthChecker(threading.Thread):
    """Asks for health every `pause` seconds until stopped: gRPC Health/Check, or REST GET /health."""

    def __init__(self, address: str, rest_url: str = "", pause: float = 0.1):
        super().__init__(daemon=True)
        self.address, self.rest_url, self.pause = address, rest_url, pause
        self.stop = threading.Event()
        self.answered: list[float] = []  # latencies of SERVING / 200 answers
        self.asked = 0

    def _healthy(self, health, rest) -> bool:
        if rest:
            return rest.get("/health", timeout=5).status_code == 200
        return health.Check(health_pb2.HealthCheckRequest(), timeout=5).status == health_pb2.HealthCheckResponse.SERVING

    def run(self) -> None:
        rest = _rest_client(self.rest_url)
        with grpc.insecure_channel(self.address, options=[("grpc.use_local_subchannel_pool", 1)]) as channel:
            health = health_pb2_grpc.HealthStub(channel)
            while not self.stop.wait(self.pause):
                self.asked += 1
                started = time.perf_counter()
                try:
                    if self._healthy(health, rest):
                        self.answered.append(time.perf_counter() - started)
                except Exception:  # noqa: BLE001 - an unanswered check is what this counts
                    pass
        if rest:
            rest.close()


def _processes_to_watch(server_pid: int) -> dict[str, int]:
    """The frontend (the server's own process) and, where REST is on, its Envoy (a descendant named
    envoy): the CPU each spends per flood call is what a refusal costs it, steadier than latency
    on a shared host."""
    envoy = descendant_named(server_pid, "envoy")
    return {"frontend": server_pid} | ({"envoy": envoy} if envoy else {})


def _pct(values: list[float], q: float) -> float | None:
    return round(float(np.percentile(values, q) * 1000), 1) if values else None


# The flood runs this long before the probe starts: its connections open and the queue fills. Its
# calls sent from then on are its steady state, after the first burst of every client at once.
SETTLE_S = 5.0


def _latencies(timed: list[tuple[float, float]], since: float = 0.0, until: float = float("inf")) -> list[float]:
    """The latencies of the calls sent `since` seconds into the flood or later (and before `until`)."""
    return [latency for sent_at, latency in timed if since <= sent_at < until]


# The flood's first burst: every client's first call, sent together as its processes start.
FIRST_BURST_S = 1.0


def measure(address: str, seconds: float, flood: Flood, server_pid: int = 0) -> dict:
    """One flood phase: the probe idle, then the flood (its processes), the probe and the health
    checker together; the flood's clients, probe and checker ask `address` (REST: `flood.rest_url`)."""
    rest_url = flood.rest_url
    channel = grpc.insecure_channel(address)
    stub = encoderd_pb2_grpc.EncoderStub(channel)
    rest = _rest_client(rest_url)
    _, _, idle, _ = _probe(stub, 3, 0.02, rest)
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    began = time.monotonic()
    flood = dataclasses.replace(flood, began=began, stop_at=began + SETTLE_S + seconds + 1)
    processes = [ctx.Process(target=_flood_process, args=(flood, i, out), daemon=True) for i in range(flood.processes)]
    health = HealthChecker(address, rest_url)
    watched = _processes_to_watch(server_pid) if server_pid else {}
    cpu_before = {name: cpu_seconds(pid) for name, pid in watched.items()}
    for process in processes:
        process.start()
    health.start()
    time.sleep(SETTLE_S)
    refused, by_envoy, served, other = _probe(stub, seconds, 0.02, rest)
    counts = _merged([out.get(timeout=seconds + 120) for _ in processes])
    cpu = {name: cpu_seconds(pid) - cpu_before[name] for name, pid in watched.items()}
    health.stop.set()
    health.join(30)
    for process in processes:
        process.join(30)
    channel.close()
    if rest:
        rest.close()
    latency = counts.pop("latency")
    accepted, turned_away = latency.get("OK", []), latency.get("RESOURCE_EXHAUSTED", [])
    steady = _latencies(turned_away, SETTLE_S)
    upstream = _latencies(latency.get("upstream", []))
    return {
        "idle_p50_ms": _pct(idle, 50),
        "idle_p99_ms": _pct(idle, 99),
        "refused": len(refused),
        "served": len(served),
        "served_p50_ms": _pct(served, 50),  # admitted: queued behind the flood's admitted work
        "probe_other": other,
        "refusal_p50_ms": _pct(refused, 50),
        "refusal_p99_ms": _pct(refused, 99),
        "refusal_max_ms": _pct(refused, 100),
        "by_envoy": len(by_envoy),  # the rest passed Envoy's limit and the server refused them
        "by_envoy_p99_ms": _pct(by_envoy, 99),
        "flood": counts,
        "flood_ok_p50_ms": _pct(_latencies(accepted), 50),
        "flood_ok_p99_ms": _pct(_latencies(accepted), 99),
        "flood_ok_max_ms": _pct(_latencies(accepted), 100),
        # the accepted calls apart: the first burst's (admitted before any answer calibrated the
        # rate) and the steady state's (sent while the probe ran), whose tails have different causes
        "burst_ok": len(_latencies(accepted, 0.0, FIRST_BURST_S)),
        "burst_ok_p99_ms": _pct(_latencies(accepted, 0.0, FIRST_BURST_S), 99),
        "steady_ok": len(_latencies(accepted, SETTLE_S)),
        "steady_ok_p50_ms": _pct(_latencies(accepted, SETTLE_S), 50),
        "steady_ok_p99_ms": _pct(_latencies(accepted, SETTLE_S), 99),
        # issue 42's bound, call by call: an accepted call's latency less its own compute (its
        # server-timing), and the server's part of that (tokenizing, queueing, the frontend)
        "waited_p50_ms": _pct(_latencies(latency.get(WAITED, [])), 50),
        "waited_p99_ms": _pct(_latencies(latency.get(WAITED, [])), 99),
        "waited_max_ms": _pct(_latencies(latency.get(WAITED, [])), 100),
        "server_waited_p99_ms": _pct(_latencies(latency.get(SERVER_WAITED, [])), 99),
        "server_waited_max_ms": _pct(_latencies(latency.get(SERVER_WAITED, [])), 100),
        "computed_p50_ms": _pct(_latencies(latency.get(COMPUTED, [])), 50),
        "computed_p99_ms": _pct(_latencies(latency.get(COMPUTED, [])), 99),
        "flood_refused_p50_ms": _pct(_latencies(turned_away), 50),
        "flood_refused_p99_ms": _pct(_latencies(turned_away), 99),
        # the first burst's refusals: every client's first call at once, refused in turn by one loop
        "burst_refused": len(_latencies(turned_away, 0.0, FIRST_BURST_S)),
        "burst_refused_p50_ms": _pct(_latencies(turned_away, 0.0, FIRST_BURST_S), 50),
        "burst_refused_p99_ms": _pct(_latencies(turned_away, 0.0, FIRST_BURST_S), 99),
        # after the first burst (every client's first call at once): the refusals sent while the probe ran
        "steady_refused": len(steady),
        "steady_refused_p50_ms": _pct(steady, 50),
        "steady_refused_p99_ms": _pct(steady, 99),
        "upstream_p50_ms": _pct(upstream, 50),  # REST: of the refusals, the time Envoy waited for the frontend
        "upstream_p99_ms": _pct(upstream, 99),
        # CPU per flood call (ms), whatever its outcome: the frontend's, and its Envoy's (REST on)
        **{f"{name}_cpu_ms_per_call": round(1000 * used / max(1, counts["sent"]), 3) for name, used in cpu.items()},
        "health_asked": health.asked,
        "health_answered": len(health.answered),
        "health_p99_ms": _pct(health.answered, 99),
    }


def export_ref(ref: str) -> Path:
    """`git archive REF` of this repository, laid out as an importable `encoderd` package (the
    mapping of pyproject.toml's package-dir) in a temporary folder."""
    root = Path(tempfile.mkdtemp(prefix="encoderd-ref-"))
    source = root / "source"
    source.mkdir()
    archive = subprocess.run(["git", "-C", str(REPO_ROOT), "archive", ref], check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(source)], input=archive, check=True)
    package = root / "encoderd"
    package.mkdir()
    for name, path in (
        ("server", "server"),
        ("workers", "workers"),
        ("gateway", "gateway"),
        ("clients", "clients"),
        ("v1", "protos/encoderd/v1"),
    ):
        (package / name).symlink_to(source / path)
    return root


def checkouts(compare_ref: str | None) -> list[tuple[str, str | None]]:
    """(label, exported folder or None for this checkout) of each side a benchmark compares: git
    `compare_ref`'s first (export_ref), then this checkout."""
    this: list[tuple[str, str | None]] = [("this checkout", None)]
    return [(f"ref {compare_ref}", str(export_ref(compare_ref))), *this] if compare_ref else this


def start_server(
    label: str,
    pythonpath: str | None,
    serve_args: list[str],
    logs: Path,
    envoy_limit: int | None = None,
    rest: bool = False,
) -> tuple[Managed, str, str]:
    """The server, its gRPC address and its REST URL ("" without REST): with `envoy_limit` or `rest`,
    as `encoderd serve` runs by default (its Envoy on the gRPC port; --rest-max-in-flight
    `envoy_limit`, else the default); otherwise --no-rest (the server's own port)."""
    port, rest_port = free_port(), free_port()
    rest_args = ["--rest-port", str(rest_port)] if envoy_limit or rest else ["--no-rest"]
    if envoy_limit:
        rest_args += ["--rest-max-in-flight", str(envoy_limit)]
    argv = [*serve_command(pythonpath), *rest_args, "--grpc-port", str(port), *serve_args]
    env = {"PYTHONPATH": pythonpath} if pythonpath else {}
    server = Managed(label, argv, logs / f"{label}.log", env=env, cwd=pythonpath or None).start()
    address = f"127.0.0.1:{port}"
    wait_until(lambda: grpc_serving(address), label, server, timeout=300)
    return server, address, f"http://127.0.0.1:{rest_port}" if rest else ""


def start_front(address: str, max_requests: int, workers: int, logs: Path, label: str) -> tuple[Managed, str]:
    """The shipped gRPC front before the server at `address`, refusing past `max_requests` calls."""
    port = free_port()
    config = logs / f"{label}-front.json"  # JSON is YAML too; Envoy reads it by the extension
    server_port = int(address.rpartition(":")[2])
    config.write_text(json.dumps(front_config([server_port], port, free_port(), max_requests)))
    front = Managed(f"{label}-front", front_command(find_envoy(), config, workers), logs / f"{label}-front.log").start()
    front_address = f"127.0.0.1:{port}"
    wait_until(lambda: grpc_serving(front_address), f"{label} front", front, timeout=60)
    return front, front_address


def report(rows: list[dict]) -> None:
    report_probe(rows)
    f = lambda v: "-" if v is None else f"{v:.1f}"  # noqa: E731
    print(
        f"\n{'server':<22} {'flood OK':>8} {'OK p50':>8} {'OK p99':>8} {'OK max':>8} {'refused':>8} "
        f"{'ref p50':>8} {'ref p99':>8} {'steady':>8} {'its p50':>8} {'its p99':>8} {'retry-after':>11} "
        f"{'timeouts':>8} {'health answered':>15} {'its p99':>7}"
    )
    for r in rows:
        c = r["flood"]
        health = f"{r['health_answered']}/{r['health_asked']}"
        timeouts = c.get("DEADLINE_EXCEEDED", 0) + c.get("client timeout", 0)
        print(
            f"{r['server']:<22} {c.get('OK', 0):>8} {f(r['flood_ok_p50_ms']):>8} {f(r['flood_ok_p99_ms']):>8} "
            f"{f(r['flood_ok_max_ms']):>8} {c.get('RESOURCE_EXHAUSTED', 0):>8} {f(r['flood_refused_p50_ms']):>8} "
            f"{f(r['flood_refused_p99_ms']):>8} {r['steady_refused']:>8} {f(r['steady_refused_p50_ms']):>8} "
            f"{f(r['steady_refused_p99_ms']):>8} {c.get('with retry-after', 0):>11} {timeouts:>8} "
            f"{health:>15} {f(r['health_p99_ms']):>7}"
        )
    print(
        "steady: the flood's refusals sent after its first burst (while the probe ran); retry-after: "
        "its refusals that said when to come back; timeouts: DEADLINE_EXCEEDED and client timeouts"
    )
    for r in rows:
        cpu = [
            f"{name} {r[f'{name}_cpu_ms_per_call']:.3f} ms"
            for name in ("frontend", "envoy")
            if f"{name}_cpu_ms_per_call" in r
        ]
        print(
            f"{r['server']}: in the first burst {r['burst_refused']} refused (p50 {f(r['burst_refused_p50_ms'])}, "
            f"p99 {f(r['burst_refused_p99_ms'])} ms) and {r['burst_ok']} accepted (p99 {f(r['burst_ok_p99_ms'])} ms); "
            f"accepted in the steady state {r['steady_ok']} (p50 {f(r['steady_ok_p50_ms'])}, "
            f"p99 {f(r['steady_ok_p99_ms'])} ms)"
        )
        if r.get("waited_p99_ms") is not None:
            print(
                f"{r['server']}: accepted calls less their own compute (server-timing): p50 {f(r['waited_p50_ms'])}, "
                f"p99 {f(r['waited_p99_ms'])}, max {f(r['waited_max_ms'])} ms; of it in the server p99 "
                f"{f(r['server_waited_p99_ms'])}, max {f(r['server_waited_max_ms'])} ms; their compute p50 "
                f"{f(r['computed_p50_ms'])}, p99 {f(r['computed_p99_ms'])} ms"
            )
        if cpu:
            print(f"{r['server']}: CPU per flood call: {', '.join(cpu)}")
        if r.get("upstream_p50_ms") is not None:
            print(
                f"{r['server']}: of its refusals' time, Envoy waited for the frontend p50 "
                f"{r['upstream_p50_ms']:.1f} ms, p99 {r['upstream_p99_ms']:.1f} ms (x-envoy-upstream-service-time)"
            )


def report_probe(rows: list[dict]) -> None:
    print(
        f"{'server':<22} {'idle p50':>8} {'idle p99':>8} {'refused':>7} {'served':>6} {'served p50':>10} "
        f"{'refusal p50':>11} {'refusal p99':>11} {'max':>7} {'by Envoy':>8} {'its p99':>7}  "
        "probe's other answers; flood counts"
    )
    for r in rows:
        f = lambda v: "-" if v is None else f"{v:.1f}"  # noqa: E731
        print(
            f"{r['server']:<22} {f(r['idle_p50_ms']):>8} {f(r['idle_p99_ms']):>8} {r['refused']:>7} "
            f"{r['served']:>6} {f(r['served_p50_ms']):>10} {f(r['refusal_p50_ms']):>11} "
            f"{f(r['refusal_p99_ms']):>11} {f(r['refusal_max_ms']):>7} {r['by_envoy']:>8} "
            f"{f(r['by_envoy_p99_ms']):>7}  {r['probe_other'] or '-'}; {r['flood']}"
        )


def _flood_one_server(args, label: str, path: str | None, serve_args: list[str], logs: Path, envoy_limit) -> list[dict]:
    """One server started, measured on each way in (its gRPC port; through the front), stopped."""
    name = label.replace(" ", "-") + ("-envoy" if envoy_limit else "") + ("-rest" if args.rest else "")
    server, address, rest_url = start_server(name, path, serve_args, logs, envoy_limit, args.rest)
    front = None
    rows = []
    try:
        targets = [(f"{label} + Envoy" if envoy_limit else f"{label}, REST" if args.rest else label, address)]
        if args.front and not envoy_limit:  # the same server, direct and through the front
            front, front_address = start_front(address, args.front, args.front_workers, logs, name)
            targets.append((f"{label} + front", front_address))
        for target, at in targets:
            how = "REST" if args.rest else "own connections" if args.own_connections else "one shared connection"
            how += ", honouring retry-after" if args.honour_retry_after else ""
            print(
                f"[flood] {target}: {args.clients} clients x {args.inputs} inputs, {how}, {args.seconds:g}s",
                file=sys.stderr,
            )
            flood = Flood(
                at,
                args.clients,
                began=0.0,
                stop_at=0.0,  # measure() sets both when it starts the flood
                inputs=args.inputs,
                rest_url=rest_url,
                honour=args.honour_retry_after,
                own_connections=args.own_connections,
                nice=args.flood_nice,
                processes=args.client_processes,
            )
            row = measure(at, args.seconds, flood, server.pid)
            rows.append({"server": target, **row})
    finally:
        if front:
            front.stop()
        server.stop()
    return rows


def _flood_floor(args, logs: Path) -> dict:
    """The same flood on bench.grpc_floor (a grpc.aio server that refuses every call at once)."""
    port = free_port()
    argv = [sys.executable, "-m", "encoderd.bench.grpc_floor", str(port), "--retry-after", str(args.floor_retry_after)]
    floor = Managed("grpc-floor", argv, logs / "grpc-floor.log").start()
    address = f"127.0.0.1:{port}"
    try:
        wait_until(lambda: grpc_serving(address), "the floor server", floor, timeout=60)
        print(f"[flood] grpc.aio floor: {args.clients} clients x {args.inputs} inputs", file=sys.stderr)
        flood = Flood(
            address,
            args.clients,
            began=0.0,
            stop_at=0.0,
            inputs=args.inputs,
            honour=args.honour_retry_after,
            own_connections=args.own_connections,
            nice=args.flood_nice,
            processes=args.client_processes,
        )
        return {"server": "grpc.aio floor", **measure(address, args.seconds, flood, floor.pid)}
    finally:
        floor.stop()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", type=int, default=640, help="flood clients (default: %(default)s)")
    parser.add_argument("--seconds", type=float, default=20, help="probe time per flood phase")
    parser.add_argument("--rounds", type=int, default=1, help="flood phases per server (alternating)")
    parser.add_argument("--inputs", type=int, default=4, help="inputs per flood call (default: %(default)s)")
    parser.add_argument(
        "--rest",
        action="store_true",
        help="flood and probe with REST POST /v1/embeddings through the server's Envoy (default --rest-max-in-flight)",
    )
    parser.add_argument(
        "--max-queued-inputs", type=int, default=64, help="the servers' bound (0: their default; default: %(default)s)"
    )
    parser.add_argument(
        "--honour-retry-after",
        action="store_true",
        help="flood clients wait what a refusal's retry-after / Retry-After asks (plus up to half again) "
        "before their next call, as the Python client does; default: they call again at once",
    )
    parser.add_argument(
        "--client-processes",
        type=int,
        default=1,
        help="run the flood's clients in this many processes, an event loop each (default: %(default)s; "
        "one loop driving 500 REST connections is itself the bottleneck)",
    )
    parser.add_argument(
        "--own-connections", action="store_true", help="one TCP connection per flood client (default: one shared)"
    )
    parser.add_argument(
        "--front",
        type=int,
        metavar="MAX_REQUESTS",
        help="go through the shipped gRPC front (deploy/envoy/front.yaml) with this limit of calls in flight",
    )
    parser.add_argument(
        "--gateway",
        type=int,
        metavar="MAX_IN_FLIGHT",
        help="also measure the default layout (REST on: the server's Envoy holds its gRPC port), "
        "with --rest-max-in-flight this",
    )
    parser.add_argument(
        "--front-workers",
        type=int,
        default=1,
        help="the front's Envoy worker threads (--concurrency; default: %(default)s)",
    )
    parser.add_argument(
        "--flood-nice",
        type=int,
        default=0,
        help="run the flood's process this much nicer (clients elsewhere do not take the server's cores)",
    )
    parser.add_argument("--compare-ref", help="also run the server of this git ref (e.g. a commit before a change)")
    parser.add_argument(
        "--floor",
        action="store_true",
        help="also flood bench.grpc_floor, a grpc.aio server that refuses every call at once (gRPC floods only): "
        "what grpc.aio and the flood's own clients cost",
    )
    parser.add_argument(
        "--floor-retry-after", type=int, default=1, help="the floor's retry-after trailer (default: %(default)s s)"
    )
    parser.add_argument("--serve-args", default="", help="extra `encoderd serve` flags for every server")
    parser.add_argument("--json", type=Path, help="write the rows here")
    args = parser.parse_args(argv)
    if args.floor and (args.rest or args.front or args.gateway):
        parser.error("--floor floods gRPC on a server's own port: not with --rest, --front or --gateway")
    bound = ["--max-queued-inputs", str(args.max_queued_inputs)] if args.max_queued_inputs else []
    serve_args = [*bound, *shlex.split(args.serve_args)]
    logs = Path(tempfile.mkdtemp(prefix="encoderd-flood-"))
    servers = checkouts(args.compare_ref)
    rows = []
    for _ in range(args.rounds):
        for label, path in servers:  # the reference first
            for envoy_limit in (None, args.gateway) if args.gateway else (None,):
                rows += _flood_one_server(args, label, path, serve_args, logs, envoy_limit)
        if args.floor:
            rows.append(_flood_floor(args, logs))
    report(rows)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
