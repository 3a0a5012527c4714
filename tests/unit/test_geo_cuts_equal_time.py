"""bench/geo_real.py's equal wall time: each candidate's validation points on its own measured
clock, and the common training time on the coarsest candidate's points."""
import importlib.util
import os
from types import SimpleNamespace

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_spec = importlib.util.spec_from_file_location("geo_real", os.path.join(ROOT, "bench", "geo_real.py"))
geo_real = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(geo_real)


def plan(iteration_s: float, h: int | None = None):
    return SimpleNamespace(predicted_iteration_s=iteration_s,
                           diloco=SimpleNamespace(inner_steps=h) if h is not None else None)


def points(first: float, every: float, n: int, loss0: float = 5.0):
    return [(first + i * every, i + 1, loss0 - 0.01 * i) for i in range(n)]


def test_validation_points_are_on_the_runs_own_clock():
    steps = [{"step": 1, "step_s": 5.0, "loss": 6.0}, {"step": 2, "step_s": 0.5, "loss": 5.5, "val_loss": 5.4},
             {"step": 3, "step_s": 0.5, "loss": 5.2}, {"step": 4, "step_s": 1.0, "loss": 5.0, "val_loss": 4.9}]
    assert geo_real.val_points(steps) == [(5.5, 2, 5.4), (7.0, 4, 4.9)]
    assert geo_real.val_points(steps[:1]) == []


def test_steps_and_validation_interval_from_the_prediction():
    assert geo_real.steps_for(plan(0.5), 120.0) == 240
    assert geo_real.steps_for(plan(41.0), 120.0) == 3  # rounded up: the run reaches the time asked
    assert geo_real.steps_for(plan(0.47, h=100), 120.0) == 300  # whole rounds of H
    assert geo_real.steps_for(plan(0.47, h=100), 10.0) == 100  # at least one round
    assert geo_real.val_every_for(plan(0.1), 40.0) == 20  # 20 points in 40 s
    assert geo_real.val_every_for(plan(41.0), 40.0) == 1
    assert geo_real.val_every_for(plan(0.47, h=10), 40.0) == 0 + 10  # a whole round, never a part of one
    assert geo_real.val_every_for(plan(0.05, h=10), 40.0) == 40


def test_the_common_time_brings_the_candidates_points_together():
    # DP: a point every 41 s step; DiLoCo: 22 s first step then 47 s rounds (69, 116, 163);
    # a pipeline's points every 2 s. At 69 s DP's nearest is 82 (1.19x), at 116 s 123 (1.07x), at
    # 163 s 164 (1.01x): 163 s
    pts = {"dp": points(41.0, 41.0, 4), "diloco": points(69.0, 47.0, 3), "pipeline": points(1.0, 2.0, 90)}
    w, at = geo_real.equal_time_points(pts, 40.0)
    assert w == pytest.approx(163.0)
    assert at["dp"][0] == pytest.approx(164.0) and at["diloco"][0] == pytest.approx(163.0)
    assert at["pipeline"][0] == pytest.approx(163.0) and at["pipeline"][1] == 82
    # DiLoCo's third round not reached: 116 s, where the points lie within 7 %
    w, at = geo_real.equal_time_points(dict(pts, diloco=points(69.0, 47.0, 2)), 40.0)
    assert w == pytest.approx(116.0) and at["dp"][0] == pytest.approx(123.0)
    # a candidate whose run ended before 116 s bounds W: only DiLoCo's 69 s point is left
    short = dict(pts, pipeline=points(1.0, 2.0, 45))  # last point at 89 s
    w, at = geo_real.equal_time_points(short, 40.0)
    assert w == pytest.approx(69.0) and at["dp"][0] in (pytest.approx(82.0), pytest.approx(41.0))
    # fine candidates alone: the first coarsest point at or after the asked time
    w, _ = geo_real.equal_time_points({"a": points(20.0, 11.0, 5), "b": points(1.0, 0.4, 200)}, 40.0)
    assert w == pytest.approx(42.0)


def test_a_candidate_without_a_validation_point_is_named():
    with pytest.raises(ValueError, match="no validation point recorded by diloco"):
        geo_real.equal_time_points({"dp": points(1.0, 1.0, 3), "diloco": []}, 2.0)


def test_a_run_that_ended_early_is_continued_at_its_gap_and_sized_again_by_its_measured_steps():
    # the 10 Mbit/s shape measured: DP 41 s steps to 246 s, DiLoCo rounds to 297 s, the pipeline's
    # 2 s points ending at 130 s. As if all ran on, W = 219 s (DP's 205 s point: 1.07x)
    pts = {"dp": points(41.0, 41.0, 6), "diloco": points(63.0, 78.0, 4), "pipeline": points(2.0, 2.0, 65)}
    ext = geo_real.extended(pts)
    assert ext["pipeline"][-1][0] == pytest.approx(296.0) and ext["pipeline"][-1][1:] == (None, None)
    assert ext["diloco"] == pts["diloco"]  # the latest end: nothing added
    w, at = geo_real.equal_time_points(ext, 40.0)
    assert w == pytest.approx(219.0) and at["pipeline"][1] is None and at["dp"][1] == 5
    # the pipeline trained 130 s in 130 steps: 1.05 x 220 s needs 231 steps; DiLoCo's up to whole H
    assert geo_real.steps_to_reach({"train_s": 130.0, "steps": 130}, 220.0, None) == 231
    assert geo_real.steps_to_reach({"train_s": 130.0, "steps": 200}, 200.0, 100) == 400
    assert geo_real.steps_to_reach({"train_s": 300.0, "steps": 3}, 10.0, None) == 4  # never fewer than before
