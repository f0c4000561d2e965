"""A batch too big for the GPU halves and loses nothing: the `oom` mode of `encoderd bench`
(bench/device.py), run as a child process so its memory cap binds nothing else.

    python -m encoderd.workers.bench_oom MODEL_DIR DEVICE BATCH LENGTH   # prints one JSON line

The real torch engine computes BATCH inputs of LENGTH tokens one by one (the reference), then caps the
process's GPU memory at what half the batch needs plus 40% of that (torch.cuda.set_per_process_memory_fraction)
and computes them as one batch through workers/process.forward_halving_on_oom: it must run out of
memory, halve, and answer every input with the vector computed alone (cosine > 0.999). On CPU there
is no cap that holds (under RLIMIT_AS oneDNN fails "could not create a primitive", or glibc's kept
arenas let the whole batch fit), so there it runs uncapped: every step but the halving.
"""

from __future__ import annotations

import json
import sys

import numpy as np


def is_cuda(device: str) -> bool:
    return device.startswith("cuda")


def check(model_dir: str, device: str, batch: int, length: int) -> dict:
    from .backends import create_backend
    from .contract.config import BackendOptions
    from .contract.protocol import TokenBatch
    from .contract.spec_reader import load_model_spec
    from .process import forward_halving_on_oom

    dtype = "float16" if is_cuda(device) else "float32"
    spec = load_model_spec("oom", model_dir)
    backend = create_backend("torch", spec, BackendOptions(device=device, dtype=dtype, threads=1))
    backend.load()
    rng = np.random.default_rng(0)
    ids = [rng.integers(1000, 2000, length).astype(np.int64) for _ in range(batch)]

    def token_batch(rows) -> TokenBatch:
        return TokenBatch.from_sequences(0, rows)

    alone = [np.asarray(backend.forward(token_batch([r])))[0] for r in ids]  # uncapped: the reference, one by one
    half = token_batch(ids[: max(1, batch // 2)])
    capped = _cap_memory(device, lambda: backend.forward(half))
    sizes: list[int] = []  # every forward the halving makes: [64] whole, [64, 32, 32] halved once
    forward = backend.forward

    def counted(part: TokenBatch):
        sizes.append(part.size)
        return forward(part)

    setattr(backend, "forward", counted)  # noqa: B010 - the real forward, counted: an instance attribute over the method
    got = np.asarray(forward_halving_on_oom(backend, token_batch(ids)))
    wrong = sum(
        1 for a, b in zip(got, alone, strict=False) if np.dot(a, b) / np.linalg.norm(a) / np.linalg.norm(b) < 0.999
    )
    verdict = {"inputs": batch, "answered": len(got), "lost": batch - len(got), "wrong": wrong}
    return {**verdict, "capped": capped, "halved": len(sizes) > 1, "forwards": sizes}


def _cap_memory(device: str, fits) -> bool:
    """On a GPU, cap this process's device memory at what `fits` (half the batch) needs plus a
    margin: the whole batch then runs out, its halves do not. Returns whether it capped (never on
    CPU: the module's docstring says why)."""
    if not is_cuda(device):
        return False
    import torch

    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    resident = torch.cuda.memory_allocated()  # the weights
    fits()
    working = torch.cuda.max_memory_allocated() - resident  # what half the batch needed on top
    total = torch.cuda.get_device_properties(torch.device(device)).total_memory
    # 1.4 halves' working memory: the whole batch (about two) cannot fit, a half can.
    torch.cuda.set_per_process_memory_fraction(min(1.0, (resident + 1.4 * working) / total), torch.device(device))
    return True


if __name__ == "__main__":
    print(json.dumps(check(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))))
