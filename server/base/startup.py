"""Start-up checks that fail in one line: every port before any model loads."""

from __future__ import annotations

import socket


class StartupError(Exception):
    """What cannot start, which port or file, what to do: printed as one line by the CLI."""


def check_ports(host: str, ports: dict[str, int]) -> None:
    """Each flag's port (0 = off or any) must be free on `host`, and the flags must differ:
    found now, not after minutes of loading models, nor as an Envoy that dies on start."""
    seen: dict[int, str] = {}
    for flag, port in ports.items():
        if not port:
            continue
        if port in seen:
            raise StartupError(f"{flag} {port} is also {seen[port]}: give each listener its own port")
        seen[port] = flag
        _check_free(host, port, flag)


def _listen_address(host: str, port: int) -> tuple[socket.AddressFamily, tuple]:
    """The family and address a listener on host:port binds, as the real listeners resolve it."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except OSError as exc:
        raise StartupError(f"--host {host!r} does not resolve ({exc}); give an address to listen on") from None
    family, _, _, _, address = infos[0]
    return family, address


def _check_free(host: str, port: int, flag: str) -> None:
    family, address = _listen_address(host, port)
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the real listeners do
        try:
            probe.bind(address)
        except OSError as exc:
            raise StartupError(
                f"cannot listen on {host}:{port} ({flag}): {exc.strerror}; stop what holds the "
                f"port or choose another with {flag}"
            ) from None


def any_free_port(host: str) -> int:
    """A port free on `host` now, for a listener another process binds (--grpc-port 0 behind Envoy)."""
    family, address = _listen_address(host, 0)
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.bind(address)
        return probe.getsockname()[1]
