"""A mixed gang through the orchestrator: on a machine whose free devices are one whole-core CPU and
one 1/3-core CPU (two cgroup kinds), a queued job is started by the `frenzy` policy on both kinds at
once, planned on exactly those devices with the uneven split and shards its option was priced with,
each rank in its own kind's cgroup, and it trains exactly like one rank of the same global batch,
seed and steps."""
from __future__ import annotations

import json
import os

import pytest

from contracts.cluster import ClusterSpec
from contracts.plan import Plan
from executor.launch import EMULATION_FILE, launch_run
from executor.orchestrator import Orchestrator, gang_mismatch
from executor.queue import JobQueue
from executor.store import read_metrics
from planner.entry import plan_on_devices
from planner.schedule.frenzy import FrenzyPolicy
from planner.schedule.state import ClusterState
from profiler import cgroups
from testkit.runs import one_cpu_rank_plan, run_losses
from testkit.wait import wait_until

needs_cgroups = pytest.mark.skipif(cgroups.unavailable_reason() is not None,
                                   reason=f"cgroups unavailable: {cgroups.unavailable_reason()}")

WHOLE, THIRD = {"type": "cpu", "cpu_share": 1.0}, {"type": "cpu", "cpu_share": 0.333}
TWO_KINDS = ClusterSpec.from_dict({"name": "local-two-kinds",
                                   "nodes": [{"name": "localhost", "datacenter": "local", "gpus": [WHOLE, THIRD]}],
                                   "network": {"intra_node_gbps": 40, "inter_node_gbps": 10}})
# the gang is predicted ~1.3x faster than the whole core alone: frenzy's pick (within 1.25x of the fastest)
GLOBAL_BATCH, SEQ, STEPS = 32, 128, 3


def test_the_gang_planned_on_its_devices_is_the_split_it_was_priced_with():
    from dataclasses import replace

    job = JobQueue().get(JobQueue().submit("tiny", GLOBAL_BATCH, STEPS, seq=SEQ)).job_spec()
    [decision] = FrenzyPolicy(TWO_KINDS, "fp32", mixed=True).decide(0.0, [job], ClusterState(TWO_KINDS).free_counts(),
                                                                     [])
    option = decision.option
    assert option.is_mixed and sorted(d.cpu_share for d, _ in option.parts) == [0.333, 1.0]
    plan, used = plan_on_devices(TWO_KINDS, (0, 1), "tiny", GLOBAL_BATCH, seq=SEQ, dtype="fp32", name="gang")
    assert used == (0, 1) and gang_mismatch(plan, option) is None
    a, b = plan.assignments
    swapped = replace(plan, assignments=(replace(a, micro_batch=b.micro_batch, accum_steps=b.accum_steps,
                                                 batch=b.batch), replace(b, micro_batch=a.micro_batch,
                                                                         accum_steps=a.accum_steps, batch=a.batch)))
    assert "priced as" in gang_mismatch(swapped, option)


@needs_cgroups
def test_a_mixed_gang_starts_on_two_kinds_and_trains_like_one_rank(tmp_path, caplog):
    pytest.importorskip("torch")
    q = JobQueue()
    job_id = q.submit("tiny", GLOBAL_BATCH, STEPS, seq=SEQ)
    orch = Orchestrator(q, TWO_KINDS)
    with caplog.at_level("WARNING", logger="executor.orchestrator"):
        assert orch.tick().started == [job_id]
    # planned on its devices, the plan is the split its option was priced with (gang_mismatch)
    assert not [r.message for r in caplog.records if "mixed gang" in r.message]
    job = q.get(job_id)
    assert sorted(job.devices) == [0, 1] and len(set(job.device_labels)) == 2, job.device_labels

    def ended() -> bool:
        if q.get(job_id).state == "running":
            orch.tick()
            return False
        return True

    wait_until(ended, 120, "the mixed gang's run to end", interval_s=0.5, detail=lambda: q.get(job_id).reason)
    job = q.get(job_id)
    assert job.state == "done", job.reason
    m = read_metrics(job.run_dir)
    assert m["world_size"] == 2 and len(m["steps"]) == STEPS
    # the plan is uneven: the whole core takes more samples and more of the state than the third
    plan = Plan.load(os.path.join(job.run_dir, "plan.json"))
    devices = plan.cluster.devices()
    split = sorted((devices[a.device_index][1].cpu_share, a.batch, a.shard_fraction) for a in plan.assignments)
    assert [s for s, _, _ in split] == [0.333, 1.0], split
    (_, b_third, f_third), (_, b_whole, f_whole) = split
    assert b_whole > b_third and f_whole > f_third and b_whole + b_third == GLOBAL_BATCH, split
    # each rank ran in its own cgroup, under its own kind's CPU quota
    table = json.load(open(os.path.join(job.run_dir, EMULATION_FILE)))
    assert table["mode"] == "cgroup" and len({r["cpu_cgroup"] for r in table["ranks"]}) == 2, table
    emulation = " ".join(e["message"] for e in m["events"] if e["kind"] == "emulation")
    assert "CPU quota 0.333 of a core" in emulation and "CPU quota 1 of a core" in emulation, emulation
    one = str(tmp_path / "one")
    assert launch_run(one_cpu_rank_plan("tiny", GLOBAL_BATCH, SEQ), STEPS, one) == "done", read_metrics(one)["reason"]
    gang, ref = run_losses(job.run_dir), run_losses(one)
    assert len(gang) == len(ref) == STEPS
    for a, b in zip(ref, gang):
        assert abs(a - b) / abs(a) <= 1e-5, (ref, gang)
