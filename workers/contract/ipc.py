"""Where the frontend and its workers meet: the frontend's private directory of unix sockets (the
ZeroMQ ipc:// endpoints, its gRPC socket for its own Envoy, Envoy's admin socket), and their removal,
also by workers that outlive a SIGKILLed frontend. What travels over the sockets is protocol.py's.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import shutil
import tempfile
import uuid

_private_dir: str | None = None


def _ipc_directory() -> str:
    """This frontend's own socket directory (mode 0700, so no other user can connect), made on
    first use under ENCODERD_RPC_DIR or the temp dir, and removed at exit. After a kill -9 of
    the frontend its workers remove their sockets and the directory (remove_ipc_files)."""
    global _private_dir  # noqa: PLW0603 - made once per process, on first use
    if _private_dir is None:
        base = os.environ.get("ENCODERD_RPC_DIR") or tempfile.gettempdir()
        _private_dir = tempfile.mkdtemp(prefix="encoderd-", dir=base)
        atexit.register(shutil.rmtree, _private_dir, ignore_errors=True)
    return _private_dir


def new_ipc_address(tag: str) -> str:
    """A fresh ipc:// endpoint; unix socket paths must stay under ~107 bytes."""
    path = os.path.join(_ipc_directory(), f"{tag}-{uuid.uuid4().hex[:8]}")
    if len(path.encode()) > 100:
        raise ValueError(
            f"IPC path too long for a unix socket ({len(path)} bytes): set ENCODERD_RPC_DIR to a shorter directory"
        )
    return "ipc://" + path


# The frontend's gRPC socket for its own Envoy when TLS is on (server/main/app.py): in the same private
# directory, under a fixed name, so that workers outliving a SIGKILLed frontend remove it too.
FRONTEND_GRPC_SOCKET = "frontend-grpc.sock"
# Its Envoy's admin interface (gateway/process.py drains Envoy through it), beside it for the same reasons.
ENVOY_ADMIN_SOCKET = "envoy-admin.sock"


def frontend_grpc_socket() -> str:
    return os.path.join(_ipc_directory(), FRONTEND_GRPC_SOCKET)


def envoy_admin_socket() -> str:
    return os.path.join(_ipc_directory(), ENVOY_ADMIN_SOCKET)


def remove_ipc_files(*addresses: str, with_directory: bool = False) -> None:
    """Unlink these ipc:// sockets and, with_directory, the frontend's gRPC and Envoy admin sockets and
    their directory once it is empty."""
    paths = [address.removeprefix("ipc://") for address in addresses if address]
    if with_directory:
        paths += [
            os.path.join(directory, name)
            for directory in {os.path.dirname(p) for p in paths}
            for name in (FRONTEND_GRPC_SOCKET, ENVOY_ADMIN_SOCKET)
        ]
    for path in paths:
        with contextlib.suppress(OSError):  # gone already
            os.unlink(path)
    for directory in {os.path.dirname(p) for p in paths} if with_directory else ():
        with contextlib.suppress(OSError):  # it still holds another worker's sockets: the last worker out removes it
            os.rmdir(directory)
