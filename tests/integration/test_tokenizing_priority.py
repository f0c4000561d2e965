"""A big call's tokenizing runs at the tokenizer pool's priority (--worker-nice below the frontend,
as the workers run), not at the event loop's: at the loop's priority it took the cores from the
workers, and other callers' queries computing there waited for it (issue 42, item 3).

Hugging Face tokenizers parallelizes encode_batch on threads of its own, made by whichever thread
tokenized first (the loop, for a live query); the frontend turns that off
(tokenization.tokenize_on_the_calling_thread). The server here starts without
TOKENIZERS_PARALLELISM, as a user's shell does (tests/conftest.py sets it for the test process).
"""

from __future__ import annotations

from support.nice import cpu_seconds_by_nice, process_nice
from support.server import ServerProcess

from encoderd.server.base.config import WORKER_NICE
from encoderd.v1 import encoderd_pb2 as pb

# Long texts, truncated to the model's 256 tokens: tokenizing reads every character (~0.5 s of CPU
# on a 2-vCPU Xeon), while what the loop does per input (its ids, batching, the answer) stays small.
SENTENCE = "the frontend tokenizes a long document before any worker computes it "
TEXTS = [f"passage {i}: " + SENTENCE * 110 for i in range(256)]


def test_a_big_calls_tokenizing_runs_at_the_tokenizer_pools_priority(tmp_path):
    server = ServerProcess("--replicas", "1", "--max-request-tokens", "0", log_path=tmp_path / "server.log")
    server.env.pop("TOKENIZERS_PARALLELISM", None)
    with server:
        stub = server.stub()
        stub.Embed(pb.EmbedRequest(inputs=["a live query first: tokenized on the event loop"]), timeout=60)
        frontend = process_nice(server.proc.pid)
        before = cpu_seconds_by_nice(server.proc.pid)
        answer = stub.Embed(pb.EmbedRequest(inputs=TEXTS), timeout=300)
        assert len(answer.embeddings) == len(TEXTS)
        after = cpu_seconds_by_nice(server.proc.pid)
    used = {nice: after[nice] - before.get(nice, 0.0) for nice in after}
    pool = used.get(frontend + WORKER_NICE, 0.0)
    loop = used.get(frontend, 0.0)
    # The pool's share: tokenizing and the token floor's count; the loop's: receiving, the ids, the answer.
    assert pool > 3 * loop, used
