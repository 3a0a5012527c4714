"""The roofline estimate of GPU types nothing was measured on (planner/core/roofline.py), checked
against published measured training throughput (ratios between types), and its place in the profile
store's rules (an estimate says so; a measured profile always wins). Pure Python, no torch."""
import math

import pytest

from planner.core import roofline
from contracts.catalog import get_gpu_type, match_gpu_type
from planner.core.profiles import StepProfile, get_step_profile, save_step_profile
from contracts.specs import PRESETS
from testkit.roofline import (DTYPE, MODEL, PAIRS, SEQ, TOLERANCE, all_pairs, estimated_ratio,
                              published_ratio)


@pytest.mark.parametrize("a,b", PAIRS)
def test_speed_ratio_within_25_percent_of_published_training_throughput(a, b):
    published, estimated = published_ratio(a, b), estimated_ratio(a, b)
    assert abs(estimated / published - 1) <= TOLERANCE, f"{a}/{b}: estimated {estimated:.2f}, published {published:.2f}"


def test_most_published_pairs_within_25_percent():
    within = [abs(estimated_ratio(a, b) / published_ratio(a, b) - 1) <= TOLERANCE for a, b in all_pairs()]
    assert sum(within) >= 0.75 * len(within), f"{sum(within)} of {len(within)} pairs within 25 %"


def test_roofline_beats_the_flat_efficiency_estimate_over_every_published_pair():
    """The estimate it replaces: β = FLOPs / (datasheet peak x one efficiency), so a ratio of peaks."""
    pairs = all_pairs()

    def log_error(estimate) -> float:
        return sorted(abs(math.log(estimate(a, b) / published_ratio(a, b))) for a, b in pairs)[len(pairs) // 2]

    def flat(a: str, b: str) -> float:
        return get_gpu_type(a).peak_tflops(DTYPE) / get_gpu_type(b).peak_tflops(DTYPE)

    assert log_error(estimated_ratio) < 0.5 * log_error(flat)


def test_estimate_says_it_is_a_roofline_estimate_and_a_measured_profile_wins():
    est = get_step_profile("A100-80GB", MODEL, SEQ, DTYPE)
    assert not est.measured and est.r2 is None and "roofline" in est.source and "not measured" in est.source
    measured = StepProfile("A100-80GB", MODEL.name, SEQ, DTYPE, "none", 0.01, 2 * est.beta_s, 1e-10, 0.99, True,
                           "measured (test)", est.flops_per_sample, MODEL.num_params, MODEL.num_layers,
                           (4, 8), (0.01 + 8 * est.beta_s, 0.01 + 16 * est.beta_s),
                           num_matmul_params=MODEL.matmul_params())
    save_step_profile(measured)
    assert get_step_profile("A100-80GB", MODEL, SEQ, DTYPE) == measured
    # another type's estimate carries the roofline's error on the measured one (measured β is 2x the roofline's)
    h100 = get_step_profile("H100-SXM", MODEL, SEQ, DTYPE)
    h100_roofline = roofline.estimate_step_roofline("H100-SXM", MODEL, SEQ, DTYPE).per_sample_s
    assert not h100.measured and h100.beta_s == pytest.approx(2 * h100_roofline)


def test_optimizer_step_is_priced_by_memory_bandwidth():
    a100, l4 = (get_step_profile(t, MODEL, SEQ, "bf16") for t in ("A100-80GB", "L4"))
    bw = {t: get_gpu_type(t).memory_bytes_per_s * roofline.MEMORY_EFFICIENCY for t in ("A100-80GB", "L4")}
    assert a100.optimizer_s_per_param == pytest.approx(roofline.OPTIMIZER_BYTES_PER_PARAM / bw["A100-80GB"])
    # the same on the peak-FLOPs ratio would be 312/121; AdamW streams, so it is the bandwidth ratio
    assert l4.optimizer_s_per_param / a100.optimizer_s_per_param == pytest.approx(2039 / 300)


def test_each_kind_of_kernel_is_bound_by_its_own_rate():
    r = roofline.estimate_step_roofline("A100-80GB", MODEL, SEQ, "bf16")
    rates = r.rates
    assert rates.matmul_flops_per_s == pytest.approx(271.2e12)  # the measured (MAMF) rate, not the 312 peak
    # a power-capped part at the rate it holds, not at its boost clock (T4: 42.3 of 65 TFLOP/s, 70 W)
    assert roofline.sustained_rates("T4", "bf16").matmul_flops_per_s == pytest.approx(42.31e12)
    # a part without a measurement: its peak times the measured parts' median efficiency
    assert roofline.sustained_rates("L4", "bf16").matmul_flops_per_s == pytest.approx(
        121e12 * roofline.DEFAULT_MATMUL_EFFICIENCY)
    kernels, kernel = roofline.training_kernels(MODEL, SEQ, "bf16", "none", "A100-80GB")
    assert kernel == "flash"
    matmul_flops = sum(k.count * k.flops for k in kernels if k.kind == "matmul")
    assert r.by_kind_s["matmul"] >= matmul_flops / rates.matmul_flops_per_s * (1 - 1e-9)
    elementwise_bytes = sum(k.count * k.moved_bytes for k in kernels if k.kind == "elementwise")
    assert r.by_kind_s["elementwise"] == pytest.approx(elementwise_bytes / rates.memory_bytes_per_s)
    # a GDDR part spends a larger share of its step on memory-bound kernels than an HBM one
    l4 = roofline.estimate_step_roofline("L4", MODEL, SEQ, "bf16")
    h100 = roofline.estimate_step_roofline("H100-SXM", MODEL, SEQ, "bf16")
    assert (l4.by_kind_s["elementwise"] / l4.per_sample_s) > (r.by_kind_s["elementwise"] / r.per_sample_s)
    assert h100.by_kind_s["elementwise"] / h100.per_sample_s > r.by_kind_s["elementwise"] / r.per_sample_s


def test_math_attention_materializes_the_scores():
    """Where torch falls back to math (no fused kernel takes the call) the S x S scores cost bandwidth."""
    spec = PRESETS["gpt2"]
    fused, _ = roofline.training_kernels(spec, 1024, "bf16", "none", "A100-80GB")
    kernels = [k for k in fused if k.kind == "attention"]
    assert {k.rate for k in kernels} == {"attention"}
    math_block = roofline._block_forward(spec, 1024, 2, "math", False)
    scores = [k for k in math_block if k.name == "mask_softmax"]
    assert scores and scores[0].moved_bytes >= 4 * spec.num_heads * 1024 * 1024


def test_recompute_runs_the_blocks_forward_again():
    none = roofline.estimate_step_roofline("A100-80GB", MODEL, SEQ, "bf16")
    full = roofline.estimate_step_roofline("A100-80GB", MODEL, SEQ, "bf16", recompute="full")
    assert 1.2 < full.per_sample_s / none.per_sample_s < 4 / 3  # the blocks' forward again, not the head


def test_bad_input_names_the_problem():
    with pytest.raises(ValueError, match="GPU types"):
        roofline.sustained_rates("cpu", "fp32")
    with pytest.raises(ValueError, match="unknown GPU type"):
        roofline.sustained_rates("B300", "bf16")
    with pytest.raises(ValueError, match="recompute"):
        roofline.estimate_step_roofline("A100-80GB", MODEL, SEQ, "bf16", recompute="some")


def test_a10_is_its_own_catalog_type():
    assert match_gpu_type("NVIDIA A10") == "A10"
    assert match_gpu_type("NVIDIA A10G") == "A10G"
    assert match_gpu_type("NVIDIA A100-SXM4-80GB") == "A100-80GB"
    assert get_gpu_type("A10").memory_gbps == 600
