"""Issue 7: the Node.js client (clients/node, @grpc/grpc-js + proto-loader) against the live server.

The JavaScript tests themselves are clients/node/test.js (node's built-in test runner);
this wrapper installs the client's locked dependencies and points it at the session server.
"""

from __future__ import annotations

import os
import subprocess

from support.node import googleapis_include, node_client_dir

from encoderd.workers.contract.model_files import DEFAULT_MODEL_NAME


def test_node_client_embeds_and_reranks(server):
    client_dir = node_client_dir()
    env = {
        **os.environ,
        "ENCODERD_ADDRESS": server.address,
        "ENCODERD_PROTO_INCLUDE": googleapis_include(),
        "ENCODERD_EMBED_MODEL": DEFAULT_MODEL_NAME,
        "ENCODERD_RERANK_MODEL": "reranker",
    }
    result = subprocess.run(
        ["node", "--test", "--test-reporter=spec", "test.js"],
        cwd=client_dir,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, f"node --test failed:\n{result.stdout[-6000:]}\n{result.stderr[-3000:]}"
    assert "pass 4" in result.stdout and "fail 0" in result.stdout, result.stdout[-3000:]
