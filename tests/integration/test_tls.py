"""TLS and mutual TLS on both listeners (issue 16). Two real servers on loopback, on certificates
this module makes (support/certs.py): one with TLS, its Envoy holding both ports (the default;
Envoy's DownstreamTlsContext), one with client certificates required and --grpc-direct (gRPC
from the server itself: grpc.ssl_server_credentials). Bad files stop the start in one line."""

from __future__ import annotations

import signal
import socket
import ssl
import subprocess
import sys
import time
from pathlib import Path

import grpc
import httpx
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from support.certs import make_pki
from support.server import ServerProcess

from encoderd.clients import EncoderClient, Unavailable, tls_credentials
from encoderd.gateway.process import listens_on

HANDSHAKE_TIMEOUT = 1.0  # --rest-header-timeout bounds the TLS handshake too


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    return make_pki(tmp_path_factory.mktemp("pki"))


def _rest_context(pki, client_cert: bool) -> ssl.SSLContext:
    context = ssl.create_default_context(cafile=str(pki.ca))
    if client_cert:
        context.load_cert_chain(pki.client_cert, pki.client_key)
    return context


@pytest.fixture(scope="module")
def servers(pki, tmp_path_factory, minilm_path):
    """(TLS server, mutual-TLS server), started side by side."""
    logs = tmp_path_factory.mktemp("tls-logs")
    tls = ServerProcess(
        "--model",
        f"m={minilm_path}",
        "--tls-cert",
        str(pki.server_cert),
        "--tls-key",
        str(pki.server_key),
        "--rest-header-timeout",
        str(HANDSHAKE_TIMEOUT),
        rest=True,
        log_path=logs / "tls.log",
        env={"ENCODERD_RPC_DIR": str(tmp_path_factory.mktemp("rpc"))},
        credentials=tls_credentials(pki.ca),
        rest_tls=_rest_context(pki, client_cert=False),
    )
    mutual = ServerProcess(
        "--model",
        f"m={minilm_path}",
        "--tls-cert",
        str(pki.server_cert),
        "--tls-key",
        str(pki.server_key),
        "--tls-client-ca",
        str(pki.ca),
        "--grpc-direct",
        rest=True,
        log_path=logs / "mtls.log",
        credentials=tls_credentials(pki.ca, pki.client_cert, pki.client_key),
        rest_tls=_rest_context(pki, client_cert=True),
    )
    try:
        for server in (tls.launch(), mutual.launch()):
            server.wait_serving()
            server.wait_rest()
        yield tls, mutual
    finally:
        for server in (tls, mutual):
            code = server.stop()
            assert code == 0 or (code == -signal.SIGKILL and server is tls), server.log_text()


def _refused(channel: grpc.Channel) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as refused:
        health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
    channel.close()
    return refused.value.code()


def test_grpc_over_tls_serves_and_plaintext_is_refused(servers, pki):
    tls, _ = servers
    assert listens_on(tls.envoy_pid(), tls.grpc_port)  # Envoy's TLS, not the server's
    with EncoderClient(tls.address, credentials=tls_credentials(root_certs=pki.ca)) as client:
        vectors = client.embed(["over TLS"], model="m").vectors
    assert vectors.shape == (1, 384)
    # The REST port takes native gRPC too, over its own TLS (ALPN h2), with the same answer.
    with EncoderClient(f"127.0.0.1:{tls.rest_port}", credentials=tls_credentials(root_certs=pki.ca)) as client:
        np.testing.assert_allclose(client.embed(["over TLS"], model="m").vectors, vectors, atol=1e-6)
    assert _refused(grpc.insecure_channel(tls.address)) == grpc.StatusCode.UNAVAILABLE
    # A client that trusts another CA does not accept this server.
    assert _refused(grpc.secure_channel(tls.address, tls_credentials(pki.other_ca))) == grpc.StatusCode.UNAVAILABLE


def test_rest_over_tls_with_the_ca_matches_grpc(servers, pki):
    tls, _ = servers
    response = httpx.post(
        f"https://localhost:{tls.rest_port}/v1/embeddings",
        json={"model": "m", "input": ["over TLS"]},
        verify=_rest_context(pki, client_cert=False),
        timeout=60,
    )
    assert response.status_code == 200, response.text
    rest = np.array(response.json()["data"][0]["embedding"], dtype=np.float32)
    with EncoderClient(tls.address, credentials=tls_credentials(pki.ca)) as client:
        np.testing.assert_allclose(rest, client.embed(["over TLS"], model="m").vectors[0], atol=1e-6)
    with pytest.raises(httpx.HTTPError):  # plain HTTP on the TLS port
        httpx.get(f"http://127.0.0.1:{tls.rest_port}/health", timeout=10)


def test_a_stalled_tls_handshake_is_cut_off_at_the_header_timeout(servers):
    tls, _ = servers
    with socket.create_connection(("127.0.0.1", tls.rest_port), timeout=10) as sock:
        sock.sendall(b"\x16\x03\x01")  # the start of a TLS record, then nothing
        started = time.monotonic()
        try:
            closed = sock.recv(1024) == b""
        except ConnectionResetError:
            closed = True
        elapsed = time.monotonic() - started
    assert closed and HANDSHAKE_TIMEOUT - 0.3 < elapsed < HANDSHAKE_TIMEOUT + 2.0, elapsed


def test_mutual_tls_serves_a_client_certificate_and_refuses_none(servers, pki):
    _, mutual = servers
    assert listens_on(mutual.proc.pid, mutual.grpc_port)  # --grpc-direct: the server's own TLS
    with EncoderClient(mutual.address, credentials=tls_credentials(pki.ca, pki.client_cert, pki.client_key)) as client:
        assert client.embed(["with a client certificate"], model="m").vectors.shape == (1, 384)
    with (
        EncoderClient(mutual.address, credentials=tls_credentials(pki.ca), timeout=10) as client,
        pytest.raises(Unavailable),
    ):
        client.embed(["without one"], model="m")
    assert _refused(grpc.insecure_channel(mutual.address)) == grpc.StatusCode.UNAVAILABLE

    url = f"https://127.0.0.1:{mutual.rest_port}/v1/embeddings"
    body = {"model": "m", "input": ["with a client certificate"]}
    assert httpx.post(url, json=body, verify=_rest_context(pki, client_cert=True), timeout=60).status_code == 200
    with pytest.raises(httpx.HTTPError):  # the handshake fails: certificate required
        httpx.post(url, json=body, verify=_rest_context(pki, client_cert=False), timeout=10)


def test_a_killed_tls_server_leaves_no_socket_behind(servers):
    """Envoy reaches gRPC over a unix socket in the frontend's private directory; after a SIGKILL of
    the frontend its workers remove it with their own. (Ends the TLS server: keep it last.)"""
    tls, _ = servers
    rpc_dir = Path(tls.env["ENCODERD_RPC_DIR"])
    assert list(rpc_dir.glob("encoderd-*/frontend-grpc.sock"))
    tls.proc.send_signal(signal.SIGKILL)
    tls.proc.wait()
    deadline = time.monotonic() + 10
    while list(rpc_dir.iterdir()) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not list(rpc_dir.iterdir()), list(rpc_dir.rglob("*"))


def _start_error(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "encoderd.server.main.cli", "serve", "--no-rest", "--grpc-port", "0", *args],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


@pytest.mark.parametrize(
    "case, expected",
    [
        ("missing", "cannot read --tls-cert"),
        ("mismatched", "the key does not match the certificate"),
        ("not a certificate", "holds no PEM certificate"),
        ("key only", "TLS needs both --tls-cert and --tls-key"),
    ],
)
def test_bad_tls_files_stop_the_start_in_one_line(pki, tmp_path, case, expected):
    args = {
        "missing": ["--tls-cert", str(tmp_path / "nope.pem"), "--tls-key", str(pki.server_key)],
        "mismatched": ["--tls-cert", str(pki.server_cert), "--tls-key", str(pki.other_key)],
        "not a certificate": ["--tls-cert", str(pki.server_key), "--tls-key", str(pki.server_key)],
        "key only": ["--tls-key", str(pki.server_key)],
    }[case]
    result = _start_error(*args)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("encoderd: ") and expected in lines[0], result.stderr
