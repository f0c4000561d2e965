"""What a maximum-size Embed answer costs the frontend's event loop (issue 42 item 3).

    python -m encoderd.bench.answer [--inputs 2048] [--width 384] [--batch 64] [--rounds 3] [--compare-ref REF]

Every other caller's query waits while the event loop assembles a big call's answer, so this work
is on their latency (bench.fair's "end" window). Measured here without a server or a model, on
the frontend's own code: the rows of --inputs inputs arrive as worker results of --batch rows
(float32, --width wide), each written into the request's PendingRequest as the scheduler does;
then the ResultCache assembles the answer (every input new: a big call's usual case), the
non-finite check, the normalization and the response message (EmbedResponse's embeddings,
serialized). Each checkout runs in its own process (with --compare-ref, the ref exported as
bench.flood does and imported through PYTHONPATH), --repeats answers a round, rounds alternated
A B, B A, ... so both meet about the same load on a shared host. Reported: CPU milliseconds per
answer (process time: others' load on the host moves it less than wall time), each round's
median, and the ratio. A benchmark, not a test: it prints a table and asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

from .flood import checkouts

# Run in a child process whose `encoderd` is the checkout measured: it uses names both sides have
# (PendingRequest, ResultCache, compute._refuse_non_finite, postprocess, messages), and builds the
# response as that checkout's Embed does.
CHILD = r"""
import asyncio, json, sys, time
import numpy as np
from encoderd.server.scheduling.scheduler import PendingRequest
from encoderd.server.models.result_cache import ResultCache, result_key
from encoderd.server.models import compute, postprocess
from encoderd.server.api import messages
from encoderd.v1 import encoderd_pb2 as pb

inputs, width, batch, repeats = (int(v) for v in sys.argv[1:5])
rng = np.random.default_rng(0)
results = [rng.standard_normal((min(batch, inputs - s), width), dtype=np.float32) for s in range(0, inputs, batch)]
names = [f"inputs[{i}]" for i in range(inputs)]


async def answer(call: int) -> tuple[float, float]:
    # CPU ms of (every batch's rows written but the last, spread over the call; the rest, from the
    # last row to the serialized message: one stall of the event loop at the call's end).
    cache = ResultCache("m")
    keys = [result_key("embed", str(call), str(i)) for i in range(inputs)]
    marks = []

    async def compute_some(indices):
        request = PendingRequest(len(indices))
        await asyncio.sleep(0)
        marks.append(time.process_time())
        last = len(results) - 1
        for b, rows in enumerate(results):  # the scheduler's _compute, batch after batch
            for j, row in enumerate(rows):
                if b == last and j == len(rows) - 1:
                    marks.append(time.process_time())
                request.fill(b * batch + j, row)
        rows = await request.future
        compute._refuse_non_finite("m", rows, [names[i] for i in indices])
        return rows, np.full(len(indices), 100)

    pooled, _ = await cache.resolve(keys, compute_some)
    vectors = postprocess.finish_embeddings(pooled, normalize=True)
    # The bytes gRPC sends, built as each checkout's Embed builds them (with_embeddings, if it has one,
    # may hand them over already serialized).
    if hasattr(messages, "with_embeddings"):
        response = messages.with_embeddings(pb.EmbedResponse(model="m"), vectors, "float32")
    else:
        response = pb.EmbedResponse(model="m", embeddings=messages.embeddings_message(vectors, "float32"))
    if not hasattr(response, "wire"):  # messages.Serialized: the bytes already
        response.SerializeToString()
    first, last_row = marks
    return (last_row - first) * 1000, (time.process_time() - last_row) * 1000


async def main():
    await answer(-1)  # warm
    print(json.dumps([await answer(k) for k in range(repeats)]))


asyncio.run(main())
"""


def measure(checkout: str | None, args) -> list[list[float]]:
    """CPU ms per answer (the batches' rows, the end), --repeats of them, in a fresh process of
    `checkout` (None: this one)."""
    env = dict(os.environ)
    if checkout:
        env["PYTHONPATH"] = checkout
    argv = [sys.executable, "-c", CHILD, str(args.inputs), str(args.width), str(args.batch), str(args.repeats)]
    out = subprocess.run(argv, env=env, cwd=checkout or None, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--inputs", type=int, default=2048, help="inputs of the call (default: %(default)s)")
    parser.add_argument("--width", type=int, default=384, help="vector width (default: MiniLM's %(default)s)")
    parser.add_argument("--batch", type=int, default=64, help="rows per worker result (default: %(default)s)")
    parser.add_argument("--repeats", type=int, default=20, help="answers per round (default: %(default)s)")
    parser.add_argument("--rounds", type=int, default=3, help="alternated rounds (default: %(default)s)")
    parser.add_argument("--compare-ref", help="also measure this git ref (e.g. a commit before a change)")
    parser.add_argument("--json", type=Path, help="write the results here")
    args = parser.parse_args(argv)
    sides = checkouts(args.compare_ref)
    rounds: list[dict[str, tuple[float, float]]] = []
    for r in range(args.rounds):
        order = sides if r % 2 == 0 else sides[::-1]
        measured = {label: measure(checkout, args) for label, checkout in order}
        median = statistics.median
        rounds.append({label: (median(f for f, _ in m), median(e for _, e in m)) for label, m in measured.items()})
    labels = [label for label, _ in sides]
    print(
        f"CPU ms per {args.inputs} x {args.width} answer, median of {args.repeats}, rounds alternated: the rows "
        f"of all batches but the last (spread over the call), and the end (last row to serialized message)"
    )
    print(f"{'round':>5} " + " ".join(f"{label + ' rows / end':>34}" for label in labels), end="")
    print("   end: this / ref" if len(sides) > 1 else "")
    for i, row in enumerate(rounds, start=1):
        cells = " ".join(f"{row[label][0]:26.2f} / {row[label][1]:5.2f}" for label in labels)
        ratio = f"   {row[labels[1]][1] / row[labels[0]][1]:.2f}" if len(sides) > 1 else ""
        print(f"{i:>5} {cells}{ratio}")
    if args.json:
        args.json.write_text(json.dumps(rounds, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
