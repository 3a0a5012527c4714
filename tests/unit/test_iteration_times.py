"""Issue 17: pricing a pipeline costs O(stages), not O(micro-batches), and changes no figure.

`pipeline_sim.iteration_times` extrapolates a 1F1B iteration from bounded simulations once it has
proved that the simulation's whole state recurs; `stage_memory.walk_order` walks 1F1B's first cycles
only. Each is checked against the whole computation it replaces.
"""
import dataclasses
import os
import random

import pytest

import planner.core.stage_memory as stage_memory
from bench.iteration_times import random_job
from contracts.pipeline_order import schedule_order
from contracts.cluster import ClusterSpec
from contracts.plan import PipelineSpec, PipelineStage
from contracts.specs import get_model
from planner.geo.pipeline_sim import Channel, PipelineJob, Stage, iteration_times, simulate_pipeline

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def worker_ends(sim):
    ends = {}
    for o in sim.ops + sim.step_ops:
        ends[(o.pipeline, o.stage)] = max(ends.get((o.pipeline, o.stage), 0.0), o.end_s)
    return ends


def test_extrapolated_iterations_equal_whole_simulations():
    rng = random.Random(7)
    extrapolated = 0
    for _ in range(40):
        job = random_job(rng, rng.randint(150, 400))
        whole = simulate_pipeline(job)
        got = iteration_times(job)
        assert got.iteration_s == pytest.approx(whole.iteration_s, rel=1e-9), job
        ends = worker_ends(whole)
        assert got.worker_end_s.keys() == ends.keys()
        for w, e in ends.items():
            assert got.worker_end_s[w] == pytest.approx(e, rel=1e-9)
        if got.extrapolated:
            extrapolated += 1
            assert max(got.simulated_microbatches) < job.num_microbatches
    assert extrapolated >= 20  # most of them: the check is not vacuous


def test_the_simulated_micro_batches_do_not_grow_with_the_job():
    stages = (Stage(1.0, 2.0, 0.5, "", 0.2), Stage(1.5, 2.5, 0.4, "", 0.2), Stage(0.8, 1.9, 0.3, "", 0.1))
    link = Channel("wan", 0.02, 2.0, 2.0, "temporal")
    base = PipelineJob(stages, ("wan", "wan"), (link,), 2, 100, 2e8, "1f1b", "fifo", 0.5, True, 0.1)
    seen = []
    for m in (1_000, 10_000, 1_000_000):
        got = iteration_times(dataclasses.replace(base, num_microbatches=m))
        assert got.extrapolated
        seen.append(max(got.simulated_microbatches))
    assert max(seen) <= 100
    small = dataclasses.replace(base, num_microbatches=1_000)
    assert iteration_times(small).iteration_s == pytest.approx(simulate_pipeline(small).iteration_s, rel=1e-9)


def test_gpipe_and_short_jobs_are_simulated_whole():
    stages = (Stage(1.0, 2.0), Stage(1.0, 2.0))
    free = Channel("free", 0.0, 1e9, 1e9)
    for schedule, m in (("gpipe", 1_000), ("1f1b", 20)):
        job = PipelineJob(stages, ("free",), (free,), 1, m, 0.0, schedule)
        got = iteration_times(job)
        assert not got.extrapolated and got.simulated_microbatches == (m,)
        assert got.iteration_s == simulate_pipeline(job).iteration_s


def test_the_memory_walk_of_the_first_cycles_equals_the_whole_walk(monkeypatch):
    cases = 0
    for model in ("tiny", "gpt2", "tinyllama-1.1b"):
        for S in (1, 2, 3, 5):
            spec = dataclasses.replace(get_model(model), num_layers=2 * S)
            for M in (1, 2, 3, 4, 5, 7, 12, 40):
                for schedule in ("1f1b", "gpipe"):
                    pipe = PipelineSpec(schedule, 2, M, tuple(PipelineStage(2 * j, 2, (j,), (2,)) for j in range(S)))
                    for stage in range(S):
                        for recompute in ("none", "full"):
                            args = (spec, pipe, stage, 0, 1.0, 64, "fp32", recompute)
                            short = stage_memory.estimate_stage_memory(*args)
                            with monkeypatch.context() as m:
                                m.setattr(stage_memory, "walk_order", schedule_order)
                                whole = stage_memory.estimate_stage_memory(*args)
                            assert short == whole, (model, S, M, schedule, stage, recompute)
                            cases += 1
    assert cases == 3 * (1 + 2 + 3 + 5) * 8 * 2 * 2


def test_the_cli_pipeline_option_is_the_one_whole_simulations_choose(monkeypatch):
    """planner plan on mixed-16 at a batch whose candidates have up to 1,000 micro-batches: the same
    pipeline, at the same predicted time, as when every candidate is simulated whole."""
    import planner.geo.atlas as atlas
    import planner.geo.emulated as emulated
    from planner.geo.cluster_plan import solve_cluster_pipeline
    from planner.geo.pipeline_sim import IterationTimes

    cluster = ClusterSpec.load(os.path.join(ROOT, "examples", "clusters", "mixed-16.json"))
    fast = solve_cluster_pipeline(cluster, "gpt2-xl", 1000, 1024, "bf16")

    def whole(job, whole_limit=None):
        sim = simulate_pipeline(job)
        return IterationTimes(sim.iteration_s, worker_ends(sim), (job.num_microbatches,), None)

    monkeypatch.setattr(atlas, "iteration_times", whole)
    monkeypatch.setattr(emulated, "iteration_times", whole)
    slow = solve_cluster_pipeline(cluster, "gpt2-xl", 1000, 1024, "bf16")
    assert fast.plan is not None and slow.plan is not None
    assert fast.plan.pipeline.stages == slow.plan.pipeline.stages
    assert fast.plan.predicted_iteration_s == pytest.approx(slow.plan.predicted_iteration_s, rel=1e-9)
    assert fast.reason == slow.reason  # every candidate's time, as the log and the note say them


def test_a_batch_past_the_simulated_timeline_still_gets_a_priced_pipeline():
    """planner plan at a global batch of 1e5 on mixed-16: its pipeline candidates have 6,250 to 50,000
    micro-batches. The chosen one is priced from bounded simulations, carries no timeline and says why,
    and its predicted iteration and per-device step ends are those of a whole simulation."""
    from planner.geo.cluster_plan import solve_cluster_pipeline
    from planner.geo.emulated import build_plan_job
    from planner.geo.scenario import MAX_MICROBATCHES

    cluster = ClusterSpec.load(os.path.join(ROOT, "examples", "clusters", "mixed-16.json"))
    option = solve_cluster_pipeline(cluster, "gpt2-xl", 100_000, 1024, "bf16")
    plan = option.plan
    assert plan is not None, option.reason
    assert plan.pipeline.num_microbatches > MAX_MICROBATCHES
    assert plan.pipeline.simulated_ops == ()
    assert any("no simulated timeline" in n for n in plan.notes)
    job, _ = build_plan_job(plan)
    whole = simulate_pipeline(job)
    assert plan.predicted_iteration_s == pytest.approx(whole.iteration_s, rel=1e-9)
    ends = worker_ends(whole)
    for j, st in enumerate(plan.pipeline.stages):
        for r, dev in enumerate(st.devices):
            step = next(a.predicted_step_s for a in plan.assignments if a.device_index == dev)
            assert step == pytest.approx(ends[(r, j)], rel=1e-9)


def test_a_long_job_whose_cycles_are_not_proved_is_refused_not_guessed():
    stages = (Stage(1.0, 2.0), Stage(1.0, 2.0))
    free = Channel("free", 0.0, 1e9, 1e9)
    job = PipelineJob(stages, ("free",), (free,), 1, 5_000, 0.0, "gpipe")
    with pytest.raises(ValueError, match="5000 micro-batches per iteration: a GPipe schedule"):
        iteration_times(job, whole_limit=2048)
