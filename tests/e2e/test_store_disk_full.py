"""A full disk under the run's own store (real processes, the tiny model, a small tmpfs mounted
here as root as the whole run folder, filled while the run trains): the launcher ends the run
cleanly (every process gone, the booking released), says "disk full" naming the store on stderr
with exit 1 and no traceback, and the steps recorded before stay readable."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from contracts.paths import PROJECT_ROOT
from executor import booking
from executor.store import DB_NAME, read_metrics
from testkit.processes import processes_with_data_dir
from testkit.runs import two_cpu_plan
from testkit.wait import wait_until

LONG = 100_000  # steps: the run trains until the disk fills


def _fill(folder: str) -> None:
    """Take every free byte of the filesystem holding `folder`."""
    fd = os.open(os.path.join(folder, "filler"), os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        for size in (1 << 20, 1 << 12, 1):
            try:
                while True:
                    os.write(fd, b"\0" * size)
            except OSError:
                pass
    finally:
        os.close(fd)


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a tmpfs needs root")
def test_a_full_disk_under_the_store_ends_the_run_cleanly_and_says_so(data_dir, tmp_path):
    plan = str(tmp_path / "plan.json")
    two_cpu_plan().save(plan)
    run_dir = str(tmp_path / "r")
    os.makedirs(run_dir)
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=48m", "tmpfs", run_dir], check=True)
    launcher = None
    try:
        launcher = subprocess.Popen([sys.executable, "-m", "executor", "launch", "--plan", plan, "--steps", str(LONG),
                                     "--run-dir", run_dir], cwd=PROJECT_ROOT, stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, text=True, stdin=subprocess.DEVNULL)
        wait_until(lambda: len(read_metrics(run_dir)["steps"]) >= 3, 150, "three steps", ignore=(ValueError,))
        _fill(run_dir)
        out, err = launcher.communicate(timeout=120)
        assert launcher.returncode == 1, out + err
        assert "Traceback" not in err, err
        line = [ln for ln in err.splitlines() if "disk full" in ln]
        assert line and f"cannot write {os.path.join(run_dir, DB_NAME)}" in line[0], err
        wait_until(lambda: not processes_with_data_dir(data_dir), 10, "every process of the run to end")
        assert booking.Ledger().live() == []

        r = subprocess.run([sys.executable, "-m", "executor", "metrics", "--run-dir", run_dir, "--json"],
                           capture_output=True, text=True, cwd=PROJECT_ROOT, timeout=60)
        assert r.returncode == 0, r.stdout + r.stderr
        m = json.loads(r.stdout)
        assert len(m["steps"]) >= 3 and [s["step"] for s in m["steps"]] == list(range(1, len(m["steps"]) + 1))
        assert m["status"] == "failed", m["status"]
        assert "disk full" in m["reason"] and DB_NAME in m["reason"], m["reason"]
    finally:
        if launcher is not None and launcher.poll() is None:
            launcher.kill()
            launcher.wait()
        subprocess.run(["umount", "-l", run_dir], check=False)
