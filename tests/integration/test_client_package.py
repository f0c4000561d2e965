"""Issue 18: the encoderd-client distribution, built from clients/ and protos/, installed in a
fresh virtual environment without torch, against a real server."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
import urllib.request
import zipfile
from pathlib import Path

import numpy as np
import pytest
from support.server import ServerProcess

from encoderd.clients import EncoderClient
from encoderd.workers.contract.model_files import DEFAULT_MODEL_NAME, default_model_path

ROOT = Path(__file__).resolve().parents[2]
INDEX = os.environ.get("PIP_INDEX_URL", "https://pypi.org/simple").rstrip("/")
TEXTS = ["first text", "a second, longer text about encoder models", "third"]
DOCUMENTS = ["dogs", "cats are great", "finance"]
QUEUE = 4  # the server's --max-queued-inputs: a request of QUEUE + 1 inputs is always refused

# Runs inside the fresh venv: only the installed wheel and its dependencies are importable there.
SCRIPT = textwrap.dedent("""
    import asyncio, json, sys, time
    import encoderd.clients
    from encoderd.clients import AsyncEncoderClient, EncoderClient, NotFound, ResourceExhausted, RetryPolicy

    address, model, texts, documents, queue = sys.argv[1], sys.argv[2], *map(json.loads, sys.argv[3:])
    out = {"client_file": encoderd.clients.__file__}
    with EncoderClient(address) as client:
        out["embed"] = client.embed(texts, model=model).vectors.tolist()
        out["rerank"] = [[r.index, r.score] for r in client.rerank("cats", documents, model="reranker")]
        out["classify"] = [c.labels for c in client.classify(texts, model="classifier")]
        out["tokenize"] = [[t.ids, t.tokens, t.offsets] for t in client.tokenize(texts, model=model)]
        out["models"] = sorted(m.id for m in client.list_models())
        items = [(str(i), text) for i, text in enumerate(texts)]
        out["stream"] = sorted((r.id, r.vector.tolist()) for r in client.embed_stream(items, model=model))
        try:
            client.embed(texts, model="no-such-model")
        except NotFound as error:
            out["not_found"] = [type(error).__name__, error.message]
    with EncoderClient(address, retry=RetryPolicy(max_attempts=3, initial_backoff=0.05)) as client:
        try:
            client.embed([f"input {i}" for i in range(queue + 1)], model=model)
        except ResourceExhausted as error:
            out["exhausted"] = [error.attempts, error.message]

    async def embed_async():
        async with AsyncEncoderClient(address) as client:
            return (await client.embed(texts[:1], model=model)).vectors.tolist()

    out["async_embed"] = asyncio.run(embed_async())
    print(json.dumps(out))
""")


def _run(args, timeout, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(args, capture_output=True, text=True, timeout=timeout, **kwargs, check=False)


def _index_reachable() -> str | None:
    """None when pip's index answers, else why not."""
    try:
        urllib.request.urlopen(f"{INDEX}/grpcio/", timeout=10).close()
        return None
    except OSError as exc:
        return f"cannot reach the package index {INDEX} ({exc}): the client's dependencies install from it"


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """The client wheel, built from a copy of its sources so the checkout stays clean."""
    src = tmp_path_factory.mktemp("client-src")
    shutil.copytree(ROOT / "clients", src / "clients", ignore=shutil.ignore_patterns("node", "__pycache__"))
    shutil.copytree(
        ROOT / "protos" / "encoderd" / "v1",
        src / "protos" / "encoderd" / "v1",
        ignore=shutil.ignore_patterns("__pycache__"),
    )
    shutil.copytree(
        ROOT / "packaging" / "client",
        src / "packaging" / "client",
        ignore=shutil.ignore_patterns("build", "*.egg-info"),
    )
    out = tmp_path_factory.mktemp("wheel")
    built = _run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", str(src / "packaging" / "client"), "-w", str(out)],
        timeout=300,
    )
    if built.returncode and (reason := _index_reachable()):
        pytest.skip(f"building the wheel needs setuptools: {reason}")
    assert built.returncode == 0, built.stderr
    return next(out.glob("encoderd_client-*.whl"))


@pytest.fixture(scope="module")
def venv_python(wheel, tmp_path_factory) -> Path:
    """A fresh venv (no system site-packages) with the wheel and its dependencies installed."""
    if reason := _index_reachable():
        pytest.skip(reason)
    venv = tmp_path_factory.mktemp("client-venv")
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    installed = _run([str(python), "-m", "pip", "install", "-q", str(wheel)], timeout=300)
    assert installed.returncode == 0, installed.stderr
    return python


@pytest.fixture(scope="module")
def small_queue_server(tmp_path_factory, reranker_path, classifier_path):
    log = tmp_path_factory.mktemp("logs") / "client-package.log"
    with ServerProcess(
        "--model",
        f"{DEFAULT_MODEL_NAME}={default_model_path()}",
        "--model",
        f"reranker={reranker_path}",
        "--model",
        f"classifier={classifier_path}",
        "--max-queued-inputs",
        str(QUEUE),
        log_path=log,
    ) as server:
        yield server


def test_wheel_holds_only_the_client(wheel):
    with zipfile.ZipFile(wheel) as whl:
        names = whl.namelist()
        metadata = whl.read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
    packages = {n.rsplit("/", 1)[0] for n in names if n.endswith(".py")}
    assert packages == {"encoderd/clients", "encoderd/v1"}
    # No encoderd/__init__.py: `encoderd` stays a namespace the server distribution shares.
    assert "encoderd/__init__.py" not in names
    requires = {
        re.split(r"[<>=!~; ]", line.split(":", 1)[1].strip())[0]
        for line in metadata.splitlines()
        if line.startswith("Requires-Dist:")
    }
    assert requires == {"grpcio", "protobuf", "googleapis-common-protos", "numpy"}


def test_fresh_venv_has_no_server_dependencies(venv_python):
    for module in ("torch", "transformers", "tokenizers", "zmq", "encoderd.server"):
        probe = _run([str(venv_python), "-c", f"import {module}"], timeout=60)
        assert probe.returncode != 0 and "ModuleNotFoundError" in probe.stderr, module


def test_installed_client_against_a_real_server(venv_python, small_queue_server, tmp_path):
    script = tmp_path / "use_client.py"
    script.write_text(SCRIPT)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    ran = _run(
        [
            str(venv_python),
            str(script),
            small_queue_server.address,
            DEFAULT_MODEL_NAME,
            json.dumps(TEXTS),
            json.dumps(DOCUMENTS),
            str(QUEUE),
        ],
        timeout=120,
        cwd=tmp_path,
        env=env,
    )
    assert ran.returncode == 0, ran.stderr
    got = json.loads(ran.stdout)
    assert Path(got["client_file"]).is_relative_to(venv_python.parent.parent)  # the wheel, not the checkout

    with EncoderClient(small_queue_server.address) as reference:  # the server distribution's client
        want = reference.embed(TEXTS, model=DEFAULT_MODEL_NAME).vectors
        np.testing.assert_array_equal(np.array(got["embed"], dtype=np.float32), want)
        np.testing.assert_array_equal(np.array(got["async_embed"], dtype=np.float32), want[:1])
        assert [i for i, _ in got["stream"]] == ["0", "1", "2"]
        # Streamed inputs are batched differently from the unary call: equal up to float rounding.
        np.testing.assert_allclose(np.array([v for _, v in got["stream"]]), want, atol=1e-6)
        want_ranked = [[r.index, r.score] for r in reference.rerank("cats", DOCUMENTS, model="reranker")]
        assert got["rerank"] == want_ranked and sorted(i for i, _ in want_ranked) == [0, 1, 2]
        assert got["classify"] == [[list(p) for p in c.labels] for c in reference.classify(TEXTS, model="classifier")]
        tokens = reference.tokenize(TEXTS, model=DEFAULT_MODEL_NAME)
    assert got["tokenize"] == [[t.ids, t.tokens, [list(o) for o in t.offsets]] for t in tokens]
    assert got["tokenize"][2][1] == ["[CLS]", "third", "[SEP]"]
    assert got["models"] == sorted([DEFAULT_MODEL_NAME, "reranker", "classifier"])
    assert got["not_found"][0] == "NotFound" and "no-such-model" in got["not_found"][1]
    attempts, message = got["exhausted"]
    assert attempts == 3 and "overloaded" in message
    assert _rejected(small_queue_server) == 3  # every attempt reached the server


def _rejected(server) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=5).read().decode()
    found = re.search(
        rf'^encoderd_rejected_requests_total{{model="{re.escape(DEFAULT_MODEL_NAME)}",'
        r'reason="queue_full"} (\S+)$',
        text,
        re.M,
    )
    return float(found.group(1)) if found else 0.0
