"""bench/percall.py's own logic, without a server: the queries it sends (numbered, so no result
cache answers one; with --varied, of ~50 token counts in turn) and its report's ratios."""

from __future__ import annotations

import pytest

from encoderd.bench import percall


class _RecordingStub:
    def __init__(self):
        self.texts: list[str] = []

    def Embed(self, request, timeout):
        self.texts.extend(request.inputs)


def _target(varied: bool) -> tuple[percall.Target, _RecordingStub]:
    target = percall.Target("t", server=None, address="127.0.0.1:1", rest_url="", varied=varied)
    stub = _RecordingStub()
    target.stub = stub
    return target, stub


def test_each_query_is_new_and_short_unless_varied():
    target, stub = _target(varied=False)
    for _ in range(3 * percall.VARIED_WORDS):
        target.query()
    assert len(set(stub.texts)) == len(stub.texts)
    assert max(len(t.split()) for t in stub.texts) <= 6


def test_varied_queries_cycle_over_their_lengths():
    target, stub = _target(varied=True)
    for _ in range(percall.VARIED_WORDS):
        target.query()
    bases = [percall.QUERIES[sent % len(percall.QUERIES)] for sent in range(1, len(stub.texts) + 1)]
    extra = [len(text.split()) - len(base.split()) - 1 for text, base in zip(stub.texts, bases, strict=True)]
    assert sorted(extra) == list(range(percall.VARIED_WORDS))


def test_report_gives_this_checkout_over_the_reference(capsys):
    row = {"calls": 10, "p50_ms": 4.0, "p99_ms": 8.0, "frontend_cpu_ms": 2.0, "workers_cpu_ms": 3.0, "envoy_cpu_ms": 0}
    percall.report([{"server": "ref main", **row}, {**row, "server": "this checkout", "frontend_cpu_ms": 1.5}], False)
    assert "this checkout / ref main: frontend 0.75, workers 1.00, p50 1.00, p99 1.00" in capsys.readouterr().out


def test_two_servers_are_measured_in_both_start_orders_and_merged(monkeypatch, capsys):
    """Each server's calls and CPU add up over the two orders; each order's ratios are printed."""
    orders = []

    def measure(servers, serve_args, args, queries):
        orders.append([label for label, _ in servers])
        made = []
        for label, _ in servers:
            target = percall.Target(label, server=None, address="127.0.0.1:1", rest_url="")
            slower = 2.0 if label == "this checkout" and len(orders) == 2 else 1.0  # slower in one order only
            target.latencies = [0.004 * slower] * queries
            target.cpu = {"frontend": 0.002 * queries * slower, "workers": 0.003 * queries, "envoy": 0.0}
            target.calls = queries
            made.append(target)
        return made

    monkeypatch.setattr(percall, "measure", measure)
    args = percall.argparse.Namespace(queries=400, block=100)
    rows = percall.run([("ref main", "/tmp/x"), ("this checkout", None)], [], args)
    assert orders == [["ref main", "this checkout"], ["this checkout", "ref main"]]
    assert [r["server"] for r in rows] == ["ref main", "this checkout"]
    assert [r["calls"] for r in rows] == [400, 400]
    assert rows[0]["frontend_cpu_ms"] == pytest.approx(2.0)
    assert rows[1]["frontend_cpu_ms"] == pytest.approx(3.0)  # 2 ms per call in one half, 4 in the other
    out = capsys.readouterr().out
    assert "the reference started first: this checkout / ref main: frontend 1.00" in out
    assert "this checkout started first: this checkout / ref main: frontend 2.00" in out
