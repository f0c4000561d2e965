"""A bfloat16 softmax for CPU attention (packed_pieces._attend_by_products), built for this host.

torch's CPU softmax on bfloat16 scores was ~15 % of MiniLM's padding-free forward (one thread, Zen 5):
each element is converted, exponentiated by a 1-ulp-accurate exp and converted back, in three passes.
softmax_rows.c does the same in float32 with a polynomial exp accurate to 2e-7 (bfloat16 keeps 4e-3)
and ran 1.5x faster over the bench corpus's lengths; its outputs equal torch's but for an occasional
last-bit rounding.

The kernel is compiled when a model loads, by the host's C compiler (`$CC`, else cc, gcc or clang),
for the instruction sets of the CPU it runs on (-march=native), then checked against torch.softmax on
random scores. No compiler, a compiler that cannot target this CPU, or a check that fails: torch's
softmax serves, and the log says why. The library is built in a temporary folder, loaded, and deleted
(dlopen keeps it mapped), so nothing built for one CPU is ever reused on another.

ENCODERD_BUILD_KERNELS=0 skips the build (torch's softmax serves): to compare the two, or to rule the
kernel out when diagnosing.

One thread: the kernel runs only where torch would compute the softmax on one thread (a single-thread
worker, the default on hosts of up to 4 cores, or a batch small enough to run on one).
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import shlex
import shutil
import subprocess
import sysconfig
import tempfile
import time
from pathlib import Path

import torch

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("softmax_rows.c")
SWITCH_ENV = "ENCODERD_BUILD_KERNELS"
PROFILER_NAME = "encoderd::bf16_softmax"
FLAGS = ("-O3", "-march=native", "-shared", "-fPIC")
LANES = 16  # softmax_rows.c's vector width: its scratch row is this much longer than a row


def softmax_(scores: torch.Tensor) -> torch.Tensor:
    """softmax over the last dimension; in place through the kernel where it serves, else torch's."""
    rows = kernel() if scores.dtype == torch.bfloat16 and torch.get_num_threads() == 1 else None
    if rows is None or not scores.is_contiguous() or scores.device.type != "cpu":
        return torch.softmax(scores, dim=-1)
    cols = scores.shape[-1]
    scratch = torch.empty(cols + LANES, dtype=torch.float32)
    if torch._C._autograd._profiler_enabled():  # named for bench.breakdown (else counted as Python); 10 us a call
        with torch.profiler.record_function(PROFILER_NAME):
            rows(scores.data_ptr(), scores.numel() // cols, cols, cols, scratch.data_ptr())
    else:
        rows(scores.data_ptr(), scores.numel() // cols, cols, cols, scratch.data_ptr())
    return scores


@functools.cache
def kernel():
    """softmax_rows_bf16 from a library built here for this CPU, or None (logged) where it cannot be."""
    if os.environ.get(SWITCH_ENV, "1") == "0":
        log.info("bfloat16 softmax: torch's (%s=0)", SWITCH_ENV)
        return None
    started = time.perf_counter()
    compiler = find_compiler()
    if compiler is None:
        log.info("bfloat16 softmax: torch's (no C compiler found: $CC, cc, gcc, clang)")
        return None
    try:
        function = _build(compiler)
    except (OSError, subprocess.SubprocessError) as exc:
        log.info("bfloat16 softmax: torch's (%s could not build it for this CPU: %s)", compiler[0], _first_line(exc))
        return None
    if (difference := _check(function)) is not None:
        log.warning("bfloat16 softmax: torch's (%s's build differs from torch.softmax: %s)", compiler[0], difference)
        return None
    elapsed = time.perf_counter() - started
    log.info("bfloat16 softmax: built for this CPU by %s %s in %.1f s", compiler[0], " ".join(FLAGS), elapsed)
    return function


def find_compiler() -> list[str] | None:
    """The C compiler command: $CC, else the one Python was built with, else cc, gcc, clang on PATH."""
    for candidate in (os.environ.get("CC"), sysconfig.get_config_var("CC"), "cc", "gcc", "clang"):
        command = shlex.split(candidate) if candidate else []
        if command and shutil.which(command[0]):
            return command
    return None


def _build(compiler: list[str]):
    with tempfile.TemporaryDirectory(prefix="encoderd-softmax-") as folder:
        library = Path(folder) / "softmax_rows.so"
        command = [*compiler, *FLAGS, "-o", str(library), str(SOURCE)]
        subprocess.run(command, check=True, capture_output=True, text=True, timeout=120)
        function = ctypes.CDLL(str(library)).softmax_rows_bf16
    function.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p]
    function.restype = None
    return function


def _check(function) -> str | None:
    """None when the kernel agrees with torch.softmax (float32 reference) as closely as torch's own
    bfloat16 softmax does, over lengths with and without a vector tail and with masked (-inf) scores;
    else what differs."""
    generator = torch.Generator().manual_seed(0)
    for length in (1, 7, 16, 33, 200):
        scores = (torch.randn(3, length, length, generator=generator) * 6).bfloat16()
        scores[0, :, length // 2 + 1 :] = -torch.inf
        reference = torch.softmax(scores.float(), dim=-1)
        mine = scores.clone()
        scratch = torch.empty(length + LANES)
        function(mine.data_ptr(), 3 * length, length, length, scratch.data_ptr())
        error = (mine.float() - reference).abs().max().item()
        allowed = 2 * (torch.softmax(scores, dim=-1).float() - reference).abs().max().item() + 1e-6
        if not error <= allowed:  # NaN fails too
            return f"{length}-token scores off by {error:.3g} (torch's bfloat16 softmax: {allowed / 2:.3g})"
    return None


def _first_line(exc: BaseException) -> str:
    text = getattr(exc, "stderr", None) or str(exc)
    return text.strip().splitlines()[0] if text.strip() else type(exc).__name__
