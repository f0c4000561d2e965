"""While a model's workers start, the frontend logs that they are still at it (server/models/served.py):
progress in any log format, where no progress bar is drawn."""

from __future__ import annotations

import asyncio
import logging

import pytest

from encoderd.server.models import served


class SlowWorker:
    def __init__(self, seconds: float):
        self.seconds = seconds
        self.ready = False
        self.cancelled = False

    async def start(self) -> str:
        try:
            await asyncio.sleep(self.seconds)
        except asyncio.CancelledError:
            self.cancelled = True
            raise
        self.ready = True
        return f"ready after {self.seconds}"


async def test_a_slow_start_is_reported_until_it_ends(monkeypatch, caplog):
    monkeypatch.setattr(served, "PROGRESS_EVERY_S", 0.1)
    workers = [SlowWorker(0.05), SlowWorker(0.35)]
    with caplog.at_level(logging.INFO, logger="encoderd.engine"):
        infos = await served.start_reporting_progress("m", workers)
    assert infos == ["ready after 0.05", "ready after 0.35"]
    lines = [r.getMessage() for r in caplog.records if "still loading" in r.getMessage()]
    assert 2 <= len(lines) <= 4, lines
    assert all(line.startswith("model m: 1 of 2 worker(s) still loading after") for line in lines), lines


async def test_a_fast_start_says_nothing_and_a_cancelled_one_stops_its_workers(monkeypatch, caplog):
    monkeypatch.setattr(served, "PROGRESS_EVERY_S", 10.0)
    with caplog.at_level(logging.INFO, logger="encoderd.engine"):
        assert await served.start_reporting_progress("m", [SlowWorker(0.01)]) == ["ready after 0.01"]
    assert not [r for r in caplog.records if "still loading" in r.getMessage()]

    workers = [SlowWorker(5), SlowWorker(5)]
    start = asyncio.ensure_future(served.start_reporting_progress("m", workers))
    await asyncio.sleep(0.05)
    start.cancel()
    with pytest.raises(asyncio.CancelledError):
        await start
    assert all(w.cancelled for w in workers)
