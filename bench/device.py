"""`encoderd bench --device cuda`: what differs on a GPU, and the two GPU modes.

* matmul peak on the device (`device_peak`): torch.mm in float32/float16/bfloat16 timed between
  synchronizations, the denominator of every FLOP% on that device (the CPU one is flops.matmul_peak);
* `memory`: bulk traffic for --soak-seconds while the workers' memory is sampled each second (GPU:
  the device's memory in use, read by torch.cuda.mem_get_info; CPU: the workers' RSS), reporting
  the first, last and highest reading and the growth over the second half: flat or not;
* `oom`: a batch too big for the GPU computed by the real torch engine under a memory cap it
  cannot fit (torch.cuda.set_per_process_memory_fraction, sized on half the batch), in a child
  process so the cap binds nothing else: workers/process.forward_halving_on_oom must halve it and
  lose no input, each output equal to that input computed alone (workers/bench_oom.py). On CPU it
  runs uncapped, which checks everything but the halving.

Every path runs on CPU too (the CI run of tests/gpu/device_check.sh --device cpu), so none is first
run on a GPU.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from typing import Any

from .corpus import Workload
from .modes import Row
from .options import log


def is_cuda(device: str) -> bool:
    return device.startswith("cuda")


def device_peak(device: str, sizes, seconds: float = 0.4) -> dict:
    """Best sustained GFLOP/s of torch.mm on a CUDA device per dtype (the square shapes of `sizes`
    scaled up: a GPU needs large products to reach its peak)."""
    import torch

    result: dict = {"threads": 0, "device": torch.cuda.get_device_name(torch.device(device))}
    for name, dtype in (("float32", torch.float32), ("float16", torch.float16), ("bfloat16", torch.bfloat16)):
        per_shape = {}
        for m, k, n in sizes:
            a = torch.randn(m, k, device=device, dtype=dtype)
            b = torch.randn(k, n, device=device, dtype=dtype)
            per_shape[f"{m}x{k}x{n}"] = round(_best_gflops(torch, a, b, seconds), 1)
        result[name] = max(per_shape.values())
        result[name + "_shapes"] = per_shape
    return result


def _best_gflops(torch, a, b, seconds: float) -> float:
    flop = 2.0 * a.shape[0] * a.shape[1] * b.shape[1]
    torch.mm(a, b)
    torch.cuda.synchronize()
    best, spent = float("inf"), 0.0
    for _ in range(20):
        t0 = time.perf_counter()
        for _ in range(10):  # ten back to back: one launch alone is too short to time
            torch.mm(a, b)
        torch.cuda.synchronize()
        dt = (time.perf_counter() - t0) / 10
        best, spent = min(best, dt), spent + dt * 10
        if spent > seconds:
            break
    return flop / best / 1e9


# ------------------------------------------------------------------ memory over a soak
def worker_memory_mb(device: str, worker_pids: list[int]) -> float:
    """GPU: the device's memory in use (all processes: the workers, and this process's own
    constant share); CPU: the workers' resident memory."""
    if is_cuda(device):
        import torch

        free, total = torch.cuda.mem_get_info(torch.device(device))
        return (total - free) / 2**20
    from .soak import rss_mb

    return sum(rss_mb(pid) or 0.0 for pid in worker_pids)


def run_memory(target, work: Workload, args, device: str, worker_pids: list[int]) -> Row:
    log(f"memory: {args.soak_seconds:g}s of bulk traffic, worker memory on {device} sampled each second")
    samples: list[tuple[float, float]] = []
    state: dict[str, Any] = {"errors": 0, "inputs": 0, "stop": False, "last_error": ""}

    async def client(embed, k0: int) -> None:
        k = k0
        while not state["stop"]:
            texts = [work.corpus[(k * args.batch + j) % len(work.corpus)] for j in range(args.batch)]
            k += args.concurrency
            try:
                state["inputs"] += await embed(texts)
            except Exception as exc:  # noqa: BLE001 - counted and reported: a soak keeps going
                state["errors"] += 1
                state["last_error"] = f"{type(exc).__name__}: {str(exc)[:200]}"

    async def soak() -> None:
        async with target.session() as embed:
            tasks = [asyncio.ensure_future(client(embed, i)) for i in range(args.concurrency)]
            start = time.monotonic()
            while time.monotonic() - start < args.soak_seconds:
                samples.append((time.monotonic() - start, worker_memory_mb(device, worker_pids)))
                await asyncio.sleep(1.0)
            state["stop"] = True
            await asyncio.gather(*tasks)

    asyncio.run(soak())
    row = Row("memory", "encoderd", target.protocol, errors=state["errors"], notes=state["last_error"])
    row.wall_s = round(samples[-1][0], 1) if samples else 0.0
    row.inputs_per_s = round(state["inputs"] / max(row.wall_s, 1e-9), 1)
    row.server = memory_summary(samples)
    return row


def memory_summary(samples: list[tuple[float, float]]) -> dict:
    """First, last and highest reading (MB), and the growth from the middle of the soak to its end:
    the first half holds the warm-up (allocator pools growing to the largest batch shape)."""
    if not samples:
        return {}
    values = [mb for _, mb in samples]
    middle = values[len(values) // 2]
    return {
        "memory_first_mb": round(values[0], 1),
        "memory_last_mb": round(values[-1], 1),
        "memory_max_mb": round(max(values), 1),
        "memory_growth_second_half": round(values[-1] / middle - 1, 4) if middle else None,
        "samples": len(values),
    }


# ------------------------------------------------------------------ out-of-memory halving
def run_oom(model_dir: str, device: str, batch: int, length: int) -> Row:
    """workers/bench_oom.py in a child process, its JSON verdict as a row (errors: inputs lost or wrong)."""
    log(f"oom: {batch} inputs of {length} tokens on {device} under a memory cap that fits half of them")
    argv = [sys.executable, "-m", "encoderd.workers.bench_oom", model_dir, device, str(batch), str(length)]
    started = time.monotonic()
    done = subprocess.run(argv, capture_output=True, text=True, timeout=600, check=False)
    row = Row("oom", "encoderd", "in-process", wall_s=round(time.monotonic() - started, 1))
    try:
        verdict = json.loads(done.stdout.strip().splitlines()[-1])
    except (json.JSONDecodeError, IndexError):
        row.errors, row.notes = 1, f"exit {done.returncode}: {done.stderr[-600:]}"
        return row
    row.server = verdict
    row.calls = verdict["inputs"]
    unhalved = verdict["capped"] and not verdict["halved"]
    row.errors = verdict["lost"] + verdict["wrong"] + int(unhalved)
    if unhalved:
        row.notes = "the capped batch fit: nothing was halved"
    elif not verdict["capped"]:
        row.notes = "no memory cap on CPU: the batch ran whole (the halving itself: tests/unit/test_oom_split.py)"
    return row
