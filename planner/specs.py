"""Model specifications: the architecture facts every cost model needs.

A `ModelSpec` is a frozen description of a decoder-only transformer. The torch
implementation in `models/` is built from it, the memory and time models read
it, and the parameter count below is exact for the real published checkpoints
(tests check each preset against its published figure).
"""
from __future__ import annotations

import os
from dataclasses import asdict, dataclass, fields, replace
from typing import Any

from planner.jsonio import load_json_file

FAMILIES = ("gpt2", "llama")


@dataclass(frozen=True)
class ModelSpec:
    """A decoder-only transformer.

    `family` fixes the block style: "gpt2" is learned positions, LayerNorm,
    GELU MLP (4h) and biases on every linear; "llama" is RoPE, RMSNorm, SwiGLU
    MLP and grouped-query attention without biases (Qwen2 adds q/k/v biases).
    """

    name: str
    family: str  # "gpt2" | "llama"
    num_layers: int
    hidden: int
    num_heads: int
    num_kv_heads: int
    ffn_hidden: int
    vocab_size: int
    max_seq: int
    tied_embeddings: bool
    linear_bias: bool = False  # GPT-2: bias on every Linear
    qkv_bias: bool = False  # Qwen2: bias on q/k/v only
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0

    def __post_init__(self) -> None:
        if self.family not in FAMILIES:
            raise ValueError(f"model {self.name!r}: family must be one of {FAMILIES}, got {self.family!r}")
        for f in ("num_layers", "hidden", "num_heads", "num_kv_heads", "ffn_hidden", "vocab_size", "max_seq"):
            v = getattr(self, f)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ValueError(f"model {self.name!r}: {f} must be a positive integer, got {v!r}")
        if self.hidden % self.num_heads:
            raise ValueError(
                f"model {self.name!r}: hidden {self.hidden} is not divisible by num_heads {self.num_heads}"
            )
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"model {self.name!r}: num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}"
            )

    # --- derived styles (names the torch code and the docs use) ---
    @property
    def head_dim(self) -> int:
        return self.hidden // self.num_heads

    @property
    def norm(self) -> str:
        return "layernorm" if self.family == "gpt2" else "rmsnorm"

    @property
    def activation(self) -> str:
        return "gelu" if self.family == "gpt2" else "swiglu"

    @property
    def positional(self) -> str:
        return "learned" if self.family == "gpt2" else "rope"

    # --- parameter counts (exact) ---
    def block_params(self) -> int:
        """Parameters of one transformer block."""
        h, kv = self.hidden, self.num_kv_heads * self.head_dim
        b = 1 if self.linear_bias else 0
        qkvb = 1 if (self.linear_bias or self.qkv_bias) else 0
        attn = h * (h + 2 * kv) + qkvb * (h + 2 * kv) + h * h + b * h  # qkv + out proj
        if self.family == "gpt2":
            mlp = 2 * h * self.ffn_hidden + b * (self.ffn_hidden + h)
            norms = 2 * 2 * h  # two LayerNorms, weight + bias
        else:
            mlp = 3 * h * self.ffn_hidden  # gate, up, down
            norms = 2 * h  # two RMSNorms, weight only
        return attn + mlp + norms

    def embedding_params(self) -> int:
        """Token (and learned position) embeddings plus the LM head if untied."""
        n = self.vocab_size * self.hidden
        if self.positional == "learned":
            n += self.max_seq * self.hidden
        if not self.tied_embeddings:
            n += self.vocab_size * self.hidden
        return n

    def final_norm_params(self) -> int:
        return 2 * self.hidden if self.norm == "layernorm" else self.hidden

    @property
    def num_params(self) -> int:
        return self.num_layers * self.block_params() + self.embedding_params() + self.final_norm_params()

    def matmul_params(self) -> int:
        """Weights that take part in a matmul per token: every Linear of every block plus
        the LM head (tied or not). Embedding lookups, norms and biases are excluded."""
        h, kv = self.hidden, self.num_kv_heads * self.head_dim
        mlp_mats = 2 if self.family == "gpt2" else 3
        per_block = h * (h + 2 * kv) + h * h + mlp_mats * h * self.ffn_hidden
        return self.num_layers * per_block + self.vocab_size * h

    def flops_per_token(self, seq: int) -> float:
        """Training FLOPs per token (forward + backward = 3x forward):
        6·N_matmul for the dense matmuls plus 12·L·h·s for attention scores and
        values over the full s×s square (Kaplan et al. 2020, eq. 2.1 / PaLM app. B;
        SDPA's math path does not skip the causal half)."""
        return 6.0 * self.matmul_params() + 12.0 * self.num_layers * self.hidden * seq

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ModelSpec":
        known = {f.name for f in fields(cls)}
        unknown = set(d) - known
        if unknown:
            raise ValueError(f"model spec: unknown keys {sorted(unknown)}")
        return cls(**d)

    @classmethod
    def from_hf_config(cls, path: str) -> "ModelSpec":
        """Read a Hugging Face `config.json` (GPT-2, Llama, Mistral, Qwen2) offline."""
        cfg = load_json_file(path, "config file")
        if not isinstance(cfg, dict):
            raise ValueError(f"config file {path}: expected a JSON object")
        name = os.path.basename(os.path.dirname(os.path.abspath(path))) or "custom"
        return spec_from_hf_dict(cfg, name=name, source=path)


def _need(cfg: dict, key: str, source: str, *alts: str) -> Any:
    for k in (key, *alts):
        if k in cfg:
            return cfg[k]
    raise ValueError(f"{source}: missing key {key!r}")


def spec_from_hf_dict(cfg: dict, name: str = "custom", source: str = "config") -> ModelSpec:
    """Build a ModelSpec from the dict of a Hugging Face config."""
    mtype = cfg.get("model_type", "")
    try:
        if mtype == "gpt2" or "n_embd" in cfg:
            h = int(_need(cfg, "n_embd", source))
            return ModelSpec(
                name=name, family="gpt2",
                num_layers=int(_need(cfg, "n_layer", source)), hidden=h,
                num_heads=int(_need(cfg, "n_head", source)),
                num_kv_heads=int(_need(cfg, "n_head", source)),
                ffn_hidden=int(cfg.get("n_inner") or 4 * h),
                vocab_size=int(_need(cfg, "vocab_size", source)),
                max_seq=int(_need(cfg, "n_positions", source, "n_ctx")),
                tied_embeddings=bool(cfg.get("tie_word_embeddings", True)),
                linear_bias=True, norm_eps=float(cfg.get("layer_norm_epsilon", 1e-5)),
            )
        if mtype in ("llama", "mistral", "qwen2") or "intermediate_size" in cfg:
            heads = int(_need(cfg, "num_attention_heads", source))
            return ModelSpec(
                name=name, family="llama",
                num_layers=int(_need(cfg, "num_hidden_layers", source)),
                hidden=int(_need(cfg, "hidden_size", source)),
                num_heads=heads,
                num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
                ffn_hidden=int(_need(cfg, "intermediate_size", source)),
                vocab_size=int(_need(cfg, "vocab_size", source)),
                max_seq=int(cfg.get("max_position_embeddings", 4096)),
                tied_embeddings=bool(cfg.get("tie_word_embeddings", False)),
                qkv_bias=(mtype == "qwen2") or bool(cfg.get("attention_bias", False)),
                norm_eps=float(cfg.get("rms_norm_eps", 1e-5)),
                rope_theta=float(cfg.get("rope_theta", 10000.0)),
            )
    except (TypeError, ValueError) as e:
        if isinstance(e, ValueError) and str(e).startswith(source):
            raise
        raise ValueError(f"{source}: bad value: {e}") from None
    raise ValueError(
        f"{source}: unsupported model_type {mtype!r} (supported: gpt2, llama, mistral, qwen2)"
    )


def _gpt2(name: str, layers: int, hidden: int, heads: int, vocab: int = 50257, seq: int = 1024) -> ModelSpec:
    return ModelSpec(name, "gpt2", layers, hidden, heads, heads, 4 * hidden, vocab, seq,
                     tied_embeddings=True, linear_bias=True)


def _llama(name: str, layers: int, hidden: int, heads: int, kv: int, ffn: int, vocab: int, seq: int,
           tied: bool = False, qkv_bias: bool = False, theta: float = 10000.0, eps: float = 1e-5) -> ModelSpec:
    return ModelSpec(name, "llama", layers, hidden, heads, kv, ffn, vocab, seq,
                     tied_embeddings=tied, qkv_bias=qkv_bias, rope_theta=theta, norm_eps=eps)


# Presets. Published parameter counts (checked in tests/test_specs.py):
# GPT-2 124M/355M/774M/1.5B (Radford et al. 2019, HF model cards), Llama-2 6.74B/13.0B
# (Touvron et al. 2023), Llama-3-8B 8.03B, Mistral-7B 7.24B, Qwen2-0.5B 494M.
PRESETS: dict[str, ModelSpec] = {
    # byte-level vocabulary (256) so the default corpus needs no tokenizer download
    "tiny": _gpt2("tiny", 2, 64, 4, vocab=256, seq=128),
    "tiny-llama": _llama("tiny-llama", 2, 64, 4, 2, 176, 256, 128),
    "small": _gpt2("small", 4, 128, 4, vocab=256, seq=256),
    "gpt2": _gpt2("gpt2", 12, 768, 12),
    "gpt2-medium": _gpt2("gpt2-medium", 24, 1024, 16),
    "gpt2-large": _gpt2("gpt2-large", 36, 1280, 20),
    "gpt2-xl": _gpt2("gpt2-xl", 48, 1600, 25),
    # GPT-3 2.7B shape (Brown et al. 2020, table 2.1): Cephalo's 2.7B GPT
    "gpt-2.7b": _gpt2("gpt-2.7b", 32, 2560, 32, seq=2048),
    "tinyllama-1.1b": _llama("tinyllama-1.1b", 22, 2048, 32, 4, 5632, 32000, 2048),
    "qwen2-0.5b": _llama("qwen2-0.5b", 24, 896, 14, 2, 4864, 151936, 32768, tied=True,
                         qkv_bias=True, theta=1000000.0, eps=1e-6),
    "llama2-7b": _llama("llama2-7b", 32, 4096, 32, 32, 11008, 32000, 4096),
    "llama2-13b": _llama("llama2-13b", 40, 5120, 40, 40, 13824, 32000, 4096),
    "llama3-8b": _llama("llama3-8b", 32, 4096, 32, 8, 14336, 128256, 8192, theta=500000.0),
    "mistral-7b": _llama("mistral-7b", 32, 4096, 32, 8, 14336, 32000, 32768),
}


def get_model(name_or_path: str) -> ModelSpec:
    """A preset by name, or a Hugging Face `config.json` by path."""
    if name_or_path in PRESETS:
        return PRESETS[name_or_path]
    if name_or_path.endswith(".json") or os.path.sep in name_or_path or os.path.exists(name_or_path):
        return ModelSpec.from_hf_config(name_or_path)
    raise ValueError(
        f"unknown model {name_or_path!r}: use a preset ({', '.join(PRESETS)}) or a path to a config.json"
    )


def with_max_seq(spec: ModelSpec, seq: int) -> ModelSpec:
    """The same model with a longer position table (only matters for learned positions)."""
    return spec if seq <= spec.max_seq else replace(spec, max_seq=seq)
