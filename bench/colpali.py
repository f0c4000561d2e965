"""`python -m encoderd.bench.colpali`: pages/s and query latency of a ColPali / ColQwen2 model served
by encoderd, beside transformers' own loop on the same inputs, in one run.

transformers' loop is what the model cards show: `model(**processor(images=pages))` over batches of
--batch pages (decoded from the same PNG files encoderd gets), and `model(**processor(text=[query]))`
one query at a time, in a process of its own with --threads torch threads. encoderd serves the
same directory (`encoderd serve --cpu-threads --threads --replicas 1`) and gets the same pages in
requests of --batch pages (--concurrency in flight) and the same queries one request at a time.
The phases run one after the other, each after a warm-up, with one model in memory at a time (a
real-size model twice would not fit): transformers' process exits before the server starts, and
--min-available-gib waits for memory before each phase. The served vectors of the first page are
compared with transformers' (min cosine).

Models (encoderd.bench.retrieval_models): --size tiny or real (random weights, real sizes), built
once under --cache-dir. Pages are drawn here: text lines, a rule and a figure on white, in four
shapes (A4 portrait, a 4:3 slide, a receipt, a square) so ColQwen2 reads them at different
resolutions.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import random
import statistics
import time
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from functools import partial
from pathlib import Path

import numpy as np

from .corpus import make_queries
from .options import log

PAGE_SHAPES = ((827, 1169), (1024, 768), (400, 1000), (700, 700))  # A4 at 100 dpi, a slide, a receipt, a square
_FORMAT = "retrieval-2"  # change when what retrieval_models builds changes


def build(cache: Path, model: str, size: str) -> str:
    from .models import build_once

    return build_once(cache / f"{model}-{size}", partial(in_child, _write, model, size == "real"), _FORMAT)


def _write(model: str, real: bool, out: Path) -> None:
    from . import retrieval_models

    write = retrieval_models.write_colpali if model == "colpali" else retrieval_models.write_colqwen2
    write(out, real=real)


def in_child(fn, *args):
    """fn(*args) in a process of its own, its result back. The weights it held (and torch's heap
    around them) go back to the OS when that process exits, before the next phase loads its own
    copy: freed inside one process, part of a model's memory stays in glibc's heap."""
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(fn, *args).result()


def available_gib() -> float:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) / (1 << 20)
    return float("inf")  # not Linux: nothing to wait for


def wait_for_memory(gib: float, what: str) -> None:
    """Poll until `gib` GiB are available: on a shared host, a real-size phase started short of
    memory is killed (or swaps) and measures nothing."""
    while (available := available_gib()) < gib:
        log(f"{what}: waiting for {gib:g} GiB available (now {available:.1f})")
        time.sleep(20)


def draw_page(seed: int):
    """A document page: lines of words, a rule, a grey figure; its shape by seed."""
    from PIL import Image, ImageDraw

    rng = random.Random(seed)
    width, height = PAGE_SHAPES[seed % len(PAGE_SHAPES)]
    page = Image.new("RGB", (width, height), "white")
    draw = ImageDraw.Draw(page)
    words = make_queries(40, seed)
    y = 20
    while y < height * 0.6:
        draw.text((20, y), " ".join(rng.sample(words, 4))[: width // 7], fill="black")
        y += 14
    draw.line((20, y, width - 20, y), fill="black", width=2)
    draw.rectangle((width // 5, y + 20, 4 * width // 5, height - 30), fill=(rng.randrange(60, 200),) * 3)
    return page


def png(image) -> bytes:
    import io

    buf = io.BytesIO()
    image.save(buf, "PNG")
    return buf.getvalue()


def decoded(blobs: list[bytes]) -> list:
    """PIL images of PNG files: what a loop over page files does first (encoderd decodes them too)."""
    import io

    from PIL import Image

    return [Image.open(io.BytesIO(blob)) for blob in blobs]


def transformers_loop(path: str, args, blobs: list[bytes], queries) -> dict:
    import torch
    import transformers

    torch.set_num_threads(args.threads)
    config = transformers.AutoConfig.from_pretrained(path)
    cls = transformers.ColPaliForRetrieval if config.model_type == "colpali" else transformers.ColQwen2ForRetrieval
    dtype = getattr(torch, args.dtype)
    model = cls.from_pretrained(path, dtype=dtype).eval()
    processor = transformers.AutoProcessor.from_pretrained(path)
    with torch.inference_mode():
        model(**processor(images=decoded(blobs[:1])))  # warm-up
        model(**processor(text=queries[:1]))
        started = time.perf_counter()
        first = None
        for start in range(0, len(blobs), args.batch):
            out = model(**processor(images=decoded(blobs[start : start + args.batch]))).embeddings
            first = out[0] if first is None else first
        elapsed = time.perf_counter() - started
        latencies = []
        for query in queries:
            began = time.perf_counter()
            model(**processor(text=[query]))
            latencies.append(time.perf_counter() - began)
        mask = processor(images=decoded(blobs[:1]))["attention_mask"][0].bool()
        assert first is not None  # at least one page
        rows = first[: len(mask)][mask].float().numpy()
    return {"pages_per_s": len(blobs) / elapsed, "latencies": latencies, "first_page": rows}


def encoderd_loop(path: str, args, blobs: list[bytes], queries, logs: Path) -> dict:
    import grpc

    from ..v1 import encoderd_pb2 as pb
    from ..v1 import encoderd_pb2_grpc as pb_grpc
    from .processes import Managed, free_port, grpc_serving, serve_command, wait_until

    port = free_port()
    argv = [*serve_command(), "--host", "127.0.0.1", "--grpc-port", str(port), "--metrics-port", str(free_port())]
    argv += ["--no-rest", "--model", f"m={path}", "--cpu-threads", str(args.threads), "--replicas", "1"]
    argv += ["--dtype", args.dtype]
    argv += ["--cache-dir", str(args.cache_dir / "server-cache")]
    server = Managed("encoderd", argv, logs / "encoderd-colpali.log").start()
    try:
        address = f"127.0.0.1:{port}"
        wait_until(lambda: grpc_serving(address), "encoderd", server, timeout=3600)
        channel = grpc.insecure_channel(address, options=[("grpc.max_receive_message_length", 1 << 30)])
        stub = pb_grpc.EncoderStub(channel)

        def embed(contents):
            return stub.EmbedMultiVector(pb.EmbedMultiVectorRequest(model="m", inputs=contents), timeout=3600)

        embed([pb.Content(image=pb.Media(data=blobs[0]))])  # warm-up (and the result cache: see below)
        embed([pb.Content(text="a warm-up query")])
        # Distinct bytes per timed request: the server's result cache must not answer a page it has seen.
        salted = [_salted(blob, i) for i, blob in enumerate(blobs)]
        requests = [
            [pb.Content(image=pb.Media(data=b)) for b in salted[start : start + args.batch]]
            for start in range(0, len(salted), args.batch)
        ]
        started = time.perf_counter()
        with ThreadPoolExecutor(args.concurrency) as pool:
            responses = list(pool.map(embed, requests))
        elapsed = time.perf_counter() - started
        latencies = []
        for query in queries:
            began = time.perf_counter()
            embed([pb.Content(text=query)])
            latencies.append(time.perf_counter() - began)
        first = responses[0].embeddings[0]
        rows = np.array(first.values, dtype=np.float32).reshape(first.rows, -1)
        channel.close()
    finally:
        server.stop()
    return {"pages_per_s": len(blobs) / elapsed, "latencies": latencies, "first_page": rows}


def _salted(blob: bytes, i: int) -> bytes:
    """The same PNG with a distinct trailing byte string: decodes to the same pixels (Pillow reads
    up to IEND), hashes differently (the result cache keys on the bytes)."""
    return blob + f"encoderd-bench-{i}".encode()


def main(argv: list[str] | None = None) -> None:
    # Before torch loads: OpenMP threads that wait passively, as encoderd's workers run theirs
    # (workers/process.py). Spinning ones collapse on a shared host: a tiny ColQwen2 query took
    # 300-800 ms in transformers' loop with 2 spinning threads at load 14 on 2 cores, 1-7 ms passive.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    p = argparse.ArgumentParser(prog="python -m encoderd.bench.colpali", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=("colpali", "colqwen2"), default="colqwen2")
    p.add_argument("--size", choices=("tiny", "real"), default="tiny")
    p.add_argument("--pages", type=int, default=16)
    p.add_argument("--queries", type=int, default=20)
    p.add_argument("--batch", type=int, default=4, help="pages per transformers batch and per encoderd request")
    p.add_argument("--concurrency", type=int, default=2, help="encoderd page requests in flight")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    p.add_argument("--cache-dir", type=Path, default=Path.home() / ".cache" / "encoderd-bench")
    p.add_argument(
        "--min-available-gib",
        type=float,
        help="wait before each phase until this much memory is available "
        "(default: 14 for --size real, one float32 model and its activations; 0 for tiny)",
    )
    args = p.parse_args(argv)
    need = args.min_available_gib if args.min_available_gib is not None else (14.0 if args.size == "real" else 0.0)

    wait_for_memory(need, "building the model")
    path = build(args.cache_dir, args.model, args.size)
    blobs = [png(draw_page(seed)) for seed in range(args.pages)]  # both sides get these PNG files
    queries = [f"{q} {i}" for i, q in enumerate(make_queries(args.queries, 7))]  # distinct: no cache hits
    logs = args.cache_dir / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    # One model in memory at a time: transformers' loop in a process of its own, gone before the
    # server starts (whose worker, in turn, frees its fidelity reference before loading the model).
    wait_for_memory(need, "transformers' loop")
    log(f"{args.model} {args.size} {args.dtype}, {args.threads} threads: transformers' loop")
    reference = in_child(transformers_loop, path, args, blobs, queries)
    wait_for_memory(need, "encoderd")
    log("encoderd")
    served = encoderd_loop(path, args, blobs, queries, logs)
    want, got = reference["first_page"], served["first_page"]
    cosine = float(np.min((want * got).sum(1) / np.linalg.norm(want, axis=1) / np.linalg.norm(got, axis=1)))
    print(
        f"{args.model} ({args.size}, {args.dtype}, {args.threads} threads): {args.pages} pages in batches of "
        f"{args.batch}, {args.queries} queries one at a time"
    )
    print(f"{'':14}{'pages/s':>10}{'s/page':>10}{'query p50 ms':>14}{'query p90 ms':>14}")
    for name, result in (("transformers", reference), ("encoderd", served)):
        lat = sorted(result["latencies"])
        p90 = lat[min(len(lat) - 1, int(0.9 * len(lat)))]
        rate = result["pages_per_s"]  # three significant digits: a real-size page takes minutes on 2 cores
        print(f"{name:14}{rate:>10.3g}{1 / rate:>10.3g}{statistics.median(lat) * 1000:>14.1f}{p90 * 1000:>14.1f}")
    ratio = served["pages_per_s"] / reference["pages_per_s"]
    latency = statistics.median(served["latencies"]) / statistics.median(reference["latencies"])
    print(f"encoderd / transformers: pages/s {ratio:.2f}x, query p50 {latency:.2f}x")
    print(f"first page's rows, encoderd against transformers: min cosine {cosine:.6f}")


if __name__ == "__main__":
    main()
