"""A run's processes live and die with their launcher, and `executor stop` signals only its own.

Real CLI launchers (`python -m executor launch`, the tiny model on 2 CPU ranks) killed by SIGKILL,
ended by SIGTERM or hung up (SIGHUP, an ssh session dropping): nothing of the run is left within
10 s, the devices' booking is released (a second launch on them is accepted) and the run says
what happened. `executor stop` on store rows that name another host, or a pid that is now another
process, refuses in one line and leaves that process alone.
"""
from __future__ import annotations

import contextlib
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
from typing import Iterator

import psutil
import pytest

from contracts.paths import PROJECT_ROOT
from executor import booking
from executor.launch import launch_run
from executor.store import MetricsStore, read_metrics
from testkit.processes import processes_with_data_dir
from testkit.runs import fabricate_run, two_cpu_plan
from testkit.wait import wait_until

LONG = 100_000  # steps: the run lasts until its launcher goes
GONE_S = 10.0  # the bound the issue sets for everything of the run to be gone


def _cli_launcher(run_dir: str) -> subprocess.Popen:
    """`python -m executor launch` in its own session, as a user's shell starts it."""
    os.makedirs(run_dir)
    plan = os.path.join(run_dir, "plan-in.json")
    two_cpu_plan().save(plan)
    log = open(run_dir + ".log", "wb")
    return subprocess.Popen([sys.executable, "-m", "executor", "launch", "--plan", plan, "--steps", str(LONG),
                             "--run-dir", run_dir], cwd=PROJECT_ROOT, stdout=log, stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL, start_new_session=True)


def _alive(pids: list[int]) -> list[int]:
    out = []
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                out.append(pid)
        except psutil.NoSuchProcess:
            pass
    return out


def _run_pids(launcher: subprocess.Popen, run_dir: str) -> list[int]:
    """The launcher, torchrun and every rank, once the run trains."""
    m = wait_until(lambda: (lambda m: m if m["steps"] else None)(read_metrics(run_dir)), 150, "a step",
                   ignore=(ValueError,))
    torchrun = int(open(os.path.join(run_dir, "torchrun.pid")).read())
    return [launcher.pid, torchrun, *(r["pid"] for r in m["ranks"])]


def _assert_devices_free_for_a_second_launch(tmp_path) -> None:
    assert booking.Ledger().live() == []
    second = str(tmp_path / "second")
    assert launch_run(two_cpu_plan(), 1, second) == "done", read_metrics(second)["reason"]


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP])  # SIGINT: the same handler
def test_a_stop_signal_to_the_launcher_stops_the_run_cleanly(sig, data_dir, tmp_path):
    run = str(tmp_path / "run")
    launcher = _cli_launcher(run)
    try:
        pids = _run_pids(launcher, run)
        os.kill(launcher.pid, sig)
        t0 = time.monotonic()
        wait_until(lambda: not _alive(pids), GONE_S, "every process of the run to end",
                   detail=lambda: _alive(pids))
        assert launcher.wait(timeout=5) == 0  # "stopped" exits 0; the launcher reaped torchrun on its way
        assert not processes_with_data_dir(data_dir)
        wait_until(lambda: booking.Ledger().live() == [], GONE_S - (time.monotonic() - t0), "the booking released")
        m = read_metrics(run)
        assert m["status"] == "stopped" and m["reason"] == "stopped on request", (m["status"], m["reason"])
    finally:
        launcher.kill()
        launcher.wait()
    _assert_devices_free_for_a_second_launch(tmp_path)


def test_a_sigterm_while_the_run_is_prepared_stops_it(data_dir, tmp_path):
    run = str(tmp_path / "early")
    launcher = _cli_launcher(run)
    try:
        # the launcher has taken the booking (its checks passed) but no rank is up yet
        wait_until(lambda: [b.pid for b in booking.Ledger().live()] == [launcher.pid], 60, "the launcher's booking")
        os.kill(launcher.pid, signal.SIGTERM)
        assert launcher.wait(timeout=GONE_S) == 0
        wait_until(lambda: not processes_with_data_dir(data_dir), GONE_S, "every process of the run to end")
        assert booking.Ledger().live() == []
        assert read_metrics(run)["status"] == "stopped"
    finally:
        launcher.kill()
        launcher.wait()


def test_a_sigkilled_launcher_takes_torchrun_and_the_ranks_with_it(data_dir, tmp_path):
    run = str(tmp_path / "killed")
    launcher = _cli_launcher(run)
    try:
        pids = _run_pids(launcher, run)
        os.kill(launcher.pid, signal.SIGKILL)
        launcher.wait()
        wait_until(lambda: not _alive(pids), GONE_S, "torchrun and the ranks to die with their launcher",
                   detail=lambda: _alive(pids))
        assert not processes_with_data_dir(data_dir)
        m = read_metrics(run)  # read before anything repaired the store: the launcher is simply gone
        assert m["status"] == "failed" and "launcher vanished" in m["reason"], (m["status"], m["reason"])
    finally:
        launcher.kill()
        launcher.wait()
    _assert_devices_free_for_a_second_launch(tmp_path)  # the ledger repaired itself from the processes alive
    # ... and recorded the run's end in its store, not only in what a reader infers
    store = MetricsStore(run)
    try:
        assert store.status() == "failed"
    finally:
        store.close()
    assert "launcher vanished" in read_metrics(run)["reason"]


# ---- executor stop signals only what it has verified ---------------------------------------------


@contextlib.contextmanager
def _fake_running_run(tmp_path) -> Iterator[tuple[str, subprocess.Popen]]:
    """(run folder, process): a run row that says "running", its launcher pid now an unrelated
    process (the store's own API; phase starting); the process is killed at the end."""
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        run = fabricate_run("fake", 0, None, root=str(tmp_path))
        store = MetricsStore(run)
        try:
            store.set_launcher_pid(proc.pid)
        finally:
            store.close()
        yield run, proc
    finally:
        proc.kill()
        proc.wait()


def _refused_by_stop(run: str, proc: subprocess.Popen, *words: str) -> None:
    """`executor stop` exits 2 with one line holding `words`, and `proc` is still alive."""
    r = subprocess.run([sys.executable, "-m", "executor", "stop", "--run-dir", run, "--timeout", "1"],
                       capture_output=True, text=True, cwd=PROJECT_ROOT, timeout=60)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, (r.returncode, r.stderr)
    assert "Traceback" not in r.stderr and all(w in r.stderr for w in words), r.stderr
    assert proc.poll() is None  # not signalled


def test_stop_refuses_a_run_recorded_on_another_host_and_signals_nothing(tmp_path):
    with _fake_running_run(tmp_path) as (run, proc):
        store = MetricsStore(run)
        try:  # as a shared store holds it: the run's launcher is on another machine, its pid means nothing here
            store.db.execute("UPDATE run SET host = ? WHERE run_key = ?", ("gpu-node-7", store.key))
        finally:
            store.close()
        _refused_by_stop(run, proc, f"run {run} was started on host gpu-node-7; stop it there")
        assert read_metrics(run)["status"] == "running"


def test_stop_refuses_a_pid_that_is_not_the_launcher_and_signals_nothing(tmp_path):
    with _fake_running_run(tmp_path) as (run, proc):  # an unrelated process got the launcher's pid
        _refused_by_stop(run, proc, f"pid {proc.pid} is not its launcher", "nothing signalled")


def test_stop_refuses_a_pid_whose_start_time_is_not_the_recorded_launchers(tmp_path):
    with _fake_running_run(tmp_path) as (run, proc):
        p = psutil.Process(proc.pid)
        store = MetricsStore(run)
        try:  # the launcher recorded itself an hour before this process started: the pid was reused since
            store.add_event("launcher", f"launcher pid {proc.pid} on {socket.gethostname()}, started at "
                                        f"{p.create_time() - 3600:.2f}: {shlex.join(p.cmdline())}")
        finally:
            store.close()
        _refused_by_stop(run, proc, f"pid {proc.pid} is not its launcher", "the launcher at")
