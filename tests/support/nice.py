"""CPU priorities of running processes and threads, read from /proc (Linux)."""

from __future__ import annotations

import os


def _nice_of(stat_path: str) -> int:
    with open(stat_path) as stat:
        return int(stat.read().rsplit(")", 1)[1].split()[16])  # field 19, counted after "(comm)"


def process_nice(pid: int) -> int:
    return _nice_of(f"/proc/{pid}/stat")


def thread_nice_values(pid: int) -> list[int]:
    """The nice value of each thread of a process, sorted."""
    return sorted(_nice_of(f"/proc/{pid}/task/{tid}/stat") for tid in os.listdir(f"/proc/{pid}/task"))
