"""What one short query costs: CPU of the frontend, the workers (and Envoy over REST) per call, and
its latency (issue 42 item 3, issue 47 goal 4).

    python -m encoderd.bench.percall [--compare-ref REF] [--queries 3000] [--block 100] [--rest]

It starts `encoderd serve` with its default flags (this checkout; with --compare-ref also the same
command from git REF, exported to a temporary folder), both at once, and sends each the same
sequential single short queries (bench.mixed's QUERIES, numbered so no result cache answers one)
in blocks of --block, alternating between the servers block by block, so both meet about the same
load on a shared host. Two servers are compared in both start orders, half the queries each (the
reference started first, then this checkout first), and each order's ratios are printed before the
whole run's: a pair of servers started once carries its own placement luck, which one order alone
counts as the change's (A/A runs of one commit against itself on a 2-vCPU Zen 4 VM read p50 0.95-1.06
and frontend CPU 0.95-1.08 with one order; each gap over 3 % favoured the server started second).
Each block's CPU seconds come from /proc (utime + stime, all threads):
  frontend  the `encoderd serve` process (gRPC, tokenizing, batching, the answer);
  workers   its other processes (the model workers; the idle zygote adds nothing);
  envoy     with --rest, its Envoy (JSON <-> gRPC), and the queries go to POST /v1/embeddings.
Per call = the blocks' CPU seconds over their calls. Latency p50/p99 is the client's, each call
timed alone. --gap seconds between calls (default 0: back to back; a gap lets caches go cold as
a real query stream does). --varied pads the queries with 0-49 extra words in turn, so their token
counts cycle over ~50 values, as real queries' do: the workers' GEMMs are built per token count
(oneDNN primitives, workers/memory.py bounds their caches), and a stream of ever-new counts
rebuilds them. A benchmark, not a test: it prints a table and asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import tempfile
import time
from pathlib import Path

import grpc
import numpy as np

from ..v1 import encoderd_pb2 as pb
from ..v1 import encoderd_pb2_grpc
from .flood import checkouts, start_server
from .mixed import QUERIES
from .processes import Managed, cpu_seconds, process_tree

WARM_UP = 200  # calls per server before measuring: first shapes, the drain-rate estimate
VARIED_WORDS = 50  # --varied: 0..49 extra words per query, in turn
FILLER = "and more about the same thing".split()


class Target:
    """One running server: how to send it a query, and its processes by part."""

    def __init__(self, label: str, server: Managed, address: str, rest_url: str, varied: bool = False):
        self.label, self.server, self.varied = label, server, varied
        self.stub = encoderd_pb2_grpc.EncoderStub(grpc.insecure_channel(address))
        self.rest = None
        if rest_url:
            import httpx

            self.rest = httpx.Client(base_url=rest_url, trust_env=False)
        self.latencies: list[float] = []
        self.cpu = {"frontend": 0.0, "workers": 0.0, "envoy": 0.0}
        self.calls = 0
        self.sent = 0

    def parts(self) -> dict[str, list[int]]:
        """The server's processes now, by part (a worker that restarted is found again)."""
        tree = process_tree(self.server.pid)
        envoy = [p for p in tree if _comm(p) == "envoy"]
        workers = [p for p in tree if p != self.server.pid and p not in envoy]
        return {"frontend": [self.server.pid], "workers": workers, "envoy": envoy}

    def query(self) -> None:
        self.sent += 1
        text = f"{QUERIES[self.sent % len(QUERIES)]} {self.sent}"
        if self.varied:
            extra = self.sent % VARIED_WORDS
            text += "".join(f" {FILLER[k % len(FILLER)]}" for k in range(extra))
        if self.rest is not None:
            response = self.rest.post("/v1/embeddings", json={"input": [text]}, timeout=60)
            response.raise_for_status()
        else:
            self.stub.Embed(pb.EmbedRequest(inputs=[text]), timeout=60)

    def block(self, calls: int, gap: float) -> None:
        """`calls` timed queries, their CPU added to the totals."""
        parts = self.parts()
        before = {name: sum(cpu_seconds(p) for p in pids) for name, pids in parts.items()}
        for _ in range(calls):
            started = time.perf_counter()
            self.query()
            self.latencies.append(time.perf_counter() - started)
            if gap:
                time.sleep(gap)
        for name, pids in parts.items():
            self.cpu[name] += sum(cpu_seconds(p) for p in pids) - before[name]
        self.calls += calls

    def merge(self, other: Target) -> None:
        """Add another run's calls of the same server (the other start order)."""
        self.latencies += other.latencies
        self.cpu = {name: seconds + other.cpu[name] for name, seconds in self.cpu.items()}
        self.calls += other.calls

    def result(self) -> dict:
        ms = np.array(self.latencies) * 1000
        per_call = {f"{name}_cpu_ms": 1000 * seconds / self.calls for name, seconds in self.cpu.items()}
        return {
            "server": self.label,
            "calls": self.calls,
            "p50_ms": float(np.percentile(ms, 50)),
            "p99_ms": float(np.percentile(ms, 99)),
            **per_call,
        }


def _comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


def run(servers: list[tuple[str, str | None]], serve_args: list[str], args) -> list[dict]:
    """One server's results; or two servers' over both start orders, each order's ratios printed."""
    if len(servers) == 1:
        return [t.result() for t in measure(servers, serve_args, args, args.queries)]
    half = max(args.block, args.queries // 2)
    orders = [measure(servers, serve_args, args, half), measure(servers[::-1], serve_args, args, half)[::-1]]
    for (a, b), started in zip(orders, ("the reference", "this checkout"), strict=True):
        print(f"{started} started first: {b.label} / {a.label}: {ratios(a.result(), b.result())}")
    for mine, theirs in zip(*orders, strict=True):
        mine.merge(theirs)
    return [t.result() for t in orders[0]]


def measure(servers: list[tuple[str, str | None]], serve_args: list[str], args, queries: int) -> list[Target]:
    """The servers started in the order given, then measured block by block, alternated."""
    logs = Path(tempfile.mkdtemp(prefix="encoderd-percall-"))
    targets: list[Target] = []
    try:
        for label, checkout in servers:
            name = label.replace(" ", "-")
            server, address, rest_url = start_server(name, checkout, serve_args, logs, rest=args.rest)
            targets.append(Target(label, server, address, rest_url, args.varied))
        for target in targets:
            for _ in range(WARM_UP):
                target.query()
        blocks = max(1, queries // args.block)
        for b in range(blocks):
            # ABAB... then BABA...: neither server always runs right after the other's block
            for target in targets if b % 2 == 0 else reversed(targets):
                target.block(args.block, args.gap)
        return targets
    finally:
        for target in targets:
            target.server.stop()


def report(rows: list[dict], rest: bool) -> None:
    print(f"\nsingle short query over {'REST (Envoy)' if rest else 'gRPC'}, CPU per call")
    header = f"{'server':<24} {'calls':>6} {'p50 ms':>7} {'p99 ms':>7} {'frontend ms':>11} {'workers ms':>10}"
    print(header + (f" {'envoy ms':>8}" if rest else ""))
    for r in rows:
        line = (
            f"{r['server']:<24} {r['calls']:>6} {r['p50_ms']:7.2f} {r['p99_ms']:7.2f} "
            f"{r['frontend_cpu_ms']:11.3f} {r['workers_cpu_ms']:10.3f}"
        )
        print(line + (f" {r['envoy_cpu_ms']:8.3f}" if rest else ""))
    if len(rows) == 2:
        a, b = rows
        print(f"{b['server']} / {a['server']}: {ratios(a, b)}")


def ratios(a: dict, b: dict) -> str:
    """b's CPU per call and latencies over a's."""
    return ", ".join(
        f"{key.removesuffix('_ms').removesuffix('_cpu')} {b[key] / a[key]:.2f}"
        for key in ("frontend_cpu_ms", "workers_cpu_ms", "p50_ms", "p99_ms")
        if a[key]
    )


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--queries", type=int, default=3000, help="timed calls per server, over both orders (default: %(default)s)"
    )
    parser.add_argument("--block", type=int, default=100, help="calls per block (default: %(default)s)")
    parser.add_argument("--gap", type=float, default=0.0, help="seconds between calls (default: back to back)")
    parser.add_argument("--rest", action="store_true", help="POST /v1/embeddings through Envoy instead of gRPC")
    parser.add_argument("--varied", action="store_true", help="queries of ~50 token counts in turn, not ~10 tokens")
    parser.add_argument("--compare-ref", help="also run the server of this git ref (e.g. a commit before a change)")
    parser.add_argument("--serve-args", default="", help="extra `encoderd serve` flags for every server")
    parser.add_argument("--json", type=Path, help="write the results here")
    args = parser.parse_args(argv)
    if args.block < 1 or args.queries < 1:
        parser.error("--queries and --block must be at least 1")
    servers = checkouts(args.compare_ref)
    rows = run(servers, shlex.split(args.serve_args), args)
    report(rows, args.rest)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
