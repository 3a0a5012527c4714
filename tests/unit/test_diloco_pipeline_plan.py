"""DiLoCo over pipelines in the plan contract (contracts/plan.py): a plan whose diloco groups each hold a
whole pipeline of the plan's stages is accepted and round-trips through JSON; one that is not is refused
naming the group and the stage. planner/geo/diloco_plan.py's `to_diloco_pipeline_plan` replicates a
pipeline on two datacenters onto two more (4 DCs: two pipelines of 2 stages, DiLoCo between them)."""
from __future__ import annotations

import json

import pytest

from contracts.cluster import ClusterSpec, DeviceSpec, NodeSpec
from contracts.plan import Assignment, Cut, DilocoSpec, PipelineSpec, PipelineStage, Plan
from planner.geo.diloco_plan import to_diloco_pipeline_plan

DCS = ("dc-a", "dc-b", "dc-c", "dc-d")
M = 2  # micro-batches per step


def cluster(devices_per_dc: tuple[int, ...] = (2, 1, 2, 1)) -> ClusterSpec:
    return ClusterSpec("four-dc", tuple(NodeSpec(n, n, tuple(DeviceSpec("cpu") for _ in range(k)))
                                        for n, k in zip(DCS, devices_per_dc)))


def one_pipeline() -> Plan:
    """Stage 0 (1 layer of tiny) on dc-a's 2 CPUs (rows 2 and 1, fractions 0.6 and 0.4), stage 1 on
    dc-b's CPU (rows 3); dc-c and dc-d idle."""
    c = cluster()
    rows = {0: (2, 0.6, 0), 1: (1, 0.4, 0), 2: (3, 1.0, 1)}
    asg = []
    for i, (node, _) in enumerate(c.devices()):
        r, f, s = rows.get(i, (0, 0.0, None))
        asg.append(Assignment(i, node.name, "cpu", r, M if r else 0, r * M, f, 0, 0.0, stage=s))
    stages = (PipelineStage(0, 1, (0, 1), (2, 1), "dc-a"), PipelineStage(1, 1, (2,), (3,), "dc-b"))
    return Plan(c, "tiny", 3 * M, 16, "fp32", "none", tuple(asg), 1.0, 6.0, pipeline=PipelineSpec("1f1b", 3, M, stages))


def two_pipelines(**kw) -> Plan:
    return to_diloco_pipeline_plan(one_pipeline(), [["dc-a", "dc-b"], ["dc-c", "dc-d"]], 4, **kw)


def test_replicating_a_pipeline_over_two_groups_of_datacenters():
    plan = two_pipelines(compress="int8")
    assert plan.diloco == DilocoSpec((("dc-a", "dc-b"), ("dc-c", "dc-d")), 4, compress="int8")
    assert plan.global_batch == 2 * 3 * M and plan.pipeline.micro_batch == 6
    assert [st.devices for st in plan.pipeline.stages] == [(0, 1, 3, 4), (2, 5)]
    assert [st.rows for st in plan.pipeline.stages] == [(2, 1, 2, 1), (3, 3)]
    assert [(a.node, a.batch, a.shard_fraction, a.stage) for a in plan.assignments] == [
        ("dc-a", 4, 0.6, 0), ("dc-a", 2, 0.4, 0), ("dc-b", 6, 1.0, 1),
        ("dc-c", 4, 0.6, 0), ("dc-c", 2, 0.4, 0), ("dc-d", 6, 1.0, 1)]
    kinds = {(c.a, c.b): c.kind for c in plan.cuts}
    assert kinds[("dc-a", "dc-b")] == kinds[("dc-c", "dc-d")] == "pipeline"
    assert kinds[("dc-a", "dc-c")] == kinds[("dc-b", "dc-d")] == kinds[("dc-a", "dc-d")] == "diloco"
    assert all(c.inner_steps == 4 for c in plan.cuts if c.kind == "diloco")
    # each group's own pipeline: its devices and rows, and where its rows start in every micro-batch
    sub, offset = plan.diloco_pipeline(1)
    assert (offset, sub.micro_batch, sub.num_microbatches) == (3, 3, M)
    assert [(st.devices, st.rows, st.datacenter) for st in sub.stages] == [((3, 4), (2, 1), "dc-c"),
                                                                          ((5,), (3,), "dc-d")]
    assert plan.diloco_pipeline(0)[1] == 0


def test_pipeline_diloco_plan_json_round_trip():
    plan = two_pipelines(outer_momentum=0.0, nesterov=False)
    d = json.loads(plan.to_json())
    assert d["diloco"]["groups"] == [["dc-a", "dc-b"], ["dc-c", "dc-d"]]
    assert d["pipeline"]["stages"][0]["devices"] == [0, 1, 3, 4]
    assert Plan.from_dict(d) == plan


def _with(change) -> dict:
    d = json.loads(two_pipelines().to_json())
    change(d)
    return d


def _stage(d: dict, s: int) -> dict:
    return d["pipeline"]["stages"][s]


def _asg(d: dict, i: int) -> dict:
    return d["assignments"][i]


def _cut(d: dict, a: str, b: str) -> dict:
    return next(c for c in d["cuts"] if (c["a"], c["b"]) == (a, b))


def _regroup(d: dict) -> None:
    """Group 1 also takes dc-b: group 0 then holds no device of stage 1."""
    d["diloco"]["groups"] = [["dc-a"], ["dc-b", "dc-c", "dc-d"]]
    d["cuts"] = []


def _order(d: dict) -> None:
    _stage(d, 0).update(devices=[0, 3, 1, 4], rows=[2, 2, 1, 1])


def _rows(d: dict) -> None:
    """Group 0 passes 2 rows through stage 0 and 4 through stage 1 (the micro-batch still 6 rows)."""
    _stage(d, 0)["rows"] = [1, 1, 2, 2]
    _stage(d, 1)["rows"] = [4, 2]
    for i, r in ((0, 1), (1, 1), (2, 4), (3, 2), (4, 2), (5, 2)):
        _asg(d, i).update(micro_batch=r, batch=r * M)


def _fractions(d: dict) -> None:
    _asg(d, 3)["shard_fraction"] = 0.5


BAD = [
    (_regroup, r"groups\[0\] \(dc-a\) has no device in pipeline stage 1: every group holds a whole pipeline"),
    (_order, r"pipeline stage 0 lists its devices in groups \[0, 1, 0, 1\]"),
    (_rows, r"groups\[0\] takes 2 rows of every micro-batch in pipeline stage 0 but 4 in stage 1"),
    (_fractions, r"groups\[1\]'s shard fractions in pipeline stage 0 sum to 0.900000, not 1"),
    (lambda d: d["diloco"].update(fragments=2), "fragments 2 with a pipeline"),
    (lambda d: _cut(d, "dc-a", "dc-b").update(kind="dp"), None),  # inside group 0: dp is allowed there
    (lambda d: _cut(d, "dc-a", "dc-c").update(kind="pipeline", inner_steps=None),
     "kind pipeline, but the nodes are in different diloco groups"),
]


@pytest.mark.parametrize("change,message", BAD)
def test_a_pipeline_diloco_plan_that_is_not_whole_pipelines_is_refused(change, message):
    d = _with(change)
    if message is None:
        Plan.from_dict(d)
        return
    with pytest.raises(ValueError, match=message):
        Plan.from_dict(d)


def test_to_diloco_pipeline_plan_refusals():
    with pytest.raises(ValueError, match="has no pipeline"):
        to_diloco_pipeline_plan(Plan(cluster(), "tiny", 1, 16, "fp32", "none",
                                     tuple(Assignment(i, n.name, "cpu", 1 if i == 0 else 0, 1 if i == 0 else 0,
                                                      1 if i == 0 else 0, 1.0 if i == 0 else 0.0, 0, 0.0)
                                           for i, (n, _) in enumerate(cluster().devices())), 0.0, 0.0),
                                [["dc-a"], ["dc-c"]], 2)
    with pytest.raises(ValueError, match=r"group 1's node 'dc-d' has no cpu device 0"):
        plan = one_pipeline()
        c = cluster((2, 1, 2, 0))
        to_diloco_pipeline_plan(Plan(c, plan.model, plan.global_batch, plan.seq, "fp32", "none",
                                     plan.assignments[:5], 1.0, 1.0, pipeline=plan.pipeline),
                                [["dc-a", "dc-b"], ["dc-c", "dc-d"]], 2)
    with pytest.raises(ValueError, match=r"used outside group 0's nodes"):
        to_diloco_pipeline_plan(one_pipeline(), [["dc-c", "dc-d"], ["dc-a", "dc-b"]], 2)
    with pytest.raises(ValueError, match="at least 2 groups of as many nodes"):
        to_diloco_pipeline_plan(one_pipeline(), [["dc-a", "dc-b"], ["dc-c"]], 2)
