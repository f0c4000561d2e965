"""An on-disk cache for converted models: ONNX exports, quantized graphs,
CTranslate2 conversions, TensorRT engines.

An entry is a directory named after a hash of everything its content depends
on: the model files' bytes, the dtype, the versions of the libraries that
wrote it, and this module's FORMAT. A changed checkpoint, dtype or library
therefore misses the cache instead of serving a stale graph.

Entries are built in a temporary sibling directory and renamed into place,
and rename(2) is atomic, so a crash or failed export never leaves a
half-written entry that a later start would trust. Workers starting together
(replicas of one model) build an entry once: the others wait on a per-entry
flock and then read it; should two builds still race (a filesystem without
flock), the loser of the rename discards its copy.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

log = logging.getLogger(__name__)

# Bump when the conversion code changes what it writes, to retire old entries.
FORMAT = 1
MANIFEST = "encoderd-cache.json"
_STALE_TMP_S = 24 * 3600


def library_versions(*distributions: str) -> dict[str, str]:
    """Installed versions by distribution name ("-" when absent), for cache keys."""
    versions = {}
    for name in distributions:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = "-"
    return versions


def fingerprint_model(model_dir: str | os.PathLike) -> str:
    """sha256 over the name and bytes of every top-level file of a model directory.

    Content, not mtimes: a re-downloaded identical checkpoint still hits, and
    a checkpoint edited in place misses. Sub-directories (sentence-transformers
    Pooling/Normalize configs) do not change the converted graph.
    """
    digest = hashlib.sha256()
    root = Path(model_dir)
    for path in sorted(p for p in root.iterdir() if p.is_file() and not p.name.startswith(".")):
        digest.update(path.name.encode() + b"\0")
        with open(path, "rb") as f:  # follows hub-cache symlinks to the blobs
            for chunk in iter(lambda: f.read(1 << 20), b""):
                digest.update(chunk)
    return digest.hexdigest()


@dataclass(frozen=True)
class CacheEntry:
    path: Path
    hit: bool  # True: found on disk; False: built by this call


def cached_build(
    root: str | os.PathLike, kind: str, label: str, key: dict, build: Callable[[Path], None]
) -> CacheEntry:
    """Return the entry for `key`, calling `build(tmp_dir)` to fill it on a miss.

    `kind` groups entries ("onnx", "ct2", ...). Only the hash of `key` names
    the directory, so one model served under two names shares its entries;
    `label` goes into the entry's manifest, for people listing the cache.
    """
    full_key = {"kind": kind, "format": FORMAT, **key}
    digest = hashlib.sha256(json.dumps(full_key, sort_keys=True).encode()).hexdigest()[:20]
    parent = Path(root).expanduser() / kind
    final = parent / digest
    if (final / MANIFEST).is_file():
        log.info("reusing cached %s entry %s", kind, final)
        return CacheEntry(final, hit=True)
    parent.mkdir(parents=True, exist_ok=True)
    with _build_lock(parent / f".{final.name}.lock", final):
        if (final / MANIFEST).is_file():  # built by the process we waited for
            log.info("reusing cached %s entry %s", kind, final)
            return CacheEntry(final, hit=True)
        return _build(parent, final, kind, {"label": label, "key": full_key}, build)


@contextlib.contextmanager
def _build_lock(path: Path, final: Path):
    """One builder per entry across processes (replicas of one model start together;
    N concurrent exports would cost N times the memory for one result). flock is
    released by the kernel if the holder dies, so a crashed build never blocks."""
    with open(path, "a") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log.info("waiting for another process to finish building %s", final)
            fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _build(parent: Path, final: Path, kind: str, manifest: dict, build: Callable[[Path], None]) -> CacheEntry:
    _remove_stale_tmp(parent)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=parent))
    try:
        started = time.perf_counter()
        build(tmp)
        seconds = time.perf_counter() - started
        (tmp / MANIFEST).write_text(
            json.dumps(
                {**manifest, "build_seconds": round(seconds, 2), "created": time.strftime("%Y-%m-%dT%H:%M:%S%z")},
                indent=1,
            )
        )
        if _publish(tmp, final):
            log.info("cached %s entry %s (built in %.1fs)", kind, final, seconds)
            return CacheEntry(final, hit=False)
        log.info("another process cached %s entry %s first; using it", kind, final)
        return CacheEntry(final, hit=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # gone already when published


def _publish(tmp: Path, final: Path) -> bool:
    """Atomically move tmp to final; False if a complete entry is already there."""
    try:
        os.rename(tmp, final)
        return True
    except OSError as exc:
        if exc.errno not in (errno.EEXIST, errno.ENOTEMPTY):
            raise
    if (final / MANIFEST).is_file():
        return False
    # A directory without a manifest is not ours to trust (copied in by hand?): replace it.
    shutil.rmtree(final)
    os.rename(tmp, final)
    return True


def _remove_stale_tmp(parent: Path) -> None:
    # Temp dirs of builds killed mid-way (SIGKILL, OOM) are never read, only wasted disk.
    now = time.time()
    for path in parent.glob(".*.tmp-*"):
        try:
            if now - path.stat().st_mtime > _STALE_TMP_S:
                shutil.rmtree(path, ignore_errors=True)
        except FileNotFoundError:
            pass
