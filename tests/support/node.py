"""The Node.js side of the tests: clients/node installed with `npm ci`, once."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

NODE_CLIENT = Path(__file__).resolve().parents[2] / "clients" / "node"


def googleapis_include() -> str:
    """The directory holding google/api/*.proto and google/rpc/*.proto (googleapis-common-protos)."""
    import google.api

    return str(Path(google.api.__path__[0]).parents[1])


def node_client_dir() -> Path:
    """clients/node with its node_modules from package-lock.json; skips where Node.js is missing.

    `npm ci` reinstalls from scratch, so it runs only when the lock file is newer than the
    install npm recorded (node_modules/.package-lock.json); node_modules is gitignored.
    """
    if not shutil.which("node") or not shutil.which("npm"):
        pytest.skip("Node.js / npm are not installed (.ci/run checks for them)")
    installed = NODE_CLIENT / "node_modules" / ".package-lock.json"
    sources = [NODE_CLIENT / "package-lock.json", NODE_CLIENT / "package.json"]
    if not installed.exists() or any(s.stat().st_mtime > installed.stat().st_mtime for s in sources):
        result = subprocess.run(
            ["npm", "ci", "--no-audit", "--no-fund", "--loglevel=error"],
            cwd=NODE_CLIENT,
            capture_output=True,
            text=True,
            timeout=600,
            check=False,
        )
        assert result.returncode == 0, f"npm ci failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    return NODE_CLIENT
