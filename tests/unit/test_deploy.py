"""Issue 7: the deployment files are valid for the tools that will read them.

* systemd: `systemd-analyze verify` on the units (with the GPU drop-in applied) in a
  scratch root that holds the system's own units and stand-ins for the binaries, and
  the hardening score of `systemd-analyze security --offline`.
* encoderd.env.example documents every ENCODERD_* variable the CLI reads, read from the
  CLI's own parser, so a flag added later without documentation fails here.
* Kubernetes: the manifests (and the kustomize GPU and TLS overlays, where kubectl can render them)
  against the Kubernetes JSON schemas bundled in the `kubernetes-validate` package,
  offline, strict (unknown fields fail); plus the probe / grace-period rules that matter.
* Envoy: deploy/envoy/front.yaml through `envoy --mode validate`.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from encoderd.server.main.flag_env import env_name
from encoderd.server.main.flags import build_parser

ROOT = Path(__file__).resolve().parents[2]
SYSTEMD = ROOT / "deploy" / "systemd"
KUBERNETES = ROOT / "deploy" / "kubernetes"
UNITS = ("encoderd.service", "encoderd-envoy.service")
STUB_BINARIES = ("/opt/encoderd/bin/encoderd", "/opt/encoderd/bin/envoy")  # the units' ExecStart= paths


# ------------------------------------------------------------------ env example
def cli_env_variables() -> dict[str, str]:
    """ENCODERD_* name -> flag, for every option of `encoderd serve`."""
    commands = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    found = {}
    for action in commands.choices["serve"]._actions:
        flags = [f for f in action.option_strings if f.startswith("--") and f != "--help"]
        if flags:
            found[env_name(flags[0])] = flags[0]
    return found


def test_env_example_documents_every_cli_variable():
    text = (SYSTEMD / "encoderd.env.example").read_text()
    documented = set(re.findall(r"^#?(ENCODERD_[A-Z0-9_]+)=", text, re.M))
    variables = cli_env_variables()
    assert len(variables) > 10  # the parser walk found the serve flags
    missing = sorted(set(variables) - documented)
    assert not missing, "add to deploy/systemd/encoderd.env.example:\n" + "\n".join(
        f"# {variables[name]}: <what it does>\n#{name}=<default>\n" for name in missing
    )


def test_env_example_names_only_real_variables():
    text = (SYSTEMD / "encoderd.env.example").read_text()
    known = set(cli_env_variables()) | {"ENCODERD_RPC_DIR"}  # read by workers/contract/ipc.py, not a flag
    assert set(re.findall(r"^#?(ENCODERD_[A-Z0-9_]+)=", text, re.M)) <= known


# ---------------------------------------------------------------------- systemd
@pytest.fixture(scope="module")
def systemd_root(tmp_path_factory) -> Path:
    """A scratch root: the host's system units, ours, the GPU and TLS drop-ins, and stand-in binaries."""
    analyze = shutil.which("systemd-analyze")
    if not analyze:
        pytest.skip("systemd-analyze is missing (Debian package systemd; .ci/run installs it)")
    root = tmp_path_factory.mktemp("root")
    system_units = next(
        (p for p in (Path("/usr/lib/systemd/system"), Path("/lib/systemd/system")) if (p / "sysinit.target").exists()),
        None,
    )
    if system_units is None:
        pytest.skip("the systemd package's own units are not installed")
    shutil.copytree(system_units, root / "usr/lib/systemd/system", symlinks=True)
    etc = root / "etc/systemd/system"
    (etc / "encoderd.service.d").mkdir(parents=True)
    for unit in UNITS:
        shutil.copy(SYSTEMD / unit, etc / unit)
    for drop_in in ("gpu", "tls"):
        shutil.copy(
            SYSTEMD / "encoderd.service.d" / f"{drop_in}.conf.example", etc / "encoderd.service.d" / f"{drop_in}.conf"
        )
    for binary in STUB_BINARIES:
        stub = root / binary.lstrip("/")
        stub.parent.mkdir(parents=True, exist_ok=True)
        stub.write_text("#!/bin/sh\n")
        stub.chmod(0o755)
    return root


def analyze(root: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["systemd-analyze", *args, f"--root={root}"], capture_output=True, text=True, timeout=60, check=False
    )


def test_units_pass_systemd_analyze_verify(systemd_root):
    result = analyze(systemd_root, "verify", *(f"/etc/systemd/system/{u}" for u in UNITS))
    # verify exits 0 on "unknown key, ignoring": any message at all counts as a finding.
    assert result.returncode == 0 and not (result.stdout + result.stderr).strip(), result.stdout + result.stderr


@pytest.mark.parametrize("unit", UNITS)
def test_units_are_hardened(systemd_root, unit):
    result = analyze(systemd_root, "security", "--offline=true", f"/etc/systemd/system/{unit}")
    match = re.search(r"Overall exposure level for \S+: ([\d.]+)", result.stdout)
    assert match, result.stdout[-2000:] + result.stderr
    assert float(match.group(1)) <= 2.5, result.stdout  # systemd calls < 3 "OK"; the GPU drop-in included


@pytest.mark.parametrize(
    ("env", "reason"),
    [({"ENCODERD_TLS_CERT": "/certs/server.pem"}, "TLS is on"), ({"ENCODERD_NO_OPEN_HEALTH": "1"}, "API key")],
)
def test_container_healthcheck_says_when_it_cannot_reach_the_server(env, reason):
    """The image's plaintext, keyless HEALTHCHECK against a TLS or closed-health server would only
    ever say UNAVAILABLE: it names the setting and the way out instead."""
    check = subprocess.run(
        [sys.executable, str(ROOT / "deploy" / "container" / "healthcheck.py")],
        env={**os.environ, "ENCODERD_GRPC_PORT": "9", **env},
        capture_output=True,
        check=False,
        text=True,
        timeout=30,
    )
    assert check.returncode == 1 and reason in check.stderr and "--no-healthcheck" in check.stderr


def test_units_keep_drain_inside_the_stop_timeout():
    unit = (SYSTEMD / "encoderd.service").read_text()
    assert re.search(r"^Type=notify$", unit, re.M) and re.search(r"^KillMode=mixed$", unit, re.M)
    stop = int(re.search(r"^TimeoutStopSec=(\d+)s$", unit, re.M).group(1))
    drain = next(a.default for a in _serve_actions() if a.dest == "drain_timeout")
    assert stop > drain + 5


def _serve_actions():
    commands = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return commands.choices["serve"]._actions


# ------------------------------------------------------------------- Kubernetes
def kustomize(directory: Path) -> list[dict]:
    """Render with `kubectl kustomize` where kubectl exists; else the base's files as listed."""
    kubectl = shutil.which("kubectl")
    if kubectl:
        out = subprocess.run(
            [kubectl, "kustomize", str(directory)], capture_output=True, text=True, timeout=60, check=False
        )
        assert out.returncode == 0, out.stderr
        return [d for d in yaml.safe_load_all(out.stdout) if d]
    kustomization = yaml.safe_load((directory / "kustomization.yaml").read_text())
    if "patches" in kustomization:
        pytest.skip("rendering a kustomize overlay needs kubectl (not installed)")
    return [d for name in kustomization["resources"] for d in yaml.safe_load_all((directory / name).read_text()) if d]


@pytest.fixture(scope="module", params=["base", "overlays/gpu", "overlays/tls"])
def manifests(request) -> tuple[str, list[dict]]:
    return request.param, kustomize(KUBERNETES / request.param)


def test_manifests_match_the_kubernetes_schemas(manifests):
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    _, documents = manifests
    assert {d["kind"] for d in documents} >= {"Deployment", "Service", "ConfigMap"}
    for document in documents:
        kubernetes_validate.validate(document, kubernetes_validate.latest_version(), strict=True)


def test_deployment_probes_health_and_outlives_the_drain(manifests):
    variant, documents = manifests
    (deployment,) = [d for d in documents if d["kind"] == "Deployment"]
    (config,) = [d for d in documents if d["kind"] == "ConfigMap"]
    pod = deployment["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    port = int(config["data"]["ENCODERD_GRPC_PORT"])
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        if variant == "overlays/tls":  # the kubelet's gRPC probes cannot speak TLS: REST /health over HTTPS
            assert (
                container[probe]["httpGet"]
                == {"path": "/health", "port": int(config["data"]["ENCODERD_REST_PORT"]), "scheme": "HTTPS"}
                and "grpc" not in container[probe]
            )
        else:
            assert container[probe]["grpc"]["port"] == port  # the grpc.health.v1 service, overall ("")
    pre_stop = container["lifecycle"]["preStop"]["sleep"]["seconds"]
    assert pod["terminationGracePeriodSeconds"] > pre_stop + float(config["data"]["ENCODERD_DRAIN_TIMEOUT"]) + 5
    assert config["data"]["ENCODERD_HOST"] == "0.0.0.0"  # the kubelet probes the pod IP
    assert any(m["mountPath"] == "/cache" for m in container["volumeMounts"])
    if variant == "overlays/tls":  # the Secret's files where the ConfigMap points
        mount = next(m for m in container["volumeMounts"] if m["name"] == "tls")
        secret = next(v for v in pod["volumes"] if v["name"] == "tls")["secret"]
        for key in ("ENCODERD_TLS_CERT", "ENCODERD_TLS_KEY"):
            assert config["data"][key] in (f"{mount['mountPath']}/tls.crt", f"{mount['mountPath']}/tls.key")
        assert mount["readOnly"] and secret["defaultMode"] & 0o007 == 0  # no world access to the key
    if variant == "overlays/gpu":
        assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
        assert config["data"]["ENCODERD_DEVICE"] == "cuda"


def test_manifests_run_the_image_build_sh_makes(manifests):
    variant, documents = manifests
    (deployment,) = [d for d in documents if d["kind"] == "Deployment"]
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    version = re.search(r"^VERSION=(\S+)$", (ROOT / "deploy/container/build.sh").read_text(), re.M).group(1)
    assert version == re.search(r'^version = "(.+)"$', (ROOT / "pyproject.toml").read_text(), re.M).group(1)
    assert container["image"] == f"encoderd:{version}" + ("-cuda" if variant == "overlays/gpu" else "")
    assert "command" not in container  # the image's entrypoint (tini, then encoderd) stays


def test_containerfile_matches_the_manifests_and_the_cli(manifests):
    """The image (built only where ENCODERD_TEST_IMAGES=1) agrees with what runs it: the user the pods
    run as, the cache path they mount, ENCODERD_* names the CLI reads, a gRPC health check."""
    _, documents = manifests
    (deployment,) = [d for d in documents if d["kind"] == "Deployment"]
    pod = deployment["spec"]["template"]["spec"]
    text = (ROOT / "deploy/container/Containerfile").read_text()
    user = re.search(r"^USER (\d+):(\d+)$", text, re.M).groups()
    assert user == (str(pod["securityContext"]["runAsUser"]), str(pod["securityContext"]["runAsGroup"]))
    assert re.search(r'^VOLUME \["/cache"\]$', text, re.M)
    assert set(re.findall(r"\b(ENCODERD_[A-Z_]+)=", text)) <= set(cli_env_variables()) | {"ENCODERD_RPC_DIR"}
    assert re.search(r'^HEALTHCHECK .*CMD \["encoderd-healthcheck"\]$', text, re.M)
    assert "grpc_health.v1" in (ROOT / "deploy/container/healthcheck.py").read_text()


# ------------------------------------------------------------------------ Envoy
def test_front_envoy_config_is_valid(tmp_path):
    try:
        from encoderd.gateway.envoy import find_envoy

        envoy = find_envoy()
    except Exception as exc:  # noqa: BLE001 - no binary: nothing to validate with
        pytest.skip(f"no Envoy binary: {exc}")
    config = ROOT / "deploy" / "envoy" / "front.yaml"
    result = subprocess.run(
        [envoy, "--mode", "validate", "--config-path", str(config), "--disable-hot-restart", "--log-level", "warn"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0 and "OK" in result.stdout + result.stderr, result.stdout + result.stderr


def test_python_dash_m_encoderd_is_the_encoderd_command():
    import subprocess
    import sys

    shown = subprocess.run(
        [sys.executable, "-m", "encoderd", "serve", "--help"], capture_output=True, text=True, timeout=60, check=False
    )
    assert shown.returncode == 0 and "--drain-timeout" in shown.stdout, shown.stderr
