"""What one call costs the gateway (Envoy) and the frontend in CPU, by kind of call (issue 42, item 2).

    python -m encoderd.bench.gateway_cpu [--calls 2000] [--connections 50] [--inputs 32] [--rounds 3]
                                         [--compare-ref REF]

Under a flood every refusal is paid for on the cores the workers compute with, by Envoy (REST's
filters and the transcoder) and by the Python frontend: their CPU per call sets how fast a burst
of calls is refused, and CPU time is steadier than a latency on a shared host. This starts
`encoderd serve` as it runs by default (REST on, its Envoy also on the gRPC port) with
--max-queued-inputs 1, so that every call of --inputs inputs is refused at once by the memory
bound (the earliest refusal, the same place as an overload's), and for each kind of call sends
--calls of them over --connections keep-alive connections from a bare HTTP/1.1 client (or gRPC
channels), then reads both processes' CPU seconds from /proc:

  refused REST    POST /v1/embeddings of --inputs texts (~470 bytes each): 429
  health REST     GET /health: Envoy's fixed cost of a call, next to the filters a body passes
  refused gRPC    Encoder/Embed of --inputs texts through Envoy's gRPC port: RESOURCE_EXHAUSTED

With --compare-ref the same is measured for the server of git REF (exported as bench.flood does),
rounds alternated (ref, this, this, ref, ...) so both meet the same load. Reported: microseconds of
CPU per call, each round's figure and the median. A benchmark, not a test: it asserts nothing.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
from pathlib import Path

import grpc

from ..v1 import encoderd_pb2 as pb
from ..v1 import encoderd_pb2_grpc
from .flood import checkouts, http_exchange, http_request, start_server
from .processes import cpu_seconds, descendant_named

MODEL = "sentence-transformers/all-MiniLM-L6-v2"
WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa".split()


def _texts(call: int, inputs: int) -> list[str]:
    """Distinct texts per call (identical ones would be answered from the result cache)."""
    return [f"{call}.{k} " + " ".join(WORDS * 6) for k in range(inputs)]


async def _http_connection(port: int, calls: range, method: str, path: str, inputs: int, statuses: dict) -> None:
    """`calls` requests one after the other on one keep-alive HTTP/1.1 connection."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        for call in calls:
            body = json.dumps({"model": MODEL, "input": _texts(call, inputs)}).encode() if method == "POST" else b""
            status, _ = await http_exchange(reader, writer, http_request("bench", path, body, method))
            statuses[status] = statuses.get(status, 0) + 1
    finally:
        writer.close()


async def _grpc_channel(address: str, calls: range, inputs: int, statuses: dict) -> None:
    async with grpc.aio.insecure_channel(address, options=[("grpc.use_local_subchannel_pool", 1)]) as channel:
        stub = encoderd_pb2_grpc.EncoderStub(channel)
        for call in calls:
            try:
                await stub.Embed(pb.EmbedRequest(model=MODEL, inputs=_texts(call, inputs)), timeout=30)
                code = grpc.StatusCode.OK
            except grpc.aio.AioRpcError as exc:
                code = exc.code()
            statuses[code.name] = statuses.get(code.name, 0) + 1


KINDS = ("refused REST", "health REST", "refused gRPC")


def _send(kind: str, rest_port: int, address: str, calls: int, connections: int, inputs: int) -> dict:
    """`calls` calls of `kind` over `connections` connections; their outcomes by status."""
    statuses: dict = {}
    per = calls // connections

    def connection(index: int):
        its = range(index * per, (index + 1) * per)
        if kind == "refused REST":
            return _http_connection(rest_port, its, "POST", "/v1/embeddings", inputs, statuses)
        if kind == "health REST":
            return _http_connection(rest_port, its, "GET", "/health", 0, statuses)
        return _grpc_channel(address, its, inputs, statuses)

    async def run():
        await asyncio.gather(*(connection(i) for i in range(connections)))

    asyncio.run(run())
    return statuses


def measure(label: str, checkout: str | None, args, logs: Path) -> dict:
    """Per kind of call: (Envoy, frontend) CPU microseconds per call, and the outcomes."""
    server, address, rest_url = start_server(
        label.replace(" ", "-"), checkout, ["--max-queued-inputs", "1"], logs, rest=True
    )
    try:
        envoy = descendant_named(server.pid, "envoy")
        if envoy is None:
            raise RuntimeError(f"{label}: no Envoy under the server (pid {server.pid})")
        rest_port = int(rest_url.rpartition(":")[2])
        out = {}
        for kind in KINDS:
            # first a short run: connections, Lua states, JIT traces
            _send(kind, rest_port, address, 4 * args.connections, args.connections, args.inputs)
            before = cpu_seconds(envoy), cpu_seconds(server.pid)
            statuses = _send(kind, rest_port, address, args.calls, args.connections, args.inputs)
            calls = sum(statuses.values())
            after = cpu_seconds(envoy), cpu_seconds(server.pid)
            out[kind] = {
                "envoy_us": (after[0] - before[0]) / calls * 1e6,
                "frontend_us": (after[1] - before[1]) / calls * 1e6,
                "outcomes": statuses,
            }
        return out
    finally:
        server.stop()


def report(rounds: list[dict[str, dict]], labels: list[str]) -> None:
    print("CPU microseconds per call (Envoy / frontend), each round, then the median")
    for kind in KINDS:
        for label in labels:
            figures = [r[label][kind] for r in rounds]
            envoy = [f["envoy_us"] for f in figures]
            front = [f["frontend_us"] for f in figures]
            each = "  ".join(f"{e:4.0f}/{f:4.0f}" for e, f in zip(envoy, front, strict=True))
            median = f"{statistics.median(envoy):4.0f} / {statistics.median(front):4.0f}"
            print(f"{kind:13s} {label:24s} {each}   median {median}   {figures[-1]['outcomes']}")
    if len(labels) > 1:
        ref, this = labels
        for kind in KINDS:
            envoy = [statistics.median(r[label][kind]["envoy_us"] for r in rounds) for label in (this, ref)]
            print(f"{kind:13s} Envoy this / ref {envoy[0] / envoy[1]:.2f}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=2000, help="calls of each kind per round (default: %(default)s)")
    parser.add_argument("--connections", type=int, default=50, help="connections they share (default: %(default)s)")
    parser.add_argument("--inputs", type=int, default=32, help="texts per refused call (default: %(default)s)")
    parser.add_argument("--rounds", type=int, default=3, help="alternated rounds (default: %(default)s)")
    parser.add_argument("--compare-ref", help="also measure the server of this git ref")
    parser.add_argument("--json", type=Path, help="write the rounds here")
    args = parser.parse_args(argv)
    sides = checkouts(args.compare_ref)
    logs = Path(tempfile.mkdtemp(prefix="encoderd-gateway-cpu-"))
    print(f"[gateway_cpu] server logs in {logs}", file=sys.stderr)
    rounds = []
    for r in range(args.rounds):
        order = sides if r % 2 == 0 else sides[::-1]
        rounds.append({label: measure(label, checkout, args, logs) for label, checkout in order})
    labels = [label for label, _ in sides]
    report(rounds, labels)
    if args.json:
        args.json.write_text(json.dumps(rounds, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
