"""CPU priorities of running processes and threads, read from /proc (Linux)."""

from __future__ import annotations

import os


def _stat_fields(stat_path: str) -> list[str]:
    """Fields 3 on of /proc/.../stat: those after "(comm)", whose name may hold spaces."""
    with open(stat_path) as stat:
        return stat.read().rsplit(")", 1)[1].split()


def process_nice(pid: int) -> int:
    return int(_stat_fields(f"/proc/{pid}/stat")[16])  # field 19


def thread_priorities(pid: int) -> list[tuple[int, int]]:
    """(nice value, scheduling policy: os.SCHED_OTHER, os.SCHED_IDLE...) of each thread, sorted."""
    priorities = []
    for tid in os.listdir(f"/proc/{pid}/task"):
        fields = _stat_fields(f"/proc/{pid}/task/{tid}/stat")
        priorities.append((int(fields[16]), int(fields[38])))  # fields 19 and 41
    return sorted(priorities)


def cpu_seconds_by_nice(pid: int) -> dict[int, float]:
    """CPU seconds (user + system) used so far by the process's threads, summed by nice value."""
    ticks = os.sysconf("SC_CLK_TCK")
    by_nice: dict[int, float] = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            fields = _stat_fields(f"/proc/{pid}/task/{tid}/stat")
        except FileNotFoundError:  # a thread that ended meanwhile
            continue
        nice = int(fields[16])  # field 19; utime and stime are fields 14 and 15
        by_nice[nice] = by_nice.get(nice, 0.0) + (int(fields[11]) + int(fields[12])) / ticks
    return by_nice
