"""The one restart loop for child processes (workers, Envoy), on real short-lived processes."""

from __future__ import annotations

import asyncio
import logging
import re

import pytest

from encoderd.server.scheduling.supervisor import RestartPolicy, Supervisor


class StartFailed(Exception):
    pass


class Child:
    """A shell child whose life is `script`; `starts_fail` of its (re)starts fail before it runs."""

    def __init__(self, script: str, starts_fail: int = 0):
        self.script = script
        self.starts_fail = starts_fail
        self.process: asyncio.subprocess.Process | None = None
        self.launches = 0
        self.error: Exception | None = None  # what its restarts raise, when set

    async def launch(self) -> int:
        self.launches += 1
        if self.launches > 1 and self.error:
            raise self.error
        if self.launches > 1 and self.starts_fail:
            self.starts_fail -= 1
            raise StartFailed("its port is taken")
        self.process = await asyncio.create_subprocess_exec("/bin/sh", "-c", self.script)
        return self.process.pid

    async def wait_exit(self) -> int | None:
        assert self.process is not None
        return await self.process.wait()

    def supervisor(self, policy: RestartPolicy) -> Supervisor[int]:
        pid = lambda: self.process.pid if self.process else None  # noqa: E731 - a one-line accessor
        return Supervisor("child", self.launch, self.wait_exit, pid, policy, (StartFailed,), giving_up="it is gone")


FAST = RestartPolicy(first_delay=0.01, min_delay=0.02, max_delay=0.08, healthy_after=5.0, give_up_after=5)


def _delays(caplog) -> list[float]:
    return [float(m) for m in re.findall(r"restarting it in ([0-9.]+)s", caplog.text)]


async def _until(condition, timeout: float = 20.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.01)


async def test_back_off_doubles_up_to_its_ceiling_then_gives_up_after_fast_failures(caplog):
    caplog.set_level(logging.INFO, logger="encoderd.supervisor")
    child = Child("exit 3")
    supervisor = child.supervisor(FAST)
    await supervisor.start()
    await _until(lambda: supervisor.gave_up)
    assert _delays(caplog) == [0.01, 0.02, 0.04, 0.08, 0.08]
    assert "died with exit code 3" in caplog.text
    assert "child failed 5 times in a row within 5s of starting; giving up: it is gone" in caplog.text
    assert supervisor.restarts == child.launches == 6  # the last death is counted, not restarted
    await asyncio.sleep(0.2)
    assert child.launches == 6  # nothing respawned after giving up


async def test_failed_restarts_count_as_fast_failures_and_are_logged(caplog):
    child = Child("exit 1", starts_fail=10)
    supervisor = child.supervisor(FAST)
    await supervisor.start()
    await _until(lambda: supervisor.gave_up)
    assert caplog.text.count("restart of child failed: its port is taken") == 5
    assert supervisor.restarts == 1  # one death; the rest were starts that failed


async def test_a_healthy_run_resets_back_off_and_the_failure_count(caplog):
    policy = RestartPolicy(first_delay=0.0, min_delay=0.5, max_delay=30.0, healthy_after=0.3, give_up_after=1)
    child = Child("sleep 0.4")  # always outlives healthy_after: never gives up, never backs off
    supervisor = child.supervisor(policy)
    await supervisor.start()
    await _until(lambda: supervisor.restarts >= 3)
    supervisor.stop()
    assert not supervisor.gave_up and set(_delays(caplog)) == {0.0}


async def test_the_first_start_failure_is_the_callers_and_stop_ends_restarts():
    async def refuse() -> int:
        raise StartFailed("no model")

    supervisor = Supervisor("child", refuse, refuse, lambda: None, FAST, (StartFailed,))
    with pytest.raises(StartFailed, match="no model"):
        await supervisor.start()

    child = Child("sleep 0.2")
    supervisor = child.supervisor(FAST)
    await supervisor.start()
    supervisor.stop()
    await asyncio.sleep(0.5)
    assert child.launches == 1 and supervisor.restarts == 0


def test_policy_never_gives_up_unless_asked():
    assert not RestartPolicy().gives_up(1000)
    assert not FAST.gives_up(5) and FAST.gives_up(6)
    assert RestartPolicy(first_delay=0.0).after_failure(0.0) == 0.5  # the first failure waits the least delay


async def test_an_unexpected_error_ends_supervision_with_one_clear_line(caplog):
    child = Child("sleep 0.3")
    supervisor = child.supervisor(FAST)
    await supervisor.start()
    child.error = OSError("fork failed")  # not one of its start errors
    await _until(lambda: supervisor.gave_up)
    assert "supervision of child stopped by an unexpected error; it stays down" in caplog.text
    assert "OSError: fork failed" in caplog.text  # with its traceback
