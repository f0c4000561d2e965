"""The zygote's wire, both ends: length-prefixed pickles over a socket pair, and prctl.

The frontend (server/scheduling/zygote_client.py) starts the zygote (workers/zygote.py) by module name and
talks to it through these; neither side imports the other.
"""

from __future__ import annotations

import ctypes
import pickle
import socket
import struct

ZYGOTE_MODULE = "encoderd.workers.zygote"  # run with `python -m`: the frontend never imports the worker code
PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36
LENGTH = struct.Struct("!I")


def prctl(option: int, value: int) -> bool:
    libc = ctypes.CDLL(None, use_errno=True)
    return libc.prctl(option, value, 0, 0, 0) == 0


def send(sock: socket.socket, message) -> None:
    data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    sock.sendall(LENGTH.pack(len(data)) + data)


def receive(sock: socket.socket):
    """The next message, or None at end of stream."""
    header = _read_exactly(sock, LENGTH.size)
    if header is None:
        return None
    data = _read_exactly(sock, LENGTH.unpack(header)[0])
    return None if data is None else pickle.loads(data)


def _read_exactly(sock: socket.socket, n: int) -> bytes | None:
    chunks, left = [], n
    while left:
        chunk = sock.recv(left)
        if not chunk:
            return None
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)
