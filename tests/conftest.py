"""Shared fixtures: the test models, and one real server serving all three kinds."""

from __future__ import annotations

import os

import pytest
from support.models import build_classifier, build_reranker
from support.server import ServerProcess

from encoderd.workers.contract.model_files import DEFAULT_MODEL_NAME, default_model_path

# Tests never reach a model hub.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# The servers tests start compare float32 outputs with the reference libraries and count workers:
# they pin what the defaults would otherwise choose per host (bfloat16 and one worker per core on a
# small AVX-512 host). tests/integration/test_auto_defaults.py starts one without these.
os.environ.setdefault("ENCODERD_DTYPE", "float32")
os.environ.setdefault("ENCODERD_REPLICAS", "1")


@pytest.fixture(scope="session")
def models_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("models")


@pytest.fixture(scope="session")
def minilm_path() -> str:
    return default_model_path()


@pytest.fixture(scope="session")
def reranker_path(models_dir) -> str:
    return str(build_reranker(models_dir / "reranker"))


@pytest.fixture(scope="session")
def classifier_path(models_dir) -> str:
    return str(build_classifier(models_dir / "classifier"))


@pytest.fixture(scope="session")
def server(tmp_path_factory, reranker_path, classifier_path):
    """One encoderd process serving an embedder, a reranker and a classifier."""
    log = tmp_path_factory.mktemp("logs") / "server.log"
    proc = ServerProcess(
        "--model",
        f"{DEFAULT_MODEL_NAME}={default_model_path()}",
        "--model",
        f"reranker={reranker_path}",
        "--model",
        f"classifier={classifier_path}",
        "--max-inputs-per-request",
        "256",
        # The tests on this server check answers under concurrency; admission by expected wait would
        # turn a slow or busy host into refusals (a timing-dependent failure). Admission has its own
        # servers, held by stopped workers (test_admission.py, test_refusal_order.py).
        "--max-queue-wait",
        "0",
        log_path=log,
    )
    proc.start()
    yield proc
    assert proc.stop() == 0, proc.log_text()


@pytest.fixture(scope="session")
def stub(server):
    return server.stub()
