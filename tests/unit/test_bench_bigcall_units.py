"""bench/bigcall.py's own logic, without a server: the server-timing trailer read back, every call's
texts new, and the servers' turns alternated round by round."""

from __future__ import annotations

import pytest

from encoderd.bench import bigcall


def test_server_timing_trailer_is_read_in_seconds():
    trailers = (("x-request-id", "abc"), ("server-timing", "tokenize;dur=180.32, queue;dur=6.93, total;dur=3671.86"))
    assert bigcall.trailer_timing(trailers) == pytest.approx({"tokenize": 0.18032, "queue": 0.00693, "total": 3.67186})
    assert bigcall.trailer_timing(None) == {} and bigcall.trailer_timing((("server-timing", ""),)) == {}


def test_every_call_has_texts_of_its_own():
    corpus = [f"text {i}" for i in range(10)]
    first, second = bigcall.call_texts(corpus, 0, 8), bigcall.call_texts(corpus, 1, 8)
    assert len(first) == len(second) == 8 and not set(first) & set(second)
    assert first[0] == "text 0 0" and second[0] == "text 8 1"  # a window of the corpus, numbered


class _Outcome:
    def trailing_metadata(self):
        return (("server-timing", "compute;dur=2.00, total;dur=3.00"),)


class _Stub:
    def __init__(self, label: str, log: list):
        self.label, self.log = label, log
        self.Embed = self

    def with_call(self, request, timeout):
        self.log.append((self.label, request.inputs[0].rsplit(" ", 1)[1]))
        return None, _Outcome()


def test_servers_take_turns_going_first():
    log: list = []
    servers = [("ref", _Stub("ref", log)), ("this", _Stub("this", log))]
    got = bigcall.measure(servers, rounds=3, inputs=2, corpus=["a", "b", "c"], first_call=5)
    assert [label for label, _ in log] == ["ref", "this", "this", "ref", "ref", "this"]
    assert [call for _, call in log] == ["5", "6", "7", "8", "9", "10"]
    assert len(got["ref"]) == len(got["this"]) == 3
    assert got["this"][0][1] == pytest.approx({"compute": 0.002, "total": 0.003})
    summary = bigcall.summary(got["this"])
    assert summary["compute"] == pytest.approx(0.002) and "tokenize" not in summary
