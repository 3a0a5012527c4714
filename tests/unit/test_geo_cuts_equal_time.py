"""bench/geo_real.py's equal wall time: the common wall time on the coarsest candidate's granule,
and each candidate's steps sized by its own measured step times."""
import importlib.util
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_spec = importlib.util.spec_from_file_location("geo_real", os.path.join(ROOT, "bench", "geo_real.py"))
geo_real = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(geo_real)


def test_granule_is_the_mean_later_step_times_h():
    assert geo_real.granule_s([5.0, 1.0, 3.0, 2.0], None) == (5.0, 2.0)
    # DiLoCo: the outer step's slow step counts in the mean (4 steps of 0.5 s and one of 10.5 s)
    assert geo_real.granule_s([5.0, 0.5, 0.5, 0.5, 0.5, 10.5], 5) == (5.0, pytest.approx(12.5))
    assert geo_real.granule_s([40.0], None) == (40.0, 40.0)  # one step: it is its own granule
    with pytest.raises(ValueError, match="no step times"):
        geo_real.granule_s([], None)


def test_steps_fill_the_wall_time_from_measured_steps():
    # a 5 s first step, then 0.5 s steps: 1 + 35 / 0.5 = 71 steps train 40 s
    assert geo_real.steps_measured([5.0] + [0.5] * 9, None, 40.0) == 71
    # DiLoCo at H = 10, 0.5 s a step: 5 s a round; 35 s after the first step is 7 rounds
    assert geo_real.steps_measured([5.0] + [0.5] * 9, 10, 40.0) == 70
    assert geo_real.steps_measured([5.0] + [0.5] * 9, 100, 10.0) == 100  # at least one round
    assert geo_real.steps_measured([60.0], None, 40.0) == 1


def test_common_wall_time_brings_the_candidates_ends_together():
    # DP: 41 s steps (least 41); DiLoCo: a 22 s first step, 47 s rounds (least 69); a pipeline of
    # 0.4 s steps. At 69 s DP ends at 82 (1.19x); at 116 DP ends at 123 (1.06x): 116 is chosen
    measured = [(41.0, 41.0), (69.0, 47.0), (1.0, 0.4)]
    assert geo_real.common_wall_s(40.0, measured) == pytest.approx(116.0)
    assert geo_real.common_wall_s(40.0, measured, stretch=2.0) == pytest.approx(69.0)  # 116 is past 80
    # fine candidates alone: the first coarsest end at or after the asked time
    assert geo_real.common_wall_s(40.0, [(20.0, 11.0), (1.0, 0.4)]) == pytest.approx(42.0)
    assert geo_real.least_s([22.0] + [0.47] * 99, 100) == pytest.approx(22.0 + 47.0)
    assert geo_real.least_s([41.0], None) == 41.0
