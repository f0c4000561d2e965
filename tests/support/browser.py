"""Debian's headless Chromium, as the browser tests start it (test_docs, test_browser_cors)."""

from __future__ import annotations

import shutil
from pathlib import Path

# As root on a closed network: no sandbox, and none of Chromium's own background connections
# (they are refused here, many at a time).
CHROMIUM_FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
)


def find_chromium() -> str | None:
    """The Chromium binary (.ci/run installs Debian's package), or None."""
    return shutil.which("chromium") or shutil.which("chromium-browser")


def chromium_command(chromium: str, profile: Path, *args: str) -> list[str]:
    """A headless Chromium command with its own new profile folder."""
    return [chromium, *CHROMIUM_FLAGS, f"--user-data-dir={profile}", *args]
