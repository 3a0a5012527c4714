"""The booking ledger: one place for every launcher's devices, repaired from the processes alive.

Real launches (tiny model, 2 CPU ranks) for the two-sessions case and the killed launcher;
plain processes (`sleep`) as holders for the repair."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from contextlib import closing

import psutil
import pytest

from executor import booking
from executor.launch import launch_run, start_run, stop_run
from executor.store import read_metrics
from contracts.cluster import ClusterSpec
from testkit.processes import processes_with_data_dir
from testkit.runs import two_cpu_plan
from testkit.wait import wait_until

LONG = 100_000  # steps: the run lasts until it is stopped


def _zombie_children() -> list[int]:
    return [c.pid for c in psutil.Process().children() if c.status() == psutil.STATUS_ZOMBIE]


def _sleeper() -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])


def test_the_dashboard_and_the_orchestrator_name_this_machines_devices_alike():
    plan = two_cpu_plan()  # node "localhost"
    detected = ClusterSpec.from_dict({"name": "local", "nodes": [{"name": os.uname().nodename,
                                                                   "gpus": {"cpu": 4}}]})
    assert booking.plan_device_keys(plan) == ["local/0", "local/1"]
    assert booking.cluster_device_keys(detected, [0, 1]) == ["local/0", "local/1"]
    two = ClusterSpec.from_dict({"name": "lab", "nodes": [{"name": "n0", "gpus": {"T4": 2}},
                                                          {"name": "n1", "gpus": {"T4": 1}}]})
    assert booking.cluster_device_keys(two) == ["n0/0", "n0/1", "n1/0"]


def test_a_second_booking_is_refused_naming_the_first_and_a_dead_holder_is_released(store_backend, tmp_path):
    ledger = booking.Ledger()
    holder = _sleeper()
    try:
        ledger.book(str(tmp_path / "first"), ["local/0", "local/1"], holder.pid)
        with pytest.raises(ValueError, match=r"devices local/1 are in use by run .*first \(started "):
            ledger.book(str(tmp_path / "second"), ["local/1", "local/2"])
        ledger.book(str(tmp_path / "third"), ["local/2"])  # another device: fine
        # a restart: a new Ledger over the same file sees the same bookings
        assert {b.run_dir for b in booking.Ledger().live()} == {str(tmp_path / "first"), str(tmp_path / "third")}
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    # the holder is gone and its run has no torchrun: repaired on the next read
    assert [b.run_dir for b in booking.Ledger().live()] == [str(tmp_path / "third")]
    booking.Ledger().book(str(tmp_path / "second"), ["local/1"])


def test_a_reused_pid_does_not_keep_a_booking(store_backend, tmp_path):
    ledger = booking.Ledger()
    ledger.book(str(tmp_path / "old"), ["local/0"], os.getpid())
    with closing(ledger._connect()) as conn:  # as if the booking had been made by an earlier process with our pid
        conn.execute("UPDATE bookings SET pid_start_s = pid_start_s - 3600")
    assert ledger.live() == []


def test_two_sessions_on_the_same_devices_the_second_is_refused_with_the_first_run_named(data_dir, tmp_path):
    first = start_run(two_cpu_plan(), LONG, str(tmp_path / "first"), seed=0)
    try:
        with pytest.raises(ValueError, match=f"in use by run {first.run_dir} \\(started "):
            start_run(two_cpu_plan(), LONG, str(tmp_path / "second"), seed=0)
        with pytest.raises(ValueError, match=f"in use by run {first.run_dir}"):
            launch_run(two_cpu_plan(), 2, str(tmp_path / "cli"), seed=0)  # the CLI's path
        assert not os.path.exists(tmp_path / "second" / "metrics.sqlite")
        # the launcher took the booking over: its pid holds it
        wait_until(lambda: [b.pid for b in booking.Ledger().live()] == [first.pid], 30, "the launcher to hold it")
        # stop once it trains: a launcher still building its corpus answers a stop only by its kill (30 s)
        wait_until(lambda: read_metrics(first.run_dir)["steps"], 150, "a step")
    finally:
        assert stop_run(first.run_dir) == "stopped"
    assert booking.Ledger().live() == []
    # every child the dashboard started is reaped: no <defunct> launcher
    wait_until(lambda: not _zombie_children(), 10, "the launcher to be reaped")


def test_a_sigkilled_launcher_takes_its_run_along_and_its_devices_are_released(data_dir, tmp_path):
    h = start_run(two_cpu_plan(), LONG, str(tmp_path / "killed"), seed=0)
    wait_until(lambda: len(read_metrics(h.run_dir)["steps"]) >= 1, 150, "a step")
    os.kill(h.pid, signal.SIGKILL)
    # torchrun and the ranks die with their launcher (executor/lifeline.py)
    wait_until(lambda: processes_with_data_dir(data_dir) == [], 10, "torchrun and the ranks to die with it")
    assert booking.Ledger().live() == []  # repaired from the processes alive
    booking.Ledger().book(str(tmp_path / "other"), booking.plan_device_keys(two_cpu_plan()))
    booking.Ledger().release(str(tmp_path / "other"))
    m = read_metrics(h.run_dir)
    assert m["status"] == "failed" and m["reason"].startswith("launcher vanished"), m["reason"]
    assert stop_run(h.run_dir, timeout_s=5) == "failed"  # nothing of it left to stop
