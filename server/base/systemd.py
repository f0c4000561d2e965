"""systemd readiness protocol (sd_notify) without libsystemd.

Under a `Type=notify` unit systemd puts a unix datagram socket in
$NOTIFY_SOCKET; one datagram of newline-separated `KEY=VALUE` lines reports
state: READY=1 once the models are warm (so `systemctl start` and units
ordered After= us wait for real readiness, not for the process to exist),
STOPPING=1 when draining, STATUS=... for `systemctl status`. Outside systemd
the variable is unset and every call is a cheap no-op.
"""

from __future__ import annotations

import logging
import os
import socket

log = logging.getLogger("encoderd.systemd")


def _address(raw: str) -> str | None:
    if raw.startswith("/"):
        return raw
    if raw.startswith("@"):  # Linux abstract namespace
        return "\0" + raw[1:]
    return None  # e.g. vsock: addresses (systemd 253+), not needed for a local service


def notify(**fields: str | int) -> bool:
    """Send one notification, e.g. notify(READY=1, STATUS="serving"); True when delivered."""
    raw = os.environ.get("NOTIFY_SOCKET", "")
    address = _address(raw) if raw else None
    if address is None:
        if raw:
            log.warning("NOTIFY_SOCKET=%r is not a unix socket address; not notifying systemd", raw)
        return False
    message = "\n".join(f"{key}={value}" for key, value in fields.items()).encode()
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
            sock.sendto(message, address)
        return True
    except OSError as exc:  # a lost notification must never take the server down
        log.warning("sd_notify to %s failed: %s", raw, exc)
        return False


def ready(status: str) -> bool:
    return notify(READY=1, STATUS=status)


def stopping(status: str) -> bool:
    return notify(STOPPING=1, STATUS=status)


def status(text: str) -> bool:
    return notify(STATUS=text)
