"""Roofline estimate of a training step on a GPU type nothing was measured on.

Every kernel the runtime launches for one sample (matmuls, the attention kernel contracts/attention.py
says torch picks, elementwise ops, per-micro-batch casts and accumulation, AdamW) is priced by what
bounds it, max(FLOPs / sustained FLOP/s, bytes / sustained bandwidth), summed in launch order; another
runtime's attention (Megatron-LM's unfused one, whose steps Sailor measured) can be priced instead. Rates
are sustained: a measured matmul rate where one is published (contracts/catalog.py), else the peak
times the measured parts' median efficiency. fp32 matmuls run in TF32 on parts that have it
(contracts/catalog.FP32_MATMULS_IN_TF32). Pure Python, no torch.

The kernels by kind and the rates: docs/models/cost.md ("The roofline"); checked in
tests/unit/test_roofline.py and printed by bench/roofline_ratios.py.
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass, replace
from functools import lru_cache
from types import MappingProxyType
from typing import Mapping

from contracts.attention import select_kernel
from contracts.catalog import CPU_TYPE, FP32_MATMULS_IN_TF32, MEASURED_MATMUL_TFLOPS, device_dtype, get_gpu_type
from contracts.constants import DTYPE_BYTES, FP32_BYTES, RECOMPUTE
from contracts.specs import ModelSpec

TFLOPS = 1e12

# For a part without its own measurement (catalog.MEASURED_MATMUL_TFLOPS): the datasheet peak times
# the median measured efficiency. Half precision: the median of MAMF / peak over the NVIDIA rows of
# the MAMF table the catalog cites (A100 SXM 86.9 %, GH200 83.8 %, A100 PCIe 81.1 %, H100 SXM 80.3 %,
# B300 78.6 %, B200 77.6 %, GB200 72.9 %): 80.3 %; TF32 runs on the same tensor cores and takes the same
# figure (the one measured TF32 row, H100 SXM 403.74 of 494.7, is 81.6 %). fp32 on the vector units (parts
# without TF32): the median of measured / peak over the catalog's fp32 rows (A100 40GB 18.11/19.5,
# A100 80GB 19.18/19.5, H100 52.11/67, H200 51.34/67, RTX 3090 24.79/35.6, RTX 4090 54.72/82.6,
# A6000 23.92/38.7, L40S 46.88/91.6, T4 4.30/8.1, P40 10.07/11.8): 73 %. Either carries the shortfall
# from boost clocks and kernel efficiency that the measured parts show.
DEFAULT_MATMUL_EFFICIENCY = statistics.median((0.869, 0.838, 0.811, 0.803, 0.786, 0.776, 0.729))
DEFAULT_FP32_EFFICIENCY = statistics.median((18.11 / 19.5, 19.18 / 19.5, 52.11 / 67, 51.34 / 67, 24.79 / 35.6,
                                             54.72 / 82.6, 23.92 / 38.7, 46.88 / 91.6, 4.30 / 8.1, 10.07 / 11.8))
# FlashAttention-2 (Dao 2023, arXiv:2307.08691, abstract and §4.1): the kernel torch's SDPA flash
# backend runs reaches "50-73% of the theoretical maximum FLOPs/s on A100" forward and backward.
# Take the low end over the A100 peak, relative to the A100's measured matmul rate (271.2 of 312, MAMF),
# so it scales with each part's sustained matmul rate. The memory-efficient kernel has no separate
# published figure here: it is priced at the same rate.
FUSED_ATTENTION_FRACTION_OF_MATMUL = 0.50 * 312.0 / 271.2
# Backward of the fused attention kernels: 5 matmuls of the forward's 2 (FlashAttention-2 §3.2,
# recomputing S and P), so 2.5x the forward FLOPs.
FUSED_ATTENTION_BACKWARD_FLOPS = 2.5
# Large elementwise kernels (PyTorch's vectorized loops) stream at about this fraction of the
# datasheet bandwidth. One figure for every type: it sets how much of a step is memory-bound, but
# it does not favour one type over another.
MEMORY_EFFICIENCY = 0.85
# AdamW as models/optim.py `adamw_step_` runs it, fp32 throughout, per parameter of the shard:
#   param.mul_ (decay) r+w 8 | m.lerp_(g) r m,g w m 12 | v.mul_ 8 | v.addcmul_(g, g) 12 |
#   sqrt(v, out=buf) 8 | buf.div_ 8 | buf.add_ 8 | p.addcdiv_(m, buf) r p,m,buf w p 16   = 80
# plus `global_grad_norm_sq` (read g 4, write and read the fp64 copy 8 + 8 = 20) and the unscale /
# clip `g.mul_(coef)` (8): 108 bytes per parameter, every one a streaming kernel.
OPTIMIZER_BYTES_PER_PARAM = 80 + 20 + 8
BACKWARD_ELEMENTWISE_FACTOR = 2.0  # backward traffic of an elementwise op over its forward traffic
# torch's memory-efficient attention keeps fp32 exact on Ampere and newer by "3xTF32"
# (gemm_kernel_utils.h: DefaultGemmType<Sm80+, float> uses OpMultiplyAddFastF32, three TF32 MMAs per
# product), whatever allow_tf32 says: a third of the TF32 rate.
FAST_FP32_MMAS_PER_PRODUCT = 3
BOOL_BYTES = 1  # a torch.bool mask element
# Attention another runtime may run, to price its steps (`training_kernels`): torch's SDPA kernels forced,
# or Megatron-LM's CoreAttention ("megatron", `_megatron_attention`).
OTHER_RUNTIME_ATTENTION = ("math", "efficient", "flash", "megatron")


@dataclass(frozen=True)
class SustainedRates:
    """What bounds each kind of kernel on one GPU type in one compute dtype (per second)."""

    gpu_type: str
    dtype: str  # the dtype the part really computes in (bf16 -> fp16 where it lacks bf16)
    matmul_flops_per_s: float
    fp32_flops_per_s: float  # the math attention path and fp32 training multiply in fp32
    attention_flops_per_s: float  # fused SDPA kernels
    memory_bytes_per_s: float
    basis: str  # where the matmul rate comes from


def sustained_rates(gpu_type: str, dtype: str) -> SustainedRates:
    """Sustained rates of `gpu_type` training in `dtype` (ValueError for the CPU or unknown types)."""
    gpu = get_gpu_type(gpu_type)
    if gpu.name == CPU_TYPE:
        raise ValueError("the roofline is for GPU types; the CPU worker is priced from its measured bench")
    real = device_dtype(gpu_type, dtype)
    measured = MEASURED_MATMUL_TFLOPS.get(gpu.name, {})
    tf32 = FP32_MATMULS_IN_TF32 and gpu.supports_tf32
    if tf32:  # every fp32 matmul (Linear, the math path's bmm) runs on the TF32 tensor cores
        fp32 = measured.get("tf32", gpu.tf32_tflops * DEFAULT_MATMUL_EFFICIENCY) * TFLOPS
        fp32_basis = (f"measured tf32 matmul {measured['tf32']:g} TFLOP/s" if "tf32" in measured else
                      f"tf32 peak {gpu.tf32_tflops:g} TFLOP/s x {DEFAULT_MATMUL_EFFICIENCY:.3f}")
    else:
        fp32 = measured.get("fp32", gpu.fp32_tflops * DEFAULT_FP32_EFFICIENCY) * TFLOPS
        fp32_basis = (f"measured fp32 matmul {measured['fp32']:g} TFLOP/s" if "fp32" in measured else
                      f"fp32 peak {gpu.fp32_tflops:g} TFLOP/s x {DEFAULT_FP32_EFFICIENCY:.2f}")
    if real == "fp32":
        matmul, basis = fp32, fp32_basis
    elif real in measured:
        matmul, basis = measured[real] * TFLOPS, f"measured {real} matmul {measured[real]:g} TFLOP/s"
    else:
        peak = gpu.peak_tflops(real)
        matmul = peak * DEFAULT_MATMUL_EFFICIENCY * TFLOPS
        basis = f"{real} peak {peak:g} TFLOP/s x {DEFAULT_MATMUL_EFFICIENCY:.3f}"
    attention = matmul * FUSED_ATTENTION_FRACTION_OF_MATMUL
    if real == "fp32" and tf32:
        attention /= FAST_FP32_MMAS_PER_PRODUCT
    return SustainedRates(gpu.name, real, matmul, fp32, attention, gpu.memory_bytes_per_s * MEMORY_EFFICIENCY, basis)


@dataclass(frozen=True)
class Kernel:
    """One kernel (or a group run alike) per sample: FLOPs, bytes moved, and which rate bounds its FLOPs."""

    name: str
    kind: str  # "matmul" | "attention" | "elementwise"
    flops: float
    moved_bytes: float  # bytes read + written in memory
    rate: str = "matmul"  # "matmul" | "fp32" | "attention": the FLOP/s that applies
    count: int = 1  # how many times it runs per sample (once per layer for a block's kernels)
    backward_bytes: float | None = None  # bytes its backward moves, where `_backward`'s rule does not hold

    def time_s(self, r: SustainedRates) -> float:
        """Seconds of all `count` runs: each bound by its FLOPs or its bytes, whichever is slower."""
        flops_per_s = {"matmul": r.matmul_flops_per_s, "fp32": r.fp32_flops_per_s,
                       "attention": r.attention_flops_per_s}[self.rate]
        return self.count * max(self.flops / flops_per_s, self.moved_bytes / r.memory_bytes_per_s)


@dataclass(frozen=True)
class StepRoofline:
    """Roofline step time of one GPU type: `fixed_s + per_sample_s · m` for a micro-batch of m."""

    rates: SustainedRates
    per_sample_s: float
    fixed_s: float  # per micro-batch, whatever its size: weight casts and gradient accumulation
    optimizer_s_per_param: float
    by_kind_s: Mapping[str, float]  # per-sample seconds by kind of kernel (read-only: results are cached)
    attention_kernel: str
    flops_per_sample: float

    @property
    def source(self) -> str:
        parts = ", ".join(f"{k} {v / self.per_sample_s:.0%}" for k, v in sorted(self.by_kind_s.items()))
        return (f"roofline ({self.rates.basis}; memory {self.rates.memory_bytes_per_s / 1e9:.0f} GB/s sustained; "
                f"{self.attention_kernel} attention; per sample {parts})")


def _mm(name: str, m: int, k: int, n: int, width: int) -> Kernel:
    """A (m, k) @ (k, n) forward matmul per sample: reads both operands, writes the output."""
    return Kernel(name, "matmul", 2.0 * m * k * n, width * (m * k + m * n))  # weights: see _fixed_bytes


def _ew(name: str, elements: float, passes_bytes: float) -> Kernel:
    """An elementwise kernel over `elements` values moving `passes_bytes` bytes per value."""
    return Kernel(name, "elementwise", 0.0, elements * passes_bytes)


def _ew_passes(name: str, elements: float, forward_bytes: float, backward_bytes: float) -> Kernel:
    """An elementwise kernel whose backward moves a known number of bytes per value."""
    return Kernel(name, "elementwise", 0.0, elements * forward_bytes, backward_bytes=elements * backward_bytes)


def _megatron_attention(spec: ModelSpec, seq: int, width: int) -> list[Kernel]:
    """Megatron-LM's CoreAttention (megatron/model/transformer.py) for one sample: every (B, H, S, S)
    tensor goes through memory. Bytes per element of the square, forward | backward:
      baddbmm(Q, Kᵀ) writes the scores 4 | dQ = dS·K and dK = dSᵀ·Q read dS twice 8 (the matmul kernels);
      16-bit: one fused scale+mask+softmax kernel (ScaledUpperTriangMaskedSoftmax) r+w 2w | r dP, P, w dS 3w;
      fp32 (the fused kernel takes 16-bit inputs only, FusedScaleMaskSoftmax.forward_torch_softmax):
        × layer number (apply_query_key_layer_scaling, on by default) r+w 8 | 8,
        masked_fill_ with the bool causal mask r+w 8 + mask 1 | grad.masked_fill(mask, 0) 9,
        torch softmax r+w 8 | r dP, P, w dS 12;
      attention dropout (p 0.1 by default; native_dropout) r 4, w 4 + bool mask 1 | r dP, mask, w 9;
      bmm(P, V) reads P 4 | dP = dO·Vᵀ writes dP, dV = Pᵀ·dO reads P 8 (the matmul kernels);
    then the context's permute(2, 0, 1, 3).contiguous() r+w over S × q."""
    s, q = seq, spec.q_width
    kv, sq, act = spec.num_heads * spec.head_dim, spec.num_heads * s * s, width  # K, V at num_heads
    out = [Kernel("scores", "attention", 2.0 * s * s * q, act * (s * (q + kv) + sq), "fp32")]
    if width < FP32_BYTES:
        out.append(_ew_passes("scale_mask_softmax_fused", sq, 2 * width, 3 * width))
    else:
        out += [_ew_passes("layer_scale", sq, 2 * FP32_BYTES, 2 * FP32_BYTES),
                _ew_passes("masked_fill", sq, 2 * FP32_BYTES + BOOL_BYTES, 2 * FP32_BYTES + BOOL_BYTES),
                _ew_passes("softmax", sq, 2 * FP32_BYTES, 3 * FP32_BYTES)]
    out += [_ew_passes("attention_dropout", sq, 2 * act + BOOL_BYTES, 2 * act + BOOL_BYTES),
            Kernel("p_v", "attention", 2.0 * s * s * q, act * (sq + s * kv + s * q), "fp32"),
            _ew_passes("context_permute", s * q, 2 * act, 2 * act)]
    return out


def _block_forward(spec: ModelSpec, seq: int, width: int, kernel_name: str, expand_kv: bool) -> list[Kernel]:
    """The kernels of one block's forward for one sample (seq tokens), in models/decoder.py's order."""
    s, h, q, f = seq, spec.hidden, spec.q_width, spec.ffn_hidden
    heads, kvh, hd = spec.num_heads, spec.num_kv_heads, spec.head_dim
    kv = (heads if expand_kv else kvh) * hd
    res = FP32_BYTES  # the residual stream stays fp32 under autocast (fp32 embeddings + fp32 adds)
    cast = (res + width) if width < res else 0  # autocast casts each Linear's input
    # LayerNorm is one fused kernel (r+w); RMSNorm as written is pow, mean, mul, mul (4 passes)
    norm_bytes = 2 * res if spec.norm == "layernorm" else 7 * res
    out: list[Kernel] = [_ew("attn_norm", s * h, norm_bytes), _ew("qkv_cast", s * h, 3 * cast),
                         _mm("q_proj", s, h, q, width), _mm("k_proj", s, h, kvh * hd, width),
                         _mm("v_proj", s, h, kvh * hd, width)]
    if spec.positional == "rope":  # q*cos, rotate_half (neg, cat), *sin, add: ~5 r+w passes each
        out.append(_ew("rope", s * (q + kvh * hd), 5 * 2 * width))
    if expand_kv and kvh != heads:
        out.append(_ew("repeat_kv", s * 2 * heads * hd, 2 * width))
    if kernel_name == "megatron":
        out += _megatron_attention(spec, s, width)
    elif kernel_name == "math":
        # fp32 upcast of q, k, v, scores (B, H, S, S) written, masked, softmaxed, read by P @ V;
        # both bmm over the full square in fp32 (attention.py: math upcasts 16-bit inputs)
        sq = heads * s * s
        out += [_ew("math_upcast", s * (q + 2 * kv), width + FP32_BYTES),
                Kernel("scores", "attention", 2.0 * s * s * q, FP32_BYTES * (s * (q + kv) + sq), "fp32"),
                _ew("mask_softmax", sq, 4 * FP32_BYTES),
                Kernel("p_v", "attention", 2.0 * s * s * q, FP32_BYTES * (sq + s * kv + s * q), "fp32"),
                _ew("out_cast_reshape", s * q, FP32_BYTES + 2 * width)]
    else:  # flash / efficient: causal, so half the square; q, k, v read once, out + lse written
        io_bytes = width * s * (2 * q + 2 * kv) + FP32_BYTES * heads * s  # q, k, v, out; fp32 log-sum-exp
        out.append(Kernel("sdpa_fused", "attention", 2.0 * s * s * q, io_bytes, "attention"))
    out += [_ew("o_cast", s * q, cast), _mm("o_proj", s, q, h, width),
            _ew("attn_residual", s * h, 2 * res + width),
            _ew("mlp_norm", s * h, norm_bytes)]
    if spec.activation == "swiglu":
        out += [_ew("mlp_cast", s * h, 2 * cast), _mm("gate_proj", s, h, f, width), _mm("up_proj", s, h, f, width),
                _ew("silu_mul", s * f, 2 * width + 3 * width)]
    else:
        out += [_ew("mlp_cast", s * h, cast), _mm("up_proj", s, h, f, width), _ew("gelu", s * f, 2 * width)]
    out += [_mm("down_proj", s, f, h, width), _ew("mlp_residual", s * h, 2 * res + width)]
    return out


def _head_forward(spec: ModelSpec, seq: int, width: int) -> list[Kernel]:
    s, h, v = seq, spec.hidden, spec.vocab_size
    res = FP32_BYTES
    norm_bytes = 2 * res if spec.norm == "layernorm" else 7 * res
    embed = 2 * res + (2 * res if spec.positional == "learned" else 0)  # gather (+ position add)
    return [_ew("embed", s * h, embed), _ew("final_norm", s * h, norm_bytes + (res + width if width < res else 0)),
            _mm("lm_head", s, h, v, width),
            # logits.float() then cross_entropy's log_softmax (fp32, kept for backward) and the gather
            _ew("logits_fp32", s * v, width + FP32_BYTES), _ew("log_softmax", s * v, 3 * FP32_BYTES)]


def _backward(kernels: list[Kernel]) -> list[Kernel]:
    out = []
    for k in kernels:
        if k.backward_bytes is not None:
            out.append(replace(k, name=k.name + "_bwd", flops=2 * k.flops, moved_bytes=k.backward_bytes))
        elif k.kind == "matmul":  # dgrad and wgrad: twice the FLOPs, about twice the bytes
            out.append(replace(k, name=k.name + "_bwd", flops=2 * k.flops, moved_bytes=2 * k.moved_bytes))
        elif k.kind == "attention" and k.rate == "attention":
            out.append(replace(k, name=k.name + "_bwd", flops=FUSED_ATTENTION_BACKWARD_FLOPS * k.flops,
                               moved_bytes=2 * k.moved_bytes))
        else:
            out.append(replace(k, name=k.name + "_bwd", flops=2 * k.flops,
                               moved_bytes=BACKWARD_ELEMENTWISE_FACTOR * k.moved_bytes))
    return out


def _fixed_bytes(spec: ModelSpec, width: int) -> float:
    """Bytes per micro-batch, whatever its size: every matmul weight is read by forward, dgrad and
    wgrad; autocast casts the fp32 weight once per forward (r 4, w 2); the wgrad result is cast to
    fp32 and added into the gradient (r width, r+w 4 + 4)."""
    n = spec.matmul_params()
    cast = (FP32_BYTES + width) if width < FP32_BYTES else 0
    return n * (3 * width + cast + width + 2 * FP32_BYTES)


def training_kernels(spec: ModelSpec, seq: int, dtype: str, recompute: str, gpu_type: str,
                     attention_kernel: str | None = None) -> tuple[list[Kernel], str]:
    """Every kernel of one sample's forward + backward on `gpu_type` (a block's kernels once, with
    `count` = num_layers), and the attention kernel's name. `attention_kernel` (OTHER_RUNTIME_ATTENTION:
    an SDPA kernel forced, or Megatron-LM's unfused CoreAttention, "megatron") prices another runtime's
    attention instead of the SDPA kernel torch picks for GPUMix's decoder."""
    real = device_dtype(gpu_type, dtype)
    width = DTYPE_BYTES[real]
    attn = select_kernel(gpu_type, real, spec.num_heads, spec.num_kv_heads, spec.head_dim)
    if attention_kernel is not None:
        if attention_kernel not in OTHER_RUNTIME_ATTENTION:
            raise ValueError(f"attention_kernel must be one of {', '.join(OTHER_RUNTIME_ATTENTION)}, "
                             f"got {attention_kernel!r}")
        attn = replace(attn, name=attention_kernel, expand_kv=False)
    block = _block_forward(spec, seq, width, attn.name, attn.expand_kv)
    head = _head_forward(spec, seq, width)
    blocks_fwd = [replace(k, count=spec.num_layers) for k in block]
    kernels = blocks_fwd + head + _backward(blocks_fwd + head)
    if recompute == "full":  # models/decoder.py checkpoints each block: its forward runs again in backward
        kernels += [replace(k, name=k.name + "_recompute") for k in blocks_fwd]
    return kernels, attn.name


@lru_cache(maxsize=4096)  # pure in its arguments (ModelSpec is frozen); planners ask for the same keys often
def estimate_step_roofline(gpu_type: str, spec: ModelSpec, seq: int, dtype: str,
                           recompute: str = "none", attention_kernel: str | None = None) -> StepRoofline:
    """The roofline step of `spec` at `seq` tokens per sample on `gpu_type` (docs/models/cost.md);
    `attention_kernel`: see `training_kernels`."""
    if recompute not in RECOMPUTE:
        raise ValueError(f"recompute must be one of {RECOMPUTE}, got {recompute!r}")
    if isinstance(seq, bool) or not isinstance(seq, int) or seq <= 0:
        raise ValueError(f"seq must be a positive integer, got {seq!r}")
    rates = sustained_rates(gpu_type, dtype)
    kernels, attn_name = training_kernels(spec, seq, dtype, recompute, gpu_type, attention_kernel)
    by_kind: dict[str, float] = {}
    for k in kernels:
        by_kind[k.kind] = by_kind.get(k.kind, 0.0) + k.time_s(rates)
    fixed_s = _fixed_bytes(spec, DTYPE_BYTES[rates.dtype]) / rates.memory_bytes_per_s
    return StepRoofline(rates, sum(by_kind.values()), fixed_s, OPTIMIZER_BYTES_PER_PARAM / rates.memory_bytes_per_s,
                        MappingProxyType(by_kind), attn_name, sum(k.count * k.flops for k in kernels))


__all__ = ["Kernel", "StepRoofline", "SustainedRates", "estimate_step_roofline", "sustained_rates", "training_kernels",
           "OPTIMIZER_BYTES_PER_PARAM"]
