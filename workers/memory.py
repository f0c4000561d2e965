"""Keeping a worker's memory flat under traffic of ever-new batch shapes (issue 16, finding 4).

Measured on the torch engine (MiniLM, CPU), 600 batches of 1-16 inputs of 5-256 tokens, each
batch a new shape: RSS 486 -> 1,822 MB and still growing. Two causes, each bounded here:

* Shape-keyed kernel caches. The padding-free forward's GEMMs have M = the batch's token count,
  a new value for nearly every batch, and oneDNN builds (JIT-compiles) a primitive per shape.
  PyTorch's ideep layer keeps them in an LRU of `LRU_CACHE_CAPACITY` entries and oneDNN in its
  own cache of `ONEDNN_PRIMITIVE_CACHE_CAPACITY`, both 1,024 by default: up to ~1 GB of
  primitives that are almost never reused. 64 each keeps the shapes that do repeat (short
  queries: where oneDNN computes a batch, the packed forward rounds M up to a multiple of 8,
  packed_encoder.GEMM_ROWS_MULTIPLE, so queries of up to 64 tokens share 8 shapes, 4 primitives
  each). More does not pay: MiniLM queries of 8-62 tokens in turn, a bulk batch of new shape
  after every second one, one thread: 4.1-4.6 ms of CPU per query at 64, 4.0-4.5 at 256 and
  1,024 (RSS +150 MB); what the bulk batches cost the queries is the weights they push out of
  the CPU caches, not the primitives. Both variables are read when the first primitive is built, so
  setting them in the worker before its first forward works even after torch is imported; an
  operator's own values win.
* glibc heap fragmentation. Activations of a few MB to tens of MB, freed in a different order
  and size each batch, leave free holes inside the heap that glibc does not return. malloc_trim
  gives their pages back; it walks the whole heap (milliseconds), so it runs when the worker goes
  idle (at most once a second) and, under unbroken load, at least every TRIM_BUSY_INTERVAL.

* Page faults on every batch. glibc serves an allocation over its mmap threshold (128 KiB, rising
  to the largest freed one up to 32 MiB) with a fresh mmap and gives the heap's free top back past
  its trim threshold: a bulk batch's activations (MiniLM, 8,192 tokens: 25 MB per intermediate
  matrix; bge-base 50 MB) came from the kernel, zeroed page by page, on every batch, and went back
  after it. `perf record` on the two workers under `python -m encoderd.bench.bulk_compare` (Xeon
  with AMX): 13.6 % of their CPU in the kernel, nearly all page faults. `keep_freed_memory` makes
  both thresholds HEAP_KEEP_BYTES, so freed activations stay in the heap for the next batch, and
  HeapTrimmer (below) still gives free pages back when the worker idles. The two workers' CPU in
  the kernel per 1,024-input bulk run 0.22-0.54 s -> 0.11-0.17 s; `python -m encoderd.bench.
  bulk_compare --compare-ref REF --serve-args "--batch-size 512"` (the same batches on both): 1.035x
  tokens/s, 1.064x tokens per worker CPU-second (median of 4 rounds).

With both: 488 -> 512 MB after 100 batches, then flat over the next 200 (tests/integration/
test_memory.py reproduces the growth and its bound; `python -m encoderd.bench.soak` is the
10-minute soak).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os
import time

KERNEL_CACHE_CAPACITY = 64
# Allocations below this come from the heap, and this much free memory may stay at its top between
# trims: above any one activation matrix of a batch the scheduler sends (8,192 tokens x a 4,096-wide
# float32 intermediate is 128 MB), below a whole model's weights.
HEAP_KEEP_BYTES = 256 << 20
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters (malloc.h)
_OLD_GLIBC_MMAP_THRESHOLD_MAX = 32 << 20  # the most glibc before 2.35 accepts on 64-bit
TRIM_IDLE_INTERVAL = 1.0  # seconds between trims when the worker goes idle
TRIM_BUSY_INTERVAL = 10.0  # ... and at least this often under unbroken load
_CACHE_VARIABLES = ("LRU_CACHE_CAPACITY", "ONEDNN_PRIMITIVE_CACHE_CAPACITY")


def bound_kernel_caches(capacity: int = KERNEL_CACHE_CAPACITY) -> None:
    """Cap the shape-keyed primitive caches (before the first forward; the operator's values win)."""
    for name in _CACHE_VARIABLES:
        os.environ.setdefault(name, str(capacity))


@functools.cache
def _libc() -> ctypes.CDLL | None:
    """The C library, loaded once: find_library runs `ldconfig -p` in a subprocess on Linux, and a
    worker asks for several functions (mallopt at start, malloc_trim for its trimmer and after a load)."""
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None


def _glibc_function(name: str, argtypes: list, restype):
    """The C library's function `name`, typed, or None where it has none (musl, macOS)."""
    function = getattr(_libc(), name, None)
    if function is None:
        return None
    function.argtypes, function.restype = argtypes, restype
    return function


def keep_freed_memory(limit: int = HEAP_KEEP_BYTES) -> bool:
    """Freed blocks below `limit` stay in the heap for the next batch instead of going back to the
    kernel (then faulted in, zeroed, again); an older glibc, which caps the mmap threshold, keeps
    those below its cap. False where the C library has no mallopt (musl, macOS): allocation works
    as before."""
    mallopt = _glibc_function("mallopt", [ctypes.c_int, ctypes.c_int], ctypes.c_int)
    if mallopt is None:
        return False
    kept = mallopt(_M_MMAP_THRESHOLD, limit) or mallopt(_M_MMAP_THRESHOLD, min(limit, _OLD_GLIBC_MMAP_THRESHOLD_MAX))
    return bool(mallopt(_M_TRIM_THRESHOLD, limit) and kept)


def _malloc_trim():
    """glibc's malloc_trim, or None (musl, macOS: nothing to call)."""
    return _glibc_function("malloc_trim", [ctypes.c_size_t], ctypes.c_int)


def trim_heap() -> None:
    """Give the heap's free pages back to the OS now (after freeing a whole model's weights)."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


class HeapTrimmer:
    """Gives freed heap pages back to the OS after batches, rarely enough to cost nothing."""

    def __init__(self, idle_interval: float = TRIM_IDLE_INTERVAL, busy_interval: float = TRIM_BUSY_INTERVAL):
        self._trim = _malloc_trim()
        self._idle_interval, self._busy_interval = idle_interval, busy_interval
        self._last = time.monotonic()

    def after_batch(self, idle: bool) -> bool:
        """Call after each batch, `idle` when no other batch is waiting; True when it trimmed."""
        if self._trim is None:
            return False
        since = time.monotonic() - self._last
        if since < (self._idle_interval if idle else self._busy_interval):
            return False
        self._trim(0)
        self._last = time.monotonic()
        return True
