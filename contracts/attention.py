"""Which SDPA kernel torch runs for the decoder's attention, and what it keeps for backward.

Pure Python, no torch. models/decoder.py calls `F.scaled_dot_product_attention(..., is_causal=True)`;
torch picks one backend per call (flash, memory-efficient, math, cuDNN; on CPU its flash kernel) by
device, compute capability, dtype, head_dim and grouped-query attention, and each saves different
tensors: fused kernels q, k, v, out and an fp32 log-sum-exp; math the fp32 B·heads·S² probabilities.
`select_kernel` reproduces that choice and `attention_saved_bytes` the bytes, for the memory model
(planner/core/memory.py) and the roofline (planner/core/roofline.py).

The rules per backend, read from torch 2.13.0's own sources, with where each comes from:
docs/models/memory.md ("Attention kernels"); the CPU facts are checked in tests/unit/test_attention.py.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from functools import lru_cache

from contracts.catalog import CPU_TYPE, get_gpu_type
from contracts.constants import DTYPES, FP32_BYTES

KERNELS = ("cpu_flash", "flash", "efficient", "math")
HALF_DTYPES = ("bf16", "fp16")

FLASH_MIN_SM, FUSED_MAX_SM = (8, 0), (12, 1)  # check_flash_attention_hardware_support
EFFICIENT_MIN_SM = (5, 0)  # check_mem_efficient_hardware_support
FLASH_MAX_HEAD_DIM = 256  # check_head_dim_size_flash
FLASH_HEAD_DIM_MULTIPLE = 8  # flash pads head_dim to a multiple of 8 (pad_last_dim<8>)
EFFICIENT_LSE_SEQ_MULTIPLE = 32  # logsumexp_dim = ceil(M / 32) * 32 (non-ROCm)
EFFICIENT_SUPPORTS_GQA = False  # torch 2.13.0; True from pytorch PR #191085 on


@dataclass(frozen=True)
class AttentionKernel:
    """The SDPA backend one attention call runs, and the shape of what it saves.

    expand_kv: the runtime must repeat K/V to num_heads (no enable_gqa) for this kernel to run;
    set where GQA alone would send the call to math. Then k and v are saved at num_heads."""

    name: str  # one of KERNELS
    expand_kv: bool
    saved_lse_bytes_per_token_head: int  # fp32 log-sum-exp per query token and head (0: math)
    lse_seq_multiple: int  # the saved log-sum-exp's sequence dim is rounded up to this
    head_dim_multiple: int  # q/k/v/out are saved padded to this head_dim multiple
    saves_scores: bool  # math: the fp32 (B, H, S, S) softmax output is kept
    reason: str  # why torch picks it (which check decides), for notes and the UI

    def to_dict(self) -> dict:
        return asdict(self)


def _fused(name: str, expand_kv: bool, reason: str) -> AttentionKernel:
    lse_multiple = EFFICIENT_LSE_SEQ_MULTIPLE if name == "efficient" else 1
    head_multiple = FLASH_HEAD_DIM_MULTIPLE if name == "flash" else 1
    return AttentionKernel(name, expand_kv, FP32_BYTES, lse_multiple, head_multiple, False, reason)


def _math(reason: str, expand_kv: bool = False) -> AttentionKernel:
    return AttentionKernel("math", expand_kv, 0, 1, 1, True, reason)


def kernel_by_name(name: str, expand_kv: bool = False) -> AttentionKernel:
    """The kernel `name` as if forced (torch.nn.attention.sdpa_kernel): to price a forced
    backend, or to check the formulas against a run that forces one."""
    if name not in KERNELS:
        raise ValueError(f"kernel must be one of {KERNELS}, got {name!r}")
    if name == "math":  # math repeats K/V to num_heads itself: expand_kv saves the same bytes
        return _math("forced", expand_kv)
    return _fused(name, expand_kv, "forced")


def _efficient_alignment(sm: tuple[int, int], dtype: str) -> int:
    """sdp_utils.cpp `minimum_gemm_alignment`: elements head_dim must be a multiple of."""
    half = dtype in HALF_DTYPES
    tensor_cores = sm[0] >= 8 or (sm[0] >= 7 and half)  # use_tensor_cores
    alignment = 4 if sm[0] >= 8 else 1
    return max(alignment, 128 // (16 if half else 32)) if tensor_cores else alignment


def _cuda_flash_ok(sm: tuple[int, int], dtype: str, head_dim: int) -> bool:
    if not (FLASH_MIN_SM <= sm <= FUSED_MAX_SM) or dtype not in HALF_DTYPES or head_dim > FLASH_MAX_HEAD_DIM:
        return False
    # training (inputs require grad) with 192 < head_dim <= 224 fails flash's backward there
    return not (sm in ((8, 6), (8, 7), (8, 8), (8, 9), (12, 0), (12, 1)) and 192 < head_dim <= 224)


def _cuda_efficient_ok(sm: tuple[int, int], dtype: str, head_dim: int) -> bool:
    dtypes = ("fp16", "fp32", "bf16") if sm[0] >= 8 else ("fp16", "fp32")
    return (EFFICIENT_MIN_SM <= sm <= FUSED_MAX_SM and dtype in dtypes
            and head_dim % _efficient_alignment(sm, dtype) == 0)


def _rocm_flash_ok(dtype: str, head_dim: int) -> bool:
    return dtype in HALF_DTYPES and head_dim <= FLASH_MAX_HEAD_DIM


def _rocm_efficient_ok(dtype: str, head_dim: int) -> bool:
    # AOTriton < 0.12 shares flash's head_dim check: a multiple of 8, at most 256
    return head_dim % 8 == 0 and head_dim <= FLASH_MAX_HEAD_DIM


@lru_cache(maxsize=1024)  # pure: the catalog is fixed at import, and a solve asks thousands of times
def select_kernel(device_type: str, dtype: str, num_heads: int, num_kv_heads: int,
                  head_dim: int) -> AttentionKernel:
    """The kernel torch 2.13 runs for the decoder's causal SDPA on a catalog device type
    (contracts/catalog.py) in the compute dtype, with K/V expanded where that keeps a fused
    kernel (expand_kv=True). Raises ValueError on unknown input."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}")
    if min(num_heads, num_kv_heads, head_dim) < 1 or num_heads % num_kv_heads:
        raise ValueError(f"need num_heads % num_kv_heads == 0 and positive sizes, got num_heads={num_heads}, "
                         f"num_kv_heads={num_kv_heads}, head_dim={head_dim}")
    gpu = get_gpu_type(device_type)
    gqa = num_kv_heads != num_heads
    if gpu.name == CPU_TYPE:
        return _fused("cpu_flash", False, "CPU: use_flash_attention_cpp takes every dtype, head_dim and GQA")
    if gpu.vendor == "amd":
        flash_ok, efficient_ok, where = _rocm_flash_ok(dtype, head_dim), _rocm_efficient_ok(dtype, head_dim), "ROCm"
        efficient_gqa = False
    else:
        sm = gpu.compute_capability
        if sm is None:
            raise ValueError(f"GPU type {device_type!r} has no CUDA compute capability in the catalog")
        flash_ok, efficient_ok = _cuda_flash_ok(sm, dtype, head_dim), _cuda_efficient_ok(sm, dtype, head_dim)
        where, efficient_gqa = f"sm{sm[0]}{sm[1]}", EFFICIENT_SUPPORTS_GQA
    if flash_ok:
        return _fused("flash", False, f"{where} {dtype} head_dim {head_dim}: flash (GQA native)")
    if efficient_ok and (not gqa or efficient_gqa):
        return _fused("efficient", False, f"{where} {dtype} head_dim {head_dim}: no flash, efficient")
    if efficient_ok:
        return _fused("efficient", True, f"{where} {dtype}: efficient has no GQA, so K/V are repeated "
                                         f"to {num_heads} heads instead of falling back to math")
    return _math(f"{where} {dtype} head_dim {head_dim}: no fused kernel accepts it")


def attention_saved_bytes(kernel: AttentionKernel, batch: int, seq: int, heads: int, kv_heads: int,
                          head_dim: int, width: int) -> int:
    """Bytes autograd keeps from ONE attention call until its backward: what SDPA saves plus
    its output as o_proj keeps it (the same storage for the fused kernels; math returns a
    contiguous (B, H, S, D) that the (B, S, H·D) reshape copies). `width` is the compute
    dtype's bytes (4 fp32, 2 bf16/fp16); heads/kv_heads are this GPU's (after tp)."""
    tokens = batch * seq
    if kernel.name == "math":
        acc = max(width, FP32_BYTES)  # _scaled_dot_product_attention_math upcasts 16-bit inputs
        qkv = 3 * acc * tokens * heads * head_dim  # q·√s, (k·√s)ᵀ, v, K/V repeated to `heads`
        scores = acc * batch * heads * seq * seq  # softmax output (B, H, S, S)
        out = width * tokens * heads * head_dim  # the output (cast back to `width`), reshaped for o_proj
        return qkv + scores + out
    d = math.ceil(head_dim / kernel.head_dim_multiple) * kernel.head_dim_multiple
    saved_kv = heads if kernel.expand_kv else kv_heads
    qkvo = width * tokens * d * (2 * heads + 2 * saved_kv)  # q, out (heads); k, v (saved_kv)
    lse_seq = math.ceil(seq / kernel.lse_seq_multiple) * kernel.lse_seq_multiple
    lse = kernel.saved_lse_bytes_per_token_head * batch * heads * lse_seq  # fp32 (B, H, lse_seq)
    return qkvo + lse


__all__ = ["AttentionKernel", "KERNELS", "attention_saved_bytes", "kernel_by_name", "select_kernel"]
