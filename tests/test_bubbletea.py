"""BubbleTea: prefill fills idle intervals only, never moves training, respects memory."""
import pytest

from planner.geo.bubbletea import (prefill_memory_bytes, prefill_time_s, reservations, simulate_bubbletea,
                               steady_state_gaps)
from planner.geo.evaluate import run_prefill
from planner.geo.scenario import GeoScenario, InferenceWorkload
from planner.geo.pipeline_sim import Channel, PipelineJob, Stage, simulate_pipeline
from planner.core.specs import get_model
from tests.test_geo import small_dict

GPT2 = get_model("gpt2")
WAN = Channel("wan", 0.03, 1.0, 1.0, "temporal")


def wan_job(d=2, m=6):
    """4 stages, a slow WAN hop in the middle: long bubbles."""
    return PipelineJob(tuple(Stage(0.05, 0.1, 0.01) for _ in range(4)), ("lan", "wan", "lan"),
                       (Channel("lan", 1e-5, 100, 100), WAN), d, m, 12.5e6)


def backlog(tokens=(128, 256, 512)):
    return InferenceWorkload("gpt2", tuple((t, 1 / len(tokens)) for t in tokens), None, True)


def test_prefill_never_moves_a_training_operation():
    sim = simulate_pipeline(wan_job())
    pre = simulate_bubbletea(sim, ["A100-80GB"] * 4, [40 * 2**30] * 4, backlog(), GPT2)
    assert len(pre.placements) > 10  # there is something to check
    again = simulate_pipeline(sim.job, reservations(pre))
    assert again.training_ops() == sim.training_ops()
    assert again.iteration_s == sim.iteration_s
    assert pre.gpu_utilization_with_prefill() > sim.gpu_utilization()


def test_the_comparison_would_catch_a_moved_operation():
    # negative control: a reservation over a training op does change the timeline
    sim = simulate_pipeline(wan_job())
    op = next(o for o in sim.ops if o.kind == "F" and o.stage == 2)
    moved = simulate_pipeline(sim.job, {(op.pipeline, op.stage): [(op.start_s - 0.01, op.start_s + 0.01)]})
    assert moved.training_ops() != sim.training_ops()


def test_placements_fit_gaps_and_never_overlap():
    sim = simulate_pipeline(wan_job())
    pre = simulate_bubbletea(sim, ["A100-80GB"] * 4, [40 * 2**30] * 4, backlog(), GPT2)
    T = sim.iteration_s
    for (r, j), taken in reservations(pre).items():
        taken = sorted(taken)
        for (s1, e1), (s2, e2) in zip(taken, taken[1:]):
            assert e1 <= s2 + 1e-12
        train = [(o.start_s, o.end_s) for o in sim.ops if (o.pipeline, o.stage) == (r, j)]
        for s, e in taken:
            assert 0 <= s < e <= T + 1e-12
            assert all(e <= ts + 1e-12 or s >= te - 1e-12 for ts, te in train)
    # each request's duration is the prefill time of its length on that GPU type
    took = {n: prefill_time_s(GPT2, n, "A100-80GB") for n in (128, 256, 512)}
    for p in pre.placements:
        assert p.end_s - p.start_s == pytest.approx(took[p.tokens])
    assert pre.prefill_tokens_per_s() == pytest.approx(sum(p.tokens for p in pre.placements) / T)


def test_memory_left_by_training_decides_which_stages_serve():
    sim = simulate_pipeline(wan_job())
    need = prefill_memory_bytes(GPT2, 512)
    free = [need - 1, need, 0, 10 * need]
    pre = simulate_bubbletea(sim, ["A100-80GB"] * 4, free, backlog((512,)), GPT2)
    assert pre.eligible_stages == (1, 3)
    assert {p.stage for p in pre.placements} <= {1, 3}
    none = simulate_bubbletea(sim, ["A100-80GB"] * 4, [0] * 4, backlog(), GPT2)
    assert none.placements == [] and "free" in none.note
    # the weights alone: 124M params in 16-bit
    assert prefill_memory_bytes(GPT2, 1) > 2 * GPT2.num_params


def test_rate_mode_serves_at_most_what_arrives_with_causal_ttft():
    sim = simulate_pipeline(wan_job())
    wl = InferenceWorkload("gpt2", ((256, 1.0),), requests_per_s=20.0)
    pre = simulate_bubbletea(sim, ["A100-80GB"] * 4, [40 * 2**30] * 4, wl, GPT2)
    assert 0 < len(pre.placements) <= pre.requests_offered
    took = prefill_time_s(GPT2, 256, "A100-80GB")
    for p in pre.placements:
        assert p.start_s >= p.arrival_s
    assert min(pre.ttft_s()) >= took - 1e-12
    assert pre.summary()["ttft_mean_s"] >= took


def test_steady_state_joins_the_tail_and_the_head():
    assert steady_state_gaps([(0.0, 1.0), (2.0, 3.0), (4.0, 5.0)], 5.0) == [(2.0, 3.0), (4.0, 6.0)]
    assert steady_state_gaps([(0.5, 1.0), (4.0, 5.0)], 5.0) == [(0.5, 1.0), (4.0, 5.0)]


def test_end_to_end_report_keeps_training_unchanged():
    sc = GeoScenario.from_dict(small_dict())
    from planner.geo.atlas import solve_atlas

    res = solve_atlas(sc)
    pre, same = run_prefill(sc, res.plan, res.sim)
    assert same is True and pre.placements
