"""The CPUs this process may use (its affinity, cut by its cgroup quota) and the workers x threads
the server lays over them when the operator leaves --replicas / --cpu-threads to it.

What the CPU computes well (instruction sets, dtypes) is hardware.py's; this is how many cores there
are to compute on.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

# What the server picks when the operator leaves --replicas / --cpu-threads to it (--dtype:
# hardware.choose_cpu_dtype). Every explicit flag wins over these; each choice comes with the reason
# that is logged.
CGROUP_V2_CPU_MAX = "/sys/fs/cgroup/cpu.max"
CGROUP_V1_DIRS = ("/sys/fs/cgroup/cpu", "/sys/fs/cgroup/cpu,cpuacct")
# Up to this many usable cores, one single-thread worker per core: a worker then never waits in an
# OpenMP barrier for a thread that the frontend or another process preempted. On the 2-core Zen 5
# development host, 2 workers x 1 thread against 1 worker x 2 threads: bulk +13% float32, +17%
# bfloat16, single-query and rerank no slower (docs/performance.md; bench/: `encoderd bench`).
SMALL_HOST_CORES = 4
# Beyond it, workers of several threads, so that one long input still gets several cores, and at
# most this many copies of the model in memory.
MAX_AUTO_REPLICAS = 8
MIN_THREADS_PER_WORKER = 4


def parse_cgroup_v2(cpu_max: str) -> float | None:
    """CPUs allowed by a cgroup v2 `cpu.max` ("QUOTA PERIOD", QUOTA "max" = unlimited)."""
    fields = cpu_max.split()
    if len(fields) != 2 or fields[0] == "max":
        return None
    quota, period = int(fields[0]), int(fields[1])
    return quota / period if quota > 0 and period > 0 else None


def parse_cgroup_v1(quota_us: str, period_us: str) -> float | None:
    """CPUs allowed by cgroup v1 `cpu.cfs_quota_us` / `cpu.cfs_period_us` (quota -1 = unlimited)."""
    quota, period = int(quota_us.strip()), int(period_us.strip())
    return quota / period if quota > 0 and period > 0 else None


def _read(path: str) -> str | None:
    try:
        with open(path, encoding="ascii") as f:
            return f.read()
    except OSError:
        return None


def cgroup_cpu_quota() -> float | None:
    """This process's cgroup CPU quota in CPUs (v2, else v1), None when unlimited or unknown."""
    try:
        if (text := _read(CGROUP_V2_CPU_MAX)) is not None:
            return parse_cgroup_v2(text)
        for folder in CGROUP_V1_DIRS:
            quota, period = _read(f"{folder}/cpu.cfs_quota_us"), _read(f"{folder}/cpu.cfs_period_us")
            if quota is not None and period is not None:
                return parse_cgroup_v1(quota, period)
    except ValueError:
        pass  # an unreadable quota: the affinity alone decides
    return None


@dataclass(frozen=True)
class CpuBudget:
    """The CPUs this process may use: its affinity, cut by its cgroup quota."""

    affinity: tuple[int, ...]
    quota: float | None = None  # CPUs; None = no quota

    @property
    def usable(self) -> int:
        """Whole cores' worth of CPU time: a 2-CPU quota on a 64-core host is 2 cores."""
        if self.quota is None:
            return max(1, len(self.affinity))
        return max(1, min(len(self.affinity), int(self.quota)))

    @property
    def cores(self) -> tuple[int, ...]:
        """The cores to pin workers to: the first `usable` of the affinity."""
        return self.affinity[: self.usable]

    def describe(self) -> str:
        quota = f"cgroup quota {self.quota:g} CPUs" if self.quota is not None else "no cgroup quota"
        return f"{self.usable} usable core(s): affinity {len(self.affinity)}, {quota}"


def cpu_budget() -> CpuBudget:
    return CpuBudget(tuple(sorted(os.sched_getaffinity(0))), cgroup_cpu_quota())


@dataclass(frozen=True)
class Layout:
    replicas: int  # CPU worker processes per model
    threads: int  # intra-op threads each
    why: str


def choose_cpu_layout(usable: int, replicas: int = 0, threads: int = 0) -> Layout:
    """Workers x threads for `usable` cores; `replicas` / `threads` > 0 are the operator's and win."""
    if replicas and threads:
        return Layout(replicas, threads, "--replicas and --cpu-threads given")
    if replicas:
        return Layout(replicas, max(1, usable // replicas), f"--replicas {replicas} given: an even share of the cores")
    if threads:
        return Layout(
            max(1, usable // threads), threads, f"--cpu-threads {threads} given: one worker per {threads} cores"
        )
    if usable <= SMALL_HOST_CORES:
        return Layout(
            usable,
            1,
            f"up to {SMALL_HOST_CORES} cores: one single-thread worker per core "
            "(no OpenMP barriers; measured fastest on small hosts)",
        )
    per_worker = max(MIN_THREADS_PER_WORKER, -(-usable // MAX_AUTO_REPLICAS))
    return Layout(
        max(1, usable // per_worker),
        per_worker,
        f"over {SMALL_HOST_CORES} cores: workers of {per_worker} threads (a long input still gets "
        f"several cores; at most {MAX_AUTO_REPLICAS} copies of the model)",
    )
