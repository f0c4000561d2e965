"""Hostile-client probes of issue 42 (items 1, 3 and 4), run against this checkout and, with
--compare-ref, the same command from git REF:

    python -m encoderd.bench.hostile [--runs 3] [--compare-ref REF] [--others 8] [--sends 20] [--length 65000]
                                     [--probes echo,refuse,long-query]

  echo     --others REST clients (/v1/embeddings) and as many gRPC ones (Embed, through Envoy's
           gRPC port) call back to back, 32 texts a call (each answered once before the phase
           starts, calling until it ends), while one client sends --sends REST calls and as many
           gRPC ones whose `model` is --length characters (65,000: the size issue 42 found to break
           the Envoy<->server link). Counts the others' failed calls, and the codes the sender got.
  refuse   a rerank of 1,000 documents x 2,000 characters over --max-request-tokens (default
           262,144): the time until the refusal and the frontend's peak RSS above its level before
           (sampled every 5 ms from /proc), and whether the answer named the limit.
  long-query  single short Embed queries, one after another, alone ("idle") and while another client
           sends back to back reranks of --query-documents documents (1) with a --query-chars query
           (200,000: issue 42's size; truncated to the model's 512 tokens, but tokenized whole): the
           queries' p50 and p99 in both phases, and the big calls made (and refused: 1,000 documents
           of 512-token pairs are over --max-request-tokens).
Each server is started as `encoderd serve` runs by default (REST on, its Envoy on the gRPC port),
serving the bundled MiniLM and a MiniLM reranker built from tests/support. A probe, not a test:
it prints a table and asserts nothing.
"""

from __future__ import annotations

import argparse
import itertools
import random
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

from ..workers.contract.model_files import DEFAULT_MODEL_NAME, default_model_path
from .corpus import _sentence
from .flood import checkouts
from .processes import Managed, free_port, grpc_serving, http_ok, serve_command, wait_until
from .servers import REPO_ROOT


def _reranker(cache: Path) -> str:
    sys.path.insert(0, str(REPO_ROOT / "tests"))  # the tests' `support` package, as their conftest imports it
    try:
        from support.models import build_reranker  # type: ignore[import-not-found]
    finally:
        sys.path.remove(str(REPO_ROOT / "tests"))
    return str(build_reranker(cache / "reranker-minilm"))


def _start(label: str, pythonpath: str | None, reranker: str, logs: Path) -> tuple[Managed, str, str]:
    grpc_port, rest_port = free_port(), free_port()
    argv = [
        *serve_command(pythonpath),
        "--grpc-port",
        str(grpc_port),
        "--rest-port",
        str(rest_port),
        "--model",
        f"{DEFAULT_MODEL_NAME}={default_model_path()}",
        "--model",
        f"reranker={reranker}",
    ]
    env = {"PYTHONPATH": pythonpath} if pythonpath else {}
    server = Managed(label, argv, logs / f"{label.replace(' ', '_')}.log", env=env, cwd=pythonpath or None).start()
    address, rest = f"127.0.0.1:{grpc_port}", f"http://127.0.0.1:{rest_port}"
    wait_until(lambda: grpc_serving(address), label, server, timeout=300)
    wait_until(lambda: http_ok(rest + "/health"), label + " REST", server, timeout=120)
    return server, address, rest


def echo_probe(address: str, rest: str, others: int, sends: int, length: int) -> dict:
    """Other clients' failed calls while long `model` values are sent (see the module's docstring)."""
    import grpc
    import httpx

    from ..v1 import encoderd_pb2 as pb
    from ..v1 import encoderd_pb2_grpc

    done = threading.Event()
    ready = threading.Barrier(2 * others + 1)
    results: list[bool] = []
    lock = threading.Lock()
    rng = random.Random(7)
    texts = [_sentence(rng) + " " + _sentence(rng) for _ in range(32)]
    long_model = "m" * length

    def loop(call) -> None:
        first = True
        while first or not done.is_set():
            ok = call()
            with lock:
                results.append(ok)
            if first:
                ready.wait(timeout=120)
                first = False

    def rest_client() -> None:
        with httpx.Client(base_url=rest, timeout=60, trust_env=False) as http:

            def call() -> bool:
                try:
                    return http.post("/v1/embeddings", json={"model": DEFAULT_MODEL_NAME, "input": texts}).is_success
                except httpx.HTTPError:
                    return False

            loop(call)

    def grpc_client() -> None:
        with grpc.insecure_channel(address) as channel:
            stub = encoderd_pb2_grpc.EncoderStub(channel)

            def call() -> bool:
                try:
                    stub.Embed(pb.EmbedRequest(model=DEFAULT_MODEL_NAME, inputs=texts), timeout=60)
                    return True
                except grpc.RpcError:
                    return False

            loop(call)

    threads = [threading.Thread(target=rest_client) for _ in range(others)]
    threads += [threading.Thread(target=grpc_client) for _ in range(others)]
    for thread in threads:
        thread.start()
    ready.wait(timeout=120)
    with lock:
        before = len(results)
    sent: dict[str, int] = {}
    with httpx.Client(base_url=rest, timeout=60, trust_env=False) as http, grpc.insecure_channel(address) as channel:
        stub = encoderd_pb2_grpc.EncoderStub(channel)
        for _ in range(sends):  # REST, and native gRPC through Envoy's gRPC port
            code = str(http.post("/v1/embeddings", json={"model": long_model, "input": "x"}).status_code)
            sent[code] = sent.get(code, 0) + 1
            try:
                stub.Embed(pb.EmbedRequest(model=long_model, inputs=["x"]), timeout=60)
                code = "OK"
            except grpc.RpcError as exc:
                code = exc.code().name
            sent[code] = sent.get(code, 0) + 1
    done.set()
    for thread in threads:
        thread.join()
    during = results[before:]
    return {
        "others_calls": len(during),
        "others_failed": sum(1 for ok in during if not ok),
        "sender_codes": dict(sorted(sent.items())),
    }


def _rss_kib(pid: int, field: str = "VmRSS") -> int:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


def refuse_probe(address: str, frontend: int, seed: int) -> dict:
    """The 1,000 x 2,000-character rerank: seconds to the refusal, frontend peak RSS growth."""
    import grpc

    from ..v1 import encoderd_pb2 as pb
    from ..v1 import encoderd_pb2_grpc

    rng = random.Random(seed)
    docs = []
    for _ in range(1000):
        text = ""
        while len(text) < 2000:
            text += _sentence(rng) + " "
        docs.append(text[:2000])
    request = pb.RerankRequest(model="reranker", query="which report was late", documents=docs)
    baseline, peak = _rss_kib(frontend), [0]
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            peak[0] = max(peak[0], _rss_kib(frontend))
            time.sleep(0.005)

    sampler = threading.Thread(target=sample)
    sampler.start()
    with grpc.insecure_channel(address, options=[("grpc.max_send_message_length", 64 << 20)]) as channel:
        stub = encoderd_pb2_grpc.EncoderStub(channel)
        started = time.perf_counter()
        try:
            stub.Rerank(request, timeout=120)
            code, details = "OK", ""
        except grpc.RpcError as exc:
            code, details = exc.code().name, exc.details() or ""
        seconds = time.perf_counter() - started
    stop.set()
    sampler.join()
    return {
        "seconds": seconds,
        "rss_growth_mib": max(0, peak[0] - baseline) / 1024,
        "code": code,
        "names_limit": "--max-request-tokens" in details,
    }


def long_query_probe(address: str, query_chars: int, documents: int = 1, queries: int = 300) -> dict:
    """Single queries' latency alone, then beside back-to-back reranks with a huge query."""
    import grpc

    from ..v1 import encoderd_pb2 as pb
    from ..v1 import encoderd_pb2_grpc

    query = ("which report was late and why " * (query_chars // 30 + 1))[:query_chars]
    counter = itertools.count()
    with grpc.insecure_channel(address) as channel, grpc.insecure_channel(address, options=_OWN) as big_channel:
        stub, big_stub = encoderd_pb2_grpc.EncoderStub(channel), encoderd_pb2_grpc.EncoderStub(big_channel)

        def single() -> float:
            started = time.perf_counter()
            stub.Embed(pb.EmbedRequest(model=DEFAULT_MODEL_NAME, inputs=[f"a short query {next(counter)}"]), timeout=60)
            return time.perf_counter() - started

        docs = [f"report {i}" for i in range(documents)]

        def big_calls(stop: threading.Event, made: list[int]) -> None:
            while not stop.is_set():  # each query new, so no result cache answers it
                request = pb.RerankRequest(model="reranker", query=f"{next(counter)} {query}", documents=docs)
                try:
                    big_stub.Rerank(request, timeout=120)
                except grpc.RpcError:
                    made[1] += 1
                made[0] += 1

        for _ in range(30):  # warm-up
            single()
        idle = [single() for _ in range(queries)]
        stop, made = threading.Event(), [0, 0]
        caller = threading.Thread(target=big_calls, args=(stop, made))
        caller.start()
        try:
            shared = [single() for _ in range(queries)]
        finally:
            stop.set()
            caller.join()
    ms = lambda values, q: float(np.percentile(values, q) * 1e3)  # noqa: E731
    return {
        "idle": (ms(idle, 50), ms(idle, 99)),
        "shared": (ms(shared, 50), ms(shared, 99)),
        "big_calls": made[0],
        "big_refused": made[1],
    }


_OWN = [("grpc.use_local_subchannel_pool", 1)]  # a connection of its own, as another client's


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m encoderd.bench.hostile", description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--others", type=int, default=8, help="other REST clients, and gRPC ones, in the echo probe")
    parser.add_argument("--sends", type=int, default=20, help="calls with a 65,000-character model per run")
    parser.add_argument("--length", type=int, default=65_000, help="characters of the long `model`")
    parser.add_argument("--query-chars", type=int, default=200_000, help="characters of the long-query probe's query")
    parser.add_argument("--query-documents", type=int, default=1, help="documents in each of its reranks")
    parser.add_argument("--probes", default="echo,refuse,long-query", help="which probes to run (comma-separated)")
    parser.add_argument("--compare-ref", help="also run the server of this git ref (e.g. a commit before a change)")
    parser.add_argument("--cache-dir", type=Path, default=Path(tempfile.gettempdir()) / "encoderd-bench")
    args = parser.parse_args(argv)
    args.cache_dir.mkdir(parents=True, exist_ok=True)
    logs = Path(tempfile.mkdtemp(prefix="encoderd-hostile-"))
    reranker = _reranker(args.cache_dir)
    probes = set(args.probes.split(","))
    rows = []
    for label, path in checkouts(args.compare_ref):  # the reference first
        server, address, rest = _start(label, path, reranker, logs)
        try:
            for run in range(args.runs):
                row = {"label": label, "run": run + 1}
                if "echo" in probes:
                    row["echo"] = echo_probe(address, rest, args.others, args.sends, args.length)
                if "refuse" in probes:
                    row["refuse"] = refuse_probe(address, server.pid, seed=run)
                if "long-query" in probes:
                    row["long"] = long_query_probe(address, args.query_chars, args.query_documents)
                rows.append(row)
                print(row, flush=True)
                server.check_alive()
        finally:
            server.stop()
    _report(rows)
    print(f"logs: {logs}")
    return 0


def _report(rows: list[dict]) -> None:
    if any("echo" in row or "refuse" in row for row in rows):
        print(
            f"\n{'server':<22} {'run':>3} {'others failed':>15} {'sender codes':<40} {'refusal s':>9} "
            f"{'RSS +MiB':>8} {'code':<17} names limit"
        )
    for row in rows:
        echo, refused = row.get("echo"), row.get("refuse")
        if echo or refused:
            failed = f"{echo['others_failed']}/{echo['others_calls']}" if echo else "-"
            codes = str(echo["sender_codes"]) if echo else "-"
            refusal = (
                f"{refused['seconds']:>9.2f} {refused['rss_growth_mib']:>8.0f} {refused['code']:<17} "
                f"{refused['names_limit']}"
                if refused
                else "-"
            )
            print(f"{row['label']:<22} {row['run']:>3} {failed:>15} {codes:<40} {refusal}")
    if any("long" in row for row in rows):
        head = f"{'idle p50/p99 ms':>16} {'beside p50/p99 ms':>18} {'p99 ratio':>9} big calls (refused)"
        print(f"\n{'server':<22} {'run':>3} {head}")
    for row in rows:
        if long := row.get("long"):
            idle, shared = long["idle"], long["shared"]
            print(
                f"{row['label']:<22} {row['run']:>3} {idle[0]:>7.1f} /{idle[1]:>7.1f} "
                f"{shared[0]:>8.1f} /{shared[1]:>8.1f} {shared[1] / idle[1]:>9.2f} {long['big_calls']:>9}"
                f" ({long.get('big_refused', 0)})"
            )


if __name__ == "__main__":
    sys.exit(main())
