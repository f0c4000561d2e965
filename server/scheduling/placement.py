"""Where each worker replica of a model runs: device, CPU cores, threads."""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass

from ...workers.contract.cpu_cores import Layout, choose_cpu_layout, cpu_budget


class PlacementError(ValueError):
    """Devices or replicas that cannot be placed on this host: a start-up error (one line, exit 2)."""


@dataclass(frozen=True)
class Placement:
    device: str  # "cpu" or "cuda:N"
    cores: tuple[int, ...] = ()  # CPU affinity of the worker process; () = inherit
    threads: int = 0  # intra-op threads; 0 = the backend's default

    @property
    def label(self) -> str:
        if self.device == "cpu" and self.cores:
            return f"cpu[{self.cores[0]}-{self.cores[-1]}]" if len(self.cores) > 1 else f"cpu[{self.cores[0]}]"
        return self.device


def usable_cores() -> list[int]:
    """The cores this process may run on, within its cgroup CPU quota (workers/contract/cpu_cores.py)."""
    return list(cpu_budget().cores)


def _affinity() -> int:
    return len(cpu_budget().affinity)


def visible_gpus() -> int:
    """Count the GPUs a worker would see, without importing torch in the frontend."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return len([d for d in visible.split(",") if d.strip() and d.strip() != "-1"])
    if not shutil.which("nvidia-smi"):
        return 0
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=10, check=False).stdout
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
                raise PlacementError("--device cuda: no GPU is visible")
            out += [f"cuda:{i}" for i in range(count)]
        elif device == "cpu" or device.startswith("cuda:"):
            out.append(device)
        else:
            raise PlacementError(f"unknown device {device!r}: use cpu, cuda or cuda:N")
    if not out:
        raise PlacementError("no device given")
    return out


def cpu_layout(replicas: int = 0, cpu_threads: int = 0) -> Layout:
    """Workers x threads per model on the CPU: the operator's flags, else cpu_cores.choose_cpu_layout."""
    return choose_cpu_layout(len(usable_cores()), replicas, cpu_threads)


def plan_replicas(devices: str, replicas: int = 1, cpu_threads: int = 0) -> list[Placement]:
    """One placement per worker: `replicas` per device (0 = auto: one per GPU, the CPU layout of
    cpu_layout); CPU replicas get disjoint core sets when there are enough cores, sized
    `cpu_threads` (default: an even share)."""
    if replicas < 0:
        raise PlacementError("--replicas must be at least 1 (or 0: chosen for this host)")
    placements: list[Placement] = []
    cores = usable_cores()
    layout = cpu_layout(replicas, cpu_threads) if not replicas else None
    per_cpu = layout.replicas if layout else replicas
    cpu_replicas = [d for d in expand_devices(devices) for _ in range(per_cpu) if d == "cpu"]
    gpu_threads = cpu_threads
    if layout:
        cpu_threads = layout.threads
    share = cpu_threads or max(1, len(cores) // max(1, len(cpu_replicas)))
    cpu_index = 0
    for device in expand_devices(devices):
        for _ in range(per_cpu if device == "cpu" else replicas or 1):
            if device != "cpu":
                placements.append(Placement(device, threads=gpu_threads))
                continue
            if len(cpu_replicas) == 1 and (not cpu_threads or cpu_threads >= len(cores)):
                # One worker: all usable cores, no pinning; threads named only where a quota cuts them.
                placements.append(Placement("cpu", threads=0 if len(cores) == _affinity() else len(cores)))
            else:
                start = (cpu_index * share) % len(cores)
                pinned = tuple(cores[(start + k) % len(cores)] for k in range(min(share, len(cores))))
                placements.append(Placement("cpu", pinned, len(pinned)))
            cpu_index += 1
    return placements
