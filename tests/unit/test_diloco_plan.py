"""The plan contract's `diloco` section and `cuts` (contracts/plan.py): JSON round trip, refusals
naming the bad field; planner/geo/diloco_plan.py's `to_diloco_plan` from a data-parallel plan."""
from __future__ import annotations

import json
from dataclasses import replace

import pytest

from contracts.cluster import ClusterSpec, DeviceSpec, NodeSpec
from contracts.plan import Assignment, Cut, DilocoSpec, Plan
from planner.geo.diloco_plan import to_diloco_plan


def dp_plan() -> Plan:
    """Data parallel over two datacenters: dc-a with 2 CPUs (batches 2, 1), dc-b with 1 (batch 1)."""
    cluster = ClusterSpec("two-dc", (NodeSpec("dc-a", "dc-a", (DeviceSpec("cpu"), DeviceSpec("cpu"))),
                                     NodeSpec("dc-b", "dc-b", (DeviceSpec("cpu"),))))
    pieces = [("dc-a", 2, 0.4), ("dc-a", 1, 0.2), ("dc-b", 1, 0.4)]
    asg = tuple(Assignment(i, node, "cpu", b, 1, b, f, 0, 0.0) for i, (node, b, f) in enumerate(pieces))
    return Plan(cluster, "tiny", 4, 16, "fp32", "none", asg, 0.0, 0.0)


def test_to_diloco_plan_rescales_fractions_per_group_and_names_the_cuts():
    plan = to_diloco_plan(dp_plan(), 8, outer_lr=0.5, fragments=2, compress="int8")
    assert plan.diloco == DilocoSpec((("dc-a",), ("dc-b",)), 8, outer_lr=0.5, fragments=2, compress="int8")
    assert [a.shard_fraction for a in plan.assignments] == pytest.approx([2 / 3, 1 / 3, 1.0])
    assert [a.batch for a in plan.assignments] == [2, 1, 1]
    assert plan.cuts == (Cut("dc-a", "dc-b", "diloco", 8),)
    assert plan.rebalance == "off"
    one = to_diloco_plan(dp_plan(), 3, groups=[["dc-a", "dc-b"]])
    assert one.cuts == (Cut("dc-a", "dc-b", "dp"),)
    assert [a.shard_fraction for a in one.assignments] == pytest.approx([0.4, 0.2, 0.4])


def test_diloco_plan_json_round_trip():
    plan = to_diloco_plan(dp_plan(), 4, outer_momentum=0.0, nesterov=False, compress="bf16")
    d = json.loads(plan.to_json())
    assert d["diloco"] == {"groups": [["dc-a"], ["dc-b"]], "inner_steps": 4, "outer_lr": 0.7, "outer_momentum": 0.0,
                           "nesterov": False, "fragments": 1, "compress": "bf16", "overlap": False,
                           "merge_alpha": 0.5}
    assert d["cuts"] == [{"a": "dc-a", "b": "dc-b", "kind": "diloco", "inner_steps": 4}]
    assert Plan.from_dict(d) == plan
    plain = json.loads(dp_plan().to_json())
    assert "diloco" not in plain and "cuts" not in plain  # a plan without them writes what it did


def _with(change) -> dict:
    d = json.loads(to_diloco_plan(dp_plan(), 4).to_json())
    change(d)
    return d


BAD = [
    (lambda d: d["diloco"].update(inner_steps=0), "plan: diloco: inner_steps must be an integer >= 1"),
    (lambda d: d["diloco"].update(outer_lr=-1), "plan: diloco: outer_lr must be a finite number > 0"),
    (lambda d: d["diloco"].update(outer_momentum=1.0), "outer_momentum must be below 1"),
    (lambda d: d["diloco"].update(nesterov="yes"), "nesterov must be true or false"),
    (lambda d: d["diloco"].update(fragments=5), r"fragments \(5\) must not exceed inner_steps \(4\)"),
    (lambda d: d["diloco"].update(compress="fp8"), "compress must be one of fp32, bf16, int8"),
    (lambda d: d["diloco"].update(overlap=1), "overlap must be true or false"),
    (lambda d: d["diloco"].update(overlap=True, inner_steps=1),
     "overlap needs inner_steps >= 2"),
    (lambda d: d["diloco"].update(merge_alpha=1.5), r"merge_alpha must be a finite number in \[0, 1\]"),
    (lambda d: d["diloco"].update(groups=[["dc-a"]]), "device 2 is used but its node 'dc-b' is in no group"),
    (lambda d: d["diloco"].update(groups=[["dc-a"], ["dc-a", "dc-b"]]), "node 'dc-a' is in more than one group"),
    (lambda d: d["diloco"].update(groups=[["dc-a"], ["dc-c"]]), "names node 'dc-c', which is not in the cluster"),
    (lambda d: d["diloco"].update(lr=1), r"unknown field\(s\) \['lr'\]"),
    (lambda d: d["assignments"][2].update(shard_fraction=0.5), "groups\\[1\\]'s shard fractions sum to 0.500000"),
    (lambda d: d["cuts"][0].update(kind="ring"), "kind must be one of pipeline, diloco, dp"),
    (lambda d: d["cuts"][0].update(inner_steps=2), "inner_steps 2, but the plan's diloco runs inner_steps 4"),
    (lambda d: d["cuts"][0].update(kind="dp", inner_steps=None), "kind dp, but the nodes are in different diloco"),
    (lambda d: d["cuts"][0].update(kind="pipeline", inner_steps=None), "kind pipeline, but the plan has no pipeline"),
    (lambda d: d["cuts"].append(dict(d["cuts"][0])), "named more than once"),
    (lambda d: d["cuts"][0].update(b="dc-z"), "both ends must be nodes of the cluster"),
    (lambda d: d.pop("diloco"), "kind diloco, but the plan has no diloco section"),
]


@pytest.mark.parametrize("change,message", BAD)
def test_a_bad_diloco_field_is_refused_naming_it(change, message):
    with pytest.raises(ValueError, match=message):
        Plan.from_dict(_with(change))


def test_a_non_diloco_cut_refuses_inner_steps():
    with pytest.raises(ValueError, match="inner_steps is for diloco cuts only"):
        Cut("dc-a", "dc-b", "dp", 3)


def test_to_diloco_plan_refuses_a_group_without_samples():
    plan = dp_plan()
    asg = list(plan.assignments)  # dc-b keeps its 40 % of the state but trains no sample
    asg[0] = replace(asg[0], micro_batch=3, batch=3)
    asg[2] = replace(asg[2], micro_batch=0, accum_steps=0, batch=0)
    with pytest.raises(ValueError, match="group 1 \\(dc-b\\) has no device with samples"):
        to_diloco_plan(replace(plan, assignments=tuple(asg)), 2)
