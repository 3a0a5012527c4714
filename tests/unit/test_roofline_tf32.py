"""fp32 on parts with TF32 (planner/core/roofline.py, contracts/catalog.py): the matmuls run on the TF32 tensor
cores, and the A100:V100 fp32 step-time ratio on OPT-350 (seq 2048) set beside the one Sailor measured.

Sailor's ratio is of Megatron-DeepSpeed steps, whose fp32 attention is unfused: Megatron's CoreAttention writes
the S×S scores and runs the layer-number scale, the masked fill, the softmax and the attention dropout over them
in memory, each a memory-bound pass that runs at the bandwidth ratio (1555 / 900 GB/s) rather than the matmul one.
The roofline prices those passes ("megatron"); torch's SDPA math path ("math") and the fused SDPA kernel GPUMix's
own decoder runs (None) are printed beside it. Pure Python, no torch."""
from __future__ import annotations

import json
import os

import pytest

from contracts.catalog import CATALOG, FP32_MATMULS_IN_TF32, MEASURED_MATMUL_TFLOPS
from planner.core import roofline
from planner.core.profiles import get_step_profile
from profiler.importer import SAILOR_MODELS

SAILOR_PROFILES = os.path.join(os.path.dirname(__file__), "..", "..", "..", "shared", "sailor", "profiles_tmp.json")
OPT = SAILOR_MODELS["OPT-350"]
MICRO_BATCH = 4  # the largest the V100-16GB holds at TP 1 in Sailor's table
# Σ over OPT-350's 26 layers of forward + backward at micro-batch 4, TP 1, in Sailor's profiles_tmp.json:
# V100-16 2.609743 s / A100-40 0.773872 s, from
#   python -c "import json; d=json.load(open('../shared/sailor/profiles_tmp.json'))['OPT-350'];
#   t=lambda g: sum(f+b for f,b,_ in d[g]['4']['1'].values()); print(t('V100-16')/t('A100-40'))"
SAILOR_A100_V100_RATIO = 3.3720
RATIO_WITHOUT_TF32 = 1.58  # the estimate before TF32 was modelled (matmuls at the 18.11 TF fp32 rate)


def _ratio(attention_kernel: str | None) -> float:
    a, v = (roofline.estimate_step_roofline(t, OPT, 2048, "fp32", attention_kernel=attention_kernel)
            for t in ("A100-40GB", "V100-16GB"))
    return (v.fixed_s + MICRO_BATCH * v.per_sample_s) / (a.fixed_s + MICRO_BATCH * a.per_sample_s)


def test_fp32_matmuls_run_at_the_tf32_rate_where_the_part_has_it():
    assert FP32_MATMULS_IN_TF32
    a100 = roofline.sustained_rates("A100-40GB", "fp32")
    assert a100.matmul_flops_per_s == pytest.approx(156e12 * roofline.DEFAULT_MATMUL_EFFICIENCY)
    assert a100.fp32_flops_per_s == a100.matmul_flops_per_s  # the math path's bmm too
    # torch's fused fp32 attention keeps fp32 accuracy with three TF32 products per product
    assert a100.attention_flops_per_s == pytest.approx(
        a100.matmul_flops_per_s * roofline.FUSED_ATTENTION_FRACTION_OF_MATMUL / 3)
    assert roofline.sustained_rates("H100-SXM", "fp32").matmul_flops_per_s == pytest.approx(403.74e12)  # measured
    v100 = roofline.sustained_rates("V100-16GB", "fp32")  # Volta: no TF32, the vector rate (measured)
    assert CATALOG["V100-16GB"].tf32_tflops == 0
    assert v100.matmul_flops_per_s == pytest.approx(MEASURED_MATMUL_TFLOPS["V100-16GB"]["fp32"] * 1e12)
    assert v100.matmul_flops_per_s < CATALOG["V100-16GB"].fp32_tflops * 1e12
    # half precision is untouched
    assert roofline.sustained_rates("A100-40GB", "bf16").matmul_flops_per_s == pytest.approx(271.2e12)


def test_a100_v100_fp32_ratio_beside_sailors_measurement():
    megatron = _ratio("megatron")
    sdpa_math = _ratio("math")
    gpumix_kernels = _ratio(None)
    a, v = (get_step_profile(t, OPT, 2048, "fp32") for t in ("A100-40GB", "V100-16GB"))
    planner_estimate = v.step_time_s(MICRO_BATCH) / a.step_time_s(MICRO_BATCH)
    print(f"A100:V100 fp32 OPT-350 seq 2048 micro-batch {MICRO_BATCH}: Sailor measured {SAILOR_A100_V100_RATIO:.2f}x; "
          f"roofline with Megatron's CoreAttention {megatron:.2f}x ({megatron / SAILOR_A100_V100_RATIO - 1:+.1%}); "
          f"with torch's SDPA math path {sdpa_math:.2f}x; GPUMix's decoder (fused SDPA) {gpumix_kernels:.2f}x, "
          f"as the planner estimates it {planner_estimate:.2f}x; before TF32 {RATIO_WITHOUT_TF32}x")
    assert abs(megatron / SAILOR_A100_V100_RATIO - 1) < 0.15
    assert abs(megatron / SAILOR_A100_V100_RATIO - 1) < abs(RATIO_WITHOUT_TF32 / SAILOR_A100_V100_RATIO - 1) / 3
    # every S×S pass in memory runs at the bandwidth ratio: the more of them, the less the A100 gains
    assert gpumix_kernels > sdpa_math > megatron


def test_megatron_attention_moves_each_square_pass_through_memory():
    """Megatron's fp32 CoreAttention, per element of the (B, H, S, S) square: 42 bytes forward (scores written 4,
    layer scale 8, masked fill 9, softmax 8, dropout 9, read by P·V 4), 54 backward (dP written and P read 8,
    dropout 9, softmax 12, masked fill 9, scale 8, dS read twice 8)."""
    seq = 2048
    square = OPT.num_heads * seq * seq
    kernels, name = roofline.training_kernels(OPT, seq, "fp32", "none", "A100-40GB", "megatron")
    by_name = {k.name: k for k in kernels}
    passes = ("layer_scale", "masked_fill", "softmax", "attention_dropout")
    assert name == "megatron"
    assert sum(by_name[p].moved_bytes for p in passes) == 34 * square
    assert sum(by_name[p + "_bwd"].moved_bytes for p in passes) == 38 * square
    assert all(by_name[p].count == OPT.num_layers for p in passes)
    # 16-bit inputs take Megatron's fused scale+mask+softmax kernel: one pass of 2-byte values
    half, _ = roofline.training_kernels(OPT, seq, "fp16", "none", "A100-40GB", "megatron")
    assert {k.name for k in half} >= {"scale_mask_softmax_fused", "scale_mask_softmax_fused_bwd"}
    assert "softmax" not in {k.name for k in half}
    with pytest.raises(ValueError, match="attention_kernel must be one of"):
        roofline.training_kernels(OPT, seq, "fp32", "none", "A100-40GB", "unfused")


@pytest.mark.skipif(not os.path.exists(SAILOR_PROFILES), reason="Sailor's data (../shared/sailor) is not here")
def test_recorded_ratio_is_what_sailors_file_says():
    with open(SAILOR_PROFILES) as fh:
        opt = json.load(fh)["OPT-350"]

    def step_s(gpu: str) -> float:
        return sum(f + b for f, b, _ in opt[gpu][str(MICRO_BATCH)]["1"].values())

    measured = step_s("V100-16") / step_s("A100-40")
    print(f"Sailor's A100-40:V100-16 OPT-350 ratio at micro-batch {MICRO_BATCH}, TP 1: {measured:.4f}")
    assert measured == pytest.approx(SAILOR_A100_V100_RATIO, abs=1e-4)
    assert abs(_ratio("megatron") / measured - 1) < 0.15
