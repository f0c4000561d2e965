"""This process's memory mappings, as Linux lists them in /proc/self/smaps."""

from __future__ import annotations

from pathlib import Path


def mapping(address: int) -> dict | None:
    """The /proc/self/smaps entry holding `address`: its start, end and VmFlags; None where none does."""
    found = None
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and ":" not in head:
            start, end = (int(v, 16) for v in head.split("-"))
            found = {"start": start, "end": end} if start <= address < end else None
        elif found is not None and line.startswith("VmFlags:"):
            found["flags"] = line.split()[1:]
            return found
    return None
