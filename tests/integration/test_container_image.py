"""The CPU container image: built by deploy/container/build.sh (base from Debian packages), then one
container serves a real request over gRPC and over REST (Envoy inside the container).

Opt-in (ENCODERD_TEST_IMAGES=1): the base plus the image take minutes to build (see the notes in
deploy/container/README.md). Skipped, with the reason, where no container can run: no podman,
no mmdebstrap, or a sandbox that refuses containers.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
import urllib.request
import uuid
from pathlib import Path

import numpy as np
import pytest
from support.server import free_ports

ROOT = Path(__file__).resolve().parents[2]
BUILD = ROOT / "deploy" / "container" / "build.sh"
BASE = "localhost/encoderd-base:bookworm"
IMAGE = "localhost/encoderd:test-cpu"
TEXTS = ["hello world", "encoder models in a container"]

pytestmark = [
    pytest.mark.skipif(
        os.environ.get("ENCODERD_TEST_IMAGES") != "1",
        reason="image test is opt-in: ENCODERD_TEST_IMAGES=1 (builds for minutes)",
    ),
    pytest.mark.timeout(2400),
]  # the first test pays for building the base and the image


def podman(*args: str, timeout: float = 120, check: bool = True) -> subprocess.CompletedProcess:
    result = subprocess.run(["podman", *args], capture_output=True, text=True, timeout=timeout, check=False)
    if check and result.returncode != 0:
        raise AssertionError(f"podman {' '.join(args)}: {result.stderr[-3000:]}")
    return result


def dangling_images() -> set[str]:
    return set(podman("images", "-q", "--filter", "dangling=true").stdout.split())


@pytest.fixture(scope="module")
def engine_env() -> dict[str, str]:
    """build.sh probes podman and, where its defaults fail (no CAP_SYS_RESOURCE for its rlimits, hybrid
    cgroups that crun refuses, no systemd), writes a containers.conf and says `export CONTAINERS_CONF=...`,
    as a user is told to: the test runs its containers as that user would."""
    for tool, package in (("podman", "podman"), ("mmdebstrap", "mmdebstrap")):
        if not shutil.which(tool):
            pytest.skip(f"{tool} is missing (Debian package {package})")
    env = dict(os.environ)
    base = subprocess.run(
        [str(BUILD), "--base-only"], capture_output=True, text=True, timeout=900, env=env, check=False
    )
    if base.returncode != 0:
        pytest.skip(f"cannot build the base image or run a container here: {base.stderr.strip()[-300:]}")
    for line in base.stdout.splitlines():
        if line.startswith("export CONTAINERS_CONF="):
            env["CONTAINERS_CONF"] = line.split("=", 1)[1]
    os.environ.update({k: v for k, v in env.items() if k == "CONTAINERS_CONF"})
    podman("run", "--rm", "--network", "host", BASE, "true")  # as build.sh said, it runs
    return env


@pytest.fixture(scope="module")
def image(engine_env) -> str:
    started = time.monotonic()
    dangling = dangling_images()
    build = subprocess.run(
        [str(BUILD), "--tag", IMAGE], capture_output=True, text=True, timeout=1800, env=engine_env, check=False
    )
    assert build.returncode == 0, build.stdout[-3000:] + build.stderr[-3000:]
    print(f"image built in {time.monotonic() - started:.0f} s")
    # The multi-stage build left its build stage behind as an unnamed ~1.7 GB image.
    assert dangling_images() <= dangling, "the build left unnamed images behind"
    return IMAGE


@pytest.fixture(scope="module")
def container(image):
    """The image's defaults, its model cache on a named volume; host network (the sandbox may lack
    CNI plugins), so the ports are moved to free ones through ENCODERD_* variables."""
    grpc_port, rest_port, metrics_port = free_ports(3)
    volume = f"encoderd-test-cache-{uuid.uuid4().hex[:8]}"
    cid = podman(
        "run",
        "-d",
        "--network",
        "host",
        "-v",
        f"{volume}:/cache",
        "-e",
        f"ENCODERD_GRPC_PORT={grpc_port}",
        "-e",
        f"ENCODERD_REST_PORT={rest_port}",
        "-e",
        f"ENCODERD_METRICS_PORT={metrics_port}",
        image,
    ).stdout.strip()
    try:
        wait_healthy(cid)
        yield cid, grpc_port, rest_port
    finally:
        podman("rm", "-f", "-t", "5", cid, check=False)
        podman("volume", "rm", "-f", volume, check=False)


def wait_healthy(cid: str, timeout: float = 300) -> None:
    """Polls the image's own HEALTHCHECK (the gRPC health service) until it passes."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if podman("healthcheck", "run", cid, check=False).returncode == 0:
            return
        state = podman("inspect", "-f", "{{.State.Running}}", cid).stdout.strip()
        assert state == "true", "the container exited:\n" + podman("logs", cid, check=False).stderr[-3000:]
        time.sleep(2)
    raise AssertionError("not healthy in time:\n" + podman("logs", cid, check=False).stderr[-3000:])


def test_image_metadata(image):
    config = json.loads(podman("image", "inspect", image).stdout)[0]["Config"]
    assert config["User"] == "10001:10001"
    assert "/cache" in config["Volumes"]
    assert config["Labels"]["org.opencontainers.image.title"] == "encoderd"
    assert config["Labels"]["io.encoderd.variant"] == "cpu"
    env = dict(e.split("=", 1) for e in config["Env"])
    assert env["ENCODERD_HOST"] == "0.0.0.0" and env["HF_HOME"].startswith("/cache/")


def test_container_serves_grpc_and_rest(container, minilm_path):
    from sentence_transformers import SentenceTransformer

    from encoderd.clients import EncoderClient

    cid, grpc_port, rest_port = container
    assert podman("exec", cid, "id", "-u").stdout.strip() == "10001"  # not root
    want = SentenceTransformer(minilm_path, device="cpu").encode(TEXTS, normalize_embeddings=True)
    with EncoderClient(f"127.0.0.1:{grpc_port}") as client:
        got = client.embed(TEXTS).vectors
        (served,) = client.list_models()
    # The image runs the server's defaults: --dtype auto is bfloat16 on a CPU with native bf16 (after
    # the worker's fidelity check), float32 elsewhere; float32 must match sentence-transformers exactly.
    if served.dtype == "float32":
        np.testing.assert_allclose(got, want, atol=2e-5)
    else:
        assert served.dtype == "bfloat16", served.dtype
        assert np.min(np.sum(got * want, axis=1)) >= 0.999  # unit vectors: the cosine
    request = urllib.request.Request(
        f"http://127.0.0.1:{rest_port}/v1/embeddings",
        data=json.dumps({"input": TEXTS}).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=30) as response:
        rest = np.array([d["embedding"] for d in json.load(response)["data"]], dtype=np.float32)
    np.testing.assert_allclose(rest, got, atol=1e-6)


def test_container_stops_cleanly_on_sigterm(container):
    cid, _, _ = container
    podman("stop", "-t", "60", cid, timeout=90)
    assert podman("inspect", "-f", "{{.State.ExitCode}}", cid).stdout.strip() == "0", podman("logs", cid).stderr[-3000:]
