"""bench/bulk_compare.py's own logic, without a server: the workload it asks of `encoderd bench`'s
bulk mode, and its report's per-round ratios (tokens/s, and per worker CPU-second)."""

from __future__ import annotations

from types import SimpleNamespace

from encoderd.bench import bulk_compare
from encoderd.bench.modes import Row


def test_it_runs_the_bench_bulk_workload_every_input_once():
    args = bulk_compare.bench_args(["--corpus-size", "1024"])
    assert args.modes == ["bulk"] and args.no_st
    assert (args.corpus_size, args.concurrency, args.batch) == (1024, 32, 32)
    assert args.bulk_requests * args.batch == 1024


def _run(tokens_per_s: float, worker_cores: float, share: float, front_ms: float = 0.3) -> Row:
    cores = {"worker": worker_cores}
    run = Row("bulk", "x", "grpc", tokens_per_s=tokens_per_s, flop_utilisation=share, cpu_cores=cores)
    run.frontend_ms_per_input = front_ms
    return run


def test_report_gives_this_checkout_over_the_reference_round_by_round(capsys):
    ref = SimpleNamespace(label="ref main", runs=[_run(1000, 1.0, 0.5), _run(2000, 2.0, 0.6)])
    this = SimpleNamespace(label="this checkout", runs=[_run(1100, 1.0, 0.55), _run(2000, 1.6, 0.6, 0.15)])
    bulk_compare.report([ref, this])
    out = capsys.readouterr().out
    assert "per round: tok/s 1.100 1.000" in out
    assert "per round: tok/worker-CPU-s 1.100 1.250" in out
    assert "per round: frontend CPU/input 1.000 0.500" in out
    assert "medians: tok/s 1.050x, tok/worker-CPU-s 1.175x, frontend CPU per input 0.750x" in out
    assert "peak share 57.5 % (best 60.0 %)" in out
