"""Per-GPU peak memory of one training step of this project's runtime (Frenzy's MARP, made exact).

Pure Python, no torch: a plan or a schedule calls it thousands of times. What is modelled is
models/sharded.py (ZeRO 1/2/3, uneven shards, the units of contracts/units.py) running
models/decoder.py: the state between steps, the gradients within one, the activations autograd
saves (per attention kernel, contracts/attention.py), the loss, autocast's copies, ZeRO 3's
gathered units and the runtime's gather/reduce options (half gathered parameters, the reduce dtype,
prefetch, reduce-scatters left in flight). The peak is the largest of a few moments of the step (`estimate_peak_phases`),
each affine in the micro-batch and the shard fraction. Tensor parallelism (models/tensor.py) is exact
at zero <= 1 (`tp_units`, the local widths, `loss_bytes`, `tp_embedding_saved_bytes`); at zero 2/3
(which the runtime refuses) and the `--pp` shortcut it is analytic only; pipeline stages have their
exact model in planner/core/stage_memory.py, built from the public pieces of this module.

Every term, the moments and how the model is checked against traces (bench/memory_accuracy.py):
docs/models/memory.md.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace
from typing import Any

from contracts.attention import AttentionKernel, attention_saved_bytes, select_kernel
from contracts.plan import check_step_dtypes
from contracts.specs import ModelSpec
from contracts.units import Unit, runtime_units
from contracts.wire import token_rows_exchange
from contracts.constants import (DTYPE_BYTES, DTYPES, FP32_BYTES, HALF_BYTES, INT64_BYTES, MODELLED_ZERO_STAGES, RECOMPUTE,
                                 STEP_CHUNK_NUMEL, check_zero)


@dataclass(frozen=True)
class MemoryConfig:
    """One GPU's share of a training step. seq None means the model's max_seq; shard_fraction
    None means 1/dp (the even split), 0 a GPU without optimizer state; micro_batch 0 is a GPU
    that only holds state."""

    micro_batch: int = 1
    seq: int | None = None
    # micro-batches this GPU runs per optimizer step; at zero >= 2 the runtime keeps every
    # micro-batch's unit-boundary activations (layer-wise accumulation, contracts/units.py)
    accum_steps: int = 1
    dtype: str = "fp32"  # fp32, or bf16/fp16 autocast with fp32 master weights
    recompute: str = "none"  # "full": torch.utils.checkpoint around every block
    dp: int = 1
    tp: int = 1
    pp: int = 1
    zero: int = 0
    shard_fraction: float | None = None
    # the catalog GPU type (or "cpu") the step runs on: it decides the attention kernel
    device_type: str = "cpu"
    # zero 3: the dtype of the gathered full parameters (the master slice and AdamW state stay fp32);
    # bf16/fp16 halves the gathers and lets autocast use the weights as they are (no copies)
    param_dtype: str = "fp32"
    # the dtype a unit's full gradient is cast to for its reduce-scatter (the slice's stays fp32)
    reduce_dtype: str = "fp32"
    # zero 3: units whose gather is in flight ahead of the one computing (1: the next one)
    prefetch: int = 1
    # reduce-scatters left in flight (0 or 1): 1 keeps each unit's (cast) full gradient alive through
    # the next unit's backward, 0 waits for each as it is issued
    reduce_in_flight: int = 0
    # tokens in one optimizer step over every rank (global batch x seq; 0: not given). With them a
    # layer-wise step sends the embedding unit's gradient as rows where contracts.wire says it pays
    step_tokens: int = 0

    def __post_init__(self) -> None:
        def is_int(v: Any) -> bool:
            return isinstance(v, int) and not isinstance(v, bool)

        if not is_int(self.micro_batch) or self.micro_batch < 0:
            raise ValueError(f"micro_batch must be an integer >= 0, got {self.micro_batch!r}")
        if not is_int(self.accum_steps) or self.accum_steps < 1:
            raise ValueError(f"accum_steps must be an integer >= 1, got {self.accum_steps!r}")
        if self.seq is not None and (not is_int(self.seq) or self.seq < 1):
            raise ValueError(f"seq must be a positive integer, got {self.seq!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.recompute not in RECOMPUTE:
            raise ValueError(f"recompute must be one of {RECOMPUTE}, got {self.recompute!r}")
        for name in ("dp", "tp", "pp"):
            v = getattr(self, name)
            if not is_int(v) or v < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {v!r}")
        check_zero(self.zero, MODELLED_ZERO_STAGES)
        f = self.shard_fraction
        if f is not None:
            # 0 is allowed here: a GPU that computes but owns no slice of the AdamW state
            if isinstance(f, bool) or not isinstance(f, (int, float)) or not (0.0 <= f <= 1.0):
                raise ValueError(f"shard_fraction must be in [0, 1], got {f!r}")
            if self.zero == 0 and f != 1.0:
                raise ValueError(f"shard_fraction {f} needs zero >= 1: zero=0 keeps the whole state on every GPU")
        check_step_dtypes(self.zero, self.param_dtype, self.reduce_dtype, self.prefetch, what="MemoryConfig")
        if self.param_dtype != "fp32" and self.param_dtype != self.dtype:
            raise ValueError(f"param_dtype {self.param_dtype} needs dtype {self.param_dtype} (got dtype="
                             f"{self.dtype}): half parameters are computed on under autocast in their own dtype")
        if isinstance(self.reduce_in_flight, bool) or self.reduce_in_flight not in (0, 1):
            raise ValueError(f"reduce_in_flight must be 0 or 1 (reduce-scatters left in flight), "
                             f"got {self.reduce_in_flight!r}")
        if not is_int(self.step_tokens) or self.step_tokens < 0:
            raise ValueError(f"step_tokens must be an integer >= 0, got {self.step_tokens!r}")

    @property
    def fraction(self) -> float:
        """This GPU's share of the sharded state: shard_fraction, else 1/dp (1 with zero=0)."""
        if self.zero == 0:
            return 1.0
        return float(self.shard_fraction) if self.shard_fraction is not None else 1.0 / self.dp

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class MemoryBreakdown:
    """Bytes per GPU at the peak moment of the step; peak_bytes is their sum."""

    num_params: int
    params_bytes: int
    grads_bytes: int
    optimizer_bytes: int
    activations_bytes: int
    other_bytes: int
    peak_bytes: int

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def validate_for(spec: ModelSpec, cfg: MemoryConfig) -> int:
    """Check `cfg` against the model; returns the sequence length used."""
    seq = cfg.seq or spec.max_seq
    if seq > spec.max_seq:
        raise ValueError(f"seq {seq} > the model's max_seq {spec.max_seq}")
    if spec.num_heads % cfg.tp or spec.num_kv_heads % cfg.tp:
        raise ValueError(f"tp={cfg.tp} must divide num_heads {spec.num_heads} and num_kv_heads "
                         f"{spec.num_kv_heads} (remainders {spec.num_heads % cfg.tp}, {spec.num_kv_heads % cfg.tp})")
    if cfg.pp > spec.num_layers:
        raise ValueError(f"pp={cfg.pp} > num_layers {spec.num_layers}: a stage needs at least one layer")
    return seq


@dataclass(frozen=True)
class _Shape:
    """The per-GPU sizes the formulas use (tp shards heads and the ffn, pp the layers)."""

    layers: int  # blocks on this GPU
    h: int  # hidden (the residual stream is never sharded)
    hq: int  # query/output width on this GPU: h / tp
    kv: int  # key/value width on this GPU: num_kv_heads * head_dim / tp
    f: int  # ffn width on this GPU
    heads: int  # query heads on this GPU
    vocab: int  # vocabulary rows on this GPU (Megatron splits the head and embedding by tp)
    head_dim: int
    gpt2: bool
    tied: bool


# what depends on a spec alone (its sizes per tp and pp, its units' sizes), per spec object: a solve
# evaluates the memory model thousands of times on one spec, and hashing a spec's ~30 fields on
# every look-up would cost as much as the formulas. Found by identity: each entry holds its spec,
# so the id cannot be reused by another object while the entry exists.
_SPEC_MEMO: dict[int, tuple[ModelSpec, dict]] = {}
_SPEC_MEMO_SIZE = 64


def _memo(spec: ModelSpec) -> dict:
    entry = _SPEC_MEMO.get(id(spec))
    if entry is None or entry[0] is not spec:
        if len(_SPEC_MEMO) >= _SPEC_MEMO_SIZE:
            _SPEC_MEMO.clear()
        entry = _SPEC_MEMO[id(spec)] = (spec, {})
    return entry[1]


@dataclass(frozen=True)
class _Widths:
    """Bytes per element of the step's tensors. fp32 parameters (every stage; ZeRO 3 by default):
    the residual stream, the gathered units and their gradients are fp32, autocast casts each weight.
    ZeRO 3 with half parameters (param_dtype bf16/fp16 = dtype): the gathered units, the gradients
    autograd makes and the unit's flat gradient are half; so are the embedding's output and with it
    the residual stream and its gradient (unit boundaries, checkpointed inputs)."""

    w: int  # compute dtype: 2 under autocast, else 4
    r: int  # the residual stream (block inputs and outputs, their gradients)
    p: int  # a gathered unit's parameters and the gradients autograd makes of them
    half: bool  # half parameters: autocast makes no weight copies, gradients are not cast to fp32
    # half parameters: a norm computes on an fp32 copy of its half input (RMSNorm's x.float(); LayerNorm
    # on CUDA, in autocast's fp32 list); CPU autocast runs LayerNorm in its input's dtype
    norm32: bool
    reduce: int  # the dtype a unit's full gradient is reduce-scattered in


def _widths(s: _Shape, cfg: MemoryConfig) -> _Widths:
    w = HALF_BYTES if cfg.dtype != "fp32" else FP32_BYTES
    half = cfg.param_dtype != "fp32"
    return _Widths(w=w, r=HALF_BYTES if half else FP32_BYTES, p=DTYPE_BYTES[cfg.param_dtype], half=half,
                   norm32=not s.gpt2 or cfg.device_type != "cpu", reduce=DTYPE_BYTES[cfg.reduce_dtype])


def _shape(spec: ModelSpec, cfg: MemoryConfig) -> _Shape:
    memo = _memo(spec)
    key = ("shape", cfg.tp, cfg.pp)
    if key not in memo:
        memo[key] = _shape_of(spec, cfg.tp, cfg.pp)
    return memo[key]


def _shape_of(spec: ModelSpec, tp: int, pp: int) -> _Shape:
    return _Shape(
        layers=math.ceil(spec.num_layers / pp), h=spec.hidden, hq=spec.q_width // tp,
        kv=spec.num_kv_heads * spec.head_dim // tp, f=math.ceil(spec.ffn_hidden / tp),
        heads=spec.num_heads // tp, vocab=math.ceil(spec.vocab_size / tp), head_dim=spec.head_dim,
        gpt2=spec.family == "gpt2", tied=spec.tied_embeddings,
    )


def _local_params(spec: ModelSpec, cfg: MemoryConfig) -> int:
    """Parameters this GPU holds before ZeRO-3: all of them without TP/PP (the runtime); with
    PP the first stage (its blocks + the embeddings, the larger end), with TP Megatron's split
    (matmuls and embeddings ÷tp, norms and row-parallel biases replicated: ignored, < 0.1 %)."""
    if cfg.tp == 1 and cfg.pp == 1:
        return spec.num_params
    blocks = math.ceil(spec.num_layers / cfg.pp) * spec.block_params()
    ends = spec.embedding_params() + spec.final_norm_params() if cfg.pp == 1 else spec.embedding_params()
    return math.ceil((blocks + ends) / cfg.tp)


def _layer_saved_bytes_per_token(s: _Shape, d: _Widths) -> int:
    """Bytes autograd keeps per token for one block (models/decoder.py Block.forward), no recompute.

    d.w is the compute width: 4 (fp32) or 2 (autocast). Under autocast each Linear saves its own
    2-byte copy of its fp32 input (q/k/v: 3 copies of the attention norm's output; up, and
    gate for SwiGLU: 1 or 2 of the MLP norm's); in fp32 they share one 4-byte tensor. With half
    parameters the residual stream is half: a norm that computes in fp32 saves an fp32 copy of its
    input instead of the input (x + attn(...) is then saved by nothing; the norm's fp32 output is cast
    per Linear as above); CPU's LayerNorm keeps its half input, half statistics and one half output
    that the Linears share."""
    w = d.w
    residual = 2 * d.r * s.h  # block input x and x + attn(...) (LayerNorm/RMSNorm inputs)
    if s.gpt2:
        norms = 2 * 2 * FP32_BYTES  # LayerNorm keeps mean and rstd, (B, T, 1) each
    else:
        norms = 2 * (FP32_BYTES + FP32_BYTES * s.h)  # RMSNorm keeps rsqrt (B, T, 1) and x*rsqrt (B, T, h)
    if w == FP32_BYTES:
        norm_outputs = 2 * FP32_BYTES * s.h
    elif d.half and not d.norm32:
        norms = 2 * 2 * HALF_BYTES  # half mean and rstd
        norm_outputs = 2 * w * s.h  # one half output per norm, shared by its Linears
    else:
        norm_outputs = (3 + (1 if s.gpt2 else 2)) * w * s.h
        if d.half:
            # the fp32 copy of each norm's half input; x + attn(...) itself is then saved by nothing
            norms += 2 * FP32_BYTES * s.h
            residual = d.r * s.h
    # attention (q, k, v, the SDPA output and the kernel's statistics) is added per call by
    # `_attention_bytes`: what it keeps depends on the kernel that runs (contracts/attention.py)
    mlp = (2 if s.gpt2 else 4) * w * s.f  # GELU: up, gelu(up); SwiGLU: gate, silu(gate), up, product
    return residual + norms + norm_outputs + mlp


def attention_kernel(spec: ModelSpec, cfg: MemoryConfig) -> AttentionKernel:
    """The SDPA kernel the runtime runs for this device type and dtype (K/V expanded where GQA
    alone would fall back to the math kernel); refused where the math kernel would run anyway:
    its (B, heads, S, S) temporaries are not modelled."""
    kernel = select_kernel(cfg.device_type, cfg.dtype, spec.num_heads // cfg.tp, spec.num_kv_heads // cfg.tp,
                           spec.head_dim)
    if kernel.name == "math":
        raise ValueError(f"{cfg.device_type} in {cfg.dtype} runs SDPA's math kernel ({kernel.reason}): its "
                         "B·heads·S² temporaries are not modelled; choose a dtype with a fused kernel")
    return kernel


def _attention_bytes(spec: ModelSpec, cfg: MemoryConfig, s: _Shape, batch: int, seq: int, w: int) -> int:
    """Bytes one block's attention keeps for backward for `batch` samples (contracts/attention.py)."""
    return attention_saved_bytes(attention_kernel(spec, cfg), batch, seq, s.heads, s.kv // s.head_dim,
                                 s.head_dim, w)


def _block_matmul_params(spec: ModelSpec, s: _Shape) -> int:
    return s.h * (s.hq + 2 * s.kv) + s.hq * s.h + (2 if s.gpt2 else 3) * s.h * s.f


def _phases(spec: ModelSpec, cfg: MemoryConfig, seq: int, recompute: str | None = None,
            grads_made: bool = False) -> dict[str, tuple[int, int]]:
    """(activation bytes, other bytes) on top of the model states at each candidate peak moment;
    `recompute` in place of cfg's (the sharded runtime's boundary mode checkpoints every block);
    `grads_made`: a block's parameters get new gradients in its backward (keep mode, no buffer)."""
    s = _shape(spec, cfg)
    d = _widths(s, cfg)
    autocast = cfg.dtype != "fp32"
    w, r = d.w, d.r
    tokens = cfg.micro_batch * seq  # N = B·T
    if cfg.pp > 1:  # 1F1B: the first stage holds up to pp micro-batches in flight (Narayanan et al. 2021)
        tokens *= cfg.pp
    h, f, V, L = s.h, s.f, s.vocab, s.layers
    inputs = 2 * INT64_BYTES * cfg.micro_batch * seq  # tokens and targets, (B, T) int64
    # the forward's shared tensors: GPT-2 position ids (T,) int64; RoPE cos and sin (T, hd) in
    # the compute dtype, plus the inv_freq buffer (hd/2,) fp32
    buffers = 0 if s.gpt2 else FP32_BYTES * (s.head_dim // 2)
    shared = (INT64_BYTES * seq if s.gpt2 else 2 * seq * s.head_dim * w) + buffers
    # one block's saved bytes for the micro-batch(es) in flight: per-token terms plus attention
    layer_all = _layer_saved_bytes_per_token(s, d) * tokens + _attention_bytes(spec, cfg, s, tokens // seq, seq, w)
    final = _head_saved_per_token(s, d)
    # autocast's weight copies (none of half parameters: they are used as they are)
    block_copies = w * _block_matmul_params(spec, s) if autocast and not d.half else 0
    head_copy = w * V * h if autocast and not d.half else 0
    head_grad_pending = d.p * V * h if s.tied else 0  # tied: the head's weight grad waits for the embedding's
    dy = r * h * tokens  # gradient of the residual stream
    recompute = (recompute or cfg.recompute) == "full"
    kept = (r * h * tokens if recompute else layer_all) * L  # checkpoint keeps each block's input
    # tensor parallel (models/tensor.py): the vocabulary-parallel embedding saves its local ids and mask
    kept += tp_embedding_saved_bytes(cfg.tp, tokens)
    kept_copies = 0 if recompute else L * block_copies  # checkpointed blocks drop their copies after forward

    in_block = _in_block_backward(spec, s, d, tokens, grads_made)
    phases = {
        # backward starts: log_softmax's saved output, the grad of nll_loss and the grad of the
        # logits, (B·T, V) fp32 each (the logits themselves were freed after the loss)
        "loss": (kept + final * tokens, inputs + shared + kept_copies + head_copy + loss_bytes(cfg.tp, V, tokens)),
        # the untied head's weight grad: fp32, the grad of the logits (B·T, V) is still held,
        # with the grad of the head's input (B·T, h) and the weight grad (V, h); autocast: the
        # logits' grads and the head's weight copy are gone, the weight grad exists as a w-byte
        # matmul output and its fp32 cast for AccumulateGrad (half parameters: no cast)
        "head": (kept + final * tokens, inputs + shared + kept_copies
                 + (w * h * tokens + (w + (0 if d.half else FP32_BYTES)) * V * h if autocast
                    else FP32_BYTES * (V * tokens + h * tokens + V * h))),
        # the last block's backward (recompute: its activations and weight copies rebuilt)
        "last_block": (kept + (layer_all - r * h * tokens if recompute else 0),
                       inputs + shared + kept_copies + (block_copies if recompute else 0) + dy
                       + head_grad_pending + in_block),
        "step": (0, inputs + buffers),  # + the step's temporaries (estimate_memory adds them)
    }
    if autocast:
        # end of forward: autocast caches the weight copies of every block (checkpointed or not)
        # until its context exits, when the head writes the w-byte logits (B·T, V) from the
        # w-byte copy of the final norm's fp32 output (still referenced: 4·h per token; CPU's LayerNorm
        # of half parameters has a half output, saved as the head's input)
        norm_out = 0 if d.half and not d.norm32 else FP32_BYTES * h
        phases["forward_end"] = (kept + final * tokens, inputs + shared + L * block_copies + head_copy
                                 + (w * V + norm_out) * tokens)
    if cfg.micro_batch == 0:
        phases = {"step": phases["step"]}
    elif s.tied:
        # end of backward: the head's grad, the embedding's grad and their sum, (V, h) fp32 each
        phases["tied_embedding"] = (0, inputs + 3 * FP32_BYTES * V * h)
    return phases


# the vocabulary-parallel cross-entropy's (N,) temporaries beside its two (N, V_r) tensors, bytes per token:
# the row max (fp32), the target mask (bool), the local target ids (int64), the picked logit (fp32, a
# gathered (N, 1)), the sum of exponentials (fp32) and their stacked copy for the all-reduce (2 fp32)
TP_CE_BYTES_PER_TOKEN = FP32_BYTES + 1 + INT64_BYTES + FP32_BYTES + FP32_BYTES + 2 * FP32_BYTES


def loss_bytes(tp: int, vocab_rows: int, tokens: int) -> int:
    """The loss's largest moment beyond the saved activations (the logits of `vocab_rows` columns): one
    rank, backward starts with log_softmax's saved output, the grad of nll_loss and the grad of the
    logits, (N, V) fp32 each; tensor parallel (models/tensor._VocabCrossEntropy) the forward holds the
    logit slice and its shifted copy (exponentiated and normalized in place: the saved softmax, which
    backward turns into the logits' gradient in place) and the (N,) statistics."""
    if tp == 1:
        return 3 * FP32_BYTES * vocab_rows * tokens
    return 2 * FP32_BYTES * vocab_rows * tokens + TP_CE_BYTES_PER_TOKEN * tokens


def tp_embedding_saved_bytes(tp: int, tokens: int) -> int:
    """What the vocabulary-parallel embedding saves for backward per micro-batch: its local ids (int64)
    and the mask of the ids outside its rows (bool); 0 without tensor parallelism."""
    return (INT64_BYTES + 1) * tokens if tp > 1 else 0


def _head_saved_per_token(s: _Shape, d: _Widths) -> int:
    """Bytes per token the head keeps for backward: the last block's output x_L (the final norm's
    input), the norm's statistics and the head's input (the norm's output, a w-byte copy under autocast;
    with half parameters as in `_layer_saved_bytes_per_token`)."""
    w = d.w
    if d.half and not d.norm32:
        return d.r * s.h + 2 * HALF_BYTES + w * s.h
    final_norm = 2 * FP32_BYTES if s.gpt2 else FP32_BYTES + FP32_BYTES * s.h
    copy32 = FP32_BYTES * s.h if d.half else 0  # the fp32 copy of the half x_L
    return d.r * s.h + copy32 + final_norm + (w * s.h if w != FP32_BYTES else FP32_BYTES * s.h)


def _in_block_backward(spec: ModelSpec, s: _Shape, d: _Widths, tokens: int, grads_made: bool = False) -> int:
    """The largest transient inside one block's backward (models/decoder.py MLP in reverse): down_proj's
    output grad (autocast: a w-byte cast), its input grad (w·f per token) and its weight grad (w·h·f);
    SwiGLU's mul: two w·f gradients on top of the incoming one, and with `grads_made` (no gradient
    buffer: autograd's gradients are kept as they are made) down_proj's weight gradient made before it."""
    w = d.w
    bias = w * s.h if spec.linear_bias else 0
    made = d.p * s.h * s.f + (d.p * s.h if spec.linear_bias or spec.mlp_bias else 0) if grads_made else 0
    return max((w * s.h if w != d.r else 0) * tokens + w * s.f * tokens + w * s.h * s.f + bias,
               0 if s.gpt2 else 2 * w * s.f * tokens + made)


def _shard_numels(spec: ModelSpec, f: float, tp: int = 1) -> list[int]:
    """This GPU's slice of every runtime unit: round-half-up of f·numel (models/runtime.shard_bounds
    for the first position; a later position's slice differs by at most one element)."""
    out: list[int] = []
    for numel, count in _unit_runs(spec, tp):
        out += [int(math.floor(numel * f + 0.5))] * count
    return out


def tp_vocab_rows(vocab: int, tp: int) -> int:
    """Vocabulary rows of TP rank 0, the most of any (models/tensor.vocab_bounds: V // t each, the first
    V % t ranks one more)."""
    return vocab // tp + (1 if vocab % tp else 0)


def tp_units(spec: ModelSpec, tp: int) -> tuple[Unit, ...]:
    """The runtime's units on TP rank 0 of a group of `tp` (models/tensor.tp_unit_numels, the same
    formula): Megatron's split parameters ÷ tp (q/k/v and up/gate rows, o/down columns, the vocabulary
    rows of the embedding and an untied head), the replicated ones whole (norms, o_proj's and down_proj's
    biases, learned positions). tp 1: contracts/units.py's."""
    memo = _memo(spec)
    key = ("units", tp)
    if key not in memo:
        units = runtime_units(spec)
        if tp > 1:
            h, Vr = spec.hidden, tp_vocab_rows(spec.vocab_size, tp)
            norm = spec.final_norm_params()
            row_bias = h * ((1 if spec.linear_bias or spec.o_bias else 0)  # o_proj's and down_proj's biases
                            + (1 if spec.linear_bias or spec.mlp_bias else 0))
            replicated = 2 * norm + row_bias
            block = (spec.block_params() - replicated) // tp + replicated
            pos = spec.max_seq * h if spec.positional == "learned" else 0
            head = norm + (0 if spec.tied_embeddings else Vr * h)
            numels = [Vr * h + pos, *[block] * spec.num_layers, head]
            units = tuple(Unit(u.name, n) for u, n in zip(units, numels))
        memo[key] = units
    return memo[key]


def _unit_runs(spec: ModelSpec, tp: int = 1) -> tuple[tuple[int, int], ...]:
    """runtime_units' sizes in order as (numel, how many in a row): every block has one size, so
    a slice is rounded once per run, not once per unit."""
    memo = _memo(spec)
    if ("runs", tp) not in memo:
        memo[("runs", tp)] = _runs_of(spec, tp)
    return memo[("runs", tp)]


def _runs_of(spec: ModelSpec, tp: int) -> tuple[tuple[int, int], ...]:
    runs: list[list[int]] = []
    for u in tp_units(spec, tp):
        if runs and runs[-1][0] == u.numel:
            runs[-1][1] += 1
        else:
            runs.append([u.numel, 1])
    return tuple((numel, count) for numel, count in runs)


def _runtime_phases(spec: ModelSpec, cfg: MemoryConfig,
                    seq: int) -> tuple[dict[str, int], dict[str, tuple[int, int]]]:
    """The sharded runtime (models/sharded.py): (resident state by key, (activation bytes, other
    bytes) on top of it at each candidate peak moment of the step).

    Resident: AdamW moments and the gradient of the slice, 12 B per owned parameter; zero 1 and 2
    add the full fp32 parameters (the master slice is a view of them), zero 1 the full fp32
    gradients, zero 3 the master slice (4 B per owned parameter).
    Zero 1 runs the whole model per micro-batch: the phases of `_phases`. Zero 2 and 3 go unit by
    unit over all micro-batches (contracts/units.py):
      * keep mode (one micro-batch, recompute "none"): `_phases`' moments, where a block's output is
        held by its graph until its backward is done (+1 boundary) and a tied head's gradient has
        already been reduced (no pending (V, h) gradient);
      * boundary mode (several micro-batches, or recompute "full"): `_phases` with recompute "full"
        for the micro-batch being processed, plus the other micro-batches' unit boundaries
        (4·h·N bytes each): at the head, L+1 per micro-batch and the n-1 finished input gradients;
        in a block's backward, L+1 per micro-batch in all (inputs still to consume, the incoming
        and the finished gradients);
    and on top, the unit buffers alive at that moment: the unit's full gradient, at zero 3 its
    gathered parameters and the `prefetch` units gathered ahead (a tied embedding stays gathered
    from its forward to the head's and its gradient reduced right after it), a reduce-scatter left in flight; and each
    unit's reduce as a moment of its own (docs/models/memory.md)."""
    f = cfg.fraction
    shards = _shard_numels(spec, f, cfg.tp)
    owned = sum(shards)
    units = tp_units(spec, cfg.tp)
    P = sum(u.numel for u in units) if cfg.tp > 1 else spec.num_params
    resident = {"params_bytes": FP32_BYTES * (owned if cfg.zero >= 3 else P),
                # zero 1: the full gradients, alive from the first micro-batch to their reduce
                "grads_bytes": FP32_BYTES * P if cfg.zero <= 1 else 0,
                "optimizer_bytes": 2 * FP32_BYTES * owned}
    slice_grads = FP32_BYTES * owned  # every unit's slice gradient, from its reduce to the update
    # the global norm walks each slice in chunks, one fp64 copy of a chunk at a time (models/optim.py);
    # AdamW's single fp32 chunk buffer (4 B per element) comes later and is smaller
    step_temps = 2 * FP32_BYTES * min(max(shards), STEP_CHUNK_NUMEL)
    n = cfg.accum_steps if cfg.micro_batch > 0 else 0
    inputs_all = 2 * INT64_BYTES * cfg.micro_batch * seq * n
    extra_inputs = inputs_all - 2 * INT64_BYTES * cfg.micro_batch * seq
    s = _shape(spec, cfg)
    d = _widths(s, cfg)
    if cfg.zero <= 1:
        one = _phases(spec, cfg, seq)
        phases = {k: (a, o + extra_inputs) for k, (a, o) in one.items()}
        full_grads = resident["grads_bytes"]  # freed after their reduce, before the update
        phases["step"] = (one["step"][0], one["step"][1] + step_temps + extra_inputs + slice_grads - full_grads)
        rb = DTYPE_BYTES[cfg.reduce_dtype]
        if rb != FP32_BYTES and len(units) > 1:
            # each unit's full gradient cast to the reduce dtype while the fp32 gradients of the units
            # after it still wait (counted in the resident state until their own cast): largest at the
            # first unit, or at the second with the first's reduce (its cast and its slice's result)
            # still in flight and the first slice gradient made
            in_flight = rb * (units[0].numel + shards[0]) if cfg.reduce_in_flight else 0
            phases["reduce_cast"] = (0, inputs_all + max(
                rb * units[0].numel,
                rb * units[1].numel + in_flight + FP32_BYTES * (shards[0] - units[0].numel)))
        return resident, phases
    # zero 2/3: unit by unit (a rank without samples runs the same collectives with no activations)
    keep = n == 1 and cfg.recompute == "none"
    if cfg.micro_batch:
        one = _phases(spec, cfg, seq, None if keep else "full", grads_made=keep)
    else:
        pending = s.vocab * s.h * DTYPE_BYTES[cfg.param_dtype] if spec.tied_embeddings else 0
        one = {"loss": (0, 0), "head": (0, 0), "last_block": (0, pending), "step": _phases(spec, cfg, seq)["step"]}
    h, V, L = spec.hidden, spec.vocab_size, spec.num_layers
    autocast = cfg.dtype != "fp32"
    w, gw, rb = d.w, d.p, d.reduce  # compute width; a unit's gathered parameters and gradient; the reduce's
    tokens = cfg.micro_batch * seq
    bd = d.r * h * tokens  # one unit boundary of one micro-batch (the residual stream's dtype)
    tied = spec.tied_embeddings
    embed, block, head = units[0].numel, units[1].numel if L else 0, units[-1].numel
    gathered = cfg.zero == 3
    k = cfg.prefetch if gathered else 0  # units gathered ahead, in the order of their uses
    g = (lambda numel: gw * numel if gathered else 0)
    pending = gw * V * h if tied else 0  # `_phases` holds the tied head's gradient through backward
    # slice gradients alive: after the head's reduce (and a tied embedding's), after every block's
    early = FP32_BYTES * (shards[-1] + (shards[0] if tied else 0))
    late = slice_grads - (0 if tied else FP32_BYTES * shards[0])
    # gathered at the head: the head, a tied embedding and the next blocks of the backward
    gathers_head = g(head) + (g(embed) if tied else 0) + min(k, L) * g(block)
    gathers_block = g(block) * (1 + min(k, L - 1))  # the last block's backward and the blocks after it
    # boundary mode accumulates every micro-batch in the unit's flat gradient; keep mode lets autograd
    # make each parameter's gradient (already counted in `_phases`) and flattens it after the unit
    grad_bufs_head = 0 if keep else gw * (head + (embed if tied else 0))

    # the embedding unit's gradient as the step's rows (models/sharded.py `set_batch_split`, the rule of
    # contracts.wire.token_rows_exchange at the step's tokens): this rank's ids and rows, then everyone's
    rows = cfg.step_tokens > 0 and token_rows_exchange(cfg.step_tokens, embed, h, rb, cfg.dp)
    every = cfg.step_tokens
    own_rows = n * cfg.micro_batch * seq * (INT64_BYTES + h * rb)
    every_rows = every * (INT64_BYTES + h * rb)

    def in_flight(numel: int, shard: int, first: bool = True) -> int:
        """A unit's reduce-scatter left in flight (reduce_in_flight 1) while the next unit computes: its full
        gradient in the reduce dtype and, unless it lands in the fp32 slice directly, its slice's result."""
        if not cfg.reduce_in_flight:
            return 0
        return rb * numel + (rb * shard if rb != FP32_BYTES or not first else 0)

    # in flight during the last block's backward: the head's reduce (a tied embedding's, after it)
    flight_last = in_flight(embed, shards[0]) if tied else in_flight(head, shards[-1])
    flight_first = in_flight(block, shards[1]) if L > 1 else flight_last
    others = 0 if keep else (L + 2) * (n - 1) * bd
    layer_all = _layer_saved_bytes_per_token(s, d) * tokens + _attention_bytes(spec, cfg, s, cfg.micro_batch, seq, w)
    copies = HALF_BYTES * _block_matmul_params(spec, s) if autocast and not d.half else 0
    graph_bytes = layer_all + copies if keep else 0  # one block's graph (keep mode)

    # the step's shared tensors, alive throughout: RoPE's cos and sin, made once outside autocast (fp32),
    # with the inv_freq buffer; GPT-2's position ids die in the embedding's no-grad forward. `_phases`
    # counts a whole-model forward's instead (position ids saved, cos/sin in the compute dtype)
    shared = 0 if s.gpt2 or not cfg.micro_batch else 2 * seq * s.head_dim * FP32_BYTES + FP32_BYTES * (s.head_dim // 2)
    model_shared = 0 if not cfg.micro_batch else INT64_BYTES * seq if s.gpt2 else (
        2 * seq * s.head_dim * w + FP32_BYTES * (s.head_dim // 2))

    def plus(k: str, act: int, other: int) -> tuple[int, int]:
        a, o = one[k]
        return a + act, o + other + extra_inputs + shared - model_shared

    def update_peak() -> int:
        """The most the update holds beyond the slice gradients: while unit j is updated, AdamW's
        chunk buffer beside the prefetched units gathered before it; after the last, those units."""
        ahead = [g(u.numel) for u in units[:min(k, len(units) - 2) + 1]] if k else []
        during = [(FP32_BYTES * min(sh, STEP_CHUNK_NUMEL) if sh else 0) + sum(ahead[:j])
                  for j, sh in enumerate(shards)]
        return max(during + [sum(ahead)])

    phases = {
        "loss": plus("loss", others, gathers_head + grad_bufs_head),
        "head": plus("head", others, gathers_head + grad_bufs_head),
        # keep: the block's output, held by its graph; boundaries: the input gradient being made
        # while the incoming one is still listed
        "last_block": plus("last_block", bd if keep else ((L + 1) * (n - 1) + 1) * bd,
                           gathers_block + (0 if keep else gw * block) - pending + early + flight_last),
        "embed_backward": (n * bd, (own_rows if rows else gw * embed) + inputs_all + shared + late
                           + (in_flight(block, shards[1]) if L else 0)),
        # the first block's backward: the fewest boundaries (or graphs) left, the most slice
        # gradients made (every block above it reduced); the middle blocks lie between the two ends
        "first_block": plus("last_block", (bd if keep else (2 * n - L) * bd) - (L - 1) * graph_bytes,
                            g(block) + (0 if keep else gw * block) - pending + early
                            + FP32_BYTES * shards[1] * (L - 1) + flight_first),
        # the embedding's reduce: its flat gradient (still referenced by the step until it returns), its
        # cast to the reduce dtype, the slice gradient made by a first reduce and the slice's result unless
        # it lands in the fp32 slice directly (the second reduce of a tied embedding adds to the slice)
        "embed_reduce": (0, inputs_all + shared + late + (0 if tied else FP32_BYTES * shards[0])
                         + (own_rows + every_rows if rows else
                            gw * embed + (rb * embed if gw != rb else 0) + (rb * shards[0] if tied or rb != FP32_BYTES else 0))
                         # the first block's reduce, still in flight beside it (the step's last reduce waits for none)
                         + (in_flight(block, shards[1]) if L else 0)),
        # the update: the global norm's temporaries, then AdamW unit by unit (its one chunk buffer);
        # with prefetch the next step's first units (the embedding, updated first, and the
        # `prefetch` blocks after it) are each gathered right after its update, beside the rest of it
        "step": (one["step"][0], one["step"][1] + extra_inputs + slice_grads + max(step_temps, update_peak())),
    }
    mid = min(k, L - 1)  # the backward's block holding the most: its prefetched blocks beside the slices made above it
    if 0 < mid < L - 1:
        # the first block's activations (a lower bound of this moment's); its buffers exactly
        phases["middle_block"] = plus("last_block", (bd if keep else (2 * n - L) * bd) - (L - 1) * graph_bytes,
                                      g(block) * (1 + mid) + (0 if keep else gw * block) - pending + early
                                      + FP32_BYTES * shards[1] * (L - 1 - mid) + flight_first)
    if tied and gathered and L:
        # the first block's forward: a tied embedding stays gathered from its forward to the head's,
        # beside the block and the units prefetched after it (its activations: at most the head's)
        phases["forward"] = (0, inputs_all + shared + g(embed) + g(block) * (1 + min(k, L - 1))
                             + (g(head) if k >= L else 0))
    if rows:
        # the rows exchange waited (the first block's reduce before it, freed): every rank's rows (and an
        # fp32 copy of them unless fp32), the slice's rows table (fp32, a spare row; the slice may start
        # and end inside a row: at most one row more than its length), everyone's ids and their offsets
        table_rows = -(-shards[0] // h) + 2
        phases["embed_rows_add"] = (0, inputs_all + shared + slice_grads + every * h * rb
                                    + (every * h * FP32_BYTES if rb != FP32_BYTES else 0)
                                    + table_rows * h * FP32_BYTES + 2 * INT64_BYTES * every)
    if not cfg.micro_batch:  # no activations: the unit buffers of the moments alone
        phases = {key: (0, o) for key, (a, o) in phases.items()}

    def reduce_bytes(numel: int, shard: int, first: bool = True) -> int:
        """A unit's reduce (the one before it already waited): its gradient (autograd's, or the flat
        buffer) beside the flat copy in the reduce dtype; then that copy, the slice gradient made by a
        first reduce and the slice's result unless it lands in the fp32 slice directly."""
        made = gw * numel + (rb * numel if keep or gw != rb else 0)
        sent = rb * numel + (FP32_BYTES * shard if first else 0) + (rb * shard if rb != FP32_BYTES or not first else 0)
        return max(made, sent)

    # at a unit's reduce: every graph still held (keep) or every boundary and input gradient (boundaries)
    base = inputs_all + shared
    graph = layer_all + copies
    act_head = L * graph + bd if keep else (L * n + n) * bd
    tied_grad = gw * V * h if keep and tied else 0  # autograd's gradient of the tied weight, made by the head
    phases["reduce_head"] = (act_head, base + gathers_head + grad_bufs_head - (0 if keep else gw * head)
                             + tied_grad + reduce_bytes(head, shards[-1]))
    if tied:  # the head freed, its reduce waited
        phases["reduce_tied_embed"] = (act_head, base + gathers_head - g(head) + FP32_BYTES * shards[-1]
                                       + reduce_bytes(embed, shards[0]) - (tied_grad if keep else 0))
    if L:
        # the last block's reduce (the other blocks' graphs or boundaries still held) and the first's
        # (keep: the graphs of the blocks below, the output of the one below held beside them, dx)
        phases["reduce_block"] = ((L - 1) * graph + 2 * bd if keep and L > 1 else bd if keep else L * n * bd,
                                  base + gathers_block + early + reduce_bytes(block, shards[1]))
        phases["reduce_first_block"] = (bd if keep else n * bd, base + g(block) + early
                                        + FP32_BYTES * shards[1] * (L - 1) + reduce_bytes(block, shards[1]))
        if 0 < mid < L - 1:  # the block holding the most blocks gathered (the first's activations, a lower bound)
            phases["reduce_middle_block"] = (bd if keep else n * bd, base + g(block) * (1 + mid) + early
                                             + FP32_BYTES * shards[1] * (L - 1 - mid) + reduce_bytes(block, shards[1]))
    if "forward_end" in one:
        # the head's autocast region is its own: in boundary mode no block's weight copies are cached
        # (keep mode: they are saved in the blocks' graphs, as `_phases` counts them)
        copies = 0 if keep else L * copies
        phases["forward_end"] = plus("forward_end", others, gathers_head + grad_bufs_head - copies)
    return resident, phases


def estimate_startup_bytes(spec: ModelSpec, cfg: MemoryConfig) -> int:
    """Peak bytes while the runtime is built (models/sharded.py: the decoder on the meta device,
    each unit materialized in full, initialized and cut to this GPU's slice before the next one
    exists). Per unit: its full fp32 buffer, the slice's moments and gradient (12 B per owned
    element) and at zero 3 the master copy of the slice, after which the full buffer is freed."""
    if cfg.tp != 1 or cfg.pp != 1:
        raise ValueError("start-up memory is modelled for the runtime (tp = pp = 1) only")
    shards = _shard_numels(spec, cfg.fraction)
    done, peak = 0, 0
    for u, owned in zip(runtime_units(spec), shards):
        # the full buffer, the moments, the slice's gradient (its storage freed at once), the master copy
        if cfg.zero >= 3:
            peak = max(peak, done + FP32_BYTES * u.numel + 3 * FP32_BYTES * owned)
            done += 3 * FP32_BYTES * owned
        else:
            peak = max(peak, done + FP32_BYTES * u.numel + 3 * FP32_BYTES * owned)
            done += FP32_BYTES * u.numel + 2 * FP32_BYTES * owned
    return peak


def estimate_memory(spec: ModelSpec, cfg: MemoryConfig) -> MemoryBreakdown:
    """Predicted per-GPU peak bytes of one training step of `spec` under `cfg` (see module doc)."""
    return estimate_with_phases(spec, cfg)[0]


def estimate_peak_phases(spec: ModelSpec, cfg: MemoryConfig) -> dict[str, int]:
    """Total bytes at each candidate peak moment ("forward_end", "loss", "head", "last_block",
    "first_block", the units' "reduce_*", "embed_backward", "step", ...; those that apply). Each is affine in micro_batch and in
    shard_fraction; estimate_memory's peak_bytes is their maximum. A coefficient table built
    from a few points should interpolate each phase and take the max, not interpolate the max."""
    return estimate_with_phases(spec, cfg)[1]


def estimate_with_phases(spec: ModelSpec, cfg: MemoryConfig) -> tuple[MemoryBreakdown, dict[str, int]]:
    """estimate_memory and estimate_peak_phases from one evaluation."""
    seq = validate_for(spec, cfg)
    # the runtime: models/sharded.py; tensor parallel at zero 1 (models/tensor_runtime.py, TP rank 0)
    if cfg.pp == 1 and (cfg.tp == 1 or cfg.zero <= 1):
        resident, phases = _runtime_phases(spec, cfg, seq)
        states = sum(resident.values())
        act, other = max(phases.values(), key=lambda ao: ao[0] + ao[1])
        num = spec.num_params if cfg.tp == 1 else sum(u.numel for u in tp_units(spec, cfg.tp))
        breakdown = MemoryBreakdown(num_params=num, **resident, activations_bytes=act, other_bytes=other,
                                    peak_bytes=states + act + other)
        return breakdown, {k: states + a + o for k, (a, o) in phases.items()}
    return _estimate_analytic(spec, cfg, seq)


def _estimate_analytic(spec: ModelSpec, cfg: MemoryConfig, seq: int) -> tuple[MemoryBreakdown, dict[str, int]]:
    """The `--pp` shortcut and tensor parallelism at zero 2/3: analytic only (the runtime runs neither)."""
    n = spec.num_params
    local = _local_params(spec, cfg)
    f = cfg.fraction
    params = FP32_BYTES * (math.ceil(f * local) if cfg.zero >= 3 else local)
    grads = FP32_BYTES * (math.ceil(f * local) if cfg.zero >= 2 else local)
    shard = local if cfg.zero == 0 else int(round(f * local))
    # exp_avg + exp_avg_sq fp32, and one fp32 step scalar per chunk (torch.optim.AdamW state)
    optimizer = 2 * FP32_BYTES * shard + FP32_BYTES * math.ceil(shard / STEP_CHUNK_NUMEL)
    step_temps = 2 * FP32_BYTES * min(shard, STEP_CHUNK_NUMEL)  # sqrt(v) and sqrt(v)/c of one chunk
    phases = _phases(spec, cfg, seq)
    act, other = phases["step"]
    phases["step"] = (act, other + step_temps)
    if cfg.zero >= 3:
        # analytic ZeRO-3 (Rajbhandari et al. 2020): one block's fp32 parameters gathered for
        # compute while the next one is prefetched, at every moment of forward and backward
        gather = 2 * FP32_BYTES * math.ceil(spec.block_params() / cfg.tp)
        phases = {k: (a, o + (gather if k != "step" else 0)) for k, (a, o) in phases.items()}
    act, other = max(phases.values(), key=lambda ao: ao[0] + ao[1])
    states = params + grads + optimizer
    breakdown = MemoryBreakdown(num_params=n, params_bytes=params, grads_bytes=grads, optimizer_bytes=optimizer,
                                activations_bytes=act, other_bytes=other, peak_bytes=states + act + other)
    return breakdown, {k: states + a + o for k, (a, o) in phases.items()}


# ---- public pieces for other runtimes' models (planner/core/stage_memory.py: a pipeline stage) ------------


def compute_width(cfg: MemoryConfig) -> int:
    """Bytes of the compute dtype: 4 in fp32, 2 under bf16/fp16 autocast."""
    return HALF_BYTES if cfg.dtype != "fp32" else FP32_BYTES


def block_saved_bytes(spec: ModelSpec, cfg: MemoryConfig, batch: int, seq: int) -> int:
    """Bytes one block keeps for backward for `batch` samples of `seq` tokens, no recomputation (its
    per-token tensors and the attention kernel's, as `_phases` counts them; autocast weight copies apart)."""
    s, w = _shape(spec, replace(cfg, pp=1)), compute_width(cfg)
    return _layer_saved_bytes_per_token(s, _widths(s, cfg)) * batch * seq + _attention_bytes(spec, cfg, s, batch,
                                                                                             seq, w)


def block_backward_transient_bytes(spec: ModelSpec, cfg: MemoryConfig, tokens: int) -> int:
    """The largest transient inside one block's backward for `tokens` tokens (`_in_block_backward`)."""
    s = _shape(spec, replace(cfg, pp=1))
    return _in_block_backward(spec, s, _widths(s, cfg), tokens)


def head_saved_bytes_per_token(spec: ModelSpec, cfg: MemoryConfig) -> int:
    """Bytes per token the final norm and the head keep for backward (`_head_saved_per_token`)."""
    s = _shape(spec, replace(cfg, pp=1))
    return _head_saved_per_token(s, _widths(s, cfg))


def block_weight_copy_bytes(spec: ModelSpec, cfg: MemoryConfig) -> int:
    """Autocast's w-byte copies of one block's matmul weights (0 in fp32)."""
    return HALF_BYTES * _block_matmul_params(spec, _shape(spec, replace(cfg, pp=1))) if cfg.dtype != "fp32" else 0
