"""One decoder-only transformer for both model families, built from a ModelSpec.

GPT-2 style ("gpt2"): learned positions, LayerNorm, GELU MLP, a bias on every
Linear, the LM head tied to the token embedding. Llama style ("llama"): RoPE
(default, linear or Llama-3 frequency scaling), RMSNorm, SwiGLU MLP, grouped-query
attention, an explicit head_dim, optional q/k/v biases (Qwen2), q/k/v/o and MLP biases
(Llama's attention_bias / mlp_bias), an untied or tied head. This is the code the executor
trains and the profiler traces, so planner/core/memory.py models exactly the tensors it keeps for
backward: change a line here and the memory model (and its accuracy test) must follow.
Tensor parallelism (models/tensor.apply_tp) swaps in parallel Linears and embeddings and sets the
`tp_enter` hooks, identity here, at the input of attention, of the MLP and of the head.

Given the same weights it computes what `transformers` computes for the same config
(tests/unit/test_hf_parity.py: logits within 1e-5 in fp32); `hf_state_dict_to_decoder` and
`decoder_state_dict_to_hf` translate the weights' names and layouts both ways. Dropout is not
implemented (the decoder trains without it; transformers' eval mode is what it equals).
"""
from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from contracts.specs import ModelSpec
from contracts.constants import RECOMPUTE

INIT_STD = 0.02  # GPT-2 / Llama initializer_range


class RMSNorm(nn.Module):
    """y = x / sqrt(mean(x^2) + eps) * w (Zhang & Sennrich 2019), written out so
    every saved tensor is visible: x, rsqrt (B, T, 1), x*rsqrt (B, T, h)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.float()  # statistics in fp32 even under autocast (no-op for fp32 input)
        r = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)  # (B, T, 1)
        return (x * r) * self.weight


def no_tp(x: torch.Tensor) -> torch.Tensor:
    """The `tp_enter` hook of attention, the MLP and the head without tensor parallelism: identity.
    models/tensor.apply_tp sets it to Megatron's f operator (identity forward, the input gradient
    all-reduced over the TP group in backward)."""
    return x


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class Attention(nn.Module):
    """Causal self-attention through SDPA. With GQA (num_kv_heads < num_heads) the call passes
    enable_gqa, which only the flash kernels take (contracts/attention.py); expand_kv=True repeats
    K and V to num_heads first so that the memory-efficient kernel (fp32 on CUDA, sm < 80) runs
    instead of math: k and v are then saved at num_heads, with the same result."""

    def __init__(self, spec: ModelSpec, expand_kv: bool = False):
        super().__init__()
        h, hd, q = spec.hidden, spec.head_dim, spec.q_width
        self.num_heads, self.num_kv_heads, self.head_dim = spec.num_heads, spec.num_kv_heads, hd
        self.expand_kv = expand_kv
        qkv_bias = spec.linear_bias or spec.qkv_bias
        # separate q/k/v (HF names): q and k die after RoPE, only v is kept by SDPA
        self.q_proj = nn.Linear(h, q, bias=qkv_bias)
        self.k_proj = nn.Linear(h, spec.num_kv_heads * hd, bias=qkv_bias)
        self.v_proj = nn.Linear(h, spec.num_kv_heads * hd, bias=qkv_bias)
        self.o_proj = nn.Linear(q, h, bias=spec.linear_bias or spec.o_bias)
        self.tp_enter = no_tp

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
        B, T, C = x.shape
        x = self.tp_enter(x)  # tensor parallel: num_heads, num_kv_heads are this rank's (models/tensor.py)
        q = self.q_proj(x).view(B, T, self.num_heads, self.head_dim).transpose(1, 2)  # (B, nh, T, hd)
        k = self.k_proj(x).view(B, T, self.num_kv_heads, self.head_dim).transpose(1, 2)  # (B, nkv, T, hd)
        v = self.v_proj(x).view(B, T, self.num_kv_heads, self.head_dim).transpose(1, 2)  # (B, nkv, T, hd)
        if rope is not None:
            cos, sin = rope  # (T, hd), already in the compute dtype
            q = q * cos + rotate_half(q) * sin
            k = k * cos + rotate_half(k) * sin
        return self.o_proj(self.attend(q, k, v))

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """(B, nh, T, hd) q and (B, nkv, T, hd) k, v (after RoPE) -> (B, T, nh·hd), o_proj's input."""
        B, _, T, _ = q.shape
        gqa = self.num_kv_heads != self.num_heads
        if gqa and self.expand_kv:
            # head i of q reads kv head i // groups, as enable_gqa does; backward sums the copies
            groups = self.num_heads // self.num_kv_heads
            k = k.repeat_interleave(groups, dim=1)  # (B, nh, T, hd)
            v = v.repeat_interleave(groups, dim=1)  # (B, nh, T, hd)
            gqa = False
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)  # (B, nh, T, hd)
        return y.transpose(1, 2).reshape(B, T, self.num_heads * self.head_dim)  # (B, T, nh·hd)


class MLP(nn.Module):
    def __init__(self, spec: ModelSpec):
        super().__init__()
        h, f, b = spec.hidden, spec.ffn_hidden, spec.linear_bias or spec.mlp_bias
        self.swiglu = spec.activation == "swiglu"
        if self.swiglu:
            self.gate_proj = nn.Linear(h, f, bias=spec.mlp_bias)
        self.up_proj = nn.Linear(h, f, bias=b)
        self.down_proj = nn.Linear(f, h, bias=b)
        self.tp_enter = no_tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.tp_enter(x)
        if self.swiglu:  # Shazeer 2020: down(silu(gate x) * up x)
            return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        return self.down_proj(F.gelu(self.up_proj(x), approximate="tanh"))  # GPT-2's gelu_new


def _norm(spec: ModelSpec) -> nn.Module:
    if spec.norm == "layernorm":
        return nn.LayerNorm(spec.hidden, eps=spec.norm_eps)
    return RMSNorm(spec.hidden, spec.norm_eps)


class Block(nn.Module):
    """Pre-norm residual block: x + attn(norm(x)), then + mlp(norm(x))."""

    def __init__(self, spec: ModelSpec, expand_kv: bool = False):
        super().__init__()
        self.attn_norm = _norm(spec)
        self.attn = Attention(spec, expand_kv)
        self.mlp_norm = _norm(spec)
        self.mlp = MLP(spec)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), rope)
        return x + self.mlp(self.mlp_norm(x))


class Decoder(nn.Module):
    def __init__(self, spec: ModelSpec, recompute: str = "none", expand_kv: bool = False):
        super().__init__()
        if recompute not in RECOMPUTE:
            raise ValueError(f"recompute must be one of {RECOMPUTE}, got {recompute!r}")
        self.spec, self.recompute, self.expand_kv = spec, recompute, expand_kv
        self.embed = nn.Embedding(spec.vocab_size, spec.hidden)
        self.pos_embed = nn.Embedding(spec.max_seq, spec.hidden) if spec.positional == "learned" else None
        self.blocks = nn.ModuleList(Block(spec, expand_kv) for _ in range(spec.num_layers))
        self.norm = _norm(spec)
        self.lm_head = None if spec.tied_embeddings else nn.Linear(spec.hidden, spec.vocab_size, bias=False)
        self.tp_enter = no_tp  # tensor parallel: f before the (vocabulary-parallel) head
        if spec.positional == "rope":
            self.register_buffer("inv_freq", self._inv_freq(torch.device("cpu")), persistent=False)
        self.apply(_init_weights)

    def _inv_freq(self, device: torch.device) -> torch.Tensor:
        return rope_inv_freq(self.spec, device)

    def init_buffers(self, device: torch.device) -> None:
        """Make the non-parameter buffers on `device` (a model built on the meta device has none)."""
        if self.spec.positional == "rope":
            self.inv_freq = self._inv_freq(device)

    def _rope(self, T: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        pos = torch.arange(T, device=device, dtype=torch.float32)
        freqs = torch.outer(pos, self.inv_freq)  # (T, hd/2)
        emb = torch.cat((freqs, freqs), dim=-1)  # (T, hd)
        # cast once per forward to the dtype q/k have (bf16 under autocast), not per layer
        dtype = torch.get_autocast_dtype(device.type) if torch.is_autocast_enabled(device.type) else torch.float32
        return emb.cos().to(dtype), emb.sin().to(dtype)

    def rope(self, T: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor] | None:
        """RoPE's (cos, sin) for T positions in the compute dtype, or None for learned positions."""
        return None if self.pos_embed is not None else self._rope(T, device)

    def embed_tokens(self, idx: torch.Tensor) -> torch.Tensor:
        """(B, T) token ids -> (B, T, h) residual stream input."""
        T = idx.shape[1]
        if T > self.spec.max_seq:
            raise ValueError(f"sequence {T} exceeds the model's max_seq {self.spec.max_seq}")
        x = self.embed(idx)  # (B, T, h)
        if self.pos_embed is not None:
            x = x + self.pos_embed(torch.arange(T, device=idx.device))  # (B, T, h) + (T, h)
        return x

    def head_logits(self, x: torch.Tensor) -> torch.Tensor:
        """(B, T, h) last block output -> (B, T, V) logits (final norm, then the head)."""
        x = self.tp_enter(self.norm(x))
        weight = self.embed.weight if self.lm_head is None else self.lm_head.weight
        return F.linear(x, weight)  # (B, T, V); tensor parallel: this rank's (B, T, V_r) slice

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(idx)
        rope = self.rope(idx.shape[1], idx.device)
        for block in self.blocks:
            if self.recompute == "full":
                # keep only the block input; recompute the block in backward
                x = checkpoint(block, x, rope, use_reentrant=False)
            else:
                x = block(x, rope)
        return self.head_logits(x)


def rope_inv_freq(spec: ModelSpec, device: torch.device | None = None) -> torch.Tensor:
    """RoPE inverse frequencies (Su et al. 2021), (hd/2,) fp32, scaled as spec.rope_type says:
    "linear" divides all by the factor (kaiokendev); "llama3" (Llama 3.1) keeps the high
    frequencies, divides those with a wavelength above original_max_seq / low_freq_factor and
    interpolates in between: transformers' _compute_llama3_parameters, op for op."""
    hd = spec.head_dim
    inv_freq = 1.0 / (spec.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.float32, device=device) / hd))
    if spec.rope_type == "linear":
        return inv_freq / spec.rope_factor
    if spec.rope_type == "llama3":
        factor, low, high = spec.rope_factor, spec.rope_low_freq_factor, spec.rope_high_freq_factor
        old_len = spec.rope_original_max_seq
        low_freq_wavelen, high_freq_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
        return torch.where(medium, smoothed, scaled)
    return inv_freq


def _init_weights(m: nn.Module) -> None:
    # GPT-2 / Llama: N(0, 0.02) for every matrix, zero biases, unit norm weights
    if isinstance(m, (nn.Linear, nn.Embedding)):
        nn.init.normal_(m.weight, mean=0.0, std=INIT_STD)
        if getattr(m, "bias", None) is not None:
            nn.init.zeros_(m.bias)


def build_model(spec: ModelSpec, recompute: str = "none", expand_kv: bool = False) -> nn.Module:
    """The decoder for `spec`; deterministic given torch.manual_seed. Build under
    `torch.device("meta")` or FakeTensorMode to get shapes without memory. expand_kv: repeat
    K/V to num_heads before SDPA (contracts.attention.select_kernel says where that pays)."""
    return Decoder(spec, recompute, expand_kv)


def num_parameters(model: nn.Module) -> int:
    """Distinct parameters (a tied head is counted once)."""
    return sum(p.numel() for p in model.parameters())


# --- Hugging Face weights <-> decoder weights ----------------------------------------------
# The decoder keeps transformers' Llama names under its own prefixes; GPT-2 stores each Linear
# as a Conv1D, weight (in, out), so every matrix is transposed, and fuses q/k/v in c_attn
# (output columns [q | k | v]).

_HF_PREFIX = {"gpt2": "transformer.", "llama": "model."}
_GPT2_BLOCK = {"attn_norm": "ln_1", "mlp_norm": "ln_2", "attn.o_proj": "attn.c_proj",
               "mlp.up_proj": "mlp.c_fc", "mlp.down_proj": "mlp.c_proj"}
_LLAMA_BLOCK = {"attn_norm": "input_layernorm", "mlp_norm": "post_attention_layernorm"}
# checkpoint entries that are buffers, not weights (GPT-2's causal mask, old Llama RoPE caches)
_HF_IGNORED = re.compile(r"(\.attn\.bias|\.attn\.masked_bias|\.rotary_emb\.inv_freq)$")


@dataclass(frozen=True)
class HfSource:
    """Where a decoder parameter lives in a Hugging Face checkpoint."""

    key: str  # the checkpoint's tensor name (with transformers' model prefix)
    transpose: bool = False  # GPT-2 Conv1D: stored (in, out)
    part: int | None = None  # GPT-2 c_attn: the q (0), k (1) or v (2) third of the last dim


def decoder_parameter_names(spec: ModelSpec) -> list[str]:
    """The decoder's parameter names in state_dict order (built on the meta device: no memory)."""
    with torch.device("meta"):
        return [n for n, _ in Decoder(spec).named_parameters()]


def hf_source(spec: ModelSpec, name: str) -> HfSource:
    """The checkpoint tensor (and layout) holding decoder parameter `name`."""
    pre = _HF_PREFIX[spec.family]
    if name == "lm_head.weight":
        return HfSource("lm_head.weight")
    top = {"embed.weight": "wte.weight" if spec.family == "gpt2" else "embed_tokens.weight",
           "pos_embed.weight": "wpe.weight"}
    if name in top:
        return HfSource(pre + top[name])
    if name.startswith("norm."):
        return HfSource(pre + ("ln_f." + name[len("norm."):] if spec.family == "gpt2" else name))
    m = re.fullmatch(r"blocks\.(\d+)\.(.+)\.(weight|bias)", name)
    if m is None:
        raise ValueError(f"no Hugging Face name for decoder parameter {name!r}")
    i, module, kind = m.groups()
    if spec.family == "llama":
        hf_module = _LLAMA_BLOCK.get(module, module.replace("attn.", "self_attn."))
        return HfSource(f"{pre}layers.{i}.{hf_module}.{kind}")
    qkv = {"attn.q_proj": 0, "attn.k_proj": 1, "attn.v_proj": 2}
    if module in qkv:
        return HfSource(f"{pre}h.{i}.attn.c_attn.{kind}", transpose=kind == "weight", part=qkv[module])
    is_linear = module not in ("attn_norm", "mlp_norm")
    return HfSource(f"{pre}h.{i}.{_GPT2_BLOCK[module]}.{kind}", transpose=is_linear and kind == "weight")


def hf_state_dict_to_decoder(spec: ModelSpec, sd: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A transformers checkpoint's tensors (names with or without the model prefix, e.g. the hub's
    GPT-2 files that lack "transformer.") -> the decoder's state dict. A tied head's lm_head.weight
    is dropped (it is the embedding). ValueError naming missing, unexpected or misshapen tensors."""
    pre = _HF_PREFIX[spec.family]
    by_key = {(k if k.startswith(pre) or k == "lm_head.weight" else pre + k): k for k in sd}
    with torch.device("meta"):
        shapes = {n: p.shape for n, p in Decoder(spec).named_parameters()}
    out, used = {}, set()
    for name, shape in shapes.items():
        src = hf_source(spec, name)
        if src.key not in by_key:
            raise ValueError(f"checkpoint misses {src.key!r} (for the decoder's {name})")
        used.add(src.key)
        t = sd[by_key[src.key]]
        if src.part is not None:
            width = t.shape[-1] // 3
            t = t.narrow(-1, src.part * width, width)
        if src.transpose:
            t = t.t()
        if tuple(t.shape) != tuple(shape):
            raise ValueError(f"checkpoint {src.key!r}: shape {tuple(t.shape)} does not fit the decoder's {name} "
                             f"{tuple(shape)}")
        out[name] = t.contiguous()
    extra = sorted(k for k in by_key if k not in used and not _HF_IGNORED.search(k)
                   and not (k == "lm_head.weight" and spec.tied_embeddings))
    if extra:
        raise ValueError(f"checkpoint has {len(extra)} tensors the model does not: {', '.join(extra[:3])}")
    return out


def decoder_state_dict_to_hf(spec: ModelSpec, sd: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The decoder's state dict -> transformers' names and layouts (contiguous tensors, GPT-2's
    q/k/v fused into c_attn), ready for safetensors; a tied head has no lm_head.weight."""
    out: dict[str, torch.Tensor] = {}
    parts: dict[str, list[torch.Tensor | None]] = {}
    for name in decoder_parameter_names(spec):
        src = hf_source(spec, name)
        t = sd[name].t() if src.transpose else sd[name]
        if src.part is None:
            out[src.key] = t.contiguous()
        else:
            parts.setdefault(src.key, [None, None, None])[src.part] = t
    for key, (q, k, v) in parts.items():
        out[key] = torch.cat((q, k, v), dim=-1).contiguous()
    return out


__all__ = ["build_model", "num_parameters", "Decoder", "RECOMPUTE", "HfSource", "hf_source",
           "decoder_parameter_names", "hf_state_dict_to_decoder", "decoder_state_dict_to_hf", "rope_inv_freq"]
