"""One maximum-size call beside other callers' single queries (issue 42, item 3).

    python -m encoderd.bench.fair [--rounds 3] [--big-calls 2] [--rest] [--compare-ref REF] [--serve-args ...]

It starts `encoderd serve` (this checkout; with --compare-ref also the same command from git REF,
exported to a temporary folder) with its default flags, and measures on each server:
  idle    sequential single short queries, nothing else running: p50/p99 (once after the warm-up,
          and again at the start of each round: the round's ratio is against its own);
  solo    --big-calls Embed calls of --max-inputs-per-request (2,048) inputs, one after the other,
          alone: the big call's inputs/s;
  shared  the same big calls while a client sends single queries as in `idle` (a closed loop, on
          its own channel and thread): the queries' p50/p99 and the big calls' inputs/s.
With --rest the servers run with REST on (their Envoy also holds the gRPC port the queries use) and
the big calls are OpenAI's POST /v1/embeddings, answered as JSON floats: the answer's rendering is
the frontend's work too.
Each round runs solo then shared, so the two see the same machine; --rounds N gives N pairs, and
with --compare-ref both servers run at once, their rounds alternated (one of each, then the next),
so both meet about the same load on a shared host; the report puts each round's ratios side by
side: query p99 shared / idle p99, big inputs/s shared / solo. Two servers are compared in both
start orders (the reference started first for the first half of the rounds, then the pair started
again with this checkout first): a pair started once carries its own placement luck (bench.percall
measured A/A gaps of 3-6 %, each in favour of the server started second); each order's medians are
printed before the whole run's table, whose "1st" column says whether a round's server was started
first. Every big call's texts are new (a counter in each), so no result cache or in-flight sharing
shortens one. A benchmark, not a test: it prints a table and asserts nothing.

Where a slow query's time went, per round (a second table):
  * when: the shared queries by when each started against the big call (the first BOUNDARY_S of
    it: tokenizing it, its first batch; the last BOUNDARY_S and after: its answer assembled and
    sent; the middle: its pieces computing), each window's p99 and how many queries took over 2x
    the idle p99 there;
  * cores: what each part of the server used in the solo and the shared phase (as bench.mixed:
    the frontend, the workers' bulk lanes, their other threads with the urgent lanes; the big calls'
    client is a process of its own, BigCaller, counted in "foreign");
  * with --loop-probe, health checks beside the queries (answered by the frontend alone, no
    worker): their p99 idle and shared is the frontend's own lag (its event loop, its cores).
"""

from __future__ import annotations

import argparse
import functools
import http.client
import json
import multiprocessing
import shlex
import sys
import tempfile
import threading
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import grpc
import numpy as np
from grpc_health.v1 import health_pb2, health_pb2_grpc

from ..v1 import encoderd_pb2 as pb
from ..v1 import encoderd_pb2_grpc
from .flood import checkouts
from .mixed import QUERIES, QUERY_GAP_S, query_latencies, server_cpu
from .processes import CpuProbe, Managed, free_port, grpc_serving, serve_command, wait_until

BIG_INPUTS = 2048  # --max-inputs-per-request's default
BOUNDARY_S = 0.5  # the start and end windows of a big call in the "when" table
WORDS = "a maximum size request must not hold the single queries of other callers behind all of its work".split()


def big_texts(call: int, n: int = BIG_INPUTS, seed: int = 0) -> list[str]:
    """`n` texts of 40-90 words (~100 tokens, the request well within --max-request-tokens), unique per call."""
    rng = np.random.default_rng(seed)
    return [f"{call} {i} " + " ".join(rng.choice(WORDS, size=int(rng.integers(40, 90)))) for i in range(n)]


def big_calls(send, calls: int, first: int) -> list[tuple[float, float]]:
    """When each of `calls` big calls (`send` of their texts), one after the other, started and ended
    (perf_counter)."""
    spans = []
    for k in range(calls):
        texts = big_texts(first + k)
        started = time.perf_counter()
        send(texts)
        spans.append((started, time.perf_counter()))
    return spans


def grpc_sender(address: str):
    """A big call as Encoder/Embed, on its own channel."""
    stub = encoderd_pb2_grpc.EncoderStub(grpc.insecure_channel(address))
    return lambda texts: stub.Embed(pb.EmbedRequest(inputs=texts), timeout=600)


def rest_sender(rest_port: int):
    """A big call as OpenAI's POST /v1/embeddings through the server's Envoy, floats as JSON text (the
    API's default encoding_format), read to its end."""

    def send(texts: list[str]) -> None:
        connection = http.client.HTTPConnection("127.0.0.1", rest_port, timeout=600)
        try:
            body = json.dumps({"input": texts}).encode()
            connection.request("POST", "/v1/embeddings", body, {"content-type": "application/json"})
            response = connection.getresponse()
            answer = response.read()
            if response.status != 200:
                raise RuntimeError(f"a big REST call was answered {response.status}: {answer[:300]!r}")
        finally:
            connection.close()

    return send


@functools.cache
def _sender(address: str, rest_port: int | None):
    """The big caller process's sender (one channel or port for all its calls)."""
    return rest_sender(rest_port) if rest_port else grpc_sender(address)


def _big_calls_here(address: str, rest_port: int | None, calls: int, first: int) -> list[tuple[float, float]]:
    return big_calls(_sender(address, rest_port), calls, first)


class BigCaller:
    """The big calls' client: a process of its own, as another caller's is. In the queries' process
    its work (2,048 texts built, their JSON written, a 10 MB answer read) held the GIL for
    milliseconds at a time, which the query thread waited for and counted as the server's latency.
    perf_counter is the system's monotonic clock: the spans it returns compare with the queries'."""

    def __init__(self, address: str, rest_port: int | None):
        self.target = (address, rest_port)
        self.pool = ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn"))

    def calls(self, calls: int, first: int) -> list[tuple[float, float]]:
        return self.pool.submit(_big_calls_here, *self.target, calls, first).result()

    def close(self) -> None:
        self.pool.shutdown()


def took(spans: list[tuple[float, float]]) -> float:
    return sum(end - start for start, end in spans)


class Queries(threading.Thread):
    """Single queries (or, `health`, health checks) in a closed loop until stopped, as
    mixed.query_latencies sends them (their own channel: their own connection); a refused query is
    counted, not timed."""

    def __init__(self, address: str, health: bool = False):
        super().__init__(daemon=True)
        self.address, self.health = address, health
        self.stop = threading.Event()
        self.latencies: list[float] = []
        self.started: list[float] = []  # perf_counter when each timed one was sent
        self.refused: dict[str, int] = {}

    def run(self) -> None:
        with grpc.insecure_channel(self.address, options=[("grpc.use_local_subchannel_pool", 1)]) as channel:
            stub = encoderd_pb2_grpc.EncoderStub(channel)
            health = health_pb2_grpc.HealthStub(channel)
            i = 0
            while not self.stop.is_set():
                i += 1
                started = time.perf_counter()
                try:
                    if self.health:
                        health.Check(health_pb2.HealthCheckRequest(), timeout=60)
                    else:
                        stub.Embed(pb.EmbedRequest(inputs=[f"{QUERIES[i % len(QUERIES)]} {i}"]), timeout=60)
                    self.latencies.append(time.perf_counter() - started)
                    self.started.append(started)
                except grpc.RpcError as exc:
                    self.refused[exc.code().name] = self.refused.get(exc.code().name, 0) + 1
                time.sleep(QUERY_GAP_S)


def pct(values: list[float], q: float) -> float:
    return float(np.percentile(values, q) * 1000) if values else float("nan")


def when(queries: Queries, spans: list[tuple[float, float]], slow_s: float) -> dict:
    """The shared queries by when each started against the big call running then: "start" (its
    first BOUNDARY_S), "end" (its last BOUNDARY_S, and the gap to the next call or the end), or
    "middle"; each window's count, p99, and queries over `slow_s`."""
    windows: dict[str, list[float]] = {"start": [], "middle": [], "end": []}
    for started, latency in zip(queries.started, queries.latencies, strict=True):
        # The big call this query met: the last one that started before the query ended.
        start, end = next(((a, b) for a, b in reversed(spans) if a <= started + latency), spans[0])
        window = "start" if 0 <= started - start < BOUNDARY_S else "middle" if started < end - BOUNDARY_S else "end"
        windows[window].append(latency)
    return {
        name: {"n": len(values), "p99_ms": pct(values, 99), "slow": sum(v > slow_s for v in values)}
        for name, values in windows.items()
    }


def per_cycle(row: dict) -> float | None:
    """The big call's inputs per CPU second of the bulk lanes, shared over solo: 1 when it lost only
    the cycles the queries took (their compute, the frontend, the client), below 1 when each cycle
    it kept did less (smaller batches, gaps, cache misses)."""
    solo, shared = row["cores_solo"].get("bulk lanes"), row["cores_shared"].get("bulk lanes")
    if not solo or not shared:
        return None
    return (row["shared_inputs_per_s"] / shared) / (row["solo_inputs_per_s"] / solo)


def shared_phase(address: str, big: BigCaller, calls: int, first: int, loop_probe: bool):
    """The big calls beside the query loop (and the health loop): their spans and the loops."""
    loops = [Queries(address)] + ([Queries(address, health=True)] if loop_probe else [])
    for loop in loops:
        loop.start()
    time.sleep(0.5)  # the query loop runs before the big call starts
    spans = big.calls(calls, first)
    for loop in loops:
        loop.stop.set()
    for loop in loops:
        loop.join(60)
    return spans, loops[0], loops[1] if loop_probe else None


class Bench:
    """One server's measurements: `warm` (its warm-up and idle phase), then `round` after round;
    `merge` adds the same server's measurements from the other start order."""

    def __init__(self, address: str, rest_port: int | None, cpu: CpuProbe, args, started_first: bool = True):
        self.address, self.cpu, self.args = address, cpu, args
        self.started_first = started_first  # of the pair of servers this run started
        self.stub = encoderd_pb2_grpc.EncoderStub(grpc.insecure_channel(address))
        self.big = BigCaller(address, rest_port)
        self.idle: list[float] = []
        self.idle_health: list[float] = []
        self.rounds: list[dict] = []

    def warm(self) -> None:
        query_latencies(self.stub, 2)
        self.big.calls(1, first=10_000)  # the first big call warms the workers' shapes and the drain rate
        self.idle = query_latencies(self.stub, self.args.idle_seconds, QUERY_GAP_S)
        if self.args.loop_probe:
            health = Queries(self.address, health=True)
            health.start()
            time.sleep(self.args.idle_seconds / 2)
            health.stop.set()
            health.join(60)
            self.idle_health = health.latencies

    def merge(self, other: Bench) -> None:
        self.idle += other.idle
        self.idle_health += other.idle_health
        self.rounds += other.rounds

    def result(self) -> dict:
        out = {"idle_p50_ms": pct(self.idle, 50), "idle_p99_ms": pct(self.idle, 99), "idle_n": len(self.idle)}
        if self.idle_health:
            out["idle_health_p99_ms"] = pct(self.idle_health, 99)
        return {**out, "rounds": self.rounds}

    def round(self, r: int) -> None:
        """Idle queries, the big calls solo, then shared: the round's ratios are against its own idle
        p99 and solo rate, taken minutes apart at most (the host's load drifts more than that)."""
        calls = self.args.big_calls
        idle = query_latencies(self.stub, self.args.idle_seconds, QUERY_GAP_S)
        before = self.cpu.snapshot()
        solo = self.big.calls(calls, first=100 * r)
        middle = self.cpu.snapshot()
        spans, queries, health = shared_phase(self.address, self.big, calls, 100 * r + 50, self.args.loop_probe)
        after = self.cpu.snapshot()
        q, idle_p99 = queries.latencies, pct(idle, 99)
        solo_rate, shared_rate = BIG_INPUTS * calls / took(solo), BIG_INPUTS * calls / took(spans)
        row = {
            "idle_p99_ms": idle_p99,
            "solo_inputs_per_s": solo_rate,
            "shared_inputs_per_s": shared_rate,
            "big_shared_vs_solo": shared_rate / solo_rate,
            "query_p50_ms": pct(q, 50),
            "query_p99_ms": pct(q, 99),
            "query_p99_vs_idle": pct(q, 99) / idle_p99,
            "queries": len(q),
            "queries_failed": queries.refused,
            "when": when(queries, spans, 2 * idle_p99 / 1000),
            "cores_solo": CpuProbe.cores(before, middle),
            "cores_shared": CpuProbe.cores(middle, after),
            "health_p99_ms": pct(health.latencies, 99) if health else None,
            "started_first": self.started_first,
        }
        row["big_per_bulk_cycle"] = per_cycle(row)
        self.rounds.append(row)


def medians(result: dict) -> str:
    """A server's rounds in two numbers: the medians of query p99 / idle p99 and big shared / solo."""
    rounds = result["rounds"]
    p99 = np.median([row["query_p99_vs_idle"] for row in rounds])
    big = np.median([row["big_shared_vs_solo"] for row in rounds])
    return f"query p99/idle {p99:.2f}, big shared/solo {big:.2f} (medians of {len(rounds)} rounds)"


def report(label: str, result: dict) -> None:
    print(
        f"\n{label}: idle single query p50 {result['idle_p50_ms']:.1f} ms, p99 {result['idle_p99_ms']:.1f} ms "
        f"({result['idle_n']} queries)"
    )
    print(
        f"{'round':>5} {'1st':>3} {'idle p99':>8} {'queries':>7} {'q p50 ms':>9} {'q p99 ms':>9} {'p99/idle':>9} "
        f"{'big solo in/s':>13} {'big shared in/s':>15} {'shared/solo':>11}  queries failed"
    )
    for i, row in enumerate(result["rounds"], start=1):
        first = "yes" if row["started_first"] else "no"
        print(
            f"{i:>5} {first:>3} {row['idle_p99_ms']:8.1f} {row['queries']:>7} {row['query_p50_ms']:9.1f} "
            f"{row['query_p99_ms']:9.1f} "
            f"{row['query_p99_vs_idle']:9.2f} {row['solo_inputs_per_s']:13.1f} {row['shared_inputs_per_s']:15.1f} "
            f"{row['big_shared_vs_solo']:11.2f}  {row['queries_failed'] or '-'}"
        )
    print(
        f"  where the time went (slow: over 2x the idle p99; start / end: the big call's first / last {BOUNDARY_S} s)"
    )
    if "idle_health_p99_ms" in result:
        print(f"  health checks (the frontend alone): idle p99 {result['idle_health_p99_ms']:.1f} ms")
    for i, row in enumerate(result["rounds"], start=1):
        windows = "  ".join(
            f"{name} {w['n']} q p99 {w['p99_ms']:.1f} ms, {w['slow']} slow" for name, w in row["when"].items()
        )
        health = f"; health p99 {row['health_p99_ms']:.1f} ms" if row["health_p99_ms"] is not None else ""
        print(f"  {i}: {windows}{health}")
        for phase in ("solo", "shared"):
            cores = ", ".join(f"{k} {v:.2f}" for k, v in row[f"cores_{phase}"].items())
            print(f"     cores {phase:>6}: {cores}")
        if row["big_per_bulk_cycle"] is not None:
            print(f"     big inputs per bulk-lane CPU second, shared / solo: {row['big_per_bulk_cycle']:.2f}")


def run(servers: list[tuple[str, str | None]], serve_args: list[str], logs: Path, args) -> dict[str, dict]:
    """Each server's results; two servers are run in both start orders, the reference first for the
    first half of the rounds (the odd one of an odd count), each order's medians printed."""
    if len(servers) == 1:
        return {label: bench.result() for label, bench in run_servers(servers, serve_args, logs, args).items()}
    first_half = (args.rounds + 1) // 2
    orders = [
        run_servers(servers, serve_args, logs / "reference-first", args, first_half),
        run_servers(servers[::-1], serve_args, logs / "this-first", args, args.rounds - first_half),
    ]
    for order, started in zip(orders, ("the reference", "this checkout"), strict=True):
        print(f"{started} started first: " + "; ".join(f"{k}: {medians(b.result())}" for k, b in order.items()))
    for label, bench in orders[0].items():
        bench.merge(orders[1][label])
    return {label: bench.result() for label, bench in orders[0].items()}


def run_servers(
    servers: list[tuple[str, str | None]], serve_args: list[str], logs: Path, args, rounds: int | None = None
) -> dict[str, Bench]:
    """All servers up at once, started in the order given, their rounds alternated (one round of
    each, then the next), so each round of each meets about the same load on a shared host."""
    rounds = args.rounds if rounds is None else rounds
    logs.mkdir(parents=True, exist_ok=True)
    started: dict[str, tuple[Managed, str, int | None]] = {}
    benches: dict[str, Bench] = {}
    try:
        for label, checkout in servers:
            address = f"127.0.0.1:{free_port()}"
            rest_port = free_port() if args.rest else None
            rest = ["--rest-port", str(rest_port)] if rest_port else ["--no-rest"]
            argv = [*serve_command(checkout), *rest, "--grpc-port", address.rpartition(":")[2], *serve_args]
            env = {"PYTHONPATH": checkout} if checkout else {}
            log_path = logs / f"{label.replace(' ', '-')}.log"
            started[label] = (Managed(label, argv, log_path, env=env, cwd=checkout).start(), address, rest_port)
        for label, (server, address, rest_port) in started.items():
            wait_until(lambda address=address: grpc_serving(address), label, server, timeout=300)
            first = label == servers[0][0]
            benches[label] = Bench(address, rest_port, server_cpu(server.pid), args, started_first=first)
        for bench in benches.values():
            bench.warm()
        for r in range(rounds):
            for label, bench in benches.items():
                print(f"[fair] {label}: round {r + 1} of {rounds} ({args.big_calls} big calls)", file=sys.stderr)
                bench.round(r)
        return benches
    finally:
        for bench in benches.values():
            bench.big.close()
        for server, _, _ in started.values():
            server.stop()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--rounds",
        type=int,
        default=3,
        help="solo / shared pairs per server, with --compare-ref over both start orders (default: %(default)s)",
    )
    parser.add_argument("--big-calls", type=int, default=2, help="big calls per phase (default: %(default)s)")
    parser.add_argument("--idle-seconds", type=float, default=10, help="length of the idle query phase")
    parser.add_argument("--compare-ref", help="also run the server of this git ref (e.g. a commit before a change)")
    parser.add_argument("--serve-args", default="", help="extra `encoderd serve` flags for every server")
    parser.add_argument(
        "--loop-probe", action="store_true", help="health checks beside the queries: the frontend's own lag"
    )
    parser.add_argument(
        "--rest",
        action="store_true",
        help="the big calls as REST POST /v1/embeddings (JSON floats) through the server's Envoy; the queries "
        "stay gRPC (through the same Envoy)",
    )
    parser.add_argument("--json", type=Path, help="write the results here")
    args = parser.parse_args(argv)
    if args.rounds < (2 if args.compare_ref else 1):
        parser.error("--rounds must be at least 1, and 2 with --compare-ref (a round in each start order)")
    logs = Path(tempfile.mkdtemp(prefix="encoderd-fair-"))
    serve_args = shlex.split(args.serve_args)
    servers = checkouts(args.compare_ref)
    results = run(servers, serve_args, logs, args)
    for label, result in results.items():
        report(label, result)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
