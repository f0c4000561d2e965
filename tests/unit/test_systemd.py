"""Issue 7: sd_notify over a real unix datagram socket, as systemd listens for it."""

from __future__ import annotations

import os
import socket

import pytest

from encoderd.server.base import systemd


@pytest.fixture
def listener(tmp_path, monkeypatch):
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    path = str(tmp_path / "notify")
    sock.bind(path)
    sock.settimeout(2)
    monkeypatch.setenv("NOTIFY_SOCKET", path)
    yield sock
    sock.close()


def fields(datagram: bytes) -> dict[str, str]:
    return dict(line.split("=", 1) for line in datagram.decode().split("\n"))


def test_ready_stopping_and_status_arrive_as_one_datagram_each(listener):
    assert systemd.ready("serving 3 model(s)")
    assert fields(listener.recv(4096)) == {"READY": "1", "STATUS": "serving 3 model(s)"}
    assert systemd.status("model x unavailable")
    assert fields(listener.recv(4096)) == {"STATUS": "model x unavailable"}
    assert systemd.stopping("draining for up to 30s")
    assert fields(listener.recv(4096)) == {"STOPPING": "1", "STATUS": "draining for up to 30s"}


def test_abstract_namespace_socket(monkeypatch):
    name = f"encoderd-test-{os.getpid()}"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind("\0" + name)
        sock.settimeout(2)
        monkeypatch.setenv("NOTIFY_SOCKET", "@" + name)
        assert systemd.ready("up")
        assert fields(sock.recv(4096))["READY"] == "1"


def test_outside_systemd_it_is_a_no_op(monkeypatch):
    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    assert systemd.ready("up") is False


def test_a_dead_socket_is_reported_not_raised(tmp_path, monkeypatch):
    monkeypatch.setenv("NOTIFY_SOCKET", str(tmp_path / "nobody-listens"))
    assert systemd.stopping("bye") is False
    monkeypatch.setenv("NOTIFY_SOCKET", "vsock:2:1234")  # not a unix address: ignored with a warning
    assert systemd.status("x") is False
