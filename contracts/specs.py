"""Model specifications: the architecture facts every cost model needs.

A `ModelSpec` is a frozen description of a decoder-only transformer: models/decoder.py is built
from it, the memory and time models read it, and its parameter count is exact for the published
checkpoints (tests check each preset, and each supported Hugging Face family against
`transformers`' `num_parameters()`). Hugging Face configs (`spec_from_hf_dict`) are read strictly:
a key whose value the decoder does not implement exactly is refused with one line naming it.
Supported: GPT-2, Llama 1/2/3.x, Mistral, Qwen2/2.5; refused: mixture of experts, Gemma, other model
types, other activations or RoPE types, partial rotary embeddings. Sliding-window attention is
honoured by capping `max_seq` at the window (within it, it IS causal attention), so longer
sequences are refused, not mispredicted. Adding a family: docs/EXTENDING.md.
"""
from __future__ import annotations

import logging
import os
from dataclasses import asdict, dataclass, fields, replace
from functools import cached_property
from typing import Any

from contracts.constants import (MAX_CONFIG_FILE_BYTES, MAX_MODEL_HEADS, MAX_MODEL_HIDDEN, MAX_MODEL_LAYERS,
                                 MAX_MODEL_SEQ, MAX_MODEL_VOCAB)
from contracts.jsonio import load_json_file

log = logging.getLogger(__name__)

FAMILIES = ("gpt2", "llama")
# the largest value each size field may take (contracts/constants.py): a config claiming 10^9 layers is
# refused here, before a cost model builds anything per layer
_HIDDEN = (MAX_MODEL_HIDDEN, "MAX_MODEL_HIDDEN")
_HEADS = (MAX_MODEL_HEADS, "MAX_MODEL_HEADS")
_SEQ = (MAX_MODEL_SEQ, "MAX_MODEL_SEQ")
SIZE_LIMITS = {"num_layers": (MAX_MODEL_LAYERS, "MAX_MODEL_LAYERS"), "hidden": _HIDDEN, "ffn_hidden": _HIDDEN,
               "explicit_head_dim": _HIDDEN, "num_heads": _HEADS, "num_kv_heads": _HEADS,
               "vocab_size": (MAX_MODEL_VOCAB, "MAX_MODEL_VOCAB"), "max_seq": _SEQ, "rope_original_max_seq": _SEQ,
               "sliding_window": _SEQ}
ROPE_TYPES = ("default", "linear", "llama3")  # transformers' ROPE_INIT_FUNCTIONS the decoder implements
HF_MODEL_TYPES = ("gpt2", "llama", "mistral", "qwen2")
# planner/core/memory.py sizes q_proj/o_proj by spec.q_width (num_heads·head_dim), so an explicit head_dim
# is predicted as exactly as the rest (tests/unit/test_profiler_memory.py); False would refuse such configs
EXPLICIT_HEAD_DIM_IN_MEMORY_MODEL = True


@dataclass(frozen=True)
class ModelSpec:
    """A decoder-only transformer.

    `family` fixes the block style: "gpt2" is learned positions, LayerNorm,
    GELU MLP (4h) and biases on every linear; "llama" is RoPE, RMSNorm, SwiGLU
    MLP and grouped-query attention without biases (Qwen2 adds q/k/v biases,
    Llama's attention_bias adds q/k/v/o biases, mlp_bias gate/up/down biases).
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
    qkv_bias: bool = False  # Qwen2 (and Llama attention_bias): bias on q/k/v
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    o_bias: bool = False  # Llama attention_bias: bias on o_proj too
    mlp_bias: bool = False  # Llama mlp_bias: bias on gate/up/down
    # HF `head_dim` where it differs from hidden // num_heads (q and o are then num_heads·head_dim wide)
    explicit_head_dim: int | None = None
    # RoPE frequency scaling (transformers' rope_parameters): "linear" divides every frequency by
    # rope_factor; "llama3" (Llama 3.1+) divides the low ones and smooths the middle band
    rope_type: str = "default"
    rope_factor: float = 1.0
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_max_seq: int | None = None
    # the source config's attention window; max_seq never exceeds it (module docstring)
    sliding_window: int | None = None

    def __post_init__(self) -> None:
        for f in ("num_layers", "hidden", "num_heads", "num_kv_heads", "ffn_hidden", "vocab_size", "max_seq"):
            _check_positive(self.name, f, getattr(self, f))
        for f in ("explicit_head_dim", "rope_original_max_seq", "sliding_window"):
            if getattr(self, f) is not None:
                _check_positive(self.name, f, getattr(self, f))
        if self.family not in FAMILIES:
            raise ValueError(f"model {self.name!r}: family must be one of {FAMILIES}, got {self.family!r}")
        if self.explicit_head_dim is None and self.hidden % self.num_heads:
            raise ValueError(
                f"model {self.name!r}: hidden {self.hidden} is not divisible by num_heads {self.num_heads}"
            )
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"model {self.name!r}: num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}"
            )
        if self.family == "gpt2" and (self.explicit_head_dim is not None or self.rope_type != "default"):
            raise ValueError(f"model {self.name!r}: gpt2 has learned positions and head_dim = hidden / num_heads")
        if self.rope_type not in ROPE_TYPES:
            raise ValueError(f"model {self.name!r}: rope_type must be one of {ROPE_TYPES}, got {self.rope_type!r}")
        if self.rope_type == "llama3" and (self.rope_original_max_seq is None
                                           or self.rope_high_freq_factor <= self.rope_low_freq_factor):
            raise ValueError(f"model {self.name!r}: llama3 RoPE needs rope_original_max_seq and "
                             f"high_freq_factor {self.rope_high_freq_factor} > low_freq_factor {self.rope_low_freq_factor}")
        if self.sliding_window is not None and self.max_seq > self.sliding_window:
            raise ValueError(f"model {self.name!r}: max_seq {self.max_seq} > sliding_window {self.sliding_window} "
                             "(sliding-window attention is implemented only up to the window)")

    # --- derived styles (names the torch code and the docs use) ---
    @property
    def head_dim(self) -> int:
        return self.explicit_head_dim or self.hidden // self.num_heads

    @property
    def q_width(self) -> int:
        """Width of q_proj's output and o_proj's input: num_heads · head_dim (= hidden unless head_dim is explicit)."""
        return self.num_heads * self.head_dim

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
        h, q, kv, f = self.hidden, self.q_width, self.num_kv_heads * self.head_dim, self.ffn_hidden
        qkvb = 1 if (self.linear_bias or self.qkv_bias) else 0
        ob = 1 if (self.linear_bias or self.o_bias) else 0
        attn = h * (q + 2 * kv) + qkvb * (q + 2 * kv) + q * h + ob * h  # qkv + out proj
        if self.family == "gpt2":
            b = 1 if self.linear_bias else 0
            mlp = 2 * h * f + b * (f + h)
            norms = 2 * 2 * h  # two LayerNorms, weight + bias
        else:
            mb = 1 if self.mlp_bias else 0
            mlp = 3 * h * f + mb * (2 * f + h)  # gate, up, down
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

    @cached_property  # a frozen spec's count never changes; the memory model asks it thousands of times a solve
    def num_params(self) -> int:
        return self.num_layers * self.block_params() + self.embedding_params() + self.final_norm_params()

    def matmul_params(self) -> int:
        """Weights that take part in a matmul per token: every Linear of every block plus
        the LM head (tied or not). Embedding lookups, norms and biases are excluded."""
        h, q, kv = self.hidden, self.q_width, self.num_kv_heads * self.head_dim
        mlp_mats = 2 if self.family == "gpt2" else 3
        per_block = h * (q + 2 * kv) + q * h + mlp_mats * h * self.ffn_hidden
        return self.num_layers * per_block + self.vocab_size * h

    def flops_per_token(self, seq: int) -> float:
        """Training FLOPs per token (forward + backward = 3x forward):
        6·N_matmul for the dense matmuls plus 12·L·(heads·head_dim)·s for attention scores and
        values over the full s×s square (Kaplan et al. 2020, eq. 2.1 / PaLM app. B;
        SDPA's math path does not skip the causal half)."""
        return 6.0 * self.matmul_params() + 12.0 * self.num_layers * self.q_width * seq

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
        """Read a Hugging Face `config.json` (or a model folder holding one) offline."""
        if os.path.isdir(path):
            path = os.path.join(path, "config.json")
        cfg = load_json_file(path, "config file", MAX_CONFIG_FILE_BYTES)
        if not isinstance(cfg, dict):
            raise ValueError(f"config file {path}: expected a JSON object")
        name = os.path.basename(os.path.dirname(os.path.abspath(path))) or "custom"
        return spec_from_hf_dict(cfg, name=name, source=path)


def _check_positive(name: str, field: str, v: Any) -> None:
    if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
        raise ValueError(f"model {name!r}: {field} must be a positive integer, got {v!r}")
    limit, limit_name = SIZE_LIMITS[field]
    if v > limit:
        raise ValueError(f"model {name!r}: {field} {v:,} is over the limit of {limit:,} ({limit_name})")


# --- Hugging Face config.json -> ModelSpec -------------------------------------------------

class _Config:
    """A config dict read key by key, with transformers' defaults and one-line errors."""

    def __init__(self, cfg: dict, source: str):
        self.cfg, self.source = cfg, source

    def get(self, key: str, default: Any = None, *alts: str) -> Any:
        for k in (key, *alts):
            if self.cfg.get(k) is not None:
                return self.cfg[k]
        return default

    def need(self, key: str, *alts: str) -> Any:
        v = self.get(key, None, *alts)
        if v is None:
            raise ValueError(f"{self.source}: missing key {key!r}")
        return v

    def int(self, key: str, default: Any = None, *alts: str) -> int:
        v = self.need(key, *alts) if default is None else self.get(key, default, *alts)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or int(v) != v:
            raise ValueError(f"{self.source}: {key} must be an integer, got {v!r}")
        return int(v)

    def float(self, key: str, default: float, *alts: str) -> float:
        v = self.get(key, default, *alts)
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise ValueError(f"{self.source}: {key} must be a number, got {v!r}")
        return float(v)

    def refuse(self, key: str, why: str) -> ValueError:
        return ValueError(f"{self.source}: {key}={self.cfg.get(key)!r}: {why}")


# keys whose presence means a mixture-of-experts block (Mixtral, Qwen2-MoE, DeepSeek, OLMoE, ...)
_MOE_KEYS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_intermediate_size")
_ARCHITECTURES = {"GPT2LMHeadModel": "gpt2", "LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral",
                  "Qwen2ForCausalLM": "qwen2"}


def spec_from_hf_dict(cfg: dict, name: str = "custom", source: str = "config") -> ModelSpec:
    """Build a ModelSpec from the dict of a Hugging Face config (config.json as the hub writes it,
    or transformers 5's `config.to_dict()` with `rope_parameters`). ValueError, one line naming
    the key, for anything the decoder does not implement exactly."""
    c = _Config(cfg, source)
    for key in _MOE_KEYS:
        if c.get(key):
            raise c.refuse(key, "mixture of experts is not supported (the decoder and the memory model are dense)")
    mtype = cfg.get("model_type")
    if mtype is None:
        archs = [_ARCHITECTURES.get(a) for a in cfg.get("architectures") or [] if isinstance(a, str)]
        mtype = next((a for a in archs if a), None)
        if mtype is None:
            raise ValueError(f"{source}: missing key 'model_type' (supported: {', '.join(HF_MODEL_TYPES)})")
    if mtype in ("gemma", "gemma2", "gemma3", "gemma3_text"):
        raise c.refuse("model_type", "Gemma is not supported (GeGLU hidden_activation, (1 + w) RMSNorm and "
                                     "sqrt(hidden)-scaled embeddings are not implemented)")
    if mtype not in HF_MODEL_TYPES:
        raise c.refuse("model_type", f"unsupported model_type (supported: {', '.join(HF_MODEL_TYPES)})")
    try:
        spec = _gpt2_from_hf(c, name) if mtype == "gpt2" else _llama_from_hf(c, name, mtype)
    except ValueError as e:
        if str(e).startswith(source):
            raise
        raise ValueError(f"{source}: {e}") from None
    return spec


def _gpt2_from_hf(c: _Config, name: str) -> ModelSpec:
    act = c.get("activation_function", "gelu_new")
    if act not in ("gelu_new", "gelu_pytorch_tanh"):  # both are GELU's tanh form, the decoder's F.gelu(tanh)
        raise c.refuse("activation_function", "only gelu_new / gelu_pytorch_tanh are implemented")
    for key, default in (("scale_attn_weights", True), ("scale_attn_by_inverse_layer_idx", False),
                         ("reorder_and_upcast_attn", False), ("add_cross_attention", False)):
        if bool(c.get(key, default)) != default:
            raise c.refuse(key, f"only {key}={default} is implemented")
    h = c.int("n_embd", None, "hidden_size")
    heads = c.int("n_head", None, "num_attention_heads")
    return ModelSpec(
        name=name, family="gpt2", num_layers=c.int("n_layer", None, "num_hidden_layers"), hidden=h,
        num_heads=heads, num_kv_heads=heads, ffn_hidden=c.int("n_inner", 4 * h),
        vocab_size=c.int("vocab_size"), max_seq=c.int("n_positions", None, "max_position_embeddings", "n_ctx"),
        tied_embeddings=bool(c.get("tie_word_embeddings", True)), linear_bias=True,
        norm_eps=c.float("layer_norm_epsilon", 1e-5),
    )


# transformers 5 defaults per model type, for keys a config.json may leave out
_LLAMA_DEFAULTS = {
    "llama": {"max_position_embeddings": 2048, "num_key_value_heads": None, "sliding_window": None},
    "mistral": {"max_position_embeddings": 4096 * 32, "num_key_value_heads": 8, "sliding_window": 4096},
    "qwen2": {"max_position_embeddings": 32768, "num_key_value_heads": 32, "sliding_window": 4096},
}


def _llama_from_hf(c: _Config, name: str, mtype: str) -> ModelSpec:
    defaults = _LLAMA_DEFAULTS[mtype]
    act = c.get("hidden_act", "silu")
    if act not in ("silu", "swish"):
        raise c.refuse("hidden_act", "only silu (SwiGLU) is implemented for llama-style models")
    h, heads, layers = c.int("hidden_size"), c.int("num_attention_heads"), c.int("num_hidden_layers")
    kv = c.int("num_key_value_heads", defaults["num_key_value_heads"] or heads)
    hd = c.int("head_dim", 0) if c.get("head_dim") is not None else 0
    explicit = hd if hd and (h % heads or hd != h // heads) else None
    if explicit is not None and not EXPLICIT_HEAD_DIM_IN_MEMORY_MODEL:
        raise c.refuse("head_dim", f"differs from hidden_size / num_attention_heads = {h / heads:g}: the decoder "
                                   "implements it, the memory model does not yet (q/o widths)")
    max_pos = c.int("max_position_embeddings", defaults["max_position_embeddings"])
    window = _active_sliding_window(c, mtype, layers, defaults["sliding_window"])
    if window is not None and window < max_pos:
        log.info("%s: sliding_window %d < max_position_embeddings %d: max_seq capped at the window",
                 c.source, window, max_pos)
        max_pos = window
    rope = _rope_fields(c, max_pos)
    attention_bias = bool(c.get("attention_bias", False)) if mtype == "llama" else False
    return ModelSpec(
        name=name, family="llama", num_layers=layers, hidden=h, num_heads=heads, num_kv_heads=kv,
        ffn_hidden=c.int("intermediate_size"), vocab_size=c.int("vocab_size"), max_seq=max_pos,
        tied_embeddings=bool(c.get("tie_word_embeddings", False)),
        # Qwen2 always has q/k/v biases and never an o/MLP bias; Mistral none; Llama as its flags say
        qkv_bias=mtype == "qwen2" or attention_bias, o_bias=attention_bias,
        mlp_bias=bool(c.get("mlp_bias", False)) if mtype == "llama" else False,
        norm_eps=c.float("rms_norm_eps", 1e-6), explicit_head_dim=explicit,
        sliding_window=window, **rope,
    )


def _active_sliding_window(c: _Config, mtype: str, layers: int, default: int | None) -> int | None:
    """The attention window transformers applies to some layer, or None (full causal everywhere)."""
    window = c.cfg.get("sliding_window", default)
    if mtype == "llama" or window is None:
        return None
    if mtype == "qwen2":
        if not c.get("use_sliding_window", False):
            return None
        types = c.get("layer_types")
        sliding = (any(t == "sliding_attention" for t in types) if isinstance(types, list)
                   else c.int("max_window_layers", 28) < layers)
        if not sliding:
            return None
    return c.int("sliding_window", window)


def _rope_fields(c: _Config, max_pos: int) -> dict[str, Any]:
    """ModelSpec's rope_* fields from `rope_parameters` (transformers 5) or `rope_scaling` + `rope_theta`."""
    key = "rope_parameters" if c.get("rope_parameters") is not None else "rope_scaling"
    params = c.get(key, {})
    if not isinstance(params, dict):
        raise c.refuse(key, "expected an object")
    if any(isinstance(v, dict) for v in params.values()):
        raise c.refuse(key, "RoPE parameters per layer type are not supported")
    if float(params.get("partial_rotary_factor", c.get("partial_rotary_factor", 1.0))) != 1.0:
        raise c.refuse("partial_rotary_factor", "partial rotary embeddings are not implemented")
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in ROPE_TYPES:
        raise ValueError(f"{c.source}: {key} rope_type {rope_type!r} is not implemented "
                         f"(supported: {', '.join(ROPE_TYPES)})")
    theta = params.get("rope_theta", c.get("rope_theta", 10000.0))
    out: dict[str, Any] = {"rope_theta": float(theta), "rope_type": rope_type}
    if rope_type != "default":
        out["rope_factor"] = float(params["factor"]) if "factor" in params else _missing(c, key, "factor")
    if rope_type == "llama3":
        for field, name in (("rope_low_freq_factor", "low_freq_factor"), ("rope_high_freq_factor", "high_freq_factor")):
            out[field] = float(params[name]) if name in params else _missing(c, key, name)
        out["rope_original_max_seq"] = int(params.get("original_max_position_embeddings",
                                                      c.get("original_max_position_embeddings", max_pos)))
    return out


def _missing(c: _Config, key: str, name: str) -> Any:
    raise ValueError(f"{c.source}: {key} misses {name!r}")


def _gpt2(name: str, layers: int, hidden: int, heads: int, vocab: int = 50257, seq: int = 1024) -> ModelSpec:
    return ModelSpec(name, "gpt2", layers, hidden, heads, heads, 4 * hidden, vocab, seq,
                     tied_embeddings=True, linear_bias=True)


def _llama(name: str, layers: int, hidden: int, heads: int, kv: int, ffn: int, vocab: int, seq: int,
           tied: bool = False, qkv_bias: bool = False, theta: float = 10000.0, eps: float = 1e-5) -> ModelSpec:
    return ModelSpec(name, "llama", layers, hidden, heads, kv, ffn, vocab, seq,
                     tied_embeddings=tied, qkv_bias=qkv_bias, rope_theta=theta, norm_eps=eps)


# Presets. Published parameter counts (checked in tests/unit/test_specs.py):
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
    # OPT-350 as Sailor's heterogeneous scenario trains it (shared/sailor training_config_opt_350.json:
    # 24 layers, hidden 1024, 16 heads, vocab 50272, seq 2048, embedding and head untied; 407.4 M)
    "opt-350": ModelSpec("opt-350", "gpt2", 24, 1024, 16, 16, 4096, 50272, 2048,
                         tied_embeddings=False, linear_bias=True),
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
    """A preset by name, or a Hugging Face `config.json` (or a model folder holding one) by path."""
    if name_or_path in PRESETS:
        return PRESETS[name_or_path]
    if name_or_path.endswith(".json") or os.path.sep in name_or_path or os.path.exists(name_or_path):
        return ModelSpec.from_hf_config(name_or_path)
    raise ValueError(
        f"unknown model {name_or_path!r}: use a preset ({', '.join(PRESETS)}), a path to a config.json "
        "or a model folder"
    )


def with_max_seq(spec: ModelSpec, seq: int) -> ModelSpec:
    """The same model with a longer position table (only matters for learned positions)."""
    return spec if seq <= spec.max_seq else replace(spec, max_seq=seq)
