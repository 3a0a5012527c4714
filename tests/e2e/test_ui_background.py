"""ui/background.py: a page's computation in its own process group, replaced, cancelled, reaped.

The page tests (tests/unit/test_ui_plan.py, _geo, _scheduler) wait with testkit.apptest.settle."""
from __future__ import annotations

import subprocess
import time

import psutil
import pytest

from testkit.wait import wait_until
from ui import background

pytestmark = pytest.mark.timeout(60)


def add(a: int, b: int) -> int:
    return a + b


def refuse(n: int) -> int:
    raise ValueError(f"bad n {n}")


def hang_with_grandchild(pid_file: str) -> None:
    """A stand-in for solve_plan and its cbc: starts a grandchild, then never returns."""
    grandchild = subprocess.Popen(["sleep", "600"])
    with open(pid_file, "w", encoding="utf-8") as fh:
        fh.write(str(grandchild.pid))
    time.sleep(600)


def gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def wait_gone(pids: list[int], timeout_s: float) -> bool:
    return wait_until(lambda: all(gone(p) for p in pids), timeout_s, f"processes {pids} to end", interval_s=0.1)


def grandchild_pid(pid_file: str, timeout_s: float = 20.0) -> int:
    def written() -> str:
        with open(pid_file, encoding="utf-8") as fh:
            return fh.read()

    return int(wait_until(written, timeout_s, "the child to start its grandchild", interval_s=0.05,
                          ignore=(FileNotFoundError,)))


def wait_result(job: background.Job, timeout_s: float = 30.0):
    return wait_until(lambda: (job.result(),), timeout_s, "the job to finish", interval_s=0.05,
                      ignore=(background.Pending,))[0]


def test_result_and_error_come_back_from_the_child():
    assert wait_result(background.Job(add, (2, 3))) == 5
    job = background.Job(refuse, (7,))
    with pytest.raises(ValueError, match="bad n 7"):
        wait_result(job)
    assert job.proc.returncode == 0  # reaped: no <defunct> child left


def test_a_newer_request_kills_the_older_child_and_its_grandchildren(tmp_path):
    pid_file = str(tmp_path / "grandchild")
    first = background.submit("t-replace", hang_with_grandchild, pid_file)
    grandchild = grandchild_pid(pid_file)
    assert not gone(first.pid) and not gone(grandchild)
    second = background.submit("t-replace", add, 1, 1)
    assert wait_gone([first.pid, grandchild], 5.0), "the replaced child or its grandchild still runs"
    with pytest.raises(background.Cancelled, match="newer request"):
        first.result()
    assert wait_result(second) == 2
    assert background.current("t-replace") is second


def test_cancel_kills_the_group(tmp_path):
    pid_file = str(tmp_path / "grandchild")
    job = background.submit("t-cancel", hang_with_grandchild, pid_file)
    grandchild = grandchild_pid(pid_file)
    background.cancel("t-cancel")
    assert wait_gone([job.pid, grandchild], 5.0)
    assert background.current("t-cancel") is None


def test_a_child_whose_owner_stops_heartbeating_exits_by_itself(tmp_path):
    """No reaper (a bare Job, registered nowhere): the child's own watchdog ends its group."""
    pid_file = str(tmp_path / "grandchild")
    job = background.Job(hang_with_grandchild, (pid_file,), heartbeat_s=1.0)
    grandchild = grandchild_pid(pid_file)
    job.poll()  # one heartbeat, then silence
    assert wait_gone([job.pid, grandchild], 1.0 + 5.0), "the child outlived its owner's heartbeat"


def test_the_reaper_cancels_a_job_nobody_polls(tmp_path):
    pid_file = str(tmp_path / "grandchild")
    job = background.submit("t-reap", hang_with_grandchild, pid_file, heartbeat_s=30.0)
    grandchild = grandchild_pid(pid_file)
    job.last_poll -= 60  # as if the page had stopped polling a minute ago
    background.reap_once()
    assert wait_gone([job.pid, grandchild], 5.0)
    with pytest.raises(background.Cancelled, match="no page polled"):
        job.result()


def test_the_reaper_cancels_the_job_of_an_ended_session(tmp_path, monkeypatch):
    pid_file = str(tmp_path / "grandchild")
    job = background.submit("t-session", hang_with_grandchild, pid_file)
    grandchild = grandchild_pid(pid_file)
    monkeypatch.setattr(background, "_session_active", lambda owner: False)  # the tab closed
    background.reap_once()
    assert wait_gone([job.pid, grandchild], 5.0)
    with pytest.raises(background.Cancelled, match="session ended"):
        job.result()
    assert background.current("t-session") is None
