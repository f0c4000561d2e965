"""Soak: does memory plateau under steady mixed traffic? (issue 16, finding 4)

    python -m encoderd.bench.soak [--minutes 10] [--clients 4] [--compare-ref REF]

It starts `encoderd serve` with three models (the bundled MiniLM embedder, a MiniLM
cross-encoder and a 3-label classifier, built offline like the tests' models) and keeps C
clients sending a random mix, back to back: Embed (1-16 inputs), Rerank (a query + 2-20
documents) and Classify (1-8 inputs), every text new (so no cache or dedup answers it) and of
random length (1-300 words: every batch is a new shape). Every --sample-every seconds it reads the
RSS of the frontend and of each worker from /proc. The report: RSS per process each minute, and
the growth over the last half of the run (target: < 5%), each a minute's lowest RSS (a worker's
RSS swings by the working set of the batch in flight; the floor is what it keeps), with the
peaks of each half. With --compare-ref, the server of that git ref runs at the same time under
the same traffic (its own --clients clients), for a before/after.
A benchmark, not a test: it prints a table and asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import random
import shlex
import sys
import tempfile
import threading
import time
from pathlib import Path

import grpc

from ..v1 import encoderd_pb2 as pb
from ..v1 import encoderd_pb2_grpc
from .flood import export_ref
from .processes import Managed, free_port, grpc_serving, serve_command, wait_until
from .servers import REPO_ROOT

WORDS = (
    "memory must plateau under steady traffic of mixed lengths and kinds while the worker computes batches "
    "of every shape from short queries to long passages about rivers mountains cities and engines"
).split()
KINDS = ("embed", "rerank", "classify")


def build_models(cache: Path) -> dict[str, str]:
    """The embedder, reranker and classifier directories (the latter two built once, offline)."""
    sys.path.insert(0, str(REPO_ROOT / "tests"))  # the tests' `support` package builds them
    try:
        from support.models import build_classifier, build_reranker  # type: ignore[import-not-found]  # tests/, on sys.path above
    finally:
        sys.path.remove(str(REPO_ROOT / "tests"))
    from ..workers.contract.model_files import default_model_path

    cache.mkdir(parents=True, exist_ok=True)
    return {
        "embedder": default_model_path(),
        "reranker": str(build_reranker(cache / "reranker-minilm")),
        "classifier": str(build_classifier(cache / "classifier-minilm")),
    }


def _text(rng: random.Random, serial: int) -> str:
    return f"{serial} " + " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 300)))


class Traffic(threading.Thread):
    """One client: a random mix of calls, back to back, until stopped."""

    def __init__(self, address: str, seed: int, stop: threading.Event):
        super().__init__(daemon=True)
        self.address, self.rng, self.stop = address, random.Random(seed), stop
        self.serial = seed * 10**9
        self.calls = dict.fromkeys(KINDS, 0)
        self.errors: dict[str, int] = {}

    def _texts(self, n: int) -> list[str]:
        self.serial += n
        return [_text(self.rng, self.serial + i) for i in range(n)]

    def run(self) -> None:
        with grpc.insecure_channel(self.address) as channel:
            stub = encoderd_pb2_grpc.EncoderStub(channel)
            while not self.stop.is_set():
                kind = self.rng.choice(KINDS)
                try:
                    if kind == "embed":
                        stub.Embed(
                            pb.EmbedRequest(model="embedder", inputs=self._texts(self.rng.randint(1, 16))), timeout=120
                        )
                    elif kind == "rerank":
                        stub.Rerank(
                            pb.RerankRequest(
                                model="reranker",
                                query=self._texts(1)[0][:300],
                                documents=self._texts(self.rng.randint(2, 20)),
                            ),
                            timeout=120,
                        )
                    else:
                        stub.Classify(
                            pb.ClassifyRequest(model="classifier", inputs=self._texts(self.rng.randint(1, 8))),
                            timeout=120,
                        )
                    self.calls[kind] += 1
                except grpc.RpcError as exc:
                    self.errors[exc.code().name] = self.errors.get(exc.code().name, 0) + 1


def rss_mb(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def processes(server: Managed, address: str) -> dict[str, int]:
    """name -> pid: the frontend and each model's worker(s)."""
    with grpc.insecure_channel(address) as channel:
        models = encoderd_pb2_grpc.EncoderStub(channel).ListModels(pb.ListModelsRequest(), timeout=10).models
    pids = {"frontend": server.pid}
    for m in models:
        for i, replica in enumerate(m.replicas):
            pids[m.id + (f"#{i}" if len(m.replicas) > 1 else "")] = replica.pid
    return pids


def start(label: str, pythonpath: str | None, models: dict[str, str], serve_args: list[str], logs: Path):
    port = free_port()
    argv = [
        *serve_command(pythonpath),
        "--no-rest",
        "--grpc-port",
        str(port),
        *[a for name, path in models.items() for a in ("--model", f"{name}={path}")],
        *serve_args,
    ]
    server = Managed(
        label, argv, logs / f"{label}.log", env={"PYTHONPATH": pythonpath} if pythonpath else {}, cwd=pythonpath or None
    ).start()
    address = f"127.0.0.1:{port}"
    wait_until(lambda: grpc_serving(address), label, server, timeout=600)
    return server, address


def _floor_near(series: list[tuple[float, float]], t: float, window: float = 60.0) -> float:
    """The lowest RSS within the `window` seconds ending at t (or the nearest sample). A worker's
    RSS swings by the working set of the batch in flight and drops back when the heap is trimmed:
    the floor is the memory it keeps, which is what leaks grow."""
    near = [v for s, v in series if t - window <= s <= t] or [min(series, key=lambda p: abs(p[0] - t))[1]]
    return min(near)


def summarize(samples: list[tuple[float, dict]], names: list[str]) -> dict:
    """Per process: the RSS floor each minute, its growth over the last half of the run, and the
    peaks of the first and the second half (what the working set adds on top)."""
    out = {}
    end_t = samples[-1][0]
    for name in names:
        series = [(t, s[name]) for t, s in samples if s.get(name) is not None]
        if not series:
            continue
        mid, end = _floor_near(series, end_t / 2), _floor_near(series, end_t)
        peaks = [max([v for t, v in series if (t > end_t / 2) == second] or [0]) for second in (False, True)]
        out[name] = {
            "start_mb": round(series[0][1]),
            "mid_mb": round(mid),
            "end_mb": round(end),
            "last_half_growth_pct": round(100 * (end - mid) / mid, 1),
            "peak_first_half_mb": round(peaks[0]),
            "peak_second_half_mb": round(peaks[1]),
            "per_minute_mb": [round(_floor_near(series, 60 * m)) for m in range(int(end_t // 60) + 1)],
        }
    return out


def report(summary: dict) -> None:
    print(
        f"{'process':<26} {'start':>5} {'mid':>5} {'end':>5} {'growth, last half':>17} {'peaks (halves)':>14}"
        "  RSS floor each minute (MB)"
    )
    for name, r in summary.items():
        print(
            f"{name:<26} {r['start_mb']:>5} {r['mid_mb']:>5} {r['end_mb']:>5} {r['last_half_growth_pct']:>16.1f}% "
            f"{r['peak_first_half_mb']:>6} {r['peak_second_half_mb']:>6}  {' '.join(map(str, r['per_minute_mb']))}"
        )


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, default=10)
    parser.add_argument("--clients", type=int, default=4, help="concurrent clients per server")
    parser.add_argument("--sample-every", type=float, default=5.0, help="seconds between RSS samples")
    parser.add_argument("--compare-ref", help="also run the server of this git ref at the same time")
    parser.add_argument("--serve-args", default="", help="extra `encoderd serve` flags")
    parser.add_argument("--cache-dir", type=Path, default=Path.home() / ".cache" / "encoderd-bench")
    parser.add_argument("--json", type=Path, help="write the samples and the summary here")
    args = parser.parse_args(argv)
    models = build_models(args.cache_dir)
    logs = Path(tempfile.mkdtemp(prefix="encoderd-soak-"))
    variants = [("this", None)] + (
        [(f"ref-{args.compare_ref}", str(export_ref(args.compare_ref)))] if args.compare_ref else []
    )
    servers, pids, stop = [], {}, threading.Event()
    clients: list[Traffic] = []
    try:
        for label, path in variants:
            server, address = start(label, path, models, shlex.split(args.serve_args), logs)
            servers.append(server)
            pids.update({f"{label}:{name}": pid for name, pid in processes(server, address).items()})
            clients += [Traffic(address, seed=len(clients) + 1, stop=stop) for _ in range(args.clients)]
        print(
            f"[soak] {args.minutes:g} min, {len(clients)} clients; processes {pids}; logs {logs}",
            file=sys.stderr,
            flush=True,
        )
        for c in clients:
            c.start()
        started, samples = time.monotonic(), []
        while (elapsed := time.monotonic() - started) < args.minutes * 60:
            samples.append((elapsed, {name: rss_mb(pid) for name, pid in pids.items()}))
            if len(samples) % max(1, int(60 / args.sample_every)) == 1:
                print(
                    f"[soak] {elapsed / 60:4.1f} min "
                    + " ".join(f"{n}={v:.0f}" for n, v in samples[-1][1].items() if v),
                    file=sys.stderr,
                    flush=True,
                )
            time.sleep(args.sample_every)
        samples.append((time.monotonic() - started, {name: rss_mb(pid) for name, pid in pids.items()}))
    finally:
        stop.set()
        for c in clients:
            c.join(timeout=150)
        for server in servers:
            server.stop()
    summary = summarize(samples, list(pids))
    report(summary)
    calls = {k: sum(c.calls[k] for c in clients) for k in KINDS}
    errors: dict[str, int] = {}
    for c in clients:
        for code, n in c.errors.items():
            errors[code] = errors.get(code, 0) + n
    print(f"calls {calls}, errors {errors or 'none'}")
    if args.json:
        args.json.write_text(
            json.dumps({"summary": summary, "samples": samples, "calls": calls, "errors": errors}, indent=1)
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
