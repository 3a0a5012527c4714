"""DiLoCo over pipelines run by `executor launch` (torchrun, gloo, 4 CPU ranks): two groups, each a whole
2-stage pipeline of `tiny` (1 layer per stage, 2 micro-batches) on its own node, DiLoCo between them.

  * H = 1, inner SGD without clipping, outer SGD lr 1 and no momentum, fp32 exchange, groups taking 3
    and 1 rows of every micro-batch: the recorded losses (the groups' token-weighted mean) equal one
    synchronous pipeline with data parallelism 2 in each stage over the same rows, relative <= 1e-5;
  * H = 2 with inner AdamW and Nesterov momentum (a plan from to_diloco_pipeline_plan): the loss falls,
    a `diloco_sync` event after every second step with stage 0's bytes (its block in fp32 plus the tied
    embedding, exchanged with the last stage's copies);
  * `--emulate-wan` (root, network namespaces): the two groups as two datacenters, 50 Mbit/s apart.
"""
from dataclasses import replace

import pytest

from contracts.cluster import ClusterSpec, DeviceSpec, NodeSpec
from contracts.plan import Assignment, DilocoSpec, PipelineSpec, PipelineStage, Plan, WanLink
from contracts.specs import get_model
from contracts.units import runtime_units
from executor import wan
from executor.launch import launch_run
from executor.store import read_events, read_metrics
from models.optim import OptimConfig
from planner.geo.diloco_plan import to_diloco_pipeline_plan

pytestmark = pytest.mark.slow

SEQ = 16
M = 2  # micro-batches per step
NODES = ("localhost", "127.0.0.1")  # two names of this machine: a plain local launch
SGD = OptimConfig(kind="sgd", lr=0.5, max_grad_norm=None, warmup_steps=0)
ADAMW = OptimConfig(lr=3e-3, warmup_steps=0)


def cluster(names: tuple[str, str]) -> ClusterSpec:
    return ClusterSpec("two-dc", tuple(NodeSpec(n, n, (DeviceSpec("cpu"), DeviceSpec("cpu"))) for n in names))


def exact_plans() -> tuple[Plan, Plan]:
    """The synchronous pipeline (stage 0 on devices 0 and 2, stage 1 on 1 and 3; rows 3 and 1; fractions
    0.7 and 0.3) and the same as DiLoCo with H = 1 between the nodes (each its stages' whole state)."""
    c = cluster(NODES)
    rows = (3, 1)
    stages = (PipelineStage(0, 1, (0, 2), rows, "local"), PipelineStage(1, 1, (1, 3), rows, "local"))
    pipe = PipelineSpec("1f1b", sum(rows), M, stages)
    frac = {0: 0.7, 2: 0.3, 1: 0.7, 3: 0.3}
    asg = tuple(Assignment(i, node.name, "cpu", rows[i // 2], M, rows[i // 2] * M, frac[i], 0, 0.0)
                for i, (node, _) in enumerate(c.devices()))
    sync = Plan(c, "tiny", sum(rows) * M, SEQ, "fp32", "none", asg, 0.0, 0.0, pipeline=pipe, rebalance="off")
    spec = DilocoSpec(((NODES[0],), (NODES[1],)), 1, outer_lr=1.0, outer_momentum=0.0)
    ours = replace(sync, assignments=tuple(replace(a, shard_fraction=1.0) for a in asg), diloco=spec)
    return sync, ours


def replicated(names: tuple[str, str], inner_steps: int, wan_gbps: float | None = None) -> Plan:
    """One pipeline on names[0] (stage 0 on its device 0, stage 1 on device 1, 2 rows each), replicated
    onto names[1] by to_diloco_pipeline_plan."""
    c = cluster(names)
    asg = tuple(Assignment(i, node.name, "cpu", 2 if i < 2 else 0, M if i < 2 else 0, 2 * M if i < 2 else 0,
                           1.0 if i < 2 else 0.0, 0, 0.0) for i, (node, _) in enumerate(c.devices()))
    stages = (PipelineStage(0, 1, (0,), (2,), names[0]), PipelineStage(1, 1, (1,), (2,), names[0]))
    links = (WanLink(names[0], names[1], wan_gbps, 40.0),) if wan_gbps is not None else ()
    one = Plan(c, "tiny", 2 * M, SEQ, "fp32", "none", asg, 0.0, 0.0, pipeline=PipelineSpec("1f1b", 2, M, stages),
               wan=links)
    return to_diloco_pipeline_plan(one, [[names[0]], [names[1]]], inner_steps)


def losses(run: str) -> list[float]:
    return [s["loss"] for s in read_metrics(run)["steps"]]


def test_h1_over_two_pipelines_is_one_synchronous_pipeline(data_dir, tmp_path):
    sync, ours = exact_plans()
    runs = {}
    for name, plan in (("sync", sync), ("diloco", ours)):
        run = str(tmp_path / name)
        assert launch_run(plan, 4, run, seed=1, optim=SGD) == "done", read_metrics(run).get("reason")
        runs[name] = losses(run)
    ref, got = runs["sync"], runs["diloco"]
    assert len(ref) == len(got) == 4 and ref[-1] < ref[0] - 0.05, ref  # it trains: not constants compared
    rel = max(abs(a - b) / abs(b) for a, b in zip(got, ref))
    print(f"DiLoCo H=1 over 2 pipelines vs one synchronous pipeline (DP 2 per stage): max relative loss "
          f"difference {rel:.2e}")
    assert rel <= 1e-5, (got, ref)
    assert [e["step"] for e in read_events(str(tmp_path / "diloco"), ("diloco_sync",))] == [1, 2, 3, 4]


def test_h2_over_two_pipelines_trains_and_records_its_outer_steps(data_dir, tmp_path):
    run = str(tmp_path / "h2")
    plan = replicated(NODES, 2)
    assert launch_run(plan, 6, run, seed=2, optim=ADAMW) == "done", read_metrics(run).get("reason")
    got = losses(run)
    assert len(got) == 6 and got[-1] < got[0] - 0.05, got
    syncs = read_events(run, ("diloco_sync",))
    assert [e["step"] for e in syncs] == [2, 4, 6]
    # rank 0 holds stage 0: the embedding (over the tied exchange) and block 0, 4 bytes each in fp32
    numels = [u.numel for u in runtime_units(get_model("tiny"))]
    assert all(e["detail"]["payload_bytes"] == 4 * (numels[0] + numels[1]) and e["detail"]["stage"] == 0
               for e in syncs), syncs
    events = [e["message"] for e in read_metrics(run)["events"]]
    assert any("no final checkpoint: a DiLoCo run" in e for e in events), events


@pytest.mark.skipif(wan.unavailable_reason() is not None,
                    reason=f"emulated datacenters unavailable: {wan.unavailable_reason()}")
def test_two_pipelines_run_across_emulated_datacenters(data_dir, tmp_path):
    run = str(tmp_path / "wan")
    plan = replicated(("dc-a", "dc-b"), 2, wan_gbps=0.05)
    assert launch_run(plan, 4, run, optim=ADAMW, emulate_wan=True) == "done", read_metrics(run).get("reason")
    assert [e["step"] for e in read_events(run, ("diloco_sync",))] == [2, 4]
    got = losses(run)
    assert len(got) == 4 and all(0 < x < 10 for x in got), got
