"""`encoderd bench` (or `python -m encoderd.server.bench`): the serving benchmark of issue #5.

It is a benchmark, not a test: it reports numbers and asserts nothing about them.

What it runs, each mode on every target side by side (same corpus, same client code,
one target after the other so they share the machine's conditions):
  bulk    C clients, each sending B inputs per request back to back, until the corpus has
          been embedded once (timed from the first request to the last answer; or a fixed
          time window): inputs/s, real tokens/s, request latency, padding ratio, FLOP
          utilisation, CPU use per process (worker busy fraction). --stream adds the same
          work through one gRPC EmbedStream (the ingestion path).
  single  one short query at a time, N sequential calls: p50/p95/p99.
  rerank  a query + 50 passages per call, sequential: p50/p95.

Targets: encoderd over gRPC (always) and REST (--rest, through its Envoy gateway), an
Infinity server in its own virtualenv (--infinity, REST), and sentence-transformers in
this process (length-sorted encode; the compute floor without any server).

Tokens. The corpus is measured with the model's own tokenizer (special tokens included).
"Real tokens" are the tokens a model actually computes on: min(length, model maximum),
identical for every engine; padding is never counted as real.

FLOP estimate for a BERT-like encoder, per input of n real tokens:
    FLOPs(n) = n * (2 * P + 4 * L * H * n)
where P = L * (4 H^2 + 2 H I) are the matmul weights of the L layers (Q, K, V, O
projections and the two feed-forward matrices; embeddings are lookups, biases and norms
are negligible) and 4 L H n per token is attention (QK^T and AV, 2 FLOPs per
multiply-add). Utilisation = useful FLOPs/s (real tokens only, padding excluded) divided
by a matmul peak measured here, now, with torch at the worker's thread count and dtype.

CPU accounting. Every process we start is sampled from /proc (utime + stime) at the start
and the end of each measurement window; "worker busy" = worker CPU seconds / (window x
worker threads). OpenMP threads spin-wait between parallel regions, so CPU time overstates
useful work, badly so when the cores are oversubscribed (a spinning thread waits for a
preempted peer): compare busy% with FLOP%. "foreign" = CPU the rest of the machine used
meanwhile (other people's tests on a shared box): when it is not ~0 the numbers are noisy.
Environment variables (OMP_WAIT_POLICY, OMP_NUM_THREADS...) reach every server it starts.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import math
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from ..workers.model_spec import DEFAULT_MODEL_NAME, default_model_path, load_model_spec

RERANKER_NAME = "reranker"
INFINITY_SPEC = ("infinity-emb[server,torch]==0.0.78", "torch==2.13.0")
REPO_ROOT = Path(__file__).resolve().parents[1]


def log(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# --------------------------------------------------------------------------- options

# Bulk is a fixed amount of work by default (every corpus input once, C clients x B inputs a request),
# timed from the first request to the last answer. A fixed time window instead (--bulk-requests 0
# --bulk-seconds S --bulk-warmup W) counts only the requests that finish inside it, which undercounts a
# server that sorts inputs across requests (they all finish late) unless S is many times C x B / rate.
FULL = {"corpus_size": 2048, "concurrency": 32, "batch": 32, "bulk_seconds": 300.0, "bulk_warmup": 0.0,
        "bulk_requests": -1, "single_calls": 200, "rerank_calls": 10, "rerank_docs": 50,
        "peak_sizes": ((2048, 2048, 2048), (4096, 384, 1536), (4096, 1536, 384))}
QUICK = {"corpus_size": 64, "concurrency": 4, "batch": 4, "bulk_seconds": 60.0, "bulk_warmup": 0.0,
         "bulk_requests": 8, "single_calls": 10, "rerank_calls": 2, "rerank_docs": 8, "peak_sizes": ((512, 512, 512),)}


def build_parser(prog: str = "encoderd bench") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="CI smoke run: tiny corpus, a few requests, no Infinity, "
                                                        "no sentence-transformers (< 60 s)")
    p.add_argument("--json", type=Path, help="write all results to this JSON file")
    p.add_argument("--modes", default="bulk,single,rerank", help="comma-separated subset of bulk,single,rerank")
    p.add_argument("--serve-args", default="", help='extra `encoderd serve` flags, e.g. "--dtype bfloat16"')
    p.add_argument("--target-grpc", help="host:port of a running encoderd instead of starting one")
    p.add_argument("--target-rest", help="base URL of a running encoderd's REST gateway (with --target-grpc)")
    p.add_argument("--target-metrics", help="metrics URL of a running encoderd (with --target-grpc)")
    p.add_argument("--rest", action="store_true", help="also benchmark encoderd over REST (Envoy)")
    p.add_argument("--infinity", action="store_true", help="also run infinity-emb 0.0.78 side by side (own venv)")
    p.add_argument("--stream", action="store_true", help="also run bulk through one gRPC EmbedStream (ingestion)")
    p.add_argument("--no-st", action="store_true", help="skip the in-process sentence-transformers reference")
    p.add_argument("--reranker", help="cross-encoder directory for rerank (default: built from MiniLM, seeded head)")
    p.add_argument("--cache-dir", type=Path, default=Path.home() / ".cache" / "encoderd-bench",
                   help="Infinity virtualenv and built models (default: %(default)s)")
    p.add_argument("--log-dir", type=Path, help="server logs (default: a temporary folder, kept on failure)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quiet-wait", type=float, default=0.0,
                   help="before each measurement, wait up to this many seconds for other processes to go quiet")
    for name, help_ in (("corpus_size", "inputs in the corpus"), ("concurrency", "bulk clients (C)"),
                        ("batch", "inputs per bulk request (B)"), ("bulk_seconds", "bulk time limit (or window), s"),
                        ("bulk_warmup", "bulk load before the window opens, s"),
                        ("bulk_requests", "bulk requests in all (-1 = the corpus once; 0 = a time window)"),
                        ("single_calls", "sequential single-query calls"), ("rerank_calls", "sequential rerank calls"),
                        ("rerank_docs", "passages per rerank call")):
        kind = float if name.startswith("bulk_s") or name == "bulk_warmup" else int
        p.add_argument("--" + name.replace("_", "-"), type=kind, help=f"{help_} (full: {FULL[name]}, "
                                                                       f"quick: {QUICK[name]})")
    return p


def resolve_options(args: argparse.Namespace) -> argparse.Namespace:
    """Fill unset knobs from the profile (quick or full); an explicit flag always wins."""
    profile = QUICK if args.quick else FULL
    for key, value in profile.items():
        if getattr(args, key, None) is None:
            setattr(args, key, value)
    if args.bulk_requests < 0:
        args.bulk_requests = max(1, args.corpus_size // args.batch)
    args.modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if unknown := set(args.modes) - {"bulk", "single", "rerank"}:
        raise SystemExit(f"encoderd bench: unknown modes {sorted(unknown)}")
    if args.quick:
        args.infinity, args.no_st = False, True
    return args


# ---------------------------------------------------------------------------- corpus

_SUBJECTS = ("the committee", "a small team of engineers", "our customers", "the city council", "researchers at the lab",
             "the new model", "most users", "the support agent", "the quarterly report", "a local bakery",
             "the hospital", "each student", "the delivery driver", "the search engine", "investors",
             "the museum curator", "the farmers in the valley", "the airline", "my neighbour", "the database")
_VERBS = ("announced", "reviewed", "improved", "measured", "described", "rejected", "compared", "shipped", "tested",
          "explained", "questioned", "documented", "scheduled", "cancelled", "recommended", "summarised",
          "translated", "repaired", "predicted", "celebrated")
_OBJECTS = ("the budget for next year", "a faster search index", "the results of the clinical trial",
            "several new recipes", "the migration plan", "an unexpected drop in sales", "the water supply",
            "the price of electricity", "a detailed travel itinerary", "the security vulnerability",
            "the football season", "their hiring process", "the climate data from 1998", "the customer feedback",
            "a short documentary about bees", "the contract with the supplier", "the broken elevator",
            "the vaccination schedule", "a new bicycle lane", "the embeddings of every product description")
_TAILS = ("after a long discussion", "because latency matters", "in the second quarter", "without any downtime",
          "despite the heavy rain", "before the deadline on Friday", "for the third time this month",
          "with help from volunteers", "according to the press release", "although nobody asked for it",
          "while the servers were under load", "at 3:45 pm", "near the old railway station", "in Zürich and Lyon",
          "using about 12% less energy", "on behalf of the board", "once the tests passed", "as expected")
_QUERIES = ("how do I reset my password", "best pizza near the station", "what is the capital of Australia",
            "symptoms of vitamin D deficiency", "cheap flights to Lisbon in May", "python sort list of dicts",
            "why is the sky blue", "refund policy for cancelled orders", "how long to boil an egg",
            "side effects of ibuprofen", "train times Berlin to Prague", "what does a cross encoder do",
            "how to fix a leaking tap", "weather tomorrow in Oslo", "open source vector database",
            "history of the printing press")


def _sentence(rng: random.Random) -> str:
    parts = [rng.choice(_SUBJECTS), rng.choice(_VERBS), rng.choice(_OBJECTS)]
    if rng.random() < 0.6:
        parts.append(rng.choice(_TAILS))
    text = " ".join(parts)
    return text[0].upper() + text[1:] + rng.choice((".", ".", ".", "!", "?"))


class TokenCounter:
    """The model's tokenizer, untruncated: lengths include special tokens, as a model sees them."""

    def __init__(self, model_dir: str):
        from tokenizers import Tokenizer

        self.tok = Tokenizer.from_file(str(Path(model_dir) / "tokenizer.json"))
        self.tok.no_truncation()
        self.tok.no_padding()

    def lengths(self, texts: list[str]) -> np.ndarray:
        return np.array([len(e.ids) for e in self.tok.encode_batch(texts)], dtype=np.int64)

    def pair_lengths(self, query: str, docs: list[str]) -> np.ndarray:
        return np.array([len(e.ids) for e in self.tok.encode_batch([(query, d) for d in docs])], dtype=np.int64)

    def cut(self, text: str, tokens: int) -> str:
        """The longest prefix of `text` that tokenizes to at most `tokens` tokens (specials included)."""
        enc = self.tok.encode(text, add_special_tokens=False)
        keep = max(1, tokens - 2)  # [CLS] ... [SEP]
        return text if keep >= len(enc.offsets) else text[: enc.offsets[keep - 1][1]]


def make_corpus(counter: TokenCounter, n: int, seed: int, lo: int = 5, hi: int = 500) -> list[str]:
    """n passages whose token lengths are log-uniform in [lo, hi]: many short chunks, a long tail,
    shuffled so any slice of the corpus has the same mix."""
    rng = random.Random(seed)
    texts = []
    for _ in range(n):
        target = round(math.exp(rng.uniform(math.log(lo), math.log(hi))))
        text = ""
        while len(text) < target * 6:  # ~4.5 characters a token here: overshoot, then cut exactly
            text = (text + " " + _sentence(rng)).strip()
        texts.append(counter.cut(text, target))
    return texts


def make_queries(n: int, seed: int) -> list[str]:
    rng = random.Random(seed + 1)
    return [rng.choice(_QUERIES) + rng.choice(("", "?", " 2024", " please", " for beginners")) for _ in range(n)]


def length_stats(lengths: np.ndarray, max_length: int) -> dict:
    effective = np.minimum(lengths, max_length)
    edges = (5, 16, 32, 64, 128, 256, 512, 10**9)
    hist = {f"{a}-{b - 1}" if b < 10**9 else f"{a}+": int(((lengths >= a) & (lengths < b)).sum())
            for a, b in itertools.pairwise(edges)}
    return {"n": int(lengths.size), "min": int(lengths.min()), "p10": float(np.percentile(lengths, 10)),
            "p50": float(np.percentile(lengths, 50)), "p90": float(np.percentile(lengths, 90)),
            "max": int(lengths.max()), "mean": float(lengths.mean()), "model_max_length": max_length,
            "truncated_fraction": float((lengths > max_length).mean()), "mean_real": float(effective.mean()),
            "histogram": hist}


# --------------------------------------------------------------------------- FLOPs

@dataclass(frozen=True)
class FlopModel:
    layers: int
    hidden: int
    intermediate: int

    @classmethod
    def from_dir(cls, model_dir: str) -> FlopModel:
        cfg = json.loads((Path(model_dir) / "config.json").read_text())
        hidden = int(cfg["hidden_size"])
        return cls(int(cfg["num_hidden_layers"]), hidden, int(cfg.get("intermediate_size", 4 * hidden)))

    @property
    def matmul_params(self) -> int:
        return self.layers * (4 * self.hidden ** 2 + 2 * self.hidden * self.intermediate)

    def flops(self, real_lengths: np.ndarray) -> float:
        n = real_lengths.astype(np.float64)
        return float((n * (2 * self.matmul_params + 4 * self.layers * self.hidden * n)).sum())


def matmul_peak(threads: int, sizes, seconds: float = 0.4) -> dict:
    """Best sustained GFLOP/s of torch.mm for fp32 and bf16 at a few shapes (square and the model's own)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    result = {"threads": threads}
    try:
        for name, dtype in (("float32", torch.float32), ("bfloat16", torch.bfloat16)):
            per_shape = {}
            for m, k, n in sizes:
                a, b = torch.randn(m, k).to(dtype), torch.randn(k, n).to(dtype)
                per_shape[f"{m}x{k}x{n}"] = round(_best_gflops(torch, a, b, seconds), 1)
            result[name] = max(per_shape.values())
            result[name + "_shapes"] = per_shape
    finally:
        torch.set_num_threads(before)
    result["float16"] = result["bfloat16"]  # no fp16 matmul units on most CPUs: bf16 is the better guess
    return result


def _best_gflops(torch, a, b, seconds: float) -> float:
    flop = 2.0 * a.shape[0] * a.shape[1] * b.shape[1]
    torch.mm(a, b)  # first call allocates and picks kernels
    best, spent = float("inf"), 0.0
    for _ in range(50):  # bounded; usually stops on `seconds`
        t0 = time.perf_counter()
        torch.mm(a, b)
        dt = time.perf_counter() - t0
        best, spent = min(best, dt), spent + dt
        if spent > seconds:
            break
    return flop / best / 1e9


# ----------------------------------------------------------------------- processes

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Managed:
    """A child process in its own session (Ctrl-C in our terminal does not reach it: we stop it,
    in order, from `finally`); stop() ends its whole process group."""

    def __init__(self, name: str, argv: list[str], log_path: Path, env: dict | None = None, cwd: str | None = None):
        self.name, self.argv, self.log_path = name, argv, log_path
        self.env = {**os.environ, **(env or {})}
        self.cwd = cwd
        self.proc: subprocess.Popen | None = None

    def start(self) -> Managed:
        with open(self.log_path, "wb") as out:
            self.proc = subprocess.Popen(self.argv, env=self.env, stdout=out, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, start_new_session=True, cwd=self.cwd)
        return self

    @property
    def pid(self) -> int:
        return self.proc.pid

    def check_alive(self) -> None:
        if self.proc.poll() is not None:
            raise RuntimeError(f"{self.name} exited with {self.proc.returncode}; log {self.log_path}:\n"
                               f"{self.log_tail()}")

    def log_tail(self, chars: int = 3000) -> str:
        return self.log_path.read_text(errors="replace")[-chars:] if self.log_path.exists() else ""

    def stop(self, timeout: float = 30) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)  # graceful: the server stops its own children
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            pass
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)  # anything of its group still there
        self.proc.wait()


def wait_until(check, what: str, proc: Managed, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        proc.check_alive()
        with contextlib.suppress(Exception):
            if check():
                return
        time.sleep(0.25)
    raise TimeoutError(f"{what} not ready after {timeout:.0f}s; log {proc.log_path}:\n{proc.log_tail()}")


def http_ok(url: str) -> bool:
    import httpx

    return httpx.get(url, timeout=2).status_code == 200


def grpc_serving(address: str) -> bool:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(address) as channel:
        status = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=2).status
    return status == health_pb2.HealthCheckResponse.SERVING


# ------------------------------------------------------------------ CPU accounting

CLK_TCK = os.sysconf("SC_CLK_TCK")


def _proc_stat(pid: int) -> tuple[int, float] | None:
    """(parent pid, CPU seconds) of a live process."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = raw[raw.rfind(")") + 2:].split()  # the command name may contain spaces
    return int(fields[1]), (int(fields[11]) + int(fields[12])) / CLK_TCK


def process_tree(root: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and (st := _proc_stat(int(entry.name))):
            children.setdefault(st[0], []).append(int(entry.name))
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo.extend(children.get(pid, ()))
    return out


def system_busy_seconds() -> float:
    """CPU seconds all cores spent not idle since boot."""
    values = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = values[3] + values[4]  # idle + iowait
    return (sum(values[:8]) - idle) / CLK_TCK


class CpuProbe:
    """Snapshots of CPU seconds per named group of processes; groups are pid lists fixed at creation."""

    def __init__(self, groups: dict[str, list[int]]):
        self.groups = groups

    def snapshot(self) -> dict:
        snap = {"t": time.monotonic(), "system": system_busy_seconds(), "client": time.process_time()}
        for name, pids in self.groups.items():
            snap[name] = sum((_proc_stat(p) or (0, 0.0))[1] for p in pids)
        return snap

    @staticmethod
    def cores(a: dict, b: dict) -> dict:
        """Average cores used per group between two snapshots, plus everyone else's ("foreign")."""
        wall = max(b["t"] - a["t"], 1e-9)
        used = {k: (b[k] - a[k]) / wall for k in a if k not in ("t", "system")}
        used["foreign"] = max(0.0, (b["system"] - a["system"]) / wall - sum(used.values()))
        return {k: round(v, 3) for k, v in used.items()}


# ------------------------------------------------------------------------- metrics

def scrape(url: str | None) -> dict[str, float]:
    """encoderd counters summed over their labels, per metric sample name and model."""
    if not url:
        return {}
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    for family in text_string_to_metric_families(httpx.get(url, timeout=5).text):
        for s in family.samples:
            if s.name.startswith("encoderd_") and "model" in s.labels and "le" not in s.labels:
                key = f"{s.name}|{s.labels['model']}"
                out[key] = out.get(key, 0.0) + s.value
    return out


def server_counters(before: dict, after: dict, model: str) -> dict:
    def delta(name: str) -> float:
        key = f"{name}|{model}"
        return after.get(key, 0.0) - before.get(key, 0.0)

    real, computed, batches = (delta("encoderd_real_tokens_total"), delta("encoderd_computed_tokens_total"),
                               delta("encoderd_batches_total"))
    if not real:
        return {}
    return {"padding_ratio": computed / real, "batches": int(batches),
            "mean_batch_size": delta("encoderd_batch_size_sum") / max(batches, 1),
            "mean_batch_seconds": delta("encoderd_batch_duration_seconds_sum") / max(batches, 1),
            "server_real_tokens": int(real), "server_computed_tokens": int(computed)}


# ------------------------------------------------------------------------- clients

class GrpcTarget:
    """encoderd over gRPC (generated stubs: what a Go/Java/Python client pays)."""

    protocol = "grpc"

    def __init__(self, address: str, embed_model: str, rerank_model: str | None):
        import grpc

        from ..v1 import encoderd_pb2, encoderd_pb2_grpc

        self.address, self.embed_model, self.rerank_model = address, embed_model, rerank_model
        self._grpc, self._pb, self._pb_grpc = grpc, encoderd_pb2, encoderd_pb2_grpc
        self._channel = grpc.insecure_channel(address, options=[("grpc.max_receive_message_length", 64 << 20)])
        self._stub = encoderd_pb2_grpc.EncoderStub(self._channel)

    def embed(self, texts: list[str]) -> int:
        reply = self._stub.Embed(self._pb.EmbedRequest(model=self.embed_model, inputs=texts), timeout=600)
        return len(reply.embeddings)

    def rerank(self, query: str, docs: list[str]) -> int:
        request = self._pb.RerankRequest(model=self.rerank_model, query=query, documents=docs)
        return len(self._stub.Rerank(request, timeout=600).results)

    @contextlib.asynccontextmanager
    async def aio_stub(self):
        """(stub, messages module) on a grpc.aio channel; such channels belong to the running loop."""
        channel = self._grpc.aio.insecure_channel(self.address,
                                                  options=[("grpc.max_receive_message_length", 64 << 20)])
        try:
            yield self._pb_grpc.EncoderStub(channel), self._pb
        finally:
            await channel.close()

    @contextlib.asynccontextmanager
    async def session(self):
        """An async embed function for bulk clients."""
        async with self.aio_stub() as (stub, pb):
            async def embed(texts: list[str]) -> int:
                reply = await stub.Embed(pb.EmbedRequest(model=self.embed_model, inputs=texts), timeout=600)
                return len(reply.embeddings)

            yield embed

    def close(self) -> None:
        self._channel.close()


class RestTarget:
    """OpenAI `POST {base}/embeddings` (encoding_format float) and Cohere `POST {base}/rerank`, over httpx:
    the same client code for encoderd's Envoy and for Infinity."""

    protocol = "rest"

    def __init__(self, base_url: str, embed_model: str, rerank_model: str | None):
        import httpx

        self.base, self.embed_model, self.rerank_model = base_url.rstrip("/"), embed_model, rerank_model
        self._httpx = httpx
        self._client = httpx.Client(timeout=600)

    def _embed_body(self, texts: list[str]) -> dict:
        return {"model": self.embed_model, "input": texts, "encoding_format": "float"}

    def embed(self, texts: list[str]) -> int:
        reply = self._client.post(self.base + "/embeddings", json=self._embed_body(texts))
        reply.raise_for_status()
        return len(reply.json()["data"])

    def rerank(self, query: str, docs: list[str]) -> int:
        body = {"model": self.rerank_model, "query": query, "documents": docs, "return_documents": False}
        reply = self._client.post(self.base + "/rerank", json=body)
        reply.raise_for_status()
        return len(reply.json()["results"])

    @contextlib.asynccontextmanager
    async def session(self):
        limits = self._httpx.Limits(max_connections=1024, max_keepalive_connections=1024)
        async with self._httpx.AsyncClient(timeout=600, limits=limits) as client:
            async def embed(texts: list[str]) -> int:
                reply = await client.post(self.base + "/embeddings", json=self._embed_body(texts))
                reply.raise_for_status()
                return len(reply.json()["data"])

            yield embed

    def close(self) -> None:
        self._client.close()


class SentenceTransformersTarget:
    """sentence-transformers in this process: no server, no serialization; its encode() sorts by length."""

    protocol = "in-process"

    def __init__(self, embed_dir: str, rerank_dir: str | None, threads: int):
        import torch
        from sentence_transformers import CrossEncoder, SentenceTransformer

        torch.set_num_threads(threads)  # the same threads as the encoderd worker
        self.model = SentenceTransformer(embed_dir, device="cpu")
        self.cross = CrossEncoder(rerank_dir, device="cpu") if rerank_dir else None

    def embed(self, texts: list[str], batch_size: int = 32) -> int:
        return len(self.model.encode(texts, batch_size=batch_size, show_progress_bar=False))

    def rerank(self, query: str, docs: list[str]) -> int:
        return len(self.cross.predict([(query, d) for d in docs], show_progress_bar=False))

    def padding_ratio(self, texts: list[str], lengths: np.ndarray, batch_size: int) -> float:
        """Padding its encode() computes: it sorts by character length, batches, pads to each batch's longest."""
        order = np.argsort([-len(t) for t in texts], kind="stable")
        sorted_lengths = lengths[order]
        computed = sum(len(b) * b.max() for b in np.array_split(sorted_lengths,
                                                               range(batch_size, len(texts), batch_size)))
        return float(computed / sorted_lengths.sum())

    def close(self) -> None:
        pass


# --------------------------------------------------------------------------- modes

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
    cpu_cores: dict = field(default_factory=dict)
    server: dict = field(default_factory=dict)
    notes: str = ""


def percentiles(latencies: list[float], row: Row) -> None:
    if latencies:
        ms = np.array(latencies) * 1e3
        row.p50_ms, row.p95_ms, row.p99_ms = (round(float(np.percentile(ms, q)), 2) for q in (50, 95, 99))


@dataclass
class Workload:
    corpus: list[str]
    real: np.ndarray            # real (truncated) tokens per corpus input
    queries: list[str]
    query_real: np.ndarray
    rerank_sets: list[tuple[str, list[str], np.ndarray]]   # query, passages, real pair tokens


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
        except Exception as exc:  # counted and reported, never fatal: a benchmark keeps going
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
    return {"issued": 0, "errors": 0, "done": [], "window": (start + args.bulk_warmup, 0.0),
            "deadline": start + args.bulk_warmup + args.bulk_seconds}


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
    except Exception as exc:
        state["errors"], state["last_error"] = state["errors"] + 1, f"{type(exc).__name__}: {str(exc)[:200]}"


def run_bulk(name: str, target, work: Workload, args, probe: CpuProbe | None, metrics_url: str | None,
             model: str, flops: FlopModel, peak: float, worker_threads: int, stream: bool = False) -> Row:
    how = "one EmbedStream" if stream else f"{args.concurrency} clients x {args.batch} inputs"
    protocol = "grpc-stream" if stream else target.protocol
    log(f"bulk {name}/{protocol}: {how}, " + (f"{args.bulk_requests * args.batch} inputs" if args.bulk_requests
                                              else f"{args.bulk_warmup:g}s warm-up + {args.bulk_seconds:g}s window"))
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
    row.flop_utilisation = round(_useful_flops(work, done, flops, wall) / (peak * 1e9), 4)
    row.server = server_counters(before, scrape(metrics_url), model)
    row.padding_ratio = row.server.get("padding_ratio")
    if snap0 and snap1:
        row.cpu_cores = CpuProbe.cores(snap0, snap1)
        row.worker_busy = busy(row.cpu_cores, "worker", worker_threads)
    if state.get("last_error"):
        row.notes = state["last_error"]
    return row


def _useful_flops(work: Workload, done, flops: FlopModel, wall: float) -> float:
    # Per-request FLOPs would need the indices; tokens/s x the corpus' mean FLOPs per real token is exact
    # in expectation because every request is a slice of the same shuffled mix.
    per_token = flops.flops(work.real) / float(work.real.sum())
    return per_token * sum(d[3] for d in done) / wall


def run_bulk_in_process(st: SentenceTransformersTarget, work: Workload, args, flops: FlopModel, peak: float,
                        threads: int) -> Row:
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
    row = Row("bulk", "sentence-transformers", "in-process", calls=w + 1, wall_s=round(wall, 2),
              inputs_per_s=round(inputs / wall, 2), tokens_per_s=round(tokens / wall, 1),
              padding_ratio=round(float(np.mean(padding)), 4), cpu_cores=CpuProbe.cores(snap0, snap1))
    row.flop_utilisation = round(flops.flops(work.real) / float(work.real.sum()) * tokens / wall / (peak * 1e9), 4)
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
        except Exception as exc:  # counted and reported, never fatal
            errors, last_error = errors + 1, f"{type(exc).__name__}: {str(exc)[:200]}"
    snap1 = probe.snapshot()
    return Sequential(latencies, errors, last_error, snap1["t"] - snap0["t"], CpuProbe.cores(snap0, snap1))


def run_single(name: str, target, work: Workload, args, probe: CpuProbe | None, threads: int) -> Row:
    log(f"single {name}/{target.protocol}: {args.single_calls} sequential one-query calls")
    items = [work.queries[i % len(work.queries)] for i in range(args.single_calls)]
    run = _sequential(lambda q: target.embed([q]), items, probe, warmup=3)
    tokens = sum(int(work.query_real[i % len(work.queries)]) for i in range(len(run.latencies)))
    row = Row("single", name, target.protocol, calls=len(run.latencies), errors=run.errors, notes=run.last_error,
              inputs_per_s=round(len(run.latencies) / run.wall, 2), tokens_per_s=round(tokens / run.wall, 1),
              cpu_cores=run.cpu_cores, worker_busy=busy(run.cpu_cores, "worker", threads))
    percentiles(run.latencies, row)
    return row


def run_rerank(name: str, target, work: Workload, args, probe: CpuProbe | None, flops: FlopModel,
               peak: float, threads: int) -> Row:
    log(f"rerank {name}/{target.protocol}: {args.rerank_calls} sequential calls, query + {args.rerank_docs} passages")
    sets = work.rerank_sets
    run = _sequential(lambda s: target.rerank(s[0], s[1]), sets, probe, warmup=1)
    tokens = np.concatenate([s[2] for s in sets])
    row = Row("rerank", name, target.protocol, calls=len(run.latencies), errors=run.errors, notes=run.last_error,
              inputs_per_s=round(len(run.latencies) * args.rerank_docs / run.wall, 2),
              tokens_per_s=round(float(tokens.sum()) / run.wall, 1), cpu_cores=run.cpu_cores,
              worker_busy=busy(run.cpu_cores, "rerank_worker", threads))
    row.flop_utilisation = round(flops.flops(tokens) / run.wall / (peak * 1e9), 4)
    percentiles(run.latencies, row)
    return row


# ---------------------------------------------------------------------- the servers

def serve_flags() -> set[str]:
    """The flags this checkout's `encoderd serve` understands (REST is being added)."""
    from .cli import build_parser as serve_parser

    sub = next(a for a in serve_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return {opt for action in sub.choices["serve"]._actions for opt in action.option_strings}


def start_encoderd(args, embed_dir: str, rerank_dir: str | None, logs: Path, rest: bool) -> tuple[Managed, dict]:
    import shlex

    flags = serve_flags()
    ports = {"grpc": free_port(), "metrics": free_port(), "rest": free_port() if rest else 0}
    argv = [sys.executable, "-m", "encoderd.server.cli", "serve", "--host", "127.0.0.1",
            "--grpc-port", str(ports["grpc"]), "--metrics-port", str(ports["metrics"]),
            "--model", f"{DEFAULT_MODEL_NAME}={embed_dir}"]
    if rerank_dir:
        argv += ["--model", f"{RERANKER_NAME}={rerank_dir}"]
    if rest:
        argv += ["--rest-port", str(ports["rest"])]
    elif "--no-rest" in flags:  # its REST default port may be taken (or in use by another run)
        argv += ["--no-rest"]
    argv += shlex.split(args.serve_args)
    log("starting " + " ".join(argv[2:]))
    return Managed("encoderd", argv, logs / "encoderd.log").start(), ports


def infinity_venv(cache: Path) -> Path:
    """~/.cache/encoderd-bench/venv-infinity, created once: Infinity pins sentence-transformers < 4 and
    transformers 4.57, which cannot share our environment."""
    venv = cache / "venv-infinity"
    ready = venv / ".encoderd-bench-ready"
    if ready.exists() and ready.read_text() == " ".join(INFINITY_SPEC):
        return venv
    shutil.rmtree(venv, ignore_errors=True)  # a half-made one from an interrupted run
    log(f"creating {venv} with {' '.join(INFINITY_SPEC)} (once; a few minutes)")
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "install", "-q", *INFINITY_SPEC],
                   check=True, timeout=1800)
    ready.write_text(" ".join(INFINITY_SPEC))
    return venv


def start_infinity(venv: Path, embed_dir: str, rerank_dir: str | None, logs: Path) -> tuple[Managed, int]:
    port = free_port()
    models = [("--model-id", embed_dir, DEFAULT_MODEL_NAME)] + ([("--model-id", rerank_dir, RERANKER_NAME)]
                                                                 if rerank_dir else [])
    argv = [str(venv / "bin" / "infinity_emb"), "v2", "--host", "127.0.0.1", "--port", str(port),
            "--engine", "torch", "--device", "cpu", "--dtype", "float32",
            "--no-vector-disk-cache"]  # its default caches results by request hash: repeated inputs would be free
    for flag, path, name in models:
        argv += [flag, path, "--served-model-name", name]
    env = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "INFINITY_ANONYMOUS_USAGE_STATS": "0",
           "DO_NOT_TRACK": "1", "PYTHONPATH": ""}
    log("starting infinity_emb " + " ".join(argv[2:]))
    # cwd outside the repository, so nothing of ours shadows its imports
    return Managed("infinity", argv, logs / "infinity.log", env=env, cwd=str(logs)).start(), port


def build_reranker(args) -> str:
    """A one-label cross-encoder: MiniLM body + seeded head (tests/support/models.py), built once."""
    if args.reranker:
        return args.reranker
    import importlib.util

    source = REPO_ROOT / "tests" / "support" / "models.py"
    if not source.exists():
        raise SystemExit("encoderd bench: rerank needs --reranker DIR (no repository checkout to build one from)")
    spec = importlib.util.spec_from_file_location("_encoderd_test_models", source)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    args.cache_dir.mkdir(parents=True, exist_ok=True)
    return str(module.build_reranker(args.cache_dir / "reranker-minilm"))


def list_models(address: str) -> list:
    import grpc

    from ..v1 import encoderd_pb2, encoderd_pb2_grpc

    with grpc.insecure_channel(address) as channel:
        return list(encoderd_pb2_grpc.EncoderStub(channel).ListModels(encoderd_pb2.ListModelsRequest(),
                                                                        timeout=10).models)


def encoderd_probe_groups(server: Managed | None, models: list, embed_model: str,
                          rerank_model: str | None) -> dict[str, list[int]]:
    """The workers of the benchmarked models, the others, and the rest of the server's tree (frontend, Envoy)."""
    def pids(model_ids) -> list[int]:
        return [r.pid for m in models if m.id in model_ids for r in m.replicas if r.pid]

    groups = {"worker": pids({embed_model}), "rerank_worker": pids({rerank_model})}
    if server:
        named = {p for g in groups.values() for p in g}
        groups["other_workers"] = [p for p in pids({m.id for m in models}) if p not in named]
        groups["frontend"] = [server.pid]
        skip = named | set(groups["other_workers"]) | {server.pid}
        groups["gateway"] = [p for p in process_tree(server.pid) if p not in skip]
    return groups


def busy(cores: dict, group: str, threads: int) -> float | None:
    """The fraction of the wall time a worker's compute threads were on a CPU."""
    return round(cores[group] / threads, 3) if group in cores else None


# ------------------------------------------------------------------------ reporting

def print_table(rows: list[Row], out=sys.stdout) -> None:
    head = (f"{'mode':7} {'engine':22} {'proto':10} {'inputs/s':>9} {'tok/s':>9} {'p50 ms':>9} {'p95 ms':>9} "
            f"{'p99 ms':>9} {'pad':>5} {'FLOP%':>6} {'busy%':>6} {'calls':>6} {'err':>4}")
    print(head, file=out)
    print("-" * len(head), file=out)
    def fmt(value, width: int, decimals: int, scale: float = 1.0) -> str:
        return f"{value * scale:{width}.{decimals}f}" if value is not None else "-".rjust(width)

    for r in rows:
        print(f"{r.mode:7} {r.engine:22} {r.protocol:10} {r.inputs_per_s:9.1f} {r.tokens_per_s:9.0f} "
              f"{r.p50_ms:9.1f} {r.p95_ms:9.1f} {r.p99_ms:9.1f} {fmt(r.padding_ratio, 5, 2)} "
              f"{fmt(r.flop_utilisation, 6, 1, 100)} {fmt(r.worker_busy, 6, 0, 100)} {r.calls:6d} {r.errors:4d}",
              file=out)
    cpu_rows = [r for r in rows if r.cpu_cores]
    if cpu_rows:
        print("\nCPU cores used while measuring (client = this process; foreign = everyone else on the machine):",
              file=out)
        for r in cpu_rows:
            used = ", ".join(f"{k} {v:.2f}" for k, v in r.cpu_cores.items() if v >= 0.005 or k == "foreign")
            print(f"  {r.mode:7} {r.engine}/{r.protocol}: {used}", file=out)
    for r in rows:
        if r.notes:
            print(f"  note {r.mode} {r.engine}/{r.protocol}: {r.notes}", file=out)


def ratios(rows: list[Row]) -> list[dict]:
    """encoderd vs each other engine, per mode; > 1 means encoderd is better.
    bulk: tokens/s ratio; single and rerank: p50 latency of the other / encoderd's."""
    out = []
    for mine in (r for r in rows if r.engine == "encoderd"):
        for other in (r for r in rows if r.mode == mine.mode and r.engine != "encoderd"):
            if mine.mode == "bulk":
                value = mine.tokens_per_s / other.tokens_per_s if other.tokens_per_s else None
                metric = "tokens/s encoderd / other"
            else:
                value = other.p50_ms / mine.p50_ms if mine.p50_ms else None
                metric = "p50 other / encoderd"
            out.append({"mode": mine.mode, "encoderd": mine.protocol, "vs": f"{other.engine}/{other.protocol}",
                        "metric": metric, "ratio": round(value, 3) if value else None})
    return out


def print_ratios(items: list[dict], out=sys.stdout) -> None:
    if not items:
        return
    print("\nRatios (> 1 = encoderd better):", file=out)
    for x in items:
        value = f"{x['ratio']:.2f}x" if x["ratio"] else "-"
        print(f"  {x['mode']:7} encoderd/{x['encoderd']:5} vs {x['vs']:34} {value:>8}   ({x['metric']})", file=out)


# ----------------------------------------------------------------------------- main

def make_workload(args, embed_dir: str, rerank_dir: str | None) -> tuple[Workload, dict]:
    counter = TokenCounter(embed_dir)
    embed_max = load_model_spec("bench", embed_dir).max_length
    corpus = make_corpus(counter, args.corpus_size, args.seed)
    lengths = counter.lengths(corpus)
    queries = make_queries(64, args.seed)
    info = {"corpus": length_stats(lengths, embed_max),
            "queries": length_stats(counter.lengths(queries), embed_max)}
    sets = []
    if rerank_dir:
        rerank_max = load_model_spec("bench", rerank_dir).max_length
        rng = random.Random(args.seed + 2)
        for i in range(args.rerank_calls):
            docs = [corpus[rng.randrange(len(corpus))] for _ in range(args.rerank_docs)]
            sets.append((queries[i % len(queries)], docs,
                         np.minimum(counter.pair_lengths(queries[i % len(queries)], docs), rerank_max)))
        info["rerank_pairs"] = length_stats(np.concatenate([s[2] for s in sets]), rerank_max)
    work = Workload(corpus, np.minimum(lengths, embed_max), queries, np.minimum(counter.lengths(queries), embed_max),
                    sets)
    return work, info


def worker_threads(args) -> int:
    import shlex

    tokens = shlex.split(args.serve_args)
    for i, tok in enumerate(tokens):
        if tok == "--cpu-threads" and i + 1 < len(tokens) and int(tokens[i + 1]) > 0:
            return int(tokens[i + 1])
        if tok.startswith("--cpu-threads=") and int(tok.split("=", 1)[1]) > 0:
            return int(tok.split("=", 1)[1])
    return int(os.environ.get("ENCODERD_CPU_THREADS", "0")) or len(os.sched_getaffinity(0))


class Bench:
    """Owns everything it starts; close() stops it all, whatever happened."""

    def __init__(self, args):
        self.args = args
        self.stack = contextlib.ExitStack()
        self.rows: list[Row] = []
        self.info: dict = {}

    def run(self) -> dict:
        args = self.args
        started = time.monotonic()
        embed_dir = default_model_path()
        rerank_dir = build_reranker(args) if "rerank" in args.modes else None
        work, self.info = make_workload(args, embed_dir, rerank_dir)
        log(f"corpus: {len(work.corpus)} inputs, tokens p50 {self.info['corpus']['p50']:.0f} "
            f"mean {self.info['corpus']['mean']:.0f} max {self.info['corpus']['max']}")
        threads = worker_threads(args)
        self.info["peak_gflops"] = peak = self.measure_peak(threads)
        log(f"matmul peak with {threads} threads: fp32 {peak['float32']:.0f} GFLOP/s, "
            f"bf16 {peak['bfloat16']:.0f} GFLOP/s (others used {peak['foreign_cores']:.2f} cores meanwhile)")
        targets = self.start_targets(embed_dir, rerank_dir)
        flops = FlopModel.from_dir(embed_dir)
        self.info["flop_model"] = {**asdict(flops), "matmul_params": flops.matmul_params,
                                   "formula": "FLOPs(n) = n * (2*P + 4*L*H*n), P = L*(4H^2 + 2HI)"}
        self.run_modes(targets, work, flops, threads)
        self.info["elapsed_s"] = round(time.monotonic() - started, 1)
        return self.report()

    def start_targets(self, embed_dir: str, rerank_dir: str | None) -> list[dict]:
        args = self.args
        logs = args.log_dir or Path(tempfile.mkdtemp(prefix="encoderd-bench-"))
        logs.mkdir(parents=True, exist_ok=True)
        self.info["log_dir"] = str(logs)
        rest = args.rest and self._rest_available()
        venv = infinity_venv(args.cache_dir) if args.infinity else None
        server = ports = infinity = None
        if not args.target_grpc:
            server, ports = start_encoderd(args, embed_dir, rerank_dir, logs, rest)
            self.stack.callback(server.stop)
        if venv:  # started together: both load at once, saving a minute
            infinity, inf_port = start_infinity(venv, embed_dir, rerank_dir, logs)
            self.stack.callback(infinity.stop)
        targets = self._encoderd_targets(server, ports, rest)
        if infinity:
            wait_until(lambda: http_ok(f"http://127.0.0.1:{inf_port}/health"), "infinity", infinity, 600)
            client = RestTarget(f"http://127.0.0.1:{inf_port}", DEFAULT_MODEL_NAME, rerank_dir and RERANKER_NAME)
            self.stack.callback(client.close)
            tree = process_tree(infinity.pid)
            self.info.setdefault("pids", {})["infinity"] = tree
            targets.append({"name": "infinity", "client": client, "probe": CpuProbe({"server": tree}),
                            "metrics": None, "dtype": "float32"})
            log("infinity ready")
        if not args.no_st:
            log("loading sentence-transformers in this process")
            st = SentenceTransformersTarget(embed_dir, rerank_dir, worker_threads(args))
            targets.append({"name": "sentence-transformers", "client": st, "probe": None, "metrics": None,
                            "dtype": "float32"})
        self._add_foreign_reference(targets)
        return targets

    def _rest_available(self) -> bool:
        if self.args.target_grpc:
            return bool(self.args.target_rest)
        if "--rest-port" in serve_flags():
            return True
        log("REST skipped: this checkout's `encoderd serve` has no --rest-port yet")
        self.info["rest_skipped"] = "encoderd serve has no --rest-port"
        return False

    def _encoderd_targets(self, server: Managed | None, ports: dict | None, rest: bool) -> list[dict]:
        args = self.args
        address = args.target_grpc or f"127.0.0.1:{ports['grpc']}"
        metrics = args.target_metrics or (f"http://127.0.0.1:{ports['metrics']}/metrics" if ports else None)
        if server:
            wait_until(lambda: grpc_serving(address), "encoderd gRPC", server, 900)
        base = (args.target_rest or f"http://127.0.0.1:{ports['rest']}") if rest else ""
        if server and rest:  # before the process tree is read: Envoy is one of its children
            wait_until(lambda: http_ok(base + "/health"), "encoderd REST", server, 300)
        models = list_models(address)
        embed = next(m for m in models if m.kind == "embedding")
        rerank = next((m.id for m in models if m.kind == "reranker"), None)
        self.info["encoderd_models"] = [{"id": m.id, "kind": m.kind, "engine": m.engine, "device": m.device,
                                         "dtype": m.dtype, "replicas": len(m.replicas)} for m in models]
        probe = CpuProbe(encoderd_probe_groups(server, models, embed.id, rerank))
        self.info["pids"] = {"encoderd": sorted({p for pids in probe.groups.values() for p in pids})}
        grpc_client = GrpcTarget(address, embed.id, rerank)
        self.stack.callback(grpc_client.close)
        targets = [{"name": "encoderd", "client": grpc_client, "probe": probe, "metrics": metrics,
                    "dtype": embed.dtype, "model": embed.id}]
        if rest:
            rest_client = RestTarget(base.rstrip("/") + "/v1", embed.id, rerank)
            self.stack.callback(rest_client.close)
            targets.append({**targets[0], "client": rest_client})
        log(f"encoderd ready: {', '.join(m.id for m in models)}")
        return targets

    def _add_foreign_reference(self, targets: list[dict]) -> None:
        # Every group knows all our processes, so "foreign" excludes the other idle server too.
        ours = {name: pids for t in targets if t["probe"] for name, pids in t["probe"].groups.items()}
        all_pids = sorted({p for pids in ours.values() for p in pids})
        for t in targets:
            if t["probe"]:
                mine = {p for pids in t["probe"].groups.values() for p in pids}
                t["probe"].groups["idle_servers"] = [p for p in all_pids if p not in mine]

    def run_modes(self, targets: list[dict], work: Workload, flops: FlopModel, threads: int) -> None:
        args, peak = self.args, self.info["peak_gflops"]
        # Mode by mode, every target side by side: the conditions of the machine stay comparable.
        if "single" in args.modes:
            for t in targets:
                self.quiet()
                self.rows.append(run_single(t["name"], t["client"], work, args, t["probe"], threads))
        if "rerank" in args.modes and work.rerank_sets:
            for t in targets:
                self.quiet()
                self.rows.append(run_rerank(t["name"], t["client"], work, args, t["probe"], flops,
                                            peak[t["dtype"]], threads))
        if "bulk" in args.modes:
            for t in targets:
                self.quiet()
                if t["name"] == "sentence-transformers":
                    row = run_bulk_in_process(t["client"], work, args, flops, peak["float32"], threads)
                else:
                    row = run_bulk(t["name"], t["client"], work, args, t["probe"], t["metrics"],
                                   t.get("model", ""), flops, peak[t["dtype"]], threads)
                self.rows.append(row)
                if args.stream and t["name"] == "encoderd" and t["client"].protocol == "grpc":
                    self.quiet()
                    self.rows.append(run_bulk(t["name"], t["client"], work, args, t["probe"], t["metrics"],
                                              t.get("model", ""), flops, peak[t["dtype"]], threads, stream=True))

    def measure_peak(self, threads: int) -> dict:
        """The best of up to three tries: a peak measured while others load the machine is too low (and
        every utilisation too high), so it retries unless the machine was quiet, and says how busy it was."""
        best: dict = {}
        for _ in range(1 if self.args.quick else 3):
            self.quiet()
            before = CpuProbe({}).snapshot()
            peak = matmul_peak(threads, self.args.peak_sizes)
            peak["foreign_cores"] = CpuProbe.cores(before, CpuProbe({}).snapshot())["foreign"]
            if not best or peak["float32"] > best["float32"]:
                best = peak
            if peak["foreign_cores"] < 0.2:
                break
        return best

    def quiet(self) -> None:
        """On a shared machine, wait (up to --quiet-wait s) until the others use < 0.3 cores; our servers
        are idle between measurements, so what is busy now is someone else."""
        deadline = time.monotonic() + self.args.quiet_wait
        while True:
            a = CpuProbe({}).snapshot()
            time.sleep(1.0)
            load = CpuProbe.cores(a, CpuProbe({}).snapshot())["foreign"]
            if load < 0.3 or time.monotonic() >= deadline:
                break
        if self.args.quiet_wait:
            log(f"  machine load before measuring: {load:.2f} cores used by others")

    def report(self) -> dict:
        args = self.args
        result = {"conditions": {
            "quick": args.quick, "serve_args": args.serve_args, "concurrency": args.concurrency, "batch": args.batch,
            "bulk_seconds": args.bulk_seconds, "bulk_warmup": args.bulk_warmup, "single_calls": args.single_calls,
            "rerank_calls": args.rerank_calls, "rerank_docs": args.rerank_docs, "cpus": len(os.sched_getaffinity(0)),
            "worker_threads": worker_threads(args), "python": sys.version.split()[0]},
            **self.info, "results": [asdict(r) for r in self.rows], "ratios": ratios(self.rows)}
        print()
        print_table(self.rows)
        print_ratios(result["ratios"])
        print(f"\nconditions: {json.dumps(result['conditions'])}\ncorpus tokens: "
              f"{json.dumps({k: v for k, v in self.info['corpus'].items()})}")
        if args.json:
            args.json.write_text(json.dumps(result, indent=2))
            log(f"wrote {args.json}")
        return result

    def close(self) -> None:
        self.stack.close()


def _raise_on_sigterm(signum, frame):
    raise SystemExit(128 + signum)  # unwinds through `finally`, so the servers are stopped


def main(argv: list[str] | None = None, prog: str = "python -m encoderd.server.bench") -> int:
    args = resolve_options(build_parser(prog).parse_args(argv))
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    signal.signal(signal.SIGTERM, _raise_on_sigterm)
    bench = Bench(args)
    try:
        bench.run()
    except KeyboardInterrupt:
        log("interrupted; stopping what was started")
        return 130
    finally:
        bench.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
