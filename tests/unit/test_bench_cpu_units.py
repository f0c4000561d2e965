"""The benchmarks' CPU accounting (bench/processes.py): threads grouped by scheduling policy, as
bench.mixed splits a worker's bulk lane (SCHED_IDLE) from its other threads."""

from __future__ import annotations

import os
import threading
import time

from encoderd.bench.processes import CpuProbe, thread_stats


def _spin_idle(ready: threading.Event, stop: threading.Event) -> None:
    os.sched_setscheduler(threading.get_native_id(), os.SCHED_IDLE, os.sched_param(0))
    ready.set()
    while not stop.is_set():
        sum(range(10_000))  # CPU time on this thread only


def test_an_idle_policy_thread_is_counted_in_its_own_group():
    ready, stop = threading.Event(), threading.Event()
    spinner = threading.Thread(target=_spin_idle, args=(ready, stop), daemon=True)
    spinner.start()
    try:
        assert ready.wait(5)
        idle = thread_stats([os.getpid()], idle=True)
        assert idle == [f"/proc/{os.getpid()}/task/{spinner.native_id}/stat"]
        rest = thread_stats([os.getpid()], idle=False)
        assert idle[0] not in rest and f"/proc/{os.getpid()}/task/{threading.get_native_id()}/stat" in rest
        probe = CpuProbe({"idle lane": idle, "process": [os.getpid()]})
        before = after = probe.snapshot()
        deadline = time.monotonic() + 30  # SCHED_IDLE runs only on a core nothing else wants
        while after["idle lane"] - before["idle lane"] < 0.05 and time.monotonic() < deadline:
            time.sleep(0.05)
            after = probe.snapshot()
        # The spinner's CPU time is counted in its own group, and in its whole process too.
        spun = after["idle lane"] - before["idle lane"]
        assert 0.05 <= spun <= after["process"] - before["process"] + 0.02
    finally:
        stop.set()
        spinner.join(5)
