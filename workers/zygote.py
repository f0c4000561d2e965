"""The zygote: a process that has imported torch, transformers and the worker code once, and
forks CPU workers on request, so a worker (a restart above all) skips seconds of imports.

Started by the frontend (server/scheduling/zygote_client.py) with one end of a socket pair; it answers
`ready` once its imports are done, then reads fork requests (a WorkerConfig) one at a time.
It runs no torch op, no tokenizer and no ZeroMQ context: nothing in it may hold a thread or a
lock that a forked child would inherit half-taken (numpy's OpenBLAS threads are its own, and
OpenBLAS stops them around fork). It never touches CUDA: CUDA workers are spawned plainly.

Each worker is forked twice (zygote -> middle -> worker) and the middle exits at once, so
the worker is re-parented to the frontend, a child subreaper (PR_SET_CHILD_SUBREAPER): the
frontend waits for it, signals it and sees it die exactly as a spawned worker, and the
worker's own parent watch (workers/process.py) works unchanged. The zygote dies with the
frontend (PR_SET_PDEATHSIG, and EOF on its socket).
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import os
import signal
import socket
import sys
import time
import warnings

from .contract.zygote_wire import LENGTH, PR_SET_PDEATHSIG, prctl, receive, send

log = logging.getLogger("encoderd.zygote")

# What every CPU worker imports before its model loads: seconds of work done here once.
PRELOAD = (
    "torch",
    "transformers",
    "tokenizers",
    "safetensors.torch",
    "transformers.modeling_utils",
    "encoderd.workers.process",
    "encoderd.workers.backends.torch_backend",
    "encoderd.workers.fidelity",
    "encoderd.workers.calibration",
)


def main(argv: list[str]) -> int:
    fd, frontend_pid, log_level, log_format = int(argv[0]), int(argv[1]), argv[2], argv[3]
    prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != frontend_pid:  # the frontend died before the line above
        return 0
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the frontend; it decides
    # Read by OpenMP when torch loads, here: as workers/process.py sets it for a spawned CPU worker.
    if "GOMP_SPINCOUNT" not in os.environ:
        os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    from .contract.logs import configure_logging

    configure_logging(log_level, log_format)  # its records are the "encoderd.zygote" logger's; no worker label
    sock = socket.socket(fileno=fd)
    started = time.perf_counter()
    try:
        for name in PRELOAD:
            importlib.import_module(name)
    except Exception as exc:  # noqa: BLE001 - reported to the frontend, which refuses to start with that message
        send(sock, ("error", f"importing the worker libraries failed: {type(exc).__name__}: {exc}"))
        return 1
    log.debug("imported %s in %.1fs", ", ".join(PRELOAD), time.perf_counter() - started)
    send(sock, ("ready", os.getpid()))
    return serve(sock)


def serve(sock: socket.socket) -> int:
    """Fork a worker per request until the frontend closes the socket."""
    warnings.filterwarnings("ignore", message=".*fork.*", category=DeprecationWarning)  # see the module doc
    while (request := receive(sock)) is not None:
        config, frontend_pid = request
        _preload_family(config.spec.model_type)
        reply: tuple[str, int | str]
        try:
            reply = ("forked", fork_worker(sock, config, frontend_pid))
        except OSError as exc:
            reply = ("error", f"fork failed: {exc}")
        send(sock, reply)
    return 0


def _preload_family(model_type: str) -> None:
    """transformers' modeling module of a model family (seconds for some): once, for every fork after."""
    module = model_type.replace("-", "_")  # xlm-roberta: transformers.models.xlm_roberta
    if module and module.replace("_", "").isalnum():
        # Not a transformers family (or not installed): the worker says what is wrong.
        with contextlib.suppress(Exception):
            importlib.import_module(f"transformers.models.{module}.modeling_{module}")


def fork_worker(sock: socket.socket, config, frontend_pid: int) -> int:
    """The new worker's pid, once it is the frontend's child (its middle parent has exited)."""
    sys.stdout.flush()
    sys.stderr.flush()
    read_end, write_end = os.pipe()
    middle = os.fork()
    if middle == 0:
        code = 0
        try:
            os.close(read_end)
            worker = os.fork()
            if worker == 0:
                os.close(write_end)
                _become_worker(sock, config, frontend_pid, os.getppid())
            os.write(write_end, LENGTH.pack(worker))
        except BaseException:  # noqa: BLE001 - a forked child must reach os._exit, never unwind into the zygote's loop
            code = 1
        finally:
            os._exit(code)
    os.close(write_end)
    try:
        data = os.read(read_end, LENGTH.size)
    finally:
        os.close(read_end)
        os.waitpid(middle, 0)  # the worker is re-parented once its middle has exited
    if len(data) != LENGTH.size:
        raise OSError("the forked worker's intermediate process failed")
    return LENGTH.unpack(data)[0]


def _become_worker(sock: socket.socket, config, frontend_pid: int, middle_pid: int) -> None:
    """In the forked worker: wait to be the frontend's child, then run the worker; never return."""
    code = 1
    try:
        sock.close()
        signal.signal(signal.SIGINT, signal.SIG_DFL)  # run_worker sets what it wants
        deadline = time.monotonic() + 5
        while os.getppid() == middle_pid and time.monotonic() < deadline:
            time.sleep(0.001)
        if os.getppid() != frontend_pid:  # the frontend is gone (or is no subreaper): nothing to serve
            os._exit(3)
        from .process import run_worker

        run_worker(config, frontend_pid)
        code = 0
    except SystemExit as done:
        code = done.code if isinstance(done.code, int) else 1
    except BaseException:  # noqa: BLE001 - a forked worker must reach os._exit whatever ends it
        import traceback

        traceback.print_exc()
    finally:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        os._exit(code)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
