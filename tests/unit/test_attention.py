"""contracts/attention.py against torch itself: the kernel table, the expand_kv runtime path, and
the saved bytes of one real attention call (saved_tensors_hooks on CPU; torch's meta kernels
for the CUDA-only backends)."""
from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F
from torch.autograd.graph import saved_tensors_hooks
from torch.nn.attention import SDPBackend, sdpa_kernel

from models.decoder import build_model
from contracts.attention import attention_saved_bytes, kernel_by_name, select_kernel
from contracts.catalog import CATALOG
from contracts.specs import PRESETS

TABLE = [
    # device, dtype, heads, kv_heads, head_dim -> kernel, expand_kv
    ("T4", "fp16", 32, 8, 128, "efficient", True),  # sm75: no flash, efficient lacks GQA
    ("T4", "fp16", 32, 32, 128, "efficient", False),
    ("V100-16GB", "fp16", 32, 8, 128, "efficient", True),
    ("P40", "fp32", 32, 8, 128, "efficient", True),  # sm61 >= sm50
    ("A100-80GB", "bf16", 32, 8, 128, "flash", False),  # flash takes GQA
    ("A100-80GB", "fp32", 32, 32, 128, "efficient", False),  # flash is 16-bit only
    ("A100-80GB", "fp32", 32, 8, 128, "efficient", True),
    ("H100-SXM", "bf16", 14, 2, 64, "flash", False),
    ("RTX4090", "fp16", 32, 8, 128, "flash", False),
    ("A100-80GB", "bf16", 8, 8, 200, "flash", False),
    ("L4", "bf16", 8, 8, 200, "efficient", False),  # sm89: flash backward lacks 192 < hd <= 224
    ("L4", "bf16", 8, 2, 256, "flash", False),  # ... but takes 256
    ("A100-80GB", "bf16", 8, 2, 512, "efficient", True),  # flash: head_dim <= 256
    ("T4", "bf16", 8, 8, 128, "math", False),  # no bf16 kernel before sm80
    ("T4", "fp16", 8, 2, 100, "math", False),  # efficient on sm75 needs head_dim % 8 == 0
    ("MI300X", "bf16", 32, 8, 128, "flash", False),
    ("MI300X", "fp32", 32, 8, 128, "efficient", True),
    ("cpu", "fp32", 4, 2, 16, "cpu_flash", False),
    ("cpu", "bf16", 4, 2, 100, "cpu_flash", False),
]


@pytest.mark.parametrize("device,dtype,heads,kv,hd,name,expand", TABLE)
def test_kernel_table(device, dtype, heads, kv, hd, name, expand):
    k = select_kernel(device, dtype, heads, kv, hd)
    assert (k.name, k.expand_kv) == (name, expand), k.reason


def test_bad_input_and_catalog_capabilities():
    for args in [("cpu", "fp8", 4, 4, 16), ("cpu", "fp32", 4, 3, 16), ("cpu", "fp32", 4, 4, 0), ("TPU", "fp32", 4, 4, 16)]:
        with pytest.raises(ValueError):
            select_kernel(*args)
    assert CATALOG["T4"].compute_capability == (7, 5) and CATALOG["cpu"].compute_capability is None
    for gpu in CATALOG.values():  # every NVIDIA type has one and gets a kernel
        assert (gpu.compute_capability is not None) == (gpu.vendor == "nvidia"), gpu.name
        assert select_kernel(gpu.name, "fp32", 8, 2, 64).name in ("cpu_flash", "efficient")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kv", [4, 2])
def test_cpu_runs_the_flash_kernel(dtype, kv):
    """What torch itself chooses on CPU for the table's cpu rows."""
    q = torch.randn(1, 4, 24, 16, dtype=dtype, requires_grad=True)
    k = torch.randn(1, kv, 24, 16, dtype=dtype, requires_grad=True)
    gqa = kv != 4
    assert torch._fused_sdp_choice(q, k, k, is_causal=True, enable_gqa=gqa) == SDPBackend.FLASH_ATTENTION.value
    y = F.scaled_dot_product_attention(q, k, k, is_causal=True, enable_gqa=gqa)
    assert type(y.grad_fn).__name__ == "ScaledDotProductFlashAttentionForCpuBackward0"


def test_expand_kv_is_numerically_the_gqa_call():
    spec = PRESETS["tiny-llama"]
    assert spec.num_kv_heads < spec.num_heads
    idx = torch.randint(0, spec.vocab_size, (2, 24), generator=torch.Generator().manual_seed(1))
    runs = []
    for expand in (False, True):
        torch.manual_seed(0)
        model = build_model(spec, expand_kv=expand)
        logits = model(idx)
        logits.float().square().mean().backward()
        runs.append((logits.detach(), [p.grad for p in model.parameters()]))
    (y0, g0), (y1, g1) = runs
    assert (y0 - y1).abs().max().item() <= 1e-6
    assert max((a - b).abs().max().item() for a, b in zip(g0, g1)) <= 1e-6
    assert all(g.abs().sum() > 0 for g in g0)  # the comparison is not of zeros


def _measure(spec, expand_kv: bool, autocast: bool, force_math: bool, batch=2, seq=40) -> int:
    """Run one real Attention.forward (projections, RoPE, SDPA, o_proj) and count the distinct
    storages autograd saves inside its `attend` step, plus attend's output, which o_proj saves."""
    torch.manual_seed(0)
    model = build_model(spec, expand_kv=expand_kv)
    attn = model.blocks[0].attn
    storages: dict[int, int] = {}

    def pack(t):
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    real_attend = attn.attend

    def traced_attend(q, k, v):
        with saved_tensors_hooks(pack, lambda t: t):
            y = real_attend(q, k, v)
        pack(y)  # o_proj's saved input (the same storage as SDPA's saved output when fused)
        assert y.dtype == (torch.bfloat16 if autocast else torch.float32)
        return y

    attn.attend = traced_attend
    x = torch.randn(batch, seq, spec.hidden, requires_grad=True)
    amp = torch.autocast("cpu", dtype=torch.bfloat16) if autocast else contextlib.nullcontext()
    backend = sdpa_kernel(SDPBackend.MATH) if force_math else contextlib.nullcontext()
    with amp, backend:
        attn(x, model.rope(seq, x.device)).sum().backward()  # backward runs: what was saved is used
    return sum(storages.values())


@pytest.mark.parametrize("name", ["tiny", "tiny-llama"])
@pytest.mark.parametrize("autocast", [False, True])
@pytest.mark.parametrize("expand_kv,force_math", [(False, False), (True, False), (False, True)])
def test_saved_bytes_of_one_cpu_attention_call(name, autocast, expand_kv, force_math):
    spec = PRESETS[name]
    width = 2 if autocast else 4
    measured = _measure(spec, expand_kv, autocast, force_math)
    if force_math:
        kernel = kernel_by_name("math")
    else:
        kernel = select_kernel("cpu", "bf16" if autocast else "fp32", spec.num_heads, spec.num_kv_heads, spec.head_dim)
        assert kernel.name == "cpu_flash" and not kernel.expand_kv
        if expand_kv:  # the runtime expanded anyway: k and v are saved at num_heads
            kernel = kernel_by_name("cpu_flash", expand_kv=True)
    predicted = attention_saved_bytes(kernel, 2, 40, spec.num_heads, spec.num_kv_heads, spec.head_dim, width)
    assert measured == predicted


@pytest.mark.parametrize("dtype,width", [(torch.bfloat16, 2), (torch.float32, 4)])
@pytest.mark.parametrize("seq", [40, 64])
def test_cuda_kernels_saved_bytes_match_torch_meta(dtype, width, seq):
    """Flash and efficient run only on CUDA: their outputs' shapes and dtypes from torch's
    meta kernels (torch/_meta_registrations.py), with what derivatives.yaml saves:
    query, key, value, output, logsumexp."""
    B, H, KV, D = 2, 8, 2, 64
    q = torch.empty(B, H, seq, D, dtype=dtype, device="meta")
    kv = torch.empty(B, KV, seq, D, dtype=dtype, device="meta")
    kv_full = torch.empty(B, H, seq, D, dtype=dtype, device="meta")

    def nbytes(*ts):
        return sum(t.numel() * t.element_size() for t in ts)

    out, lse, *_ = torch.ops.aten._scaled_dot_product_efficient_attention(q, kv_full, kv_full, None, True, 0.0, True)
    assert nbytes(q, kv_full, kv_full, out, lse) == attention_saved_bytes(
        kernel_by_name("efficient", expand_kv=True), B, seq, H, KV, D, width)
    if dtype == torch.bfloat16:  # flash is 16-bit only
        out, lse, *_ = torch.ops.aten._scaled_dot_product_flash_attention(q, kv, kv, 0.0, True)
        assert nbytes(q, kv, kv, out, lse) == attention_saved_bytes(kernel_by_name("flash"), B, seq, H, KV, D, width)
