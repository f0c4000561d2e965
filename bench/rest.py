"""REST-through-Envoy next to direct gRPC, in one run, on loopback.

    python -m encoderd.bench.rest                      # starts its own server (bundled MiniLM, --grpc-direct)
    python -m encoderd.bench.rest --grpc 127.0.0.1:50051 --rest http://127.0.0.1:7997

For each batch size (inputs per request) it runs, one after the other, for
--seconds each with --concurrency requests in flight:
  grpc            Encoder.Embed over gRPC (the baseline)
  openai-float    POST /v1/embeddings, floats rendered by the server (HttpBody)
  openai-base64   POST /v1/embeddings, base64 (what the openai SDK asks for)
  encoderd-json   POST /v1/encoderd/embed: Envoy prints the proto's repeated float
and prints requests/s, inputs/s, p50, p95 and response size. Every request
carries distinct texts, so the server's in-flight deduplication never helps.

    python -m encoderd.bench.rest --stub

isolates the gateway: the same real Envoy in front of a stand-in gRPC server
(its own process) that answers canned unit vectors with no model, so the rows
differ only by transport and by who prints the floats (Envoy's proto-JSON for
encoderd-json, the server's orjson-rendered HttpBody for openai-float).
The client shares the machine: on few cores its own CPU cost is in the numbers.
Needs httpx (the dev extra).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import os
import signal
import subprocess
import sys
import time
import urllib.request

import numpy as np

from ..v1 import encoderd_pb2 as pb
from ..v1 import encoderd_pb2_grpc
from ..workers.contract.model_files import DEFAULT_MODEL_NAME
from .processes import free_port, serve_command

WORDS = "the quick brown fox jumps over a lazy dog while encoders embed short passages into vectors".split()
MODES = ("grpc", "openai-float", "openai-base64", "encoderd-json")


def _texts(counter, batch: int) -> list[str]:
    """Distinct short sentences (8-16 words)."""
    out = []
    for _ in range(batch):
        n = next(counter)
        out.append(" ".join(WORDS[(n * 7 + i) % len(WORDS)] for i in range(8 + n % 9)) + f" {n}")
    return out


def _request(mode: str, model: str, texts: list[str]):
    """(path, JSON body) for a REST mode."""
    if mode == "encoderd-json":
        return "/v1/encoderd/embed", {"model": model, "inputs": texts}
    return "/v1/embeddings", {"model": model, "input": texts, "encoding_format": mode.removeprefix("openai-")}


async def _run_mode(mode: str, args, batch: int, counter, grpc_stub, http) -> dict:
    latencies, sizes = [], []

    async def one() -> None:
        texts = _texts(counter, batch)
        started = time.perf_counter()
        if mode == "grpc":
            response = await grpc_stub.Embed(pb.EmbedRequest(model=args.model, inputs=texts))
            size = response.ByteSize()
        else:
            path, body = _request(mode, args.model, texts)
            response = await http.post(path, json=body)
            response.raise_for_status()
            size = len(response.content)
        latencies.append(time.perf_counter() - started)
        sizes.append(size)

    async def loop(until: float) -> None:
        while time.perf_counter() < until:
            await one()

    await asyncio.gather(*(loop(time.perf_counter() + args.warmup) for _ in range(args.concurrency)))
    latencies.clear()
    sizes.clear()
    started = time.perf_counter()
    await asyncio.gather(*(loop(started + args.seconds) for _ in range(args.concurrency)))
    elapsed = time.perf_counter() - started
    ms = np.array(latencies) * 1000
    return {
        "mode": mode,
        "batch": batch,
        "requests": len(ms),
        "rps": len(ms) / elapsed,
        "inputs_s": len(ms) * batch / elapsed,
        "p50": np.percentile(ms, 50),
        "p95": np.percentile(ms, 95),
        "bytes": int(np.mean(sizes)),
    }


async def run(args) -> list[dict]:
    import grpc

    try:
        import httpx
    except ImportError:
        raise SystemExit("encoderd.bench.rest needs httpx: pip install httpx (or the encoderd[dev] extra)") from None

    counter = itertools.count()
    limits = httpx.Limits(max_connections=args.concurrency, max_keepalive_connections=args.concurrency)
    results = []
    async with (
        grpc.aio.insecure_channel(args.grpc) as channel,
        httpx.AsyncClient(base_url=args.rest, limits=limits, timeout=120, trust_env=False) as http,
    ):
        stub = encoderd_pb2_grpc.EncoderStub(channel)
        for batch in args.batch:
            for mode in args.modes:
                result = await _run_mode(mode, args, batch, counter, stub, http)
                print(_row(result), flush=True)
                results.append(result)
    return results


def _row(r: dict) -> str:
    return (
        f"{r['mode']:<14} batch {r['batch']:>3}  {r['rps']:8.1f} req/s  {r['inputs_s']:8.1f} inputs/s  "
        f"p50 {r['p50']:7.2f} ms  p95 {r['p95']:7.2f} ms  {r['bytes']:>8} B/response  (n={r['requests']})"
    )


# ------------------------------------------------------------ stand-in server
def _serve_stub(port: int, dim: int) -> None:
    """Process entry: Embed and CreateEmbeddings answer random unit vectors, computing nothing."""
    import grpc

    from ..server.api.rest import render_embeddings
    from ..v1 import compat_pb2_grpc

    rng = np.random.default_rng(0)

    def vectors(n: int) -> np.ndarray:
        v = rng.standard_normal((n, dim)).astype(np.float32)
        return v / np.linalg.norm(v, axis=1, keepdims=True)

    class Encoder(encoderd_pb2_grpc.EncoderServicer):
        async def Embed(self, request, context):
            rows = vectors(len(request.inputs))
            return pb.EmbedResponse(
                model=request.model,
                embeddings=[pb.Embedding(values=v) for v in rows.tolist()],
                usage=pb.Usage(prompt_tokens=len(request.inputs)),
            )

    class Compat(compat_pb2_grpc.CompatServicer):
        async def CreateEmbeddings(self, request, context):
            n = len(request.input.list_value.values)
            return render_embeddings(request.model, vectors(n), request.encoding_format or "float", n)

    async def serve() -> None:
        server = grpc.aio.server()
        encoderd_pb2_grpc.add_EncoderServicer_to_server(Encoder(), server)
        compat_pb2_grpc.add_CompatServicer_to_server(Compat(), server)
        server.add_insecure_port(f"127.0.0.1:{port}")
        await server.start()
        await server.wait_for_termination()

    asyncio.run(serve())


async def run_stub(args) -> None:
    import multiprocessing

    from ..gateway.envoy import GatewaySettings
    from ..gateway.process import EnvoyProcess

    grpc_port = free_port()
    stub = multiprocessing.get_context("spawn").Process(target=_serve_stub, args=(grpc_port, args.dim), daemon=True)
    stub.start()
    import grpc

    async with grpc.aio.insecure_channel(f"127.0.0.1:{grpc_port}") as channel:
        await asyncio.wait_for(channel.channel_ready(), 60)
    envoy = EnvoyProcess(GatewaySettings(grpc_addresses=(f"127.0.0.1:{grpc_port}",), rest_port=free_port()))
    await envoy.start()
    args.grpc, args.rest = f"127.0.0.1:{grpc_port}", envoy.url
    try:
        await run(args)
    finally:
        await envoy.stop()
        stub.kill()


# ------------------------------------------------------------------ own server
def _start_server(args) -> subprocess.Popen:
    grpc_port, rest_port = free_port(), free_port()
    args.grpc, args.rest = f"127.0.0.1:{grpc_port}", f"http://127.0.0.1:{rest_port}"
    command = [
        *serve_command(),
        "--grpc-port",
        str(grpc_port),
        "--rest-port",
        str(rest_port),
        "--grpc-direct",  # the baseline is the server's own gRPC port, not gRPC through the same Envoy
        "--log-level",
        "WARNING",
        *args.serve_args,
    ]
    proc = subprocess.Popen(command, start_new_session=True)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"encoderd exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(args.rest + "/health", timeout=2):
                return proc
        except OSError:
            time.sleep(0.2)
    os.killpg(proc.pid, signal.SIGKILL)
    raise SystemExit("encoderd did not become ready")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--grpc", help="HOST:PORT of a running server (default: start one)")
    parser.add_argument("--rest", help="base URL of its REST gateway")
    parser.add_argument("--model", default=DEFAULT_MODEL_NAME)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 32], help="inputs per request")
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--seconds", type=float, default=5.0, help="measured time per mode and batch size")
    parser.add_argument("--warmup", type=float, default=1.0)
    parser.add_argument("--stub", action="store_true", help="gateway only: Envoy + a stand-in server with no model")
    parser.add_argument("--dim", type=int, default=384, help="embedding size of the stand-in server")
    parser.add_argument("serve_args", nargs="*", help="extra `encoderd serve` flags for the own server (after --)")
    args = parser.parse_args(argv)
    if bool(args.grpc) != bool(args.rest):
        parser.error("give both --grpc and --rest, or neither")
    if args.stub:
        asyncio.run(run_stub(args))
        return 0
    server = None if args.grpc else _start_server(args)
    try:
        asyncio.run(run(args))
    finally:
        if server:
            server.send_signal(signal.SIGTERM)
            server.wait(60)
    return 0


if __name__ == "__main__":
    sys.exit(main())
