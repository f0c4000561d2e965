"""Where each worker replica of a model runs: device, CPU cores, threads."""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass


@dataclass(frozen=True)
class Placement:
    device: str                  # "cpu" or "cuda:N"
    cores: tuple[int, ...] = ()  # CPU affinity of the worker process; () = inherit
    threads: int = 0             # intra-op threads; 0 = the backend's default

    @property
    def label(self) -> str:
        if self.device == "cpu" and self.cores:
            return f"cpu[{self.cores[0]}-{self.cores[-1]}]" if len(self.cores) > 1 else f"cpu[{self.cores[0]}]"
        return self.device


def usable_cores() -> list[int]:
    """The cores this process may run on, within its cgroup CPU quota."""
    cores = sorted(os.sched_getaffinity(0))
    quota = _cgroup_cpu_limit()
    return cores[:max(1, int(quota))] if quota and quota < len(cores) else cores


def _cgroup_cpu_limit() -> float | None:
    try:
        quota, period = open("/sys/fs/cgroup/cpu.max").read().split()
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        return None


def visible_gpus() -> int:
    """Count the GPUs a worker would see, without importing torch in the frontend."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return len([d for d in visible.split(",") if d.strip() and d.strip() != "-1"])
    if not shutil.which("nvidia-smi"):
        return 0
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.TimeoutExpired):
        return 0
    return sum(1 for line in out.splitlines() if line.startswith("GPU "))


def expand_devices(devices: str) -> list[str]:
    """`cpu`, `cuda` (every visible GPU), `cuda:N`, or a comma-separated list of them."""
    out: list[str] = []
    for device in (d.strip() for d in devices.split(",") if d.strip()):
        if device == "cuda":
            count = visible_gpus()
            if not count:
                raise ValueError("--device cuda: no GPU is visible")
            out += [f"cuda:{i}" for i in range(count)]
        elif device == "cpu" or device.startswith("cuda:"):
            out.append(device)
        else:
            raise ValueError(f"unknown device {device!r}: use cpu, cuda or cuda:N")
    if not out:
        raise ValueError("no device given")
    return out


def plan_replicas(devices: str, replicas: int = 1, cpu_threads: int = 0) -> list[Placement]:
    """One placement per worker: `replicas` per device; CPU replicas get disjoint core sets
    when there are enough cores, sized `cpu_threads` (default: an even share)."""
    if replicas < 1:
        raise ValueError("--replicas must be at least 1")
    placements: list[Placement] = []
    cpu_replicas = [d for d in expand_devices(devices) for _ in range(replicas) if d == "cpu"]
    cores = usable_cores()
    share = cpu_threads or max(1, len(cores) // max(1, len(cpu_replicas)))
    cpu_index = 0
    for device in expand_devices(devices):
        for _ in range(replicas):
            if device != "cpu":
                placements.append(Placement(device, threads=cpu_threads))
                continue
            if len(cpu_replicas) == 1 and not cpu_threads:
                placements.append(Placement("cpu"))  # one worker: all cores, no pinning
            else:
                start = (cpu_index * share) % len(cores)
                pinned = tuple(cores[(start + k) % len(cores)] for k in range(min(share, len(cores))))
                placements.append(Placement("cpu", pinned, len(pinned)))
            cpu_index += 1
    return placements
