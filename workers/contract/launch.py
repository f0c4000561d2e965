"""How the frontend starts a worker without importing the worker code.

multiprocessing's `spawn` pickles its target by module and name: this function is that target, so
the frontend's process imports only the contract, and the worker code (torch and the engines)
loads in the child. CPU workers forked by the zygote start at the same entry point
(workers/zygote.py).
"""

from __future__ import annotations

from .config import WorkerConfig


def run_worker(config: WorkerConfig, parent_pid: int) -> None:
    """The worker process's main (workers/process.py), imported in the child."""
    from ..process import run_worker as worker_main

    worker_main(config, parent_pid)
