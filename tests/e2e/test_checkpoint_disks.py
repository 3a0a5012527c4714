"""A full disk at a checkpoint (real processes, the tiny model, a small tmpfs as the run's
checkpoints/ folder, mounted here as root): the run fails with a reason naming the disk and the
folder, never a traceback, and once room is made the previous checkpoint resumes the run."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from executor import checkpoint as ckpt
from executor.store import read_metrics
from testkit.runs import two_cpu_plan

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _launch(plan_path: str, run_dir: str, *flags: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "executor", "launch", "--plan", plan_path, "--run-dir", run_dir,
                           *flags], capture_output=True, text=True, cwd=ROOT, timeout=300)


def _mount(path: str, size_mib: int, remount: bool = False) -> None:
    opts = f"remount,size={size_mib}m" if remount else f"size={size_mib}m"
    subprocess.run(["mount", "-t", "tmpfs", "-o", opts, "tmpfs", path], check=True)


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a tmpfs needs root")
def test_a_full_disk_fails_the_run_by_name_and_the_previous_checkpoint_resumes(tmp_path):
    plan = two_cpu_plan()
    plan_path = str(tmp_path / "plan.json")
    plan.save(plan_path)
    run_dir = str(tmp_path / "r")
    folder = os.path.join(run_dir, ckpt.CKPT_DIR)
    os.makedirs(folder)
    need_mib = ckpt.checkpoint_bytes(plan) / 2**20
    size = int(need_mib) + 1  # room for the first checkpoint, not for a second beside it
    assert (size - 1.5) < need_mib < size, need_mib
    _mount(folder, size)
    try:
        r = _launch(plan_path, run_dir, "--steps", "4", "--checkpoint-every", "2", "--json")
        assert r.returncode == 1, r.stdout + r.stderr
        assert "Traceback" not in r.stderr
        m = json.loads(r.stdout)
        assert m["status"] == "failed", m
        assert "disk full" in m["reason"] and folder in m["reason"] and "step 4" in m["reason"], m["reason"]
        assert ckpt.latest(run_dir)["step"] == 2 and ckpt.saved_steps(run_dir) == [2]

        _mount(folder, size * 3, remount=True)  # room made: resume from the step-2 checkpoint
        r = _launch(plan_path, run_dir, "--steps", "4", "--checkpoint-every", "2", "--resume")
        assert r.returncode == 0, r.stdout + r.stderr
        m = read_metrics(run_dir)
        assert m["status"] == "done" and [s["step"] for s in m["steps"]] == [1, 2, 3, 4]
        assert ckpt.latest(run_dir)["step"] == 4
    finally:
        subprocess.run(["umount", folder], check=True)
