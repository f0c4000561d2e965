"""Issue 9: streaming bulk embedding with flow control, dedup, cache and output options."""

from __future__ import annotations

import base64
import json
import os
import re
import signal
import threading
import time
import urllib.request

import grpc
import numpy as np
import pytest
from support.corpus import WORDS
from support.server import ServerProcess, until

from encoderd.clients.bulk import embed_iterable, embed_to_jsonl
from encoderd.server.api.streaming import WINDOW
from encoderd.v1 import encoderd_pb2 as pb
from encoderd.workers.contract.model_files import DEFAULT_MODEL_NAME


def _metric(server, name: str, labels: str = "") -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=5).read().decode()
    pattern = (
        rf"^{re.escape(name)}{re.escape(labels)} (\S+)$" if labels else rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$"
    )
    return sum(float(m) for m in re.findall(pattern, text, re.M))


@pytest.fixture(scope="module")
def cached_server(tmp_path_factory):
    log = tmp_path_factory.mktemp("logs") / "cached.log"
    with ServerProcess("--cache-size", "1000", "--prompt", "query=query: ", log_path=log) as server:
        yield server


def _texts(n: int) -> list[str]:
    rng = np.random.default_rng(3)
    return [f"item {i} " + " ".join(rng.choice(WORDS, size=int(rng.integers(2, 12)))) for i in range(n)]


def test_stream_of_10k_with_a_slow_reader_stays_within_the_window(server, stub):
    texts = _texts(10_000)
    peak = [0.0]
    stop = threading.Event()

    def watch():
        while not stop.is_set():
            peak[0] = max(peak[0], _metric(server, "encoderd_stream_inputs_in_flight"))
            time.sleep(0.05)

    watcher = threading.Thread(target=watch)
    watcher.start()
    seen: dict[str, np.ndarray] = {}
    # A reader that does not let its receive window grow (no BDP probing), so pausing it
    # pushes back on the server at once, as a slow consumer across a network would.
    channel = grpc.insecure_channel(server.address, options=[("grpc.http2.bdp_probe", 0)])
    try:
        items = ((f"id-{i}", t) for i, t in enumerate(texts))
        for n, result in enumerate(embed_iterable(channel, items, model=DEFAULT_MODEL_NAME, progress=False)):
            assert result.error is None and result.id not in seen
            seen[result.id] = result.vector
            if n == 200:
                time.sleep(3.0)
                # The server filled its window and stopped taking inputs: nothing more is held.
                assert _metric(server, "encoderd_stream_inputs_in_flight") == WINDOW
    finally:
        stop.set()
        watcher.join()
        channel.close()
    assert len(seen) == len(texts)
    assert peak[0] == WINDOW
    assert _metric(server, "encoderd_stream_inputs_in_flight") == 0
    sample = [0, 1, 4999, 9999]
    unary = stub.Embed(pb.EmbedRequest(model=DEFAULT_MODEL_NAME, inputs=[texts[i] for i in sample]))
    for i, embedding in zip(sample, unary.embeddings, strict=True):
        np.testing.assert_allclose(seen[f"id-{i}"], embedding.values, atol=1e-6)


def test_stream_reports_bad_inputs_and_goes_on(server, stub):
    items = [("a", "fine"), ("b", ""), ("c", "also fine, and a few more words"), ("d", "fine")]
    results = list(embed_iterable(server.address, items, model=DEFAULT_MODEL_NAME, progress=False))
    by_id = {r.id: r for r in results}
    assert set(by_id) == {"a", "b", "c", "d"}
    assert by_id["b"].vector is None and "empty" in by_id["b"].error and by_id["b"].tokens == 0
    assert by_id["a"].vector.shape == (384,)
    # Each answer counts its own input's tokens (prompt_tokens was always 0), as a unary call's usage does.
    for item_id, text in items[::2]:
        usage = stub.Embed(pb.EmbedRequest(model=DEFAULT_MODEL_NAME, inputs=[text])).usage
        assert by_id[item_id].tokens == usage.prompt_tokens > 2, item_id
    assert by_id["d"].tokens == by_id["a"].tokens


def test_stream_to_unknown_model_fails_the_stream(server):
    with pytest.raises(grpc.RpcError) as err:
        list(embed_iterable(server.address, [("a", "x")], model="nope", progress=False))
    assert err.value.code() == grpc.StatusCode.NOT_FOUND


def test_stream_cuts_over_long_inputs_on_the_side_it_asks(server, stub):
    """Issue 20: EmbedStreamRequest had no truncation_direction; the stream cut on the right."""
    long_text = " ".join(_texts(80))  # far over the model's 256 tokens
    unary = {
        side: stub.Embed(
            pb.EmbedRequest(model=DEFAULT_MODEL_NAME, inputs=[long_text], truncation_direction=side)
        ).embeddings[0]
        for side in (pb.TRUNCATION_DIRECTION_LEFT, pb.TRUNCATION_DIRECTION_RIGHT)
    }
    first = pb.EmbedStreamRequest(
        model=DEFAULT_MODEL_NAME, id="0", input=long_text, truncation_direction=pb.TRUNCATION_DIRECTION_LEFT
    )
    (streamed,) = list(stub.EmbedStream(iter([first])))
    assert not streamed.HasField("error"), streamed.error
    np.testing.assert_allclose(streamed.embedding.values, unary[pb.TRUNCATION_DIRECTION_LEFT].values, atol=1e-6)
    assert not np.allclose(streamed.embedding.values, unary[pb.TRUNCATION_DIRECTION_RIGHT].values, atol=1e-3)


def test_resumable_jsonl(server, tmp_path):
    out = tmp_path / "out.jsonl"
    items = [(f"d{i}", t) for i, t in enumerate(_texts(30))]
    assert embed_to_jsonl(server.address, items[:12], str(out), model=DEFAULT_MODEL_NAME, progress=False) == 12
    assert embed_to_jsonl(server.address, items, str(out), model=DEFAULT_MODEL_NAME, progress=False) == 18
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert sorted(r["id"] for r in records) == sorted(i for i, _ in items)
    vector = np.frombuffer(base64.b64decode(records[0]["embedding"]), dtype="<f4")
    assert vector.shape == (384,)


@pytest.fixture(scope="module")
def one_worker_server(tmp_path_factory):
    """One worker that may stay stopped (SIGSTOP) as long as a test needs: no stall watchdog."""
    log = tmp_path_factory.mktemp("logs") / "one_worker.log"
    with ServerProcess("--replicas", "1", "--worker-stall-timeout", "0", log_path=log) as server:
        yield server


def test_concurrent_identical_requests_compute_once(one_worker_server):
    """The only worker is stopped until all 16 requests are in: whichever comes first cannot finish,
    and the other 15 are counted joining it (inflight_hit) before the worker may go on. The overlap
    is made, not assumed (it failed on a loaded host when the first finished before the last came)."""
    server = one_worker_server
    stub = server.stub()
    text = "identical " + " ".join(WORDS[:200])
    tokens = f'{{model="{DEFAULT_MODEL_NAME}"}}'
    joined = f'{{model="{DEFAULT_MODEL_NAME}",outcome="inflight_hit"}}'
    before_tokens, before_joined = (
        _metric(server, "encoderd_real_tokens_total", tokens),
        _metric(server, "encoderd_cache_lookups_total", joined),
    )
    (worker,) = [m.replicas[0].pid for m in stub.ListModels(pb.ListModelsRequest()).models]
    os.kill(worker, signal.SIGSTOP)
    try:
        request = pb.EmbedRequest(model=DEFAULT_MODEL_NAME, inputs=[text])
        futures = [stub.Embed.future(request, timeout=120) for _ in range(16)]
        until(
            lambda: _metric(server, "encoderd_cache_lookups_total", joined) - before_joined == 15,
            "the 15 later requests never joined the first",
        )
    finally:
        os.kill(worker, signal.SIGCONT)
    vectors = [np.array(f.result().embeddings[0].values) for f in futures]
    computed = _metric(server, "encoderd_real_tokens_total", tokens) - before_tokens
    one_input = futures[0].result().usage.prompt_tokens
    assert all(np.array_equal(v, vectors[0]) for v in vectors)
    assert computed == one_input, f"16 identical requests computed {computed / one_input:.0f} times"


def test_cache_hits_and_misses(cached_server):
    stub = cached_server.stub()
    labels = f'{{model="{DEFAULT_MODEL_NAME}",outcome="hit"}}'
    first = stub.Embed(pb.EmbedRequest(inputs=["cache me", "and me"]))
    hits = _metric(cached_server, "encoderd_cache_lookups_total", labels)
    tokens = _metric(cached_server, "encoderd_real_tokens_total")
    second = stub.Embed(pb.EmbedRequest(inputs=["and me", "cache me", "new one"]))
    assert _metric(cached_server, "encoderd_cache_lookups_total", labels) == hits + 2
    # Only "new one" was computed: the two cached inputs cost no tokens of compute.
    assert _metric(cached_server, "encoderd_real_tokens_total") - tokens == (
        second.usage.prompt_tokens - first.usage.prompt_tokens
    )
    np.testing.assert_array_equal(second.embeddings[1].values, first.embeddings[0].values)
    assert second.usage.prompt_tokens > first.usage.prompt_tokens  # cached inputs still count their tokens


def test_output_dtypes_match_reference_quantization(server, stub):
    from sentence_transformers.util.quantization import quantize_embeddings

    texts = ["quantize this sentence", "and this other one, a bit longer"]
    ref = np.array(
        [e.values for e in stub.Embed(pb.EmbedRequest(model=DEFAULT_MODEL_NAME, inputs=texts)).embeddings],
        dtype=np.float32,
    )

    def get(dtype):
        response = stub.Embed(pb.EmbedRequest(model=DEFAULT_MODEL_NAME, inputs=texts, output_dtype=dtype))
        assert not response.embeddings[0].values
        return [e.data for e in response.embeddings]

    half = np.frombuffer(b"".join(get(pb.OUTPUT_DTYPE_FLOAT16)), "<f2").reshape(2, -1)
    np.testing.assert_array_equal(half, ref.astype(np.float16))
    exact = np.clip(ref.astype(np.float64), -1, 1)  # the proto's formulas, without float32 rounding
    int8 = np.frombuffer(b"".join(get(pb.OUTPUT_DTYPE_INT8)), np.int8).reshape(2, -1)
    np.testing.assert_array_equal(int8, np.round(exact * 127).astype(np.int8))
    uint8 = np.frombuffer(b"".join(get(pb.OUTPUT_DTYPE_UINT8)), np.uint8).reshape(2, -1)
    np.testing.assert_array_equal(uint8, np.round((exact + 1) * 127.5).astype(np.uint8))
    binary = np.frombuffer(b"".join(get(pb.OUTPUT_DTYPE_BINARY)), np.int8).reshape(2, -1)
    np.testing.assert_array_equal(binary, quantize_embeddings(ref, precision="binary"))
    ubinary = np.frombuffer(b"".join(get(pb.OUTPUT_DTYPE_UBINARY)), np.uint8).reshape(2, -1)
    np.testing.assert_array_equal(ubinary, quantize_embeddings(ref, precision="ubinary"))
    assert ubinary.shape == (2, 48)


def test_named_prompt_and_normalize_override(cached_server, minilm_path):
    from sentence_transformers import SentenceTransformer

    st = SentenceTransformer(minilm_path, device="cpu")
    stub = cached_server.stub()
    got = stub.Embed(pb.EmbedRequest(inputs=["what is a kernel"], prompt_name="query"))
    np.testing.assert_allclose(got.embeddings[0].values, st.encode(["query: what is a kernel"])[0], atol=1e-5)
    with pytest.raises(grpc.RpcError) as err:
        stub.Embed(pb.EmbedRequest(inputs=["x"], prompt_name="passage"))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "query" in err.value.details()
    raw = np.array(stub.Embed(pb.EmbedRequest(inputs=["what is a kernel"], normalize=False)).embeddings[0].values)
    assert abs(np.linalg.norm(raw) - 1) > 1e-3  # the model's Normalize step was skipped
    np.testing.assert_allclose(raw / np.linalg.norm(raw), st.encode(["what is a kernel"])[0], atol=1e-5)


def test_dimensions_wider_than_the_model_are_refused_before_any_work(server, stub):
    """They were refused only once the vectors were computed (19 s for 512 long inputs); a stream
    computed and failed every item instead of failing at once."""
    texts = _texts(64)
    queued = f'{{model="{DEFAULT_MODEL_NAME}",priority="interactive"}}'
    before = _metric(server, "encoderd_queued_inputs_total", queued)
    with pytest.raises(grpc.RpcError) as refused:
        stub.Embed(pb.EmbedRequest(model=DEFAULT_MODEL_NAME, inputs=texts, dimensions=385), timeout=30)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert refused.value.details() == "`dimensions` must be between 1 and 384 for this model, not 385"
    assert _metric(server, "encoderd_queued_inputs_total", queued) == before  # nothing was queued
    first = pb.EmbedStreamRequest(model=DEFAULT_MODEL_NAME, id="0", input=texts[0], dimensions=385)
    with pytest.raises(grpc.RpcError) as failed:
        list(stub.EmbedStream(iter([first, pb.EmbedStreamRequest(id="1", input=texts[1])]), timeout=30))
    assert failed.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "385" in failed.value.details()
    full = stub.Embed(pb.EmbedRequest(model=DEFAULT_MODEL_NAME, inputs=texts[:1], dimensions=384), timeout=30)
    assert len(full.embeddings[0].values) == 384


def test_a_bad_item_fails_alone_and_is_named_by_its_id(server, stub):
    """An item over a limit was named inputs[0], and failed the whole group it travelled in (groups
    form under backlog: tests/unit/test_stream_units.py makes one)."""
    fine = [pb.EmbedStreamRequest(id=f"fine{i}", input=text) for i, text in enumerate(_texts(40))]
    items = [
        pb.EmbedStreamRequest(model=DEFAULT_MODEL_NAME, id="first", input="fine", truncate=False),
        *fine[:20],
        pb.EmbedStreamRequest(id="huge", input="x" * 1_000_001),
        pb.EmbedStreamRequest(id="long", input="word " * 400),  # over 256 tokens, truncation off
        *fine[20:],
    ]
    answers = {a.id: a for a in stub.EmbedStream(iter(items), timeout=60)}
    assert sorted(answers) == sorted(item.id for item in items)
    for item_id in ["first", *(item.id for item in fine)]:
        assert not answers[item_id].HasField("error") and len(answers[item_id].embedding.values) == 384, item_id
    assert answers["huge"].error.message.startswith("item 'huge' has 1000001 characters"), answers["huge"]
    assert answers["long"].error.message.startswith("item 'long' is longer than"), answers["long"]
    assert {answers[i].error.code for i in ("huge", "long")} == {grpc.StatusCode.INVALID_ARGUMENT.value[0]}
