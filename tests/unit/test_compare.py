"""The even split of a plan's devices (planner/entry.py), and two runs' measured step medians (executor/compare.py)."""
from __future__ import annotations

import os

import pytest

from contracts.cluster import ClusterSpec, DeviceSpec, NodeSpec
from executor.compare import MIN_COMPARED_STEPS, SKIP_STEPS, already_even, compare_runs, prediction_gap, step_median
from planner.entry import baseline_plan, even_plan


def mixed_cluster() -> ClusterSpec:
    fast, slow = DeviceSpec("cpu", cpu_share=1.0), DeviceSpec("cpu", cpu_share=0.333, memory_gb=2.0)
    return ClusterSpec("mixed", (NodeSpec("localhost", "local", (fast, slow)),))


def solved(cluster: ClusterSpec, global_batch: int = 48):
    from planner.entry import plan_job

    return plan_job(cluster, "tiny", global_batch, seq=64).plan


def run(step_s: list[float], predicted: float | None = 0.1, **over) -> dict:
    """A read_metrics-shaped dict with these step times."""
    m = {"model": "tiny", "global_batch": 48, "seq": 64, "dtype": "fp32", "predicted_iteration_s": predicted,
         "steps": [{"step": i + 1, "step_s": t} for i, t in enumerate(step_s)]}
    m.update(over)
    return m


def test_the_even_plan_keeps_everything_but_the_split():
    plan = solved(mixed_cluster())
    even = even_plan(plan)
    assert [a.batch for a in even.assignments] == [24, 24]
    assert [a.shard_fraction for a in even.assignments] == [0.5, 0.5]
    assert (even.model, even.global_batch, even.seq, even.dtype, even.recompute, even.zero) == (
        plan.model, plan.global_batch, plan.seq, plan.dtype, plan.recompute, plan.zero)
    assert all(a.batch == a.micro_batch * a.accum_steps for a in even.assignments)
    # priced by the cost model: the third of a core is the even split's bottleneck
    assert even.predicted_iteration_s > plan.predicted_iteration_s > 0
    assert even.assignments[1].predicted_step_s > even.assignments[0].predicted_step_s
    assert [a.emulated for a in even.assignments] == [True, True]
    assert not already_even(plan, even)  # the planner gives the slow device less
    # the baseline is measured as split: live rebalancing would move it toward the plan mid-run
    assert plan.rebalance == "auto" and even.rebalance == "off"


def test_a_homogeneous_plan_is_already_even():
    cluster = ClusterSpec("two", (NodeSpec("localhost", "local", (DeviceSpec("cpu"), DeviceSpec("cpu"))),))
    plan = solved(cluster)
    assert already_even(plan, even_plan(plan))


def test_bad_baselines_are_refused_with_the_reason():
    with pytest.raises(ValueError, match="not a multiple of 4 samples"):
        baseline_plan(mixed_cluster(), "even", "tiny", 50, 64, unit=4)
    with pytest.raises(ValueError, match="baseline must be 'even' or 'proportional'"):
        baseline_plan(mixed_cluster(), "uneven", "tiny", 48, 64)


def test_proportional_gives_the_faster_device_more():
    plan = baseline_plan(mixed_cluster(), "proportional", "tiny", 48, 64, unit=4)
    fast, slow = plan.assignments
    assert fast.batch > slow.batch and fast.batch % 4 == 0 and slow.batch % 4 == 0


def test_medians_skip_the_warm_up_steps():
    warm = [5.0, 3.0]  # slow first steps that must not count
    assert SKIP_STEPS == 2
    assert step_median(run(warm + [0.1, 0.3, 0.2, 0.2, 0.4])) == 0.2
    assert step_median(run(warm + [0.1] * (MIN_COMPARED_STEPS - 1))) is None  # too few to be a median


def test_compare_runs_gives_the_speedup_and_the_prediction_gap():
    c = compare_runs(run([9.0, 9.0] + [0.25] * 10, predicted=0.2), run([9.0, 9.0] + [0.5] * 7, predicted=0.6))
    assert (c.planned_step_s, c.even_step_s, c.planned_steps, c.even_steps) == (0.25, 0.5, 10, 7)
    assert c.speedup == pytest.approx(2.0)
    assert c.planned_gap == pytest.approx(0.25) and c.even_gap == pytest.approx(-1 / 6)
    assert compare_runs(run([0.2] * 8, predicted=None), run([0.2] * 8)).planned_gap is None


def test_runs_of_different_work_or_too_short_do_not_compare():
    with pytest.raises(ValueError, match="differ in global batch"):
        compare_runs(run([0.2] * 8), run([0.2] * 8, global_batch=96))
    with pytest.raises(ValueError, match="the even run has 3 steps after the first 2"):
        compare_runs(run([0.2] * 8), run([0.2] * 5))
    with pytest.raises(ValueError, match="must be positive"):
        prediction_gap(0.2, 0.0)


def test_compare_reads_what_the_store_recorded(data_dir):
    """Two fabricated runs through the store's own writer and reader: the medians are the recorded step times."""
    from executor.store import read_metrics
    from testkit.runs import STEP_S, fabricate_run

    a = read_metrics(fabricate_run("a", 10, "done"))
    b = read_metrics(fabricate_run("b", 10, "done", slowdown=3.0))
    c = compare_runs(a, b)
    assert c.planned_step_s == c.even_step_s == STEP_S and c.planned_steps == 8 and c.speedup == 1.0


def test_even_runs_are_named_after_their_planned_run(tmp_path):
    from executor.compare import even_run_dirs, next_even_run_dir, planned_run_of

    planned = str(tmp_path / "run-20261201-140000")
    os.makedirs(planned)
    assert even_run_dirs(planned) == [] and next_even_run_dir(planned) == planned + "-even"
    os.makedirs(planned + "-even")
    os.makedirs(planned + "-even-3")
    os.makedirs(str(tmp_path / "run-20261201-140000-1-even"))  # another run's
    assert even_run_dirs(planned) == [planned + "-even", planned + "-even-3"]
    assert next_even_run_dir(planned) == planned + "-even-4"
    assert planned_run_of(planned + "-even-3") == planned and planned_run_of(planned) is None
