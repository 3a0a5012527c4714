"""The per-cut choice (planner/geo/cuts.py): slow links -> DiLoCo, fast -> DP, a pipeline where its
plan is fastest; the exchange's price by hand; the plan file round trip with cuts."""
import math

import pytest

from contracts.plan import Plan
from planner.geo.convergence import ConvergenceFit, MeasuredMultiplier
from planner.geo.cuts import choose_cuts, exchange_s, scenario_dp_plan, set_partitions
from planner.geo.emulated import model_spec
from planner.geo.evaluate import simulate_geo
from planner.geo.plan_file import geo_plan_to_plan
from planner.geo.scenario import GeoScenario

# a fit as a large model's runs might give (this file tests the choice, not the measurement)
NEAR_DP = ConvergenceFit((MeasuredMultiplier(5, 2, 1.05), MeasuredMultiplier(50, 2, 1.1)))
COSTLY = ConvergenceFit((MeasuredMultiplier(5, 2, 3.0), MeasuredMultiplier(50, 2, 3.0)))


def scenario(gbps: float, rtt_ms: float, gpus: int = 1, **over) -> GeoScenario:
    """Two datacenters of `gpus` A100s, gpt2 on a large batch: compute-heavy steps."""
    d = {"name": f"two-{gbps}", "datacenters": [{"name": "a", "gpus": {"A100-80GB": gpus}},
                                                  {"name": "b", "gpus": {"A100-80GB": gpus}}],
         "wan": [{"a": "a", "b": "b", "gbps": gbps, "rtt_ms": rtt_ms, "per_connection_gbps": gbps}],
         "model": "gpt2", "global_batch": 256, "micro_batch": 8, "seq": 1024}
    d.update(over)
    return GeoScenario.from_dict(d)


def choose(sc: GeoScenario, fit):
    pipe = geo_plan_to_plan(sc, simulate_geo(sc, baselines=False).plan)
    return choose_cuts(sc, pipe, fit)


def test_a_slow_link_chooses_diloco_with_its_h():
    ch = choose(scenario(0.5, 20), NEAR_DP)
    c = ch.chosen
    assert c.kind == "diloco" and c.plan.diloco is not None
    assert [x.to_dict() for x in c.plan.cuts] == [{"a": "a", "b": "b", "kind": "diloco", "inner_steps": c.inner_steps}]
    assert c.plan.diloco.inner_steps == c.inner_steps
    # time to target = iterations x k x (inner step + exchange / H), and it beats every other candidate
    assert c.time_to_target_s == pytest.approx(1000 * c.multiplier * c.iteration_s)
    assert all(c.time_to_target_s <= o.time_to_target_s for o in ch.candidates)
    assert any("convergence k(" in n for n in c.plan.notes)


def test_a_fast_link_chooses_synchronous_dp():
    ch = choose(scenario(400, 0.1), NEAR_DP)
    assert ch.chosen.kind == "dp" and ch.chosen.name == "dp"
    assert [x.kind for x in ch.chosen.plan.cuts] == ["dp"] and ch.chosen.plan.diloco is None


def test_costly_diloco_leaves_the_pipeline_plan():
    ch = choose(scenario(0.5, 20), COSTLY)
    assert ch.chosen.name == "pipeline"
    diloco = [c for c in ch.candidates if c.kind == "diloco"]
    assert diloco and all(d.multiplier == 3.0 for d in diloco)


def test_a_pipeline_across_the_link_is_chosen_and_named_when_fastest():
    # gpt2-xl on 16 sequences: DP's all-reduce of 1.5 B parameters over 10 Gbit/s costs more than the
    # pipeline's activations, and a costly DiLoCo (k = 3) loses to the pipeline too
    sc = scenario(10, 5, model="gpt2-xl", global_batch=16, micro_batch=1, seq=1024)
    ch = choose(sc, COSTLY)
    assert ch.chosen.name == "pipeline" and ch.chosen.plan.pipeline is not None
    assert [({x.a, x.b}, x.kind, x.inner_steps) for x in ch.chosen.plan.cuts] == [({"a", "b"}, "pipeline", None)]
    dp = next(c for c in ch.candidates if c.kind == "dp")
    assert dp.iteration_s > ch.chosen.iteration_s


def test_without_a_fit_diloco_is_not_priced():
    ch = choose(scenario(0.5, 20), None)
    assert not [c for c in ch.candidates if c.kind == "diloco"]
    assert any("no convergence fit" in n for n in ch.notes)


def test_exchange_price_by_hand():
    sc = scenario(0.5, 20)
    dp = scenario_dp_plan(sc)
    payload = model_spec(dp).num_params * 4
    # 2 ranks: 2(N-1)/N = 1 payload over 0.5 Gbit/s, plus 2 one-way latencies of 10 ms
    assert exchange_s(dp, [["a"], ["b"]], payload) == pytest.approx(payload * 8 / 0.5e9 + 2 * 0.010)
    assert exchange_s(dp, [["a"], ["b"]], payload, rtt=False) == pytest.approx(payload * 8 / 0.5e9)
    with pytest.raises(ValueError, match="no WAN link"):
        exchange_s(dp, [["a", "b"]], payload)


def test_set_partitions_counts_bell_numbers():
    assert [len(set_partitions(list("abcd"[:n]))) for n in range(1, 5)] == [1, 2, 5, 15]


def test_the_chosen_plan_file_round_trips_with_its_cuts(tmp_path):
    for sc, fit in ((scenario(0.5, 20), NEAR_DP), (scenario(400, 0.1), NEAR_DP)):
        plan = choose(sc, fit).chosen.plan
        path = str(tmp_path / f"{sc.name}.json")
        plan.save(path)
        back = Plan.load(path)
        assert back.cuts == plan.cuts and back.diloco == plan.diloco
        assert math.isclose(back.predicted_iteration_s, plan.predicted_iteration_s)


def test_wan_bytes_per_step_by_hand():
    sc = scenario(10, 5, model="gpt2-xl", global_batch=16, micro_batch=1, seq=1024)
    ch = choose(sc, NEAR_DP)
    by = {c.name: c for c in ch.candidates}
    pipe, dp = by["pipeline"], by["dp"]
    spec = model_spec(dp.plan)
    p = pipe.plan.pipeline
    # a boundary rank sends every micro-batch's activations: rows x seq x hidden fp32 values each
    assert pipe.wan_bytes_per_step == p.num_microbatches * p.stages[0].rows[0] * 1024 * spec.hidden * 4
    # DP over 2 ranks: the reduce-scatter and the all-gather, half the fp32 model each
    assert dp.wan_bytes_per_step == pytest.approx(2 * (2 - 1) / 2 * spec.num_params * 4)
    h50 = next(c for c in ch.candidates if c.kind == "diloco" and c.inner_steps == 50)
    assert h50.wan_bytes_per_step == pytest.approx(dp.wan_bytes_per_step / 50)  # the same all-reduce, once per H
