"""A mixed gang on the SLURM test cluster (testkit/slurm.py): the scheduler's option of two whole-core
CPUs on n1 and one 1/3-core CPU on n2 (two device kinds, planner/schedule/mixed.py), planned on
exactly those devices with the uneven split and shards it was priced with, runs as one
heterogeneous SLURM job (one component per node: they ask different GRES counts) and trains exactly
like one rank of the same global batch, seed and steps."""
from __future__ import annotations

import pytest

from contracts.cluster import ClusterSpec
from contracts.jobs import JobSpec
from contracts.plan import Plan
from executor.launch import launch_run
from executor.orchestrator import gang_mismatch
from executor.slurm import launch_slurm
from executor.slurm_job import SlurmSettings, read_job_file
from executor.store import read_metrics
from models.optim import OptimConfig
from planner.entry import plan_on_devices
from planner.schedule.mixed import estimate_mixed_option
from planner.schedule.options import cluster_pools
from testkit.runs import one_cpu_rank_plan, run_losses
from testkit.slurm import GRES_NAME

pytestmark = pytest.mark.slow

SEQ, SEED, STEPS, GLOBAL_BATCH = 64, 7, 3, 32
OPTIM = OptimConfig(lr=1e-3, warmup_steps=1, max_grad_norm=0.5, min_lr_ratio=0.1, decay_steps=STEPS)
# the test cluster's nodes (n1: 2 cpu GRES, n2: 1), n2's device a third of a core
GANG = ClusterSpec.from_dict({"name": "slurm-two-kinds", "nodes": [
    {"name": "n1", "datacenter": "slurm", "gpus": [{"type": "cpu"}, {"type": "cpu"}]},
    {"name": "n2", "datacenter": "slurm", "gpus": [{"type": "cpu", "cpu_share": 0.333}]}],
    "network": {"intra_node_gbps": 40, "inter_node_gbps": 10}})


@pytest.fixture
def settings(slurm_cluster, monkeypatch):
    for k, v in slurm_cluster.env.items():
        monkeypatch.setenv(k, v)
    return SlurmSettings(gres_name=GRES_NAME)


def gang_plan() -> Plan:
    """The scheduler's mixed option (2 whole CPUs + 1 third), planned on its devices."""
    whole, third = cluster_pools(GANG)
    option = estimate_mixed_option(JobSpec("gang", "tiny", GLOBAL_BATCH, SEQ, 1, 0.0), ((whole, 2), (third, 1)),
                                   "fp32")
    assert option is not None and option.is_mixed
    plan, used = plan_on_devices(GANG, (0, 1, 2), "tiny", GLOBAL_BATCH, seq=SEQ, dtype="fp32", name=GANG.name)
    assert used == (0, 1, 2) and gang_mismatch(plan, option) is None, gang_mismatch(plan, option)
    return plan


def test_a_mixed_gang_runs_as_a_heterogeneous_job_and_trains_like_one_rank(slurm_cluster, settings, tmp_path):
    plan = gang_plan()
    batches = sorted(a.batch for a in plan.assignments)
    assert batches[0] < batches[-1] and sum(batches) == GLOBAL_BATCH  # uneven: the third takes less
    gang = str(tmp_path / "gang")
    status = launch_slurm(plan, STEPS, gang, settings, seed=SEED, optim=OPTIM)
    m = read_metrics(gang)
    assert status == "done", (m["reason"], m["events"])
    # one SLURM job of two components (n1 asks 2 GRES, n2 one): a heterogeneous job
    [submitted] = [e["message"] for e in m["events"] if e["kind"] == "slurm_job"]
    assert f"n1 {GRES_NAME}:cpu:2 : n2 {GRES_NAME}:cpu:1" in submitted, submitted
    assert read_job_file(gang)["nodes"] == ["n1", "n2"]
    assert sorted(r["node"] for r in m["ranks"]) == ["n1", "n1", "n2"]
    one = str(tmp_path / "one")
    assert launch_run(one_cpu_rank_plan("tiny", GLOBAL_BATCH, SEQ), STEPS, one, seed=SEED, optim=OPTIM) == "done", read_metrics(one)["reason"]
    ref, got = run_losses(one), run_losses(gang)
    assert len(ref) == len(got) == STEPS
    for a, b in zip(ref, got):
        assert abs(a - b) / abs(a) <= 1e-5, (ref, got)
    slurm_cluster.wait_no_jobs()
