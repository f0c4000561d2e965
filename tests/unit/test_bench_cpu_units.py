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


def _phase(name: str, inputs: float | None = None, queries: int = 0) -> dict:
    stream = {} if inputs is None else {"bulk_inputs_per_s": inputs, "bulk_words_per_s": 10 * inputs}
    return {"phase": name, "query_ms": [0.01] * queries, "cpu": {"bulk lanes": 0.0}, **stream}


def test_each_mixed_round_is_compared_with_the_solo_runs_beside_it():
    from encoderd.bench.mixed import phase_names, solo_reference, summarize_rounds

    names = phase_names(2)
    assert names == ["idle", "bulk solo 1", "mixed 1", "bulk solo 2", "mixed 2", "bulk solo 3", "mixed-fifo"]
    assert phase_names(1) == ["idle", "bulk solo", "mixed", "bulk solo again", "mixed-fifo"]
    # A host that slows down through the run: solo 100, 80, 60 inputs/s.
    streams = {"bulk solo 1": 100, "mixed 1": 81, "bulk solo 2": 80, "mixed 2": 63, "bulk solo 3": 60, "mixed-fifo": 50}
    phases = [_phase(n, streams.get(n), queries=5 if n.startswith("mixed") or n == "idle" else 0) for n in names]
    inputs = lambda p: p.get("bulk_inputs_per_s")  # noqa: E731
    assert solo_reference(phases, names.index("mixed 1"), inputs) == 90  # (100 + 80) / 2
    assert solo_reference(phases, names.index("mixed 2"), inputs) == 70  # (80 + 60) / 2
    assert solo_reference(phases, names.index("mixed-fifo"), inputs) == 80  # every solo run
    assert solo_reference(phases, names.index("bulk solo 2"), inputs) == 80

    rows = [
        {"phase": "mixed 1", "bulk_vs_solo": 0.9},
        {"phase": "mixed 2", "bulk_vs_solo": 0.84},
        {"phase": "mixed 3", "bulk_vs_solo": 0.95},
        {"phase": "mixed-fifo", "bulk_vs_solo": 0.1},
    ]
    assert summarize_rounds(rows) == {"bulk_vs_solo": 0.9}  # the median of the three rounds; not fifo
    assert summarize_rounds(rows[:1]) is None  # one round: nothing to summarize
