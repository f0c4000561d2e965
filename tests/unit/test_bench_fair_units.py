"""bench/fair.py's own logic, without a server: two servers are run in both start orders, each
server's rounds and idle queries merged over them, and each order's medians printed."""

from __future__ import annotations

import argparse

import pytest

from encoderd.bench import fair


def _bench(label: str, rounds: int, slower: float, started_first: bool) -> fair.Bench:
    bench = fair.Bench.__new__(fair.Bench)  # no server, no big caller: only what the report reads
    bench.started_first = started_first
    bench.idle = [0.005] * 10
    bench.idle_health = []
    bench.rounds = [
        {"query_p99_vs_idle": 1.5 * slower, "big_shared_vs_solo": 0.9 / slower, "started_first": started_first}
        for _ in range(rounds)
    ]
    return bench


def test_two_servers_run_in_both_start_orders_and_merge(monkeypatch, tmp_path, capsys):
    orders = []

    def run_servers(servers, serve_args, logs, args, rounds=None):
        orders.append(([label for label, _ in servers], rounds, logs.name))
        # this checkout is slower only where it started first: the start order's own luck
        this_first = servers[0][0] == "this checkout"
        return {
            label: _bench(label, rounds, 2.0 if this_first and label == "this checkout" else 1.0, i == 0)
            for i, (label, _) in enumerate(servers)
        }

    monkeypatch.setattr(fair, "run_servers", run_servers)
    args = argparse.Namespace(rounds=3)
    results = fair.run([("ref main", "/tmp/x"), ("this checkout", None)], [], tmp_path, args)
    assert orders == [
        (["ref main", "this checkout"], 2, "reference-first"),
        (["this checkout", "ref main"], 1, "this-first"),
    ]
    assert list(results) == ["ref main", "this checkout"]
    this = results["this checkout"]
    assert [row["started_first"] for row in this["rounds"]] == [False, False, True]
    assert [row["query_p99_vs_idle"] for row in this["rounds"]] == [1.5, 1.5, 3.0]
    assert this["idle_n"] == 20 and this["idle_p99_ms"] == pytest.approx(5.0)
    out = capsys.readouterr().out
    assert "the reference started first: ref main: query p99/idle 1.50, big shared/solo 0.90 (medians of 2" in out
    assert "this checkout started first: this checkout: query p99/idle 3.00, big shared/solo 0.45 (medians of 1" in out


def test_one_server_runs_once(monkeypatch, tmp_path):
    calls = []

    def run_servers(servers, serve_args, logs, args, rounds=None):
        calls.append(rounds)
        return {"this checkout": _bench("this checkout", args.rounds, 1.0, True)}

    monkeypatch.setattr(fair, "run_servers", run_servers)
    results = fair.run([("this checkout", None)], [], tmp_path, argparse.Namespace(rounds=3))
    assert calls == [None] and len(results["this checkout"]["rounds"]) == 3


def test_compare_ref_needs_a_round_in_each_order():
    with pytest.raises(SystemExit):
        fair.main(["--compare-ref", "main", "--rounds", "1"])
