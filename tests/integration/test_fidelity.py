"""Issue 15 item 2: the fidelity self-check at start-up, on real servers.

A faithful engine x dtype passes and its figures are reported in ListModels, REST /v1/models
(through Envoy) and /metrics; a deliberately broken conversion (the cached int8 graph's weight
scales bent in place, its manifest kept) stops the server with one clear line, unless the
operator passes --allow-low-fidelity. Metrics and floors: tests/unit/test_fidelity.py.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import urllib.request
from pathlib import Path

import numpy as np
import pytest
from support.server import ServerProcess

from encoderd.v1 import encoderd_pb2 as pb
from encoderd.workers.contract.model_files import DEFAULT_MODEL_NAME, default_model_path
from encoderd.workers.model_cache import MANIFEST

_DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}))
SCALE_BUG = 1.25  # every int8 weight scale off by 25%: what a quantizer with a wrong range would write


def _get(url: str) -> str:
    with _DIRECT.open(url, timeout=10) as response:
        return response.read().decode()


def _gauges(server: ServerProcess, name: str) -> dict[tuple[str, str], float]:
    """{(model, metric): value} of one fidelity gauge on /metrics."""
    text = _get(f"http://127.0.0.1:{server.metrics_port}/metrics")
    pattern = rf'^{name}\{{metric="([^"]+)",model="([^"]+)"\}} (\S+)$'
    return {(model, metric): float(value) for metric, model, value in re.findall(pattern, text, re.M)}


def _infos(server: ServerProcess) -> dict[str, pb.ModelInfo]:
    return {m.id: m for m in server.stub().ListModels(pb.ListModelsRequest()).models}


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("fidelity-cache")


@pytest.fixture(scope="module")
def int8_server(tmp_path_factory, cache_dir):
    """onnx int8 on MiniLM; exporting and quantizing fill cache_dir, which the broken-conversion
    tests copy."""
    log = tmp_path_factory.mktemp("int8") / "server.log"
    proc = ServerProcess("--engine", "onnx", "--dtype", "int8", "--cache-dir", str(cache_dir), log_path=log)
    proc.start(timeout=300)
    yield proc
    assert proc.stop() == 0, proc.log_text()


def test_torch_float32_passes_and_is_reported_everywhere(tmp_path, cache_dir, reranker_path, classifier_path):
    log = tmp_path / "server.log"
    with ServerProcess(
        "--model",
        f"{DEFAULT_MODEL_NAME}={default_model_path()}",
        "--model",
        f"reranker={reranker_path}",
        "--model",
        f"classifier={classifier_path}",
        "--cache-dir",
        str(cache_dir),
        rest=True,
        log_path=log,
    ) as server:
        infos = _infos(server)
        expected = {
            DEFAULT_MODEL_NAME: ["min_cosine"],
            "reranker": ["max_prob_diff", "kendall_tau"],
            "classifier": ["max_prob_diff", "top1_agreement"],
        }
        for name, metrics in expected.items():
            info = infos[name]
            assert info.fidelity_status == "passed", info
            assert [f.metric for f in info.fidelity] == metrics and all(f.passed for f in info.fidelity)
        [cosine] = infos[DEFAULT_MODEL_NAME].fidelity
        # The padding-free torch path against transformers' padded float32 forward: equal to rounding.
        assert cosine.value >= 0.9999 and cosine.bound == 0.9999
        diff, tau = infos["reranker"].fidelity
        assert diff.value <= 1e-3 and diff.bound == 0.001 and tau.value == 1.0

        rest = {m["id"]: m for m in json.loads(_get(server.rest_url + "/v1/models"))["data"]}
        assert rest[DEFAULT_MODEL_NAME]["fidelity_status"] == "passed"
        assert rest[DEFAULT_MODEL_NAME]["fidelity"] == [
            {"metric": "min_cosine", "value": cosine.value, "bound": 0.9999, "passed": True}
        ]
        assert [f["metric"] for f in rest["classifier"]["fidelity"]] == expected["classifier"]

        values, bounds = _gauges(server, "encoderd_model_fidelity"), _gauges(server, "encoderd_model_fidelity_bound")
        assert values[(DEFAULT_MODEL_NAME, "min_cosine")] == pytest.approx(cosine.value)
        assert bounds[(DEFAULT_MODEL_NAME, "min_cosine")] == 0.9999
        assert values[("reranker", "kendall_tau")] == 1.0
        assert values.keys() == bounds.keys() == {(n, m) for n, ms in expected.items() for m in ms}
    text = log.read_text()
    assert re.search(
        r"fidelity self-check passed: .*all-MiniLM-L6-v2 \(torch float32 on cpu\): min_cosine 1\.0000", text
    )


def test_onnx_int8_passes_with_its_own_figure(int8_server):
    info = _infos(int8_server)[DEFAULT_MODEL_NAME]
    assert (info.engine, info.dtype, info.fidelity_status) == ("onnx", "int8", "passed")
    [cosine] = info.fidelity
    # int8 is not exact: a figure of 1.0 here would mean the check compared the wrong thing.
    assert 0.99 <= cosine.value < 0.9999 and cosine.bound == 0.99 and cosine.passed
    assert _gauges(int8_server, "encoderd_model_fidelity")[(DEFAULT_MODEL_NAME, "min_cosine")] == pytest.approx(
        cosine.value
    )


def _break_int8_conversion(cache_dir: Path, into: Path) -> Path:
    """A copy of the cache whose int8 graph's weight scales are all off by SCALE_BUG; manifest kept."""
    import onnx
    from onnx import numpy_helper

    shutil.copytree(cache_dir, into)
    [entry] = [
        p.parent for p in (into / "onnx").glob(f"*/{MANIFEST}") if json.loads(p.read_text())["label"].endswith("-int8")
    ]
    model = onnx.load(str(entry / "model.onnx"))
    quantized = {init.name for init in model.graph.initializer if init.name.endswith("_quantized")}
    bent = 0
    for init in model.graph.initializer:
        if init.name.removesuffix("_scale") + "_quantized" in quantized:
            init.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(init) * np.float32(SCALE_BUG), init.name))
            bent += 1
    assert bent >= 24  # 6 layers x (q, k, v, attention output, up-projection)
    onnx.save(model, str(entry / "model.onnx"))
    return into


def test_a_broken_conversion_is_refused(int8_server, cache_dir, tmp_path):
    broken = _break_int8_conversion(cache_dir, tmp_path / "cache")
    log = tmp_path / "server.log"
    server = ServerProcess("--engine", "onnx", "--dtype", "int8", "--cache-dir", str(broken), log_path=log).launch()
    try:
        code = server.proc.wait(timeout=180)
    except subprocess.TimeoutExpired:
        server.stop()
        pytest.fail(f"a broken int8 graph was served; log: {server.log_text()}")
    assert code != 0
    text = log.read_text()
    assert "reusing cached onnx entry" in text  # the broken graph itself was loaded, not rebuilt
    [line] = [ln for ln in text.splitlines() if "fidelity self-check FAILED" in ln and "not serving it" in ln]
    figure = float(re.search(r"min_cosine (\d\.\d+) \(floor 0\.99\)", line).group(1))
    assert figure < 0.95
    assert " ERROR " in line and "--dtype float32" in line and "--allow-low-fidelity" in line
    assert "Traceback" not in text


def test_allow_low_fidelity_serves_and_reports_the_low_figure(int8_server, cache_dir, tmp_path):
    broken = _break_int8_conversion(cache_dir, tmp_path / "cache")
    log = tmp_path / "server.log"
    with ServerProcess(
        "--engine", "onnx", "--dtype", "int8", "--cache-dir", str(broken), "--allow-low-fidelity", log_path=log
    ) as server:
        info = _infos(server)[DEFAULT_MODEL_NAME]
        assert info.fidelity_status == "low"
        [cosine] = info.fidelity
        assert cosine.value < 0.95 and not cosine.passed and cosine.bound == 0.99
        assert _gauges(server, "encoderd_model_fidelity")[(DEFAULT_MODEL_NAME, "min_cosine")] == pytest.approx(
            cosine.value
        )
        response = server.stub().Embed(pb.EmbedRequest(inputs=["still served"]))
        assert len(response.embeddings[0].values) == 384
    text = log.read_text()
    assert re.search(r"WARNING.*fidelity self-check FAILED.*min_cosine 0\.\d+ \(floor 0\.99\).*serving it anyway", text)
    assert "reference cached" in text  # copied with the cache: no second float32 forward


def test_the_check_of_a_logits_served_cross_encoder_compares_its_logits(tmp_path, cache_dir):
    """Issue 43 item 2: a CrossEncoder saved with an Identity activation is served its logits, and
    its bfloat16 check measures those (max_logit_diff), not sigmoid probabilities of them: the figure
    is the largest difference between the logits the bfloat16 engine serves and transformers' float32
    ones. Fails on the old code (it reported max_prob_diff, up to 4x smaller than the logits' own)."""
    from support.st_models import build_head_model

    from encoderd.server.models import postprocess
    from encoderd.workers import calibration, fidelity
    from encoderd.workers.backends import BackendOptions, create_backend
    from encoderd.workers.contract.model_spec import ScoreActivation
    from encoderd.workers.contract.spec_reader import load_model_spec

    path = build_head_model(tmp_path / "ce-identity", ("score",), cross_encoder_activation="Identity")
    spec = load_model_spec("ce-identity", str(path))
    assert spec.score_activation == ScoreActivation.IDENTITY
    backend = create_backend("torch", spec, BackendOptions(dtype="bfloat16", cache_dir=str(cache_dir)))
    backend.load()
    report = fidelity.self_check(backend, spec, allow_low=True)
    assert [f.metric for f in report.figures] == ["max_logit_diff", "kendall_tau"]
    [diff, _] = report.figures
    assert diff.bound == 0.04

    batches = calibration.batches(spec, backend.options.max_batch_size)
    served = postprocess.scores(np.concatenate([backend.forward(b) for b in batches])[:, 0], "identity")
    want, _ = fidelity.reference(spec, batches, str(cache_dir))
    assert diff.value == pytest.approx(float(np.max(np.abs(served - want[:, 0]))), abs=1e-6)
    as_probabilities = np.max(np.abs(postprocess.sigmoid(served) - postprocess.sigmoid(want[:, 0])))
    assert diff.value > as_probabilities  # what the old check reported instead
