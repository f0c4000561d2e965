"""Interactive queries while bulk ingestion saturates the server (issue #9's benchmark).

    python -m encoderd.bench.mixed [--seconds 15] [--rounds 3] [--query-gap 0.02] [--serve-args "--dtype bfloat16"]

It starts its own `encoderd serve` (or uses --target HOST:PORT) and measures, one
phase after the other on the same server:
  idle         sequential single short queries, nothing else running: p50/p95;
  bulk solo    one EmbedStream of mixed-length chunks (priority bulk): inputs/s, tokens/s;
  mixed        both at once: the queries' p50/p95 and the stream's throughput;
  bulk solo again  the stream alone once more: bulk/solo is against the mean of both solo runs
               (in inputs/s, and in words/s, which does not depend on which chunks a window held);
  mixed-fifo   the same, with the stream sent at interactive priority: what a one-queue
               engine (Infinity, TEI) does to live queries.
With --rounds N, N pairs of bulk solo and mixed run before the last solo, each mixed round is
compared with the solo runs on either side of it, and a summary gives the median and range of
each goal's figure over the rounds: one window moves by several percent on a shared host.
For a server it starts, a second table says where the cores went in each phase (from /proc): the
frontend, the workers' bulk lanes (their SCHED_IDLE threads, under the default --worker-nice), the
workers' other threads (urgent lanes, receivers), this benchmark's own clients, and anything else
("foreign"). "bulk CPU/solo" next to "bulk/solo": when the two match, the stream lost the cycles
the queries took (their compute, the frontend, their client), not throughput per cycle. On one
2-core host the queries' cost comes out of the stream's, so its share is bounded by what they use.
A benchmark, not a test: it prints its tables and asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import tempfile
import threading
import time
from pathlib import Path

import grpc
import numpy as np

from ..clients.bulk import embed_iterable
from ..v1 import encoderd_pb2 as pb
from ..v1 import encoderd_pb2_grpc
from ..workers.contract.corpus import chunk_corpus
from .processes import (
    CpuProbe,
    Managed,
    free_port,
    grpc_serving,
    process_tree,
    serve_command,
    thread_stats,
    wait_until,
)

QUERY_GAP_S = 0.02  # from one query's answer to the next: ~33 queries/s at a 10 ms answer
QUERIES = [
    "what is a cross encoder",
    "best laptop for travel",
    "weather in paris",
    "how do embeddings work",
    "symptoms of flu",
    "python async tutorial",
    "cheap flights to tokyo",
    "define entropy",
]


class BulkStream(threading.Thread):
    """Streams chunks until stopped; counts results per second of wall time."""

    def __init__(self, address: str, chunks: list[str], priority: int):
        super().__init__(daemon=True)
        self.address, self.chunks, self.priority = address, chunks, priority
        self.stop = threading.Event()
        self.done_at: list[float] = []
        self.words: list[int] = []  # per result: its input's length (the chunks' lengths vary widely)

    def _items(self):
        i = 0
        while not self.stop.is_set():
            yield f"{i}", f"{i} " + self.chunks[i % len(self.chunks)]  # unique: no dedup shortcut
            i += 1

    def run(self) -> None:
        with grpc.insecure_channel(self.address) as channel:
            for result in embed_iterable(channel, self._items(), progress=False, priority=self.priority):
                self.done_at.append(time.perf_counter())
                self.words.append(1 + len(self.chunks[int(result.id) % len(self.chunks)].split()))
                if self.stop.is_set():
                    break

    def rate(self, start: float, end: float) -> float:
        return sum(start <= t < end for t in self.done_at) / (end - start)

    def word_rate(self, start: float, end: float) -> float:
        """Words of the inputs done per second: unlike inputs/s, blind to which chunks a window held."""
        return sum(w for t, w in zip(self.done_at, self.words, strict=True) if start <= t < end) / (end - start)


def query_latencies(stub, seconds: float, gap: float = QUERY_GAP_S, refused: list[float] | None = None) -> list[float]:
    """One short query after another, `gap` seconds after each answer (a closed loop: its rate is
    1 / (gap + latency)). With `refused`, a query the server refuses as overloaded is added there
    (its latency) instead of ending the run: mixed-fifo's stream fills the queue queries wait in."""
    latencies, i = [], 0
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        started = time.perf_counter()
        try:
            stub.Embed(pb.EmbedRequest(inputs=[f"{QUERIES[i % len(QUERIES)]} {i}"]))
            latencies.append(time.perf_counter() - started)
        except grpc.RpcError as exc:
            if refused is None or exc.code() != grpc.StatusCode.RESOURCE_EXHAUSTED:
                raise
            refused.append(time.perf_counter() - started)
        i += 1
        time.sleep(gap)  # users, not a load generator
    return latencies


def pct(values: list[float], q: float) -> float:
    return float(np.percentile(values, q) * 1000) if values else float("nan")


def server_cpu(server_pid: int) -> CpuProbe:
    """CPU groups of a server we started: frontend, workers' bulk lanes, workers' other threads."""
    workers = [p for p in process_tree(server_pid) if p != server_pid]
    groups: dict[str, list[int | str]] = {
        "frontend": [server_pid],
        "bulk lanes": list(thread_stats(workers, idle=True)),
        "workers, rest": list(thread_stats(workers, idle=False)),
    }
    return CpuProbe(groups)


def phase_names(rounds: int) -> list[str]:
    """The phases in the order they run: idle, then `rounds` pairs of a solo and a mixed phase,
    one more solo (every mixed phase has a solo on each side), and mixed-fifo."""
    if rounds == 1:
        return ["idle", "bulk solo", "mixed", "bulk solo again", "mixed-fifo"]
    pairs = [name for r in range(1, rounds + 1) for name in (f"bulk solo {r}", f"mixed {r}")]
    return ["idle", *pairs, f"bulk solo {rounds + 1}", "mixed-fifo"]


def run_phases(
    address: str, seconds: float, cpu: CpuProbe | None = None, rounds: int = 1, gap: float = QUERY_GAP_S
) -> list[dict]:
    """Each phase's results, in the order of phase_names(rounds)."""
    stub = encoderd_pb2_grpc.EncoderStub(grpc.insecure_channel(address))
    chunks = chunk_corpus(2000)
    query_latencies(stub, 2)  # warm up
    cpu = cpu or CpuProbe({})
    before = cpu.snapshot()
    latencies = query_latencies(stub, seconds, gap)
    phases: list[dict] = [
        {"phase": "idle", "query_ms": latencies, "seconds": seconds, "cpu": CpuProbe.cores(before, cpu.snapshot())}
    ]
    for phase in phase_names(rounds)[1:]:
        priority = pb.PRIORITY_INTERACTIVE if phase == "mixed-fifo" else pb.PRIORITY_BULK
        stream = BulkStream(address, chunks, priority)
        stream.start()
        time.sleep(3)  # reach steady state
        start, before = time.perf_counter(), cpu.snapshot()
        refused: list[float] = []
        if phase.startswith("mixed"):
            latencies = query_latencies(stub, seconds, gap, refused)
        else:
            time.sleep(seconds)
            latencies = []
        end, after = time.perf_counter(), cpu.snapshot()
        stream.stop.set()
        stream.join(timeout=60)
        phases.append(
            {
                "phase": phase,
                "query_ms": latencies,
                "refused": len(refused),
                "seconds": end - start,
                "bulk_inputs_per_s": stream.rate(start, end),
                "bulk_words_per_s": stream.word_rate(start, end),
                "cpu": CpuProbe.cores(before, after),
            }
        )
        time.sleep(1)
    return phases


def solo_reference(phases: list[dict], index: int, value) -> float | None:
    """What phases[index] is compared with: for a mixed round, the mean of `value` over the solo runs
    just before and after it (a host whose speed drifts, or a server still warming up, then biases
    neither side); for any other phase, the mean over every solo run. None without a solo run."""
    solos = [i for i, p in enumerate(phases) if p["phase"].startswith("bulk solo")]
    if phases[index]["phase"].startswith("mixed") and phases[index]["phase"] != "mixed-fifo":
        solos = [i for i in solos if abs(i - index) == 1] or solos
    values = [value(phases[i]) for i in solos]
    return float(np.mean(values)) if values and all(v is not None for v in values) else None


def _ratio(value: float | None, reference: float | None) -> float | None:
    return value / reference if value is not None and reference else None


def report(phases: list[dict]) -> list[dict]:
    rows = []
    idle_p95 = pct(phases[0]["query_ms"], 95)
    for i, r in enumerate(phases):
        q = r["query_ms"]
        bulk = r.get("bulk_inputs_per_s")
        rows.append(
            {
                "phase": r["phase"],
                "queries": len(q),
                "refused": r.get("refused", 0),
                "queries_per_s": len(q) / r["seconds"],
                "p50_ms": pct(q, 50),
                "p95_ms": pct(q, 95),
                "p95_vs_idle": pct(q, 95) / idle_p95 if q else None,
                "bulk_inputs_per_s": bulk,
                "bulk_vs_solo": _ratio(bulk, solo_reference(phases, i, lambda p: p.get("bulk_inputs_per_s"))),
                "bulk_words_vs_solo": _ratio(
                    r.get("bulk_words_per_s"), solo_reference(phases, i, lambda p: p.get("bulk_words_per_s"))
                ),
            }
        )
    print(
        f"{'phase':<16} {'queries':>7} {'refused':>7} {'q/s':>5} {'p50 ms':>8} {'p95 ms':>8} {'p95/idle':>9}"
        f" {'bulk in/s':>10} {'bulk/solo':>9} {'words/solo':>10}"
    )
    for row in rows:
        fmt = lambda v, f: (f % v) if isinstance(v, float) else "-"  # noqa: E731
        print(
            f"{row['phase']:<16} {row['queries']:>7} {row['refused']:>7} {row['queries_per_s']:5.1f} "
            f"{fmt(row['p50_ms'], '%8.1f'):>8} {fmt(row['p95_ms'], '%8.1f'):>8} "
            f"{fmt(row['p95_vs_idle'], '%9.2f'):>9} {fmt(row['bulk_inputs_per_s'], '%10.1f'):>10} "
            f"{fmt(row['bulk_vs_solo'], '%9.2f'):>9} {fmt(row['bulk_words_vs_solo'], '%10.2f'):>10}"
        )
    report_cpu(phases, rows)
    summarize_rounds(rows)
    return rows


CPU_GROUPS = ("frontend", "bulk lanes", "workers, rest", "client", "foreign")


def report_cpu(phases: list[dict], rows: list[dict]) -> None:
    """Cores per group and phase (a server this bench started only); adds them to `rows`."""
    if "bulk lanes" not in phases[0]["cpu"]:
        return
    print(f"\ncores used       {' '.join(f'{g:>13}' for g in CPU_GROUPS)} {'bulk CPU/solo':>13}")
    for i, (row, r) in enumerate(zip(rows, phases, strict=True)):
        row["cpu_cores"] = r["cpu"]
        # No SCHED_IDLE threads (--worker-nice 0): the bulk lanes count under "workers, rest", no share.
        lanes = solo_reference(phases, i, lambda p: p["cpu"]["bulk lanes"])
        row["bulk_cpu_vs_solo"] = _ratio(r["cpu"]["bulk lanes"], lanes)
        streamed = r.get("bulk_inputs_per_s") is not None and row["bulk_cpu_vs_solo"] is not None
        share = f"{row['bulk_cpu_vs_solo']:13.2f}" if streamed else f"{'-':>13}"
        cores = " ".join(f"{r['cpu'][g]:13.2f}" for g in CPU_GROUPS)
        print(f"{row['phase']:<16} {cores} {share}")


def summarize_rounds(rows: list[dict]) -> dict | None:
    """With several mixed rounds: the median and range of each goal's figure over them (one
    10-second window moves by several percent on a shared host; a median of rounds much less)."""
    mixed = [row for row in rows if row["phase"].startswith("mixed ")]
    if len(mixed) < 2:
        return None
    summary = {}
    print(f"\nover {len(mixed)} mixed rounds: median (min-max)")
    for key, label in (
        ("p95_vs_idle", "query p95 / idle p95"),
        ("bulk_vs_solo", "stream vs solo, inputs/s"),
        ("bulk_words_vs_solo", "stream vs solo, words/s"),
        ("bulk_cpu_vs_solo", "bulk-lane CPU vs solo"),
    ):
        values = [row[key] for row in mixed if row.get(key) is not None]
        if values:
            summary[key] = float(np.median(values))
            print(f"  {label:<26} {summary[key]:.2f} ({min(values):.2f}-{max(values):.2f})")
    return summary


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=15, help="length of each measured phase")
    parser.add_argument("--target", help="HOST:PORT of a running encoderd (default: start one)")
    parser.add_argument("--serve-args", default="", help="extra `encoderd serve` flags for the server it starts")
    parser.add_argument(
        "--rounds", type=int, default=1, help="solo / mixed pairs, each mixed round against the solo runs beside it"
    )
    parser.add_argument(
        "--query-gap",
        type=float,
        default=QUERY_GAP_S,
        help="seconds from one query's answer to the next (sets the query rate; their CPU is the stream's loss)",
    )
    parser.add_argument("--json", type=Path, help="write the results here")
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    if args.query_gap < 0:
        parser.error("--query-gap must be at least 0")
    server, address = None, args.target
    if not address:
        address = f"127.0.0.1:{free_port()}"
        argv = [
            *serve_command(),
            "--no-rest",
            "--grpc-port",
            address.rpartition(":")[2],
            *shlex.split(args.serve_args),
        ]
        server = Managed("encoderd", argv, Path(tempfile.mkdtemp()) / "encoderd.log").start()
    try:
        if server:
            wait_until(lambda: grpc_serving(address), "encoderd", server, timeout=300)
        rows = report(
            run_phases(address, args.seconds, server_cpu(server.pid) if server else None, args.rounds, args.query_gap)
        )
    finally:
        if server:
            server.stop()
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
