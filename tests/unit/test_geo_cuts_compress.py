"""Compressed outer deltas in the per-cut choice (planner/geo/cuts.py): a wire dtype is priced only
where its k was measured, with the exchange's payload in that dtype."""
import pytest

from planner.geo.convergence import ConvergenceFit, MeasuredMultiplier
from planner.geo.cuts import choose_cuts, diloco_candidates, exchange_s, scenario_dp_plan
from planner.geo.emulated import model_spec
from planner.geo.evaluate import simulate_geo
from planner.geo.plan_file import geo_plan_to_plan
from planner.geo.scenario import GeoScenario

FP32_ONLY = ConvergenceFit((MeasuredMultiplier(5, 2, 1.05), MeasuredMultiplier(100, 2, 1.1)))
BOTH = ConvergenceFit((*FP32_ONLY.measured, MeasuredMultiplier(5, 2, 1.05, compress="bf16"),
                       MeasuredMultiplier(100, 2, 1.1, compress="bf16")))
BF16_COSTLY = ConvergenceFit((*FP32_ONLY.measured, MeasuredMultiplier(5, 2, 4.0, compress="bf16"),
                              MeasuredMultiplier(100, 2, 4.0, compress="bf16")))


def scenario(gbps: float, rtt_ms: float) -> GeoScenario:
    return GeoScenario.from_dict({
        "name": f"two-{gbps}", "datacenters": [{"name": "a", "gpus": {"A100-80GB": 1}},
                                               {"name": "b", "gpus": {"A100-80GB": 1}}],
        "wan": [{"a": "a", "b": "b", "gbps": gbps, "rtt_ms": rtt_ms, "per_connection_gbps": gbps}],
        "model": "gpt2", "global_batch": 256, "micro_batch": 8, "seq": 1024})


def choose(sc: GeoScenario, fit):
    return choose_cuts(sc, geo_plan_to_plan(sc, simulate_geo(sc, baselines=False).plan), fit)


def test_only_measured_dtypes_are_priced():
    ch = choose(scenario(0.5, 20), FP32_ONLY)
    assert {c.plan.diloco.compress for c in ch.candidates if c.kind == "diloco"} == {"fp32"}
    both = choose(scenario(0.5, 20), BOTH)
    assert {c.plan.diloco.compress for c in both.candidates if c.kind == "diloco"} == {"fp32", "bf16"}


def test_bf16_halves_the_payload_and_wins_a_slow_link_at_equal_k():
    sc = scenario(0.5, 20)
    ch = choose(sc, BOTH)
    by = {c.name: c for c in ch.candidates}
    fp, bf = by["diloco H=50 groups=a|b"], by["diloco H=50 groups=a|b bf16"]
    assert bf.wan_bytes_per_step == pytest.approx(fp.wan_bytes_per_step / 2)
    dp = scenario_dp_plan(sc)
    numel = model_spec(dp).num_params
    assert bf.exchange_s == pytest.approx(exchange_s(dp, [["a"], ["b"]], numel * 2))
    assert fp.exchange_s == pytest.approx(exchange_s(dp, [["a"], ["b"]], numel * 4))
    assert bf.multiplier == fp.multiplier and bf.time_to_target_s < fp.time_to_target_s
    assert ch.chosen.plan.diloco.compress == "bf16" and "bf16" in ch.chosen.note


def test_a_costly_bf16_k_keeps_fp32():
    ch = choose(scenario(0.5, 20), BF16_COSTLY)
    assert ch.chosen.kind == "diloco" and ch.chosen.plan.diloco.compress == "fp32"


def test_an_unmeasured_dtype_is_refused():
    sc = scenario(0.5, 20)
    with pytest.raises(ValueError, match="int8.*no measured k"):
        diloco_candidates(scenario_dp_plan(sc), FP32_ONLY, 1000, compresses=("int8",))


def test_a_compressed_exchange_is_priced_only_inside_its_measured_h():
    narrow = ConvergenceFit((*FP32_ONLY.measured, MeasuredMultiplier(25, 2, 1.1, compress="bf16"),
                             MeasuredMultiplier(50, 2, 1.1, compress="bf16")))
    ch = choose(scenario(0.5, 20), narrow)
    hs = {(c.plan.diloco.compress, c.inner_steps) for c in ch.candidates if c.kind == "diloco"}
    assert {h for c, h in hs if c == "bf16"} == {25, 50}
    assert {h for c, h in hs if c == "fp32"} == {5, 10, 25, 50, 100}
