"""bench.flood's bookkeeping: clients shared among the flood's processes, their counts merged,
the first burst told from the steady state, Envoy's upstream time kept. No server: the pieces
whose arithmetic the report rests on."""

from __future__ import annotations

import asyncio

import pytest

from encoderd.bench.flood import (
    Flood,
    _count,
    _latencies,
    _merged,
    _next_texts,
    _refused,
    _upstream_time,
    http_exchange,
    http_request,
)


def _flood(clients: int, processes: int) -> Flood:
    return Flood("127.0.0.1:1", clients, began=0.0, stop_at=1.0, inputs=1, processes=processes)


@pytest.mark.parametrize(("clients", "processes"), [(500, 4), (600, 1), (7, 3), (2, 5)])
def test_every_client_runs_in_exactly_one_process(clients, processes):
    shares = [_flood(clients, processes).share(i) for i in range(processes)]
    assert sum(shares) == clients
    assert max(shares) - min(shares) <= 1


def test_merged_counts_add_and_latencies_join():
    a = {
        "sent": 3,
        "OK": 1,
        "RESOURCE_EXHAUSTED": 2,
        "latency": {"OK": [(0.0, 0.5)], "RESOURCE_EXHAUSTED": [(1.0, 0.1)]},
    }
    b = {"sent": 2, "RESOURCE_EXHAUSTED": 2, "with retry-after": 2, "latency": {"RESOURCE_EXHAUSTED": [(6.0, 0.2)]}}
    merged = _merged([a, b])
    assert {k: v for k, v in merged.items() if k != "latency"} == {
        "sent": 5,
        "OK": 1,
        "RESOURCE_EXHAUSTED": 4,
        "with retry-after": 2,
    }
    assert merged["latency"] == {"OK": [(0.0, 0.5)], "RESOURCE_EXHAUSTED": [(1.0, 0.1), (6.0, 0.2)]}


def test_steady_state_leaves_out_the_calls_sent_before_it():
    counts: dict = {"began": 100.0, "latency": {}}
    _count(counts, "RESOURCE_EXHAUSTED", started=100.5)  # the first burst
    _count(counts, "RESOURCE_EXHAUSTED", started=106.0)
    timed = counts["latency"]["RESOURCE_EXHAUSTED"]
    assert [sent_at for sent_at, _ in timed] == [0.5, 6.0]
    assert len(_latencies(timed)) == 2
    assert len(_latencies(timed, since=5.0)) == 1
    assert len(_latencies(timed, until=1.0)) == 1  # the first burst's alone


def test_texts_differ_across_processes_and_calls():
    """Identical inputs in flight are computed once: every flood call must send its own."""
    texts = ["a", "b"]
    first, second = {"sent": 0, "tag": 0}, {"sent": 0, "tag": 1}
    sent = [tuple(_next_texts(c, texts)) for c in (first, second, first, second)]
    assert len({t for call in sent for t in call}) == 8


def test_refusals_count_retry_after_and_envoy_wait_only_when_given():
    counts: dict = {"latency": {}}
    _refused(counts, None)
    _refused(counts, 2.0)
    _upstream_time(counts, None)  # a refusal Envoy made itself: no upstream time
    _upstream_time(counts, "37")
    assert counts["with retry-after"] == 1
    assert counts["latency"]["upstream"] == [(0.0, 0.037)]


async def _answering(responses: list[bytes]):
    """A local HTTP server answering each request on a connection with the next of `responses`; the
    requests it read come back in the list it returns."""
    seen: list[bytes] = []

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        for response in responses:
            head = await reader.readuntil(b"\r\n\r\n")
            length = int(next(line for line in head.split(b"\r\n") if line.lower().startswith(b"content-length"))[15:])
            seen.append(head + await reader.readexactly(length))
            writer.write(response)
            await writer.drain()
        writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    return server, server.sockets[0].getsockname()[1], seen


async def test_the_rest_flood_client_speaks_http_1_1_on_one_connection():
    """bench.flood's REST callers talk HTTP/1.1 themselves (httpx cost ~1 ms of a call's CPU): three
    answers on one keep-alive connection, with a length, chunked, and a 429 that says when to retry."""
    responses = [
        b'HTTP/1.1 200 OK\r\ncontent-length: 11\r\ncontent-type: application/json\r\n\r\n{"data":[]}',
        b'HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n4\r\n{"a"\r\n3\r\n:1}\r\n0\r\n\r\n',
        b"HTTP/1.1 429 Too Many Requests\r\nretry-after: 2\r\nx-envoy-upstream-service-time: 7\r\n"
        b"content-length: 2\r\n\r\n{}",
    ]
    server, port, seen = await _answering(responses)
    async with server:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        answers = [
            await http_exchange(reader, writer, http_request(f"127.0.0.1:{port}", "/v1/x", b"[1]")) for _ in responses
        ]
        writer.close()
    assert [status for status, _ in answers] == [200, 200, 429]
    assert answers[2][1]["retry-after"] == "2" and answers[2][1]["x-envoy-upstream-service-time"] == "7"
    assert all(request.startswith(b"POST /v1/x HTTP/1.1\r\n") and request.endswith(b"\r\n\r\n[1]") for request in seen)
