"""The plan file's pipeline section (contracts/plan.py): what it accepts and what it refuses."""
from __future__ import annotations

import pytest

from contracts.cluster import ClusterSpec
from contracts.plan import Assignment, PipelineSpec, PipelineStage, Plan, WanLink, link_key


def _cluster() -> ClusterSpec:
    return ClusterSpec.from_dict({"name": "two-dc", "nodes": [
        {"name": "dc-a", "datacenter": "dc-a", "gpus": {"cpu": 2}},
        {"name": "dc-b", "datacenter": "dc-b", "gpus": {"cpu": 1}}]})


def _plan(rows=(2, 2), m=4, layers=(3, 1), fractions=(0.5, 0.5)) -> Plan:
    mb = sum(rows)
    assignments = (
        Assignment(0, "dc-a", "cpu", rows[0], m, rows[0] * m, fractions[0], 0, 0.0),
        Assignment(1, "dc-a", "cpu", rows[1], m, rows[1] * m, fractions[1], 0, 0.0),
        Assignment(2, "dc-b", "cpu", mb, m, mb * m, 1.0, 0, 0.0),
    )
    pipe = PipelineSpec("1f1b", mb, m, (PipelineStage(0, layers[0], (0, 1), tuple(rows), "dc-a"),
                                        PipelineStage(layers[0], layers[1], (2,), (mb,), "dc-b")))
    return Plan(_cluster(), "small", mb * m, 64, "fp32", "none", assignments, 1.0, mb * m, pipeline=pipe,
                connections={link_key("dc-b", "dc-a"): 4}, wan=(WanLink("dc-a", "dc-b", 0.05, 30.0),))


def test_a_pipeline_plan_round_trips_through_json():
    p = _plan()
    q = Plan.from_dict(p.to_dict())
    assert q == p
    assert q.pipeline.stage_of(1) == (0, 1) and q.pipeline.stage_of(2) == (1, 0)
    assert q.connections == {"dc-a|dc-b": 4} and q.wan == (WanLink("dc-a", "dc-b", 0.05, 30.0),)
    assert "pipeline" not in Plan.from_dict({k: v for k, v in p.to_dict().items() if k != "pipeline"} | {
        "assignments": [a.to_dict() | {"batch": 4, "micro_batch": 1} for a in p.assignments[:2]]
        + [p.assignments[2].to_dict() | {"batch": 0, "micro_batch": 0, "shard_fraction": 0.0, "accum_steps": 0}],
        "global_batch": 8}).to_dict()


def test_a_stage_whose_shard_fractions_do_not_sum_to_one_is_refused():
    with pytest.raises(ValueError, match="stage 0: shard fractions"):
        _plan(fractions=(0.5, 0.4))


def test_rows_must_sum_to_the_micro_batch_and_match_the_assignments():
    p = _plan().to_dict()
    p["pipeline"]["stages"][0]["rows"] = [3, 2]
    with pytest.raises(ValueError, match=r"rows \[3, 2\] must be positive and sum to the micro-batch 4"):
        Plan.from_dict(p)
    p["pipeline"]["stages"][0]["rows"] = [3, 1]
    with pytest.raises(ValueError, match="device 0 of pipeline stage 0 must have micro_batch 3"):
        Plan.from_dict(p)


def test_stages_must_cover_the_layers_in_order():
    p = _plan().to_dict()
    p["pipeline"]["stages"][1]["first_layer"] = 2
    with pytest.raises(ValueError, match="must start at 3"):
        Plan.from_dict(p)


def test_a_stage_without_layers_is_refused():
    p = _plan().to_dict()
    p["pipeline"]["stages"][0]["num_layers"] = 0
    p["pipeline"]["stages"][1]["first_layer"] = 0
    with pytest.raises(ValueError, match="stage 0 has no layers"):
        Plan.from_dict(p)


def test_a_links_per_connection_rate_round_trips_and_must_be_positive():
    p = _plan().to_dict()
    p["wan"][0]["per_connection_gbps"] = 0.01
    assert Plan.from_dict(p).wan[0].per_connection_gbps == 0.01
    assert Plan.from_dict(p).to_dict()["wan"][0]["per_connection_gbps"] == 0.01
    p["wan"][0]["per_connection_gbps"] = -1
    with pytest.raises(ValueError, match="per_connection_gbps > 0"):
        Plan.from_dict(p)


def test_a_device_in_two_stages_or_none_is_refused():
    p = _plan().to_dict()
    p["pipeline"]["stages"][1]["devices"] = [1]
    with pytest.raises(ValueError, match="more than one pipeline stage"):
        Plan.from_dict(p)


def test_the_global_batch_is_micro_batch_times_micro_batches():
    p = _plan().to_dict()
    p["pipeline"]["num_microbatches"] = 3
    with pytest.raises(ValueError, match="num_microbatches"):
        Plan.from_dict(p)


def test_unknown_schedule_is_refused():
    p = _plan().to_dict()
    p["pipeline"]["schedule"] = "zigzag"
    with pytest.raises(ValueError, match="1f1b, gpipe"):
        Plan.from_dict(p)


def test_a_wan_link_must_join_two_nodes_of_the_cluster():
    p = _plan().to_dict()
    p["wan"] = [{"a": "dc-a", "b": "dc-z", "gbps": 1.0}]
    with pytest.raises(ValueError, match="dc-z"):
        Plan.from_dict(p)
    p["wan"] = [{"a": "dc-a", "b": "dc-b", "gbps": 0.0}]
    with pytest.raises(ValueError, match="gbps > 0"):
        Plan.from_dict(p)
