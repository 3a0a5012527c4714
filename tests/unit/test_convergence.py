"""The DiLoCo convergence model (planner/geo/convergence.py): k read off measured curves, the
interpolation over H and G, the extrapolation flag, the committed file."""
import math

import pytest

from planner.geo.convergence import (ConvergenceFit, MeasuredMultiplier, fit_multipliers, load_fit,
                                     measure_multiplier, tokens_to_loss)

DP = [(100.0, 3.0), (200.0, 2.0), (400.0, 1.5)]


def test_tokens_to_loss_interpolates_between_measured_points():
    assert tokens_to_loss(DP, 2.5) == pytest.approx(150.0)
    assert tokens_to_loss(DP, 1.75) == pytest.approx(300.0)
    assert tokens_to_loss(DP, 3.0) == 100.0
    assert tokens_to_loss(DP, 3.5) is None  # above the first measured point
    assert tokens_to_loss(DP, 1.0) is None  # lower than DP ever got


def test_measure_multiplier_is_the_mean_token_ratio_inside_dps_curve():
    # DiLoCo reaches 2.5 at 300 tokens (DP: 150 -> 2.0x) and 2.0 at 600 (DP: 200 -> 3.0x); 1.2 is skipped
    m = measure_multiplier(DP, [(300.0, 2.5), (600.0, 2.0), (800.0, 1.2)], 10, 2)
    assert (m.multiplier, m.num_points) == (pytest.approx(2.5), 2)
    assert measure_multiplier(DP, [(50.0, 9.0)], 10, 2) is None


def test_fit_interpolates_in_log_h_and_is_flat_outside():
    fit = fit_multipliers([MeasuredMultiplier(5, 2, 3.0), MeasuredMultiplier(50, 2, 2.0)])
    mid = math.exp((math.log(5) + math.log(50)) / 2)  # ~15.8: half way in ln H
    assert fit.multiplier(5, 2) == 3.0 and fit.multiplier(50, 2) == 2.0
    assert fit.multiplier(int(round(mid)), 2) == pytest.approx(2.5, abs=0.01)
    assert fit.multiplier(500, 2) == 2.0 and fit.multiplier(1, 2) == 3.0
    assert fit.multiplier(10, 1) == 1.0  # one group is data parallelism
    # G = 3 from G = 2: (k - 1) doubles
    assert fit.multiplier(50, 3) == pytest.approx(3.0)


def test_estimate_flags_what_lies_outside_the_measurements():
    fit = fit_multipliers([MeasuredMultiplier(5, 2, 3.0), MeasuredMultiplier(50, 2, 2.0)], {"command": "c"})
    inside = fit.estimate(10, 2)
    assert not inside.extrapolated and "interpolated" in inside.note
    far = fit.estimate(100, 2)
    assert far.extrapolated and "H=100 outside the measured H 5-50" in far.note
    g3 = fit.estimate(10, 3)
    assert g3.extrapolated and "G=3 not measured" in g3.note


def test_never_below_one_and_repeats_merge():
    fit = fit_multipliers([MeasuredMultiplier(10, 2, 0.8, 2), MeasuredMultiplier(10, 2, 1.1, 2),
                           MeasuredMultiplier(20, 2, 1.4)])
    assert fit.measured[0].multiplier == pytest.approx(0.95) and fit.measured[0].num_points == 4
    assert fit.multiplier(10, 2) == 1.0


def test_bad_fits_are_refused():
    with pytest.raises(ValueError, match="G >= 2"):
        fit_multipliers([MeasuredMultiplier(10, 1, 1.0)])
    with pytest.raises(ValueError, match="measured twice"):
        ConvergenceFit((MeasuredMultiplier(10, 2, 1.0), MeasuredMultiplier(10, 2, 1.2)))
    with pytest.raises(ValueError, match="inner_steps"):
        fit_multipliers([MeasuredMultiplier(10, 2, 1.5)]).multiplier(0, 2)


def test_round_trip_and_the_committed_fit(tmp_path):
    fit = fit_multipliers([MeasuredMultiplier(5, 2, 3.0), MeasuredMultiplier(50, 2, 2.0)], {"model": "tiny"})
    path = str(tmp_path / "fit.json")
    fit.save(path)
    assert load_fit(path) == fit
    assert load_fit(str(tmp_path / "none.json")) is None
    committed = load_fit()
    if committed is not None:  # written by bench/diloco_convergence.py, with how
        assert {"command", "model", "inner_steps_measured", "written_at_utc"} <= set(committed.provenance)
        assert all(committed.multiplier(m.inner_steps, m.num_groups) >= 1.0 for m in committed.measured)


def test_k_is_kept_apart_per_wire_dtype():
    fit = fit_multipliers([MeasuredMultiplier(5, 2, 3.0), MeasuredMultiplier(50, 2, 2.0),
                           MeasuredMultiplier(50, 2, 2.5, compress="bf16"),
                           MeasuredMultiplier(50, 2, 1.5, compress="bf16")])
    assert fit.compresses == ("fp32", "bf16")
    assert fit.multiplier(50, 2) == 2.0 and fit.multiplier(50, 2, "bf16") == pytest.approx(2.0)
    assert fit.multiplier(5, 2, "bf16") == pytest.approx(2.0)  # bf16 measured only at H = 50: flat
    est = fit.estimate(5, 2, "bf16")
    assert est.extrapolated and "bf16" in est.note and "outside the measured H 50-50" in est.note
    with pytest.raises(ValueError, match="no k measured at compress='int8'"):
        fit.multiplier(50, 2, "int8")
    with pytest.raises(ValueError, match="compress must be one of"):
        fit.multiplier(50, 2, "fp16")


def test_a_file_without_compress_reads_as_fp32(tmp_path):
    m = MeasuredMultiplier.from_dict({"inner_steps": 10, "num_groups": 2, "multiplier": 1.5})
    assert m.compress == "fp32"
    fit = fit_multipliers([m, MeasuredMultiplier(10, 2, 1.7, compress="bf16")])
    path = str(tmp_path / "fit.json")
    fit.save(path)
    assert load_fit(path) == fit
