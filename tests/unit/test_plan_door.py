"""Validation at the door: a plan file's every field checked as it is read (contracts/plan.py), and
the run folder and store checks of executor/checks.py that need no process."""
from __future__ import annotations

import json
import os

import pytest

from contracts.plan import Plan
from contracts.run import RunConfig
from executor import checks
from executor.store import MetricsStore
from testkit.runs import two_cpu_plan


def _mutated(change) -> dict:
    d = json.loads(json.dumps(two_cpu_plan().to_dict()))
    change(d)
    return d


def _asg(i: int, **kw):
    return lambda d: d["assignments"][i].update(kw)


BAD = {
    "negative micro-batch × accumulation": (_asg(0, micro_batch=-2, accum_steps=-1), "micro_batch"),
    "zero micro-batch with samples": (_asg(0, micro_batch=0, accum_steps=2, batch=0), "batches sum to 2"),
    "zero accumulation with samples": (_asg(0, accum_steps=0), "accum_steps"),
    "batch not micro × accum": (_asg(0, batch=3), "batch 3 != micro_batch 2"),
    "NaN fraction": (_asg(0, shard_fraction=float("nan")), "shard_fraction must be a finite number"),
    "negative fraction": (_asg(0, shard_fraction=-0.5), "shard_fraction"),
    "fractions not summing to 1": (_asg(0, shard_fraction=0.25), "shard fractions sum to"),
    "fractional micro-batch": (_asg(1, micro_batch=0.5, accum_steps=4, batch=2), "micro_batch"),
    "NaN slowdown": (_asg(1, slowdown=float("nan")), "slowdown"),
    "seq 0": (lambda d: d.update(seq=0), "seq must be an integer >= 1"),
    "global batch 4.5": (lambda d: d.update(global_batch=4.5), "global_batch"),
    "index beyond the cluster": (_asg(1, device_index=7), "device_index 7 is beyond the cluster"),
    "one device twice": (_asg(1, device_index=0), "more than one assignment"),
    "type not the cluster's": (_asg(1, type="A100-80GB"), "in the cluster"),
    "wrong version": (lambda d: d.update(version=2), "plan version 2"),
    "zero stage 5": (lambda d: d.update(zero=5), "zero must be one of"),
    "unknown dtype": (lambda d: d.update(dtype="fp8"), "dtype must be one of"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_a_bad_plan_entry_is_refused_naming_it(case):
    change, words = BAD[case]
    with pytest.raises(ValueError) as e:
        Plan.from_dict(_mutated(change), "p.json")
    assert words in str(e.value) and "\n" not in str(e.value)


def test_a_good_plan_and_one_without_version_are_read():
    d = two_cpu_plan().to_dict()
    assert Plan.from_dict(d) == two_cpu_plan()
    del d["version"]  # written before versions were kept
    assert Plan.from_dict(d) == two_cpu_plan()


def test_a_used_folder_is_refused_unless_resumed_or_overwritten(tmp_path):
    run_dir = str(tmp_path / "r")
    os.makedirs(run_dir)
    config = RunConfig(steps=2, run_dir=run_dir)
    checks.check_folder_reuse(config)  # empty: fine
    store = MetricsStore(run_dir)
    store.init_run(two_cpu_plan(), 2, 0, backend="gloo")
    store.finish("done")
    store.close()
    with pytest.raises(ValueError, match="holds an earlier run .metrics.: pass --resume"):
        checks.check_folder_reuse(config)
    checks.check_folder_reuse(RunConfig(steps=2, run_dir=run_dir, overwrite=True))
    checks.check_folder_reuse(RunConfig(steps=2, run_dir=run_dir, resume=True))
    other = str(tmp_path / "c")
    os.makedirs(os.path.join(other, "checkpoints", "step_000002"))
    with pytest.raises(ValueError, match="checkpoints"):
        checks.check_folder_reuse(RunConfig(steps=2, run_dir=other))


def test_overwrite_removes_the_run_state_and_nothing_else(tmp_path):
    from executor.backend import clear_run_state

    run_dir = tmp_path / "r"
    for rel in ("checkpoints/step_000002/shard_0.bin", "checkpoints/latest.json", "logs/rank0.log",
                "metrics.sqlite", "metrics.sqlite-wal", "timeline.json", "prefill_rank0.json", "notes.txt"):
        (run_dir / rel).parent.mkdir(parents=True, exist_ok=True)
        (run_dir / rel).write_text("x")
    clear_run_state(str(run_dir))
    left = sorted(str(p.relative_to(run_dir)) for p in run_dir.rglob("*"))
    assert left == ["checkpoints", "notes.txt"]  # the user's file stays; checkpoints/ may be a mount point


def _two_node_plan():
    from contracts.cluster import ClusterSpec, DeviceSpec, NodeSpec
    from contracts.plan import Assignment

    cluster = ClusterSpec("two", (NodeSpec("n1", "dc", (DeviceSpec("cpu"),)), NodeSpec("n2", "dc", (DeviceSpec("cpu"),))))
    asg = (Assignment(0, "n1", "cpu", 2, 1, 2, 0.5, 0, 0.1), Assignment(1, "n2", "cpu", 2, 1, 2, 0.5, 0, 0.1))
    return Plan(cluster, "tiny", 4, 16, "fp32", "none", asg, 0.1, 1.0)


def test_multi_node_sqlite_on_a_network_filesystem_is_refused(tmp_path, monkeypatch):
    mounts = tmp_path / "mounts"
    mounts.write_text(f"/dev/sda1 / ext4 rw 0 0\nserver:/export {tmp_path}/shared nfs4 rw 0 0\n")
    assert checks.filesystem_type(str(tmp_path / "shared" / "runs" / "r"), str(mounts)) == "nfs4"
    assert checks.filesystem_type(str(tmp_path / "local"), str(mounts)) == "ext4"
    monkeypatch.delenv("GPUMIX_DB", raising=False)
    monkeypatch.setattr(checks, "filesystem_type", lambda path: "nfs4" if "/shared/" in path else "ext4")
    plan = _two_node_plan()
    with pytest.raises(ValueError, match=r"network filesystem \(nfs4\).*GPUMIX_DB=postgresql://"):
        checks.check_store_safe(plan, str(tmp_path / "shared" / "r"))
    checks.check_store_safe(plan, str(tmp_path / "local" / "r"))  # one host's disk: SQLite is fine
    checks.check_store_safe(two_cpu_plan(), str(tmp_path / "shared" / "r"))  # one node
    monkeypatch.setenv("GPUMIX_DB", "postgresql://u@db.example/runs")
    checks.check_store_safe(plan, str(tmp_path / "shared" / "r"))  # the ranks write PostgreSQL
