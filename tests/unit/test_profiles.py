"""The profile store and the estimated-vs-measured rules (pure Python: no torch here)."""
import json
import os

import pytest

from planner.core import profiles, roofline
from contracts.catalog import get_gpu_type
from planner.core.profiles import (CollectiveFit, CollectiveProfile, DeviceBench, MatmulResult, StepProfile,
                              analytic_flops_per_sample, fit_line, get_collective_profile, get_step_profile,
                              load_step_profiles, save_device_bench, save_step_profile)
from contracts.specs import PRESETS

TINY, SMALL, GPT2 = PRESETS["tiny"], PRESETS["small"], PRESETS["gpt2"]


def measured(device_type, spec, seq=128, dtype="fp32", alpha=0.002, efficiency=0.5, opt=2e-9, flops=None):
    """A measured profile whose β is what `efficiency` of the device's peak gives."""
    flops = flops or analytic_flops_per_sample(spec, seq)
    peak = get_gpu_type(device_type).peak_tflops(dtype)
    beta = flops / (peak * 1e12 * efficiency)
    return StepProfile(device_type, spec.name, seq, dtype, "none", alpha, beta, opt, 0.99, True, "measured (test)",
                       flops, spec.num_params, spec.num_layers, (4, 8, 16, 32),
                       tuple(alpha + beta * m for m in (4, 8, 16, 32)), efficiency, peak,
                       num_matmul_params=spec.matmul_params())


def test_empty_store_gives_an_estimate_labelled_as_such():
    p = get_step_profile("H200", GPT2, 1024, "bf16")
    assert not p.measured and p.kind == "estimated" and p.r2 is None
    assert p.source.startswith("estimated") and "roofline" in p.source
    flops = GPT2.flops_per_token(1024) * 1024
    assert p.flops_per_sample == pytest.approx(flops)
    rl = roofline.estimate_step_roofline("H200", GPT2, 1024, "bf16")
    assert p.beta_s == pytest.approx(rl.per_sample_s)
    assert p.alpha_s == pytest.approx(12 * profiles.DEFAULT_GPU_ALPHA_PER_LAYER_S + rl.fixed_s)
    assert p.step_time_s(4) == pytest.approx(p.alpha_s + 4 * p.beta_s)
    # a slower part is predicted slower, by its own roofline (not the ratio of peaks, 989 / 125)
    v100 = get_step_profile("V100-32GB", GPT2, 1024, "bf16")
    assert v100.beta_s / p.beta_s == pytest.approx(
        roofline.estimate_step_roofline("V100-32GB", GPT2, 1024, "bf16").per_sample_s / rl.per_sample_s)
    assert 1 < v100.beta_s / p.beta_s < 989 / 125
    full = get_step_profile("H200", GPT2, 1024, "bf16", recompute="full")
    # blocks' forward again, not the LM head (whose fp32 cross-entropy traffic is a large share of gpt2's step)
    assert 1.1 < full.beta_s / p.beta_s < 4 / 3


def test_measured_profile_is_returned_as_stored(data_dir):
    m = measured("cpu", TINY)
    path = save_step_profile(m)
    assert path.startswith(os.path.join(data_dir, "profiles"))
    p = get_step_profile("cpu", TINY, 128, "fp32")
    assert p == m and p.measured and p.kind == "measured"
    # other keys are not that profile
    for other in (dict(seq=64), dict(dtype="bf16"), dict(recompute="full")):
        args = {"seq": 128, "dtype": "fp32", "recompute": "none", **other}
        assert not get_step_profile("cpu", TINY, args["seq"], args["dtype"], args["recompute"]).measured


def test_estimates_calibrate_from_measured_profiles_same_type_first():
    save_step_profile(measured("cpu", TINY, efficiency=0.3, alpha=0.004, opt=5e-9))
    est = get_step_profile("cpu", SMALL, 256, "fp32")
    assert not est.measured and "calibrated from 1 measured profile(s) on cpu fp32" in est.source
    assert est.efficiency == pytest.approx(0.3)
    assert est.beta_s == pytest.approx(analytic_flops_per_sample(SMALL, 256) / (0.05e12 * 0.3))
    assert est.alpha_s == pytest.approx(0.004 / TINY.num_layers * SMALL.num_layers)  # α per layer carried over
    assert est.optimizer_s_per_param == pytest.approx(5e-9)
    # a CPU's efficiency does not carry to a GPU
    assert "no GPU profile of this model measured" in get_step_profile("H200", GPT2, 1024, "bf16").source


def test_estimates_carry_across_gpu_types_by_ratio_of_rooflines():
    save_step_profile(measured("A100-80GB", GPT2, seq=1024, dtype="bf16", efficiency=0.55))
    h200 = get_step_profile("H200", GPT2, 1024, "bf16")
    assert not h200.measured and "measured ÷ roofline over 1 profile(s) on ['A100-80GB']" in h200.source
    a100 = get_step_profile("A100-80GB", GPT2, 1024, "bf16")
    assert a100.measured
    # the roofline's error on the measured A100 carries over: β scales by the ratio of the rooflines
    ratio = (roofline.estimate_step_roofline("H200", GPT2, 1024, "bf16").per_sample_s
             / roofline.estimate_step_roofline("A100-80GB", GPT2, 1024, "bf16").per_sample_s)
    assert h200.beta_s == pytest.approx(a100.beta_s * ratio)
    assert "counted FLOPs" in h200.source  # the measured profile's FLOPs of the same model are reused


def test_two_measured_types_median_and_same_name_other_architecture_is_ignored():
    save_step_profile(measured("cpu", TINY, efficiency=0.2))
    save_step_profile(measured("cpu", SMALL, seq=256, efficiency=0.4))
    cal = profiles.calibration("cpu", "fp32")
    assert cal.efficiency == pytest.approx(0.3) and cal.num_profiles == 2
    from dataclasses import replace

    impostor = replace(TINY, hidden=128)  # a different model under the name "tiny"
    assert not get_step_profile("cpu", impostor, 128, "fp32").measured


def test_malformed_store_files_are_skipped(data_dir):
    save_step_profile(measured("cpu", TINY))
    folder = os.path.join(data_dir, "profiles", "steps")
    with open(os.path.join(folder, "broken.json"), "w") as fh:
        fh.write("{not json")
    with open(os.path.join(folder, "wrong.json"), "w") as fh:
        json.dump({"device_type": "cpu"}, fh)
    assert [p.model for p in load_step_profiles()] == ["tiny"]


def test_bad_arguments_name_the_problem():
    with pytest.raises(ValueError, match="unknown GPU type 'B300'"):
        get_step_profile("B300", TINY, 128, "fp32")
    with pytest.raises(ValueError, match="dtype"):
        get_step_profile("cpu", TINY, 128, "int8")
    with pytest.raises(ValueError, match="seq"):
        get_step_profile("cpu", TINY, 0, "fp32")
    with pytest.raises(ValueError, match="recompute"):
        get_step_profile("cpu", TINY, 128, "fp32", recompute="some")


def test_collective_profile_round_trips_through_the_store(tmp_path):
    assert get_collective_profile("cpu") is None
    fit = CollectiveFit("all_reduce", 3e-4, 1.5e9, 0.97, (1024, 4096), (3.01e-4, 3.03e-4))
    bench = DeviceBench("cpu", "AMD EPYC", 1, (MatmulResult("fp32", 256, 0.1),), 20.0,
                        CollectiveProfile("cpu", "gloo", 2, (fit,), True, "h"), "h", "now")
    save_device_bench(bench, store_dir=str(tmp_path))
    assert get_collective_profile("cpu") is None  # another store
    got = get_collective_profile("cpu", store_dir=str(tmp_path))
    assert got == bench.collectives and got.measured
    assert got.time_s("all_reduce", 1.5e9) == pytest.approx(1.0003)
    with pytest.raises(ValueError, match="all_gather"):
        got.time_s("all_gather", 1)
    # the bench's single-thread matmul replaces the catalog's placeholder CPU peak
    assert profiles.peak_tflops("cpu", "fp32", store_dir=str(tmp_path)) == pytest.approx(0.1)
    assert profiles.peak_tflops("cpu", "fp32") == get_gpu_type("cpu").fp32_tflops


def test_fit_line_recovers_a_line_and_reports_r2():
    xs = [4, 8, 16, 32]
    a, b, r2 = fit_line(xs, [0.5 + 2 * x for x in xs])
    assert (a, b, r2) == (pytest.approx(0.5), pytest.approx(2.0), pytest.approx(1.0))
    a, b, r2 = fit_line(xs, [1.0, 9.0, 3.0, 7.0])
    assert r2 < 0.5
    a, b, _ = fit_line(xs, [2 * x - 1 for x in xs], nonnegative_intercept=True)
    assert a == 0.0 and b == pytest.approx(sum(x * (2 * x - 1) for x in xs) / sum(x * x for x in xs))
    with pytest.raises(ValueError):
        fit_line([1, 1], [1, 2])


