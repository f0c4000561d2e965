"""The host kernels' build cache (workers/backends/host_kernels.py): a library built once is loaded by the
processes that start after it and rebuilt when what it was built from changes. Locking and publishing an
entry whole are model_cache's (tests/integration/test_engines.py)."""

from __future__ import annotations

import ctypes
from pathlib import Path

import pytest

from encoderd.workers.backends import host_kernels

COMPILER = host_kernels.find_compiler()
pytestmark = pytest.mark.skipif(COMPILER is None, reason="no C compiler on this host")
FLAGS = ("-O2", "-shared", "-fPIC")


@pytest.fixture
def logged_compiler(tmp_path) -> tuple[list[str], Path]:
    """The host's compiler behind a script that appends each command line to a log first."""
    assert COMPILER is not None
    log = tmp_path / "compiler.log"
    script = tmp_path / "cc-logged"
    script.write_text(f'#!/bin/sh\necho "$*" >> {log}\nexec {" ".join(COMPILER)} "$@"\n')
    script.chmod(0o755)
    return [str(script)], log


def _source(folder: Path, answer: int) -> Path:
    source = folder / f"answer{answer}.c"
    source.write_text(f"int answer(void) {{ return {answer}; }}\n")
    return source


def _compiles(log: Path) -> int:
    """How many times the logged compiler built a library (the macro probes do not count)."""
    return sum(" -o " in line for line in log.read_text().splitlines()) if log.exists() else 0


def _answer(path: Path) -> int:
    return ctypes.CDLL(str(path)).answer()


def test_a_second_build_loads_the_first_ones_library(tmp_path, logged_compiler):
    compiler, log = logged_compiler
    source, cache = _source(tmp_path, 42), str(tmp_path / "cache")
    first = host_kernels.cached_library(compiler, FLAGS, source, cache)
    second = host_kernels.cached_library(compiler, FLAGS, source, cache)
    assert first == second and _answer(second) == 42
    assert _compiles(log) == 1


def test_a_changed_source_or_other_flags_build_anew(tmp_path, logged_compiler):
    compiler, log = logged_compiler
    cache = str(tmp_path / "cache")
    built = host_kernels.cached_library(compiler, FLAGS, _source(tmp_path, 1), cache)
    changed = _source(tmp_path, 1)
    changed.write_text(changed.read_text().replace("return 1", "return 2"))
    rebuilt = host_kernels.cached_library(compiler, FLAGS, changed, cache)
    other_flags = host_kernels.cached_library(compiler, ("-O1", *FLAGS[1:]), changed, cache)
    assert len({built, rebuilt, other_flags}) == 3 and _compiles(log) == 3
    assert (_answer(rebuilt), _answer(other_flags)) == (2, 2)


def test_an_unwritable_cache_folder_builds_for_the_process_alone(tmp_path, logged_compiler, monkeypatch, caplog):
    compiler, log = logged_compiler
    (tmp_path / "a-file").write_text("")
    monkeypatch.setattr(host_kernels, "CACHE_DIR", str(tmp_path / "a-file"))  # its kernels/ cannot be made
    with caplog.at_level("INFO", logger=host_kernels.__name__):
        library = host_kernels._load_library(compiler, FLAGS, _source(tmp_path, 5))
    assert library.answer() == 5 and _compiles(log) == 1
    assert "not cached" in caplog.text


def test_a_worker_started_later_loads_the_kernels_an_earlier_one_built(tmp_path, logged_compiler, monkeypatch):
    """kernels() as a worker's load calls it: the first builds host_kernels.c into the cache folder, a
    later process (here: the cache of kernels() cleared) loads that library, checks it, and serves."""
    compiler, log = logged_compiler
    monkeypatch.setenv("CC", compiler[0])
    monkeypatch.setattr(host_kernels, "CACHE_DIR", str(tmp_path))
    try:
        for _ in range(2):
            host_kernels.kernels.cache_clear()
            assert host_kernels.kernels() is not None
    finally:
        host_kernels.kernels.cache_clear()  # the other tests' kernels(): built under their own settings
    assert _compiles(log) == 1
    assert len(list((tmp_path / "kernels").glob(f"*/{host_kernels.LIBRARY}"))) == 1
