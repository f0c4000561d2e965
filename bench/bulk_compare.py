"""Bulk through the whole server, this checkout against another, alternated (issue #47):

    python -m encoderd.bench.bulk_compare [--compare-ref REF] [--rounds 6] [--corpus-size 1024]
                                          [--serve-args "..."]

`encoderd bench --modes bulk` measures one server once: a 1,024-input run lasts ~4 s, so on a shared
host what others run meanwhile moves its figure by 2x. This starts `encoderd serve` from this checkout
(and, with --compare-ref, the same command from git REF, exported to a temporary folder), both at
once and idle between runs, and sends each in turn the bench's bulk workload (the same corpus, C
clients x B inputs, every input once, `bench.modes.run_bulk`), round after round: ABAB... then
BABA..., so both meet about the same load. Per run: tokens/s, the workers' CPU seconds (/proc),
tokens per worker CPU-second (what the server does with the cores it gets, the figure that survives
a shared host best), the share of the matmul peak measured once at the start, and the cores others
used meanwhile. It prints each run and, per round, the ratios this checkout / REF. A benchmark,
not a test: it asserts nothing.
"""

from __future__ import annotations

import argparse
import shlex
import statistics
import sys
import tempfile
from pathlib import Path

from ..workers.contract.model_files import DEFAULT_MODEL_NAME, default_model_path
from .corpus import make_workload
from .flood import checkouts, start_server
from .flops import FlopModel, matmul_peak
from .modes import Row, run_bulk
from .options import build_parser, log, resolve_options, serving_threads, worker_threads
from .processes import CpuProbe
from .servers import encoderd_probe_groups, list_models
from .targets import GrpcTarget


def bench_args(argv: list[str]) -> argparse.Namespace:
    """`encoderd bench`'s own options for its bulk mode (its corpus and clients)."""
    return resolve_options(build_parser().parse_args(["--modes", "bulk", "--no-st", *argv]))


class Server:
    """One running server, and how to run the bulk workload on it."""

    def __init__(self, label: str, checkout: str | None, serve_args: list[str], logs: Path):
        self.label = label
        argv = ["--model", f"{DEFAULT_MODEL_NAME}={default_model_path()}", *serve_args]
        self.process, address, _ = start_server(label.replace(" ", "-"), checkout, argv, logs)
        models = list_models(address)
        self.model = next(m for m in models if m.kind == "embedding")
        self.probe = CpuProbe(encoderd_probe_groups(self.process, models, self.model.id, None))
        self.client = GrpcTarget(address, self.model.id, None)
        self.runs: list[Row] = []

    def bulk(self, work, args, flops: FlopModel, peak: dict) -> Row:
        row = run_bulk(
            self.label, self.client, work, args, self.probe, None, self.model.id, flops,
            peak.get(self.model.dtype), worker_threads(args),
        )  # fmt: skip
        self.runs.append(row)
        return row

    def stop(self) -> None:
        self.client.close()
        self.process.stop()


def per_worker_cpu_second(row: Row) -> float:
    worker = row.cpu_cores.get("worker") or 0.0
    return row.tokens_per_s / worker if worker else 0.0


def describe(row: Row) -> str:
    share = "-" if row.flop_utilisation is None else f"{100 * row.flop_utilisation:.1f} %"
    return (
        f"{row.engine:<14} {row.tokens_per_s:>9.0f} tok/s  {per_worker_cpu_second(row):>8.0f} tok/worker-CPU-s  "
        f"peak share {share:>7}  workers {row.cpu_cores.get('worker', 0):.2f} cores  "
        f"frontend {row.cpu_cores.get('frontend', 0):.2f} ({row.frontend_ms_per_input or 0:.3f} ms/input)  "
        f"others {row.cpu_cores.get('foreign', 0):.2f}" + (f"  errors {row.errors}" if row.errors else "")
    )


def report(servers: list[Server]) -> None:
    print()
    for server in servers:
        rates = [r.tokens_per_s for r in server.runs]
        per_cpu = [per_worker_cpu_second(r) for r in server.runs]
        shares = [r.flop_utilisation for r in server.runs if r.flop_utilisation is not None]
        print(
            f"{server.label:<14} median {statistics.median(rates):>9.0f} tok/s  "
            f"{statistics.median(per_cpu):>8.0f} tok/worker-CPU-s"
            + (
                f"  peak share {100 * statistics.median(shares):.1f} % (best {100 * max(shares):.1f} %)"
                if shares
                else ""
            )
        )
    if len(servers) == 2:
        ref, this = servers
        pairs = list(zip(this.runs, ref.runs, strict=True))
        tokens = [a.tokens_per_s / b.tokens_per_s for a, b in pairs]
        per_cpu = [per_worker_cpu_second(a) / per_worker_cpu_second(b) for a, b in pairs]
        front = [(a.frontend_ms_per_input or 0) / (b.frontend_ms_per_input or 1) for a, b in pairs]
        print(f"{this.label} / {ref.label}, per round: tok/s " + " ".join(f"{x:.3f}" for x in tokens))
        print(f"{this.label} / {ref.label}, per round: tok/worker-CPU-s " + " ".join(f"{x:.3f}" for x in per_cpu))
        print(f"{this.label} / {ref.label}, per round: frontend CPU/input " + " ".join(f"{x:.3f}" for x in front))
        print(
            f"medians: tok/s {statistics.median(tokens):.3f}x, tok/worker-CPU-s {statistics.median(per_cpu):.3f}x, "
            f"frontend CPU per input {statistics.median(front):.3f}x"
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m encoderd.bench.bulk_compare", description=__doc__.split("\n\n")[0])
    parser.add_argument("--compare-ref", help="also run the server of this git ref (main, a commit before a change)")
    parser.add_argument("--rounds", type=int, default=6, help="bulk runs per server, alternated (default 6)")
    parser.add_argument("--corpus-size", type=int, default=1024, help="inputs per run, each once (default 1024)")
    parser.add_argument("--serve-args", default="", help='extra `encoderd serve` flags, e.g. "--dtype int8"')
    own = parser.parse_args(argv)
    args = bench_args(["--corpus-size", str(own.corpus_size), "--serve-args", own.serve_args])
    work, info = make_workload(args, default_model_path(), None)
    flops = FlopModel.from_dir(default_model_path())
    peak = matmul_peak(serving_threads(args), args.peak_sizes)
    mean = info["corpus"]["mean"]
    log(f"corpus {len(work.corpus)} inputs (mean {mean:.0f} tokens); matmul peak bf16 {peak['bfloat16']:.0f} GFLOP/s")
    logs = Path(tempfile.mkdtemp(prefix="encoderd-bulk-compare-"))
    servers: list[Server] = []
    try:
        for label, checkout in checkouts(own.compare_ref):
            servers.append(Server(label, checkout, shlex.split(own.serve_args), logs))
        for server in servers:  # first shapes, the drain rates: not measured
            server.bulk(work, args, flops, peak)
            server.runs.clear()
        for round_ in range(own.rounds):
            for server in servers if round_ % 2 == 0 else reversed(servers):
                log(describe(server.bulk(work, args, flops, peak)))
        report(servers)
    finally:
        for server in servers:
            server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
