"""`executor launch` at the door (real processes, the tiny model): a bad plan entry refused with
exit 2 and one line before anything runs or is written; a used run folder refused without
--resume / --overwrite; keep-last-N checkpoints; a finished run without --checkpoint-every
keeps its final checkpoint, which `executor export` writes as a Hugging Face folder."""
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


def executor(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "executor", *args], capture_output=True, text=True, cwd=ROOT,
                          timeout=timeout)


def _plan_file(tmp_path, change=None) -> str:
    d = json.loads(json.dumps(two_cpu_plan().to_dict()))
    if change is not None:
        change(d)
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(d))  # NaN written as the bare NaN json.load accepts
    return str(path)


def _asg(i: int, **kw):
    return lambda d: d["assignments"][i].update(kw)


@pytest.mark.parametrize("change, words", [
    (_asg(1, micro_batch=-1, accum_steps=-2), "micro_batch"),
    (_asg(0, shard_fraction=float("nan")), "shard_fraction must be a finite number"),
    (_asg(0, shard_fraction=-0.5, batch=2), "shard_fraction"),
    (lambda d: d.update(seq=0), "seq must be an integer >= 1"),
    (_asg(1, device_index=9), "beyond the cluster"),
    (lambda d: d.update(version=7), "plan version 7"),
], ids=["negative-pair", "nan-fraction", "negative-fraction", "seq-0", "index-beyond", "version"])
def test_a_bad_plan_is_refused_before_any_rank_starts(tmp_path, change, words):
    run_dir = tmp_path / "r"
    r = executor("launch", "--plan", _plan_file(tmp_path, change), "--steps", "2", "--run-dir", str(run_dir))
    assert r.returncode == 2, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and words in r.stderr and "Traceback" not in r.stderr
    # no run folder: no store, no logs/rank*.log, no torchrun.log; refused before any rank (or torchrun) began
    assert not run_dir.exists()


def _launch(tmp_path, run_dir, *flags: str) -> subprocess.CompletedProcess:
    return executor("launch", "--plan", _plan_file(tmp_path), "--run-dir", str(run_dir), *flags)


def test_a_finished_run_keeps_its_final_checkpoint_a_used_folder_needs_resume_or_overwrite(tmp_path):
    run_dir = tmp_path / "r"
    r = _launch(tmp_path, run_dir, "--steps", "2")  # no --checkpoint-every
    assert r.returncode == 0, r.stdout + r.stderr
    assert ckpt.latest(str(run_dir))["step"] == 2
    out = tmp_path / "hf"
    r = executor("export", "--run-dir", str(run_dir), "--out", str(out), "--json")
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout)
    assert got["step"] == 2 and "config.json" in got["files"] and "model.safetensors" in got["files"]

    # the same folder again, neither resumed nor overwritten: refused before anything changes
    before = sorted(os.listdir(run_dir / "checkpoints"))
    r = _launch(tmp_path, run_dir, "--steps", "4", "--checkpoint-every", "1")
    assert r.returncode == 2 and "holds an earlier run" in r.stderr and "--overwrite" in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1
    assert sorted(os.listdir(run_dir / "checkpoints")) == before
    assert [s["step"] for s in read_metrics(str(run_dir))["steps"]] == [1, 2]

    # --overwrite: the earlier run's checkpoints and metrics are gone; keep-last-2 prunes as it goes
    r = _launch(tmp_path, run_dir, "--steps", "4", "--checkpoint-every", "1", "--keep-checkpoints", "2",
                "--overwrite")
    assert r.returncode == 0, r.stdout + r.stderr
    m = read_metrics(str(run_dir))
    assert m["status"] == "done" and [s["step"] for s in m["steps"]] == [1, 2, 3, 4]
    assert ckpt.saved_steps(str(run_dir)) == [3, 4] and ckpt.latest(str(run_dir))["step"] == 4

    # --resume continues it (the steps stay one run's, never spliced with another's)
    r = _launch(tmp_path, run_dir, "--steps", "5", "--resume", "--keep-checkpoints", "2")
    assert r.returncode == 0, r.stdout + r.stderr
    assert [s["step"] for s in read_metrics(str(run_dir))["steps"]] == [1, 2, 3, 4, 5]
    assert ckpt.saved_steps(str(run_dir)) == [4, 5]


def test_a_started_launcher_takes_the_folder_its_starter_prepared_and_a_second_start_is_refused(tmp_path):
    from executor.launch import start_run

    run_dir = str(tmp_path / "started")
    h = start_run(two_cpu_plan(), 2, run_dir)  # the starter writes the run row before the launcher runs
    assert h.wait(timeout_s=240) == "done", read_metrics(run_dir)["reason"]
    assert ckpt.latest(run_dir)["step"] == 2
    with pytest.raises(ValueError, match="holds an earlier run"):
        start_run(two_cpu_plan(), 2, run_dir)
    assert read_metrics(run_dir)["status"] == "done"
