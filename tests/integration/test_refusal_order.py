"""Issue 42, item 2: under a flood a REST embeddings call is refused before its inputs are read,
as a gRPC call already was (compute.run refuses before it validates): the refusal is the cheap
answer, and reading 32 JSON strings first cost a REST refusal more than the check itself.

The real server, its workers and Envoy. The queue is held by stopping the workers (SIGSTOP) under
one interactive call of 2,048 inputs (split: its rest waits in the SPLIT queue); a call of 300
inputs, whose own rest would wait behind it past --max-queue-wait, is refused. One whose `input` is
malformed past its first element is the witness: refused (429, Retry-After) while the queue is
held, so its inputs were never walked; once the queue has drained, the same call is a 400 naming
the problem, so nothing skips validation."""

from __future__ import annotations

import concurrent.futures as cf

import grpc
import httpx
from test_admission import HELD, held_queue, holdable_server, run_then_stop

from encoderd.v1 import encoderd_pb2 as pb

# Over SPLIT_BATCHES (4) batches of 64 inputs, valid in its first element and malformed in its last:
# only reading every input finds the fault.
MIXED = {"input": ["one more"] * 299 + [7]}


def test_rest_embeddings_are_refused_before_their_inputs_are_read(tmp_path, minilm_path):
    run_then_stop(holdable_server(tmp_path, minilm_path), _refused_while_held)


def _refused_while_held(server) -> None:
    stub = server.stub()
    pool = cf.ThreadPoolExecutor(1)
    rest = httpx.Client(base_url=server.rest_url, timeout=60, trust_env=False)
    with held_queue(server, stub, pool) as held:
        refused = rest.post("/v1/embeddings", json=MIXED)
        assert refused.status_code == 429, refused.text  # the old code read the inputs first: 400
        assert int(refused.headers["retry-after"]) >= 1
        assert "--max-queue-wait" in refused.json()["error"]["message"]
        # gRPC answers the same call the same way (an empty text is malformed there).
        try:
            stub.Embed(pb.EmbedRequest(inputs=["one more"] * 299 + [""]), timeout=60)
            raise AssertionError("admitted behind ~10 s of work")
        except grpc.RpcError as exc:
            assert exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, exc
    assert len(held.result(timeout=300).embeddings) == len(HELD)
    # Drained: now the inputs are read, and the same call is refused for what it is.
    malformed = rest.post("/v1/embeddings", json=MIXED)
    assert malformed.status_code == 400, malformed.text
    assert "mixes element types" in malformed.json()["error"]["message"]
    rest.close()
    pool.shutdown()
