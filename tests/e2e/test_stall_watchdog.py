"""The stall watchdog: a rank stopped with SIGSTOP (its peers then wait in a collective, gloo's
default timeout being 30 minutes) fails the run within the watchdog's bound, the rank named.

A real run (tiny model, 2 CPU ranks) with `stall_timeout_s` = STALL_S; the bound's derivation and
the ranks' collective timeout: tests/unit/test_stall_bound.py."""
from __future__ import annotations

import contextlib
import os
import signal
import time

from executor.launch import start_run, stop_run
from executor.store import read_metrics
from testkit.processes import processes_with_data_dir
from testkit.runs import two_cpu_plan
from testkit.wait import wait_until

STALL_S = 8.0
SLACK_S = 15.0  # the watchdog reads the store once a second; the stopped rank's kill takes a few more


def test_a_sigstopped_rank_fails_the_run_within_the_bound_named(data_dir, tmp_path):
    h = start_run(two_cpu_plan(), 100_000, str(tmp_path / "stalled"), stall_timeout_s=STALL_S)
    stopped = None
    try:
        m = wait_until(lambda: (lambda m: m if len(m["steps"]) >= 2 else None)(read_metrics(h.run_dir)), 150,
                       "two steps")
        stopped = next(r["pid"] for r in m["ranks"] if r["rank"] == 1)
        os.kill(stopped, signal.SIGSTOP)
        t0 = time.time()
        m = wait_until(lambda: (lambda m: m if m["status"] != "running" else None)(read_metrics(h.run_dir)),
                       STALL_S + SLACK_S, "the watchdog to fail the run",
                       detail=lambda: read_metrics(h.run_dir)["events"][-3:])
        assert m["status"] == "failed" and m["failed_rank"] == 1, (m["status"], m["reason"])
        assert m["reason"].startswith("stalled: no progress for") and "rank 1 stalled" in m["reason"], m["reason"]
        assert "stopped (state T)" in m["reason"], m["reason"]
        stall = [e for e in m["events"] if e["kind"] == "stall"]
        assert len(stall) == 1 and stall[0]["rank"] == 1
        assert stall[0]["time_s"] - t0 >= STALL_S - 1.0  # the bound, not something sooner, ended it
        wait_until(lambda: not processes_with_data_dir(data_dir), 30, "every process of the run to end",
                   detail=lambda: processes_with_data_dir(data_dir))
    finally:
        if stopped is not None:
            with contextlib.suppress(OSError):
                os.kill(stopped, signal.SIGKILL)
        if read_metrics(h.run_dir)["status"] == "running":
            stop_run(h.run_dir, timeout_s=5)
