"""Geo plan files without a process: the stages a one-micro-batch pipeline is priced with, no empty
stage written, a device over its memory refused, data parallelism across the link paying its all-
reduce there (the CLI and the runtime: tests/e2e/test_geo_plan_file.py)."""
from __future__ import annotations

from dataclasses import replace

import pytest

from planner.geo.atlas import solve_atlas
from planner.geo.emulated import build_plan_job, predict_dp_plan
from planner.geo.plan_file import check_runnable, geo_plan_to_plan
from planner.geo.scenario import GeoScenario
from tests.e2e.test_geo_plan_file import CPU_SCENARIO, _two_stage


def test_one_micro_batch_through_two_stages_is_the_sum_of_its_steps(tmp_path):
    """Hand arithmetic of the runtime's step: F0, the activation over the link, F1, B1, the gradient
    back, B0, the tied embedding's all-reduce, the world all-reduce, the slowest optimizer step."""
    sc = GeoScenario.from_dict({**CPU_SCENARIO, "global_batch": 1})
    geo = solve_atlas(sc).plan
    if geo.num_stages != 2:
        geo = _two_stage(sc)
    plan = geo_plan_to_plan(sc, geo)
    job, _ = build_plan_job(plan)
    s0, s1 = job.stages
    ch = job.channels[0]
    hop = job.transfer_bytes * 8 / (ch.per_transfer_gbps * 1e9) + ch.latency_s
    assert ch.latency_s == pytest.approx(0.5e-3)  # half the 1 ms round trip
    wire = hop - ch.latency_s
    # a transfer moves once its receive is posted (stage 1 waits from 0, stage 0 from its forward's end)
    arrive_f = max(s0.forward_s, 0.0 + ch.latency_s) + wire + ch.latency_s
    b1_end = arrive_f + s1.forward_s + s1.backward_s
    arrive_b = max(b1_end, s0.forward_s + ch.latency_s) + wire + ch.latency_s
    compute_end = arrive_b + s0.backward_s
    want = compute_end + job.tied_sync_s + job.world_sync_s + max(s0.optimizer_s, s1.optimizer_s)
    assert job.tied_sync_s > 0  # "small" ties its head to the embedding: summed over the link
    assert plan.predicted_iteration_s == pytest.approx(want, rel=1e-9)


def test_a_stage_without_layers_is_never_written(tmp_path):
    sc = GeoScenario.from_dict(CPU_SCENARIO)
    geo = _two_stage(sc)
    a, b = geo.stages
    empty = replace(geo, stages=(replace(a, num_layers=a.num_layers + b.num_layers), replace(b, first_layer=4,
                                                                                            num_layers=0)))
    with pytest.raises(ValueError, match="stage 1 has no layers"):
        geo_plan_to_plan(sc, empty)


def test_a_device_over_its_memory_is_refused(tmp_path):
    sc = GeoScenario.from_dict(CPU_SCENARIO)
    plan = geo_plan_to_plan(sc, _two_stage(sc))
    big = replace(plan, assignments=tuple(replace(a, predicted_memory_bytes=10**12) for a in plan.assignments))
    with pytest.raises(ValueError, match="needs .* GiB, over its"):
        check_runnable(big)


def test_a_data_parallel_plan_across_the_link_pays_its_all_reduce_on_the_link(tmp_path):
    """predict_dp_plan over two nodes: halving the link's rate adds the ring's bytes once more."""
    sc = GeoScenario.from_dict(CPU_SCENARIO)
    plan = geo_plan_to_plan(sc, _two_stage(sc))
    dp = replace(plan, pipeline=None, assignments=tuple(replace(a, micro_batch=1, accum_steps=4, batch=4,
                                                                shard_fraction=0.5) for a in plan.assignments))
    t1, _ = predict_dp_plan(dp)
    t2, _ = predict_dp_plan(replace(dp, wan=tuple(replace(w, gbps=w.gbps / 2) for w in dp.wan)))
    t4, _ = predict_dp_plan(replace(dp, wan=tuple(replace(w, gbps=w.gbps / 4) for w in dp.wan)))
    assert t2 > t1 and (t4 - t2) == pytest.approx(2 * (t2 - t1), rel=1e-6)  # the wire term is bytes / rate
