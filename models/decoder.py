"""One decoder-only transformer for both model families, built from a ModelSpec.

GPT-2 style ("gpt2"): learned positions, LayerNorm, GELU MLP, a bias on every
Linear, the LM head tied to the token embedding. Llama style ("llama"): RoPE,
RMSNorm, SwiGLU MLP, grouped-query attention, optional q/k/v biases (Qwen2),
an untied or tied head. This is the code the executor trains and the profiler
traces, so planner/memory.py models exactly the tensors it keeps for backward:
change a line here and the memory model (and its accuracy test) must follow.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from planner.specs import ModelSpec

RECOMPUTE = ("none", "full")
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


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class Attention(nn.Module):
    """Causal self-attention through SDPA. With GQA (num_kv_heads < num_heads) the call passes
    enable_gqa, which only the flash kernels take (planner/attention.py); expand_kv=True repeats
    K and V to num_heads first so that the memory-efficient kernel (fp32 on CUDA, sm < 80) runs
    instead of math: k and v are then saved at num_heads, with the same result."""

    def __init__(self, spec: ModelSpec, expand_kv: bool = False):
        super().__init__()
        h, hd = spec.hidden, spec.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = spec.num_heads, spec.num_kv_heads, hd
        self.expand_kv = expand_kv
        qkv_bias = spec.linear_bias or spec.qkv_bias
        # separate q/k/v (HF names): q and k die after RoPE, only v is kept by SDPA
        self.q_proj = nn.Linear(h, h, bias=qkv_bias)
        self.k_proj = nn.Linear(h, spec.num_kv_heads * hd, bias=qkv_bias)
        self.v_proj = nn.Linear(h, spec.num_kv_heads * hd, bias=qkv_bias)
        self.o_proj = nn.Linear(h, h, bias=spec.linear_bias)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
        B, T, C = x.shape
        q = self.q_proj(x).view(B, T, self.num_heads, self.head_dim).transpose(1, 2)  # (B, nh, T, hd)
        k = self.k_proj(x).view(B, T, self.num_kv_heads, self.head_dim).transpose(1, 2)  # (B, nkv, T, hd)
        v = self.v_proj(x).view(B, T, self.num_kv_heads, self.head_dim).transpose(1, 2)  # (B, nkv, T, hd)
        if rope is not None:
            cos, sin = rope  # (T, hd), already in the compute dtype
            q = q * cos + rotate_half(q) * sin
            k = k * cos + rotate_half(k) * sin
        return self.o_proj(self.attend(q, k, v))

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """(B, nh, T, hd) q and (B, nkv, T, hd) k, v (after RoPE) -> (B, T, h), o_proj's input."""
        B, _, T, _ = q.shape
        gqa = self.num_kv_heads != self.num_heads
        if gqa and self.expand_kv:
            # head i of q reads kv head i // groups, as enable_gqa does; backward sums the copies
            groups = self.num_heads // self.num_kv_heads
            k = k.repeat_interleave(groups, dim=1)  # (B, nh, T, hd)
            v = v.repeat_interleave(groups, dim=1)  # (B, nh, T, hd)
            gqa = False
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)  # (B, nh, T, hd)
        return y.transpose(1, 2).reshape(B, T, self.num_heads * self.head_dim)  # (B, T, h)


class MLP(nn.Module):
    def __init__(self, spec: ModelSpec):
        super().__init__()
        h, f, b = spec.hidden, spec.ffn_hidden, spec.linear_bias
        self.swiglu = spec.activation == "swiglu"
        if self.swiglu:
            self.gate_proj = nn.Linear(h, f, bias=False)
        self.up_proj = nn.Linear(h, f, bias=b)
        self.down_proj = nn.Linear(f, h, bias=b)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
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
        if spec.positional == "rope":
            self.register_buffer("inv_freq", self._inv_freq(torch.device("cpu")), persistent=False)
        self.apply(_init_weights)

    def _inv_freq(self, device: torch.device) -> torch.Tensor:
        """RoPE inverse frequencies (Su et al. 2021), (hd/2,) fp32."""
        hd = self.spec.head_dim
        return 1.0 / (self.spec.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.float32, device=device) / hd))

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
        x = self.norm(x)
        weight = self.embed.weight if self.lm_head is None else self.lm_head.weight
        return F.linear(x, weight)  # (B, T, V)

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


def _init_weights(m: nn.Module) -> None:
    # GPT-2 / Llama: N(0, 0.02) for every matrix, zero biases, unit norm weights
    if isinstance(m, (nn.Linear, nn.Embedding)):
        nn.init.normal_(m.weight, mean=0.0, std=INIT_STD)
        if getattr(m, "bias", None) is not None:
            nn.init.zeros_(m.bias)


def build_model(spec: ModelSpec, recompute: str = "none", expand_kv: bool = False) -> nn.Module:
    """The decoder for `spec`; deterministic given torch.manual_seed. Build under
    `torch.device("meta")` or FakeTensorMode to get shapes without memory. expand_kv: repeat
    K/V to num_heads before SDPA (planner.attention.select_kernel says where that pays)."""
    return Decoder(spec, recompute, expand_kv)


def num_parameters(model: nn.Module) -> int:
    """Distinct parameters (a tied head is counted once)."""
    return sum(p.numel() for p in model.parameters())


__all__ = ["build_model", "num_parameters", "Decoder", "RECOMPUTE"]
