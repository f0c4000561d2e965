"""What one big call costs end to end: sequential Embed calls of --inputs texts (2,048: the default
--max-inputs-per-request), as an ingestion job that waits for each answer sends them.

    python -m encoderd.bench.bigcall [--compare-ref REF] [--rounds 12] [--inputs 2048]

It starts `encoderd serve` with its default flags on its own gRPC port (this checkout; with
--compare-ref also the same command from git REF, exported to a temporary folder), both at once, and
sends each server one call per round, alternating which goes first. Every call's texts are new (the
bench corpus, numbered), so no result cache or in-flight sharing answers one. Two servers are
compared in both start orders, half the rounds each (a pair started once carries its own placement
luck; see bench.percall). Per server: the client's latency (median, min) and the median of the
server's own split of it (its `server-timing` trailer: tokenize, queue, compute, total), and the
ratio of the medians, this checkout's over REF's. A benchmark, not a test: it prints a table and
asserts nothing.
"""

from __future__ import annotations

import argparse
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path

import grpc

from ..v1 import encoderd_pb2 as pb
from ..v1 import encoderd_pb2_grpc
from ..workers.contract.model_files import DEFAULT_MODEL_NAME, default_model_path
from .corpus import TokenCounter, make_corpus
from .flood import checkouts, server_timing, start_server

ANSWER_BYTES = 64 << 20  # 2,048 x 384 float32 values and their framing, with room to spare
CORPUS_SIZE = 8192
COLUMNS = (("latency", 8), ("min", 8), ("tokenize", 9), ("queue", 7), ("compute", 8), ("total", 8))


def trailer_timing(trailers) -> dict[str, float]:
    """The `server-timing` trailer's figures in seconds by name ({} without one), as bench.flood reads them."""
    return server_timing(dict(trailers or ()).get("server-timing"))


def call_texts(corpus: list[str], call: int, inputs: int) -> list[str]:
    """Call number `call`'s texts: a window of the corpus, each numbered with the call."""
    return [f"{corpus[(call * inputs + i) % len(corpus)]} {call}" for i in range(inputs)]


def measure(
    servers: list[tuple[str, encoderd_pb2_grpc.EncoderStub]], rounds: int, inputs: int, corpus, first_call: int
):
    """{label: [(latency s, server-timing figures), ...]}: one call to each server per round, the
    first server of a round alternating."""
    got: dict[str, list] = {label: [] for label, _ in servers}
    call = first_call
    for r in range(rounds):
        for label, stub in servers if r % 2 == 0 else servers[::-1]:
            request = pb.EmbedRequest(model=DEFAULT_MODEL_NAME, inputs=call_texts(corpus, call, inputs))
            call += 1
            started = time.perf_counter()
            _, outcome = stub.Embed.with_call(request, timeout=600)
            got[label].append((time.perf_counter() - started, trailer_timing(outcome.trailing_metadata())))
    return got


def run_order(sides, serve_args: list[str], logs: Path, rounds: int, inputs: int, corpus, first_call: int) -> dict:
    started, channels = [], []
    try:
        servers = []
        for label, checkout in sides:
            server, address, _ = start_server(label.replace(" ", "-"), checkout, serve_args, logs)
            started.append(server)
            limits = [("grpc.max_receive_message_length", ANSWER_BYTES), ("grpc.max_send_message_length", ANSWER_BYTES)]
            channels.append(grpc.insecure_channel(address, options=limits))
            servers.append((label, encoderd_pb2_grpc.EncoderStub(channels[-1])))
        return measure(servers, rounds, inputs, corpus, first_call)
    finally:
        for channel in channels:
            channel.close()
        for server in started:
            server.stop()


def summary(calls: list) -> dict[str, float]:
    """Median latency, its minimum, and the median of each server-timing figure."""
    out = {"latency": statistics.median(c[0] for c in calls), "min": min(c[0] for c in calls)}
    for name in ("tokenize", "queue", "compute", "total"):
        values = [c[1][name] for c in calls if name in c[1]]
        if values:
            out[name] = statistics.median(values)
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--compare-ref", help="also run the server of this git ref (e.g. a commit before a change)")
    parser.add_argument("--rounds", type=int, default=12, help="calls to each server (default: %(default)s)")
    parser.add_argument("--inputs", type=int, default=2048, help="texts per call (default: %(default)s)")
    parser.add_argument("--serve-args", default="", help="extra `encoderd serve` flags for every server")
    args = parser.parse_args(argv)
    logs = Path(tempfile.mkdtemp(prefix="encoderd-bigcall-"))
    corpus = make_corpus(TokenCounter(default_model_path()), CORPUS_SIZE, seed=3)
    sides = checkouts(args.compare_ref)
    orders = [sides, sides[::-1]] if len(sides) > 1 else [sides]
    calls: dict[str, list] = {label: [] for label, _ in sides}
    for i, order in enumerate(orders):
        rounds = args.rounds // len(orders) + (i < args.rounds % len(orders))
        print(f"[bigcall] {' first, then '.join(label for label, _ in order)}: {rounds} rounds", flush=True)
        got = run_order(order, shlex.split(args.serve_args), logs, rounds, args.inputs, corpus, i * 2 * args.rounds)
        for label, some in got.items():
            calls[label] += some
    print(f"\n{args.inputs} inputs a call; medians in ms (server-timing: the server's own split)")
    print(f"{'server':<22} {'calls':>5} " + " ".join(f"{name:>{width}}" for name, width in COLUMNS))
    figures = {label: summary(some) for label, some in calls.items()}
    for label, f in figures.items():
        cells = " ".join(f"{f[n] * 1000:>{w}.0f}" if n in f else f"{'-':>{w}}" for n, w in COLUMNS)
        print(f"{label:<22} {len(calls[label]):>5} {cells}")
    if len(sides) > 1:
        ref, this = (figures[label]["latency"] for label, _ in sides)
        print(f"latency, this checkout / {sides[0][0]}: {this / ref:.3f}")
    print(f"server logs: {logs}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
