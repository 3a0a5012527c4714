"""`executor launch --backend slurm --elastic` on the SLURM test cluster (testkit/slurm.py): a run
that loses node n2 mid-run goes on on n1 from its last committed checkpoint, on a plan the launcher
computed, and its losses from there are those of a separate run of that plan resumed from a copy of
the same checkpoint.

n2 is the node killed: n1, the plan's first node, hosts the batch script and the rendezvous, so
the old job's end is seen from a node that lives (the batch script's node lost is the plain
SLURM failure test_slurm.py covers); the run's devices left after the loss are n1's two."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import replace

import pytest

from contracts.plan import Plan
from contracts.run import RunConfig
from executor import checkpoint as ckpt
from executor.elastic import replan_without, resumption_after
from executor.slurm import launch_slurm, start_slurm_run
from executor.slurm_job import SlurmSettings, read_job_file
from executor.store import MetricsStore, read_metrics
from models.optim import OptimConfig
from testkit.runs import two_cpu_plan
from testkit.slurm import GRES_NAME
from testkit.wait import wait_until
from tests.e2e.test_slurm import SEED, THREE, assert_nothing_left, losses, node_plan, wait_status

STEPS = 20
EVERY = 2  # --checkpoint-every
# n2's rank (plan position 2) stops mid-save of this step's checkpoint (executor/checkpoint.py's tests-only
# pause): the checkpoint of step EVERY is committed, this one is not, and the run waits there to be killed
PAUSE_STEP = 2 * EVERY
OPTIM = OptimConfig(lr=1e-3, warmup_steps=1, max_grad_norm=0.5, min_lr_ratio=0.1, decay_steps=STEPS)
RESUME_WITHIN_S = 120.0  # the acceptance check: resumed on the node left within this of the kill


@pytest.fixture
def settings(slurm_cluster, monkeypatch):
    for k, v in slurm_cluster.env.items():
        monkeypatch.setenv(k, v)
    return SlurmSettings(gres_name=GRES_NAME)


def _events(m: dict, kind: str) -> list[dict]:
    return [e for e in m["events"] if e["kind"] == kind]


def _first_resumed_step(run_dir: str) -> dict | None:
    """The metrics once the resumed job recorded a step after its checkpoint, else None."""
    m = read_metrics(run_dir)
    resumed = _events(m, "resume")
    if not resumed:
        assert m["status"] == "running", (m["reason"], m["events"])
        return None
    after = [s for s in m["steps"] if s["step"] > resumed[-1]["step"] and s["time_s"] >= resumed[-1]["time_s"]]
    return m if after else None


def _reference_run(elastic_dir: str, step: int, old_plan: Plan, new_plan: Plan, run_dir: str,
                   settings: SlurmSettings) -> list[float]:
    """The new plan run without interruption from a copy of the elastic run's checkpoint of `step`
    (latest.json written for the plan that saved it); its losses."""
    os.makedirs(os.path.join(run_dir, ckpt.CKPT_DIR))
    shutil.copytree(ckpt.step_folder(elastic_dir, step), ckpt.step_folder(run_dir, step))
    with open(os.path.join(run_dir, ckpt.CKPT_DIR, ckpt.LATEST), "w") as fh:
        json.dump(ckpt.checkpoint_meta(old_plan, step, ckpt.step_folder(run_dir, step)), fh)
    status = launch_slurm(new_plan, STEPS, run_dir, settings, seed=SEED, resume=True, optim=OPTIM)
    m = read_metrics(run_dir)
    assert status == "done", (m["reason"], m["events"])
    assert [s["step"] for s in m["steps"]] == list(range(step + 1, STEPS + 1))
    return losses(run_dir)


@pytest.mark.parametrize("flags, words", [
    ([], "use it with --backend slurm"),
    (["--backend", "slurm"], "give --checkpoint-every N"),
])
def test_elastic_is_refused_at_the_door_off_slurm_or_without_checkpoints(tmp_path, flags, words):
    plan = tmp_path / "plan.json"
    two_cpu_plan().save(str(plan))
    run_dir = tmp_path / "run"
    r = subprocess.run([sys.executable, "-m", "executor", "launch", "--plan", str(plan), "--steps", "3", "--run-dir",
                        str(run_dir), "--elastic", *flags], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and words in r.stderr and "--elastic" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr and not os.path.exists(run_dir / "metrics.sqlite")


def test_the_replan_is_the_planners_on_the_devices_left(data_dir):
    plan = node_plan(THREE)  # batches 5, 2, 1 on n1, n1, n2
    left = replan_without(plan, {"n2"})
    assert {a.node for a in left.used} == {"n1"} and len(left.assignments) == 2
    assert sum(a.batch for a in left.used) == plan.global_batch and left.seq == plan.seq and left.model == plan.model
    assert abs(sum(a.shard_fraction for a in left.used) - 1.0) < 1e-9
    assert left.predicted_iteration_s > 0 and all(a.predicted_memory_bytes > 0 for a in left.used)  # priced
    assert "elastic replan without node(s) n2" in left.notes[-1]
    assert [a.node for a in replan_without(plan, {"n1"}).used] == ["n2"]
    with pytest.raises(ValueError, match="no node left"):
        replan_without(plan, {"n1", "n2"})


def test_a_node_lost_before_the_first_checkpoint_ends_the_run_naming_it(tmp_path):
    plan, run_dir = node_plan(THREE), str(tmp_path / "run")
    os.makedirs(run_dir)
    store = MetricsStore(run_dir)
    try:
        store.init_run(plan, STEPS, SEED, backend="gloo")
        with pytest.raises(ValueError, match="no checkpoint committed yet"):
            resumption_after(store, plan, RunConfig(steps=STEPS, run_dir=run_dir, checkpoint_every=EVERY),
                             [("n2", "SLURM reports node n2 DOWN")])
    finally:
        store.close()
    (lost,) = _events(read_metrics(run_dir), "node_lost")
    assert lost["detail"] == {"node": "n2", "reason": "SLURM reports node n2 DOWN", "ranks": [2]}
    assert not _events(read_metrics(run_dir), "replan")


@pytest.mark.slow
def test_a_run_that_loses_a_node_resumes_on_the_node_left_from_its_last_checkpoint(slurm_cluster, settings,
                                                                                   tmp_path, monkeypatch):
    plan = replace(node_plan(THREE), rebalance="off")  # the split stays the plan's: the comparison is plan to plan
    # the launcher, sbatch (--export=ALL) and the ranks inherit it; the resumed job has no position 2
    monkeypatch.setenv(ckpt.ENV_TEST_PAUSE, f"{PAUSE_STEP}:2")
    run_dir = start_slurm_run(plan, STEPS, str(tmp_path / "elastic"), replace(settings, elastic=True), seed=SEED,
                              checkpoint_every=EVERY, optim=OPTIM).run_dir
    monkeypatch.delenv(ckpt.ENV_TEST_PAUSE)
    paused = os.path.join(ckpt.step_folder(run_dir, PAUSE_STEP) + ckpt.TMP_SUFFIX, "paused_2")
    try:
        wait_until(lambda: os.path.exists(paused), 120, f"n2's rank paused in the save of step {PAUSE_STEP}",
                   interval_s=0.2, detail=lambda: read_metrics(run_dir)["events"])
        assert ckpt.latest(run_dir)["step"] == EVERY
        slurm_cluster.kill_node("n2")
        killed = time.monotonic()
        m = wait_until(lambda: _first_resumed_step(run_dir), 2 * RESUME_WITHIN_S, "a step of the resumed job",
                       interval_s=0.3, ignore=(ValueError,), detail=lambda: read_metrics(run_dir)["events"])
        resumed_s = time.monotonic() - killed
        print(f"\nkilled n2 -> first step of the resumed job: {resumed_s:.1f} s")
        assert resumed_s <= RESUME_WITHIN_S, (resumed_s, m["events"])
        m = wait_status(run_dir, 180)
        assert m["status"] == "done", (m["reason"], m["events"])
        assert_nothing_left(slurm_cluster, run_dir)
    finally:
        slurm_cluster.revive_node("n2")

    (lost,), (replan,), (resume,) = _events(m, "node_lost"), _events(m, "replan"), _events(m, "resume")
    step = resume["step"]
    assert step == EVERY, step  # the last committed checkpoint, not the save cut short by the kill
    assert lost["detail"]["node"] == "n2" and lost["detail"]["ranks"] == [2], lost
    assert "n2" in lost["message"] and lost["step"] >= step
    assert replan["step"] == step and replan["detail"]["lost_nodes"] == ["n2"]
    assert [p["node"] for p in replan["detail"]["old"]] == ["n1", "n1", "n2"]
    kinds = [e["kind"] for e in m["events"]]
    assert kinds.index("node_lost") < kinds.index("replan") < kinds.index("resume")

    # the plan it went on with: computed by the launcher, on n1 alone, the whole global batch
    new_plan = Plan.load(os.path.join(run_dir, "plan.json"))
    assert {a.node for a in new_plan.used} == {"n1"} and sum(a.batch for a in new_plan.used) == plan.global_batch
    assert abs(sum(a.shard_fraction for a in new_plan.used) - 1.0) < 1e-9
    assert [(a.device_index, a.batch, a.shard_fraction) for a in new_plan.used] == [
        (p["device_index"], p["batch"], p["shard_fraction"]) for p in replan["detail"]["new"]]
    assert m["world_size"] == len(new_plan.used) and {r["node"] for r in m["ranks"]} == {"n1"}
    assert read_job_file(run_dir)["nodes"] == ["n1"]
    assert len({e["message"].split()[2] for e in _events(m, "slurm_job")}) == 2  # two SLURM jobs

    # every step once: those after the checkpoint are the resumed job's, not the first job's too
    assert [s["step"] for s in m["steps"]] == list(range(1, STEPS + 1))
    assert all(s["time_s"] >= resume["time_s"] for s in m["steps"] if s["step"] > step)
    elastic = [s["loss"] for s in m["steps"] if s["step"] > step]
    reference = _reference_run(run_dir, step, plan, new_plan, str(tmp_path / "reference"), settings)
    assert len(elastic) == len(reference) == STEPS - step
    worst = max(abs(a - b) / abs(b) for a, b in zip(elastic, reference))
    print(f"resumed at step {step}: {len(elastic)} losses against the reference run's, largest relative "
          f"difference {worst:.3g}")
    assert worst <= 1e-5, (elastic, reference)
    slurm_cluster.wait_no_jobs()
