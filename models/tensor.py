"""Megatron-style tensor parallelism (Shoeybi et al. 2019) for models/decoder.py: the pieces.

A TP group of t ranks holds one copy of the model between them:

  * attention: q/k/v column-parallel (each rank its num_heads/t query heads and num_kv_heads/t key/value
    heads, so GQA's head i -> kv head i // groups stays on the rank), o_proj row-parallel;
  * MLP: up (and SwiGLU's gate) column-parallel (ffn/t columns), down row-parallel;
  * the token embedding and the LM head vocabulary-parallel (rank r holds rows `vocab_bounds(V, t)[r]`),
    the cross-entropy computed vocabulary-parallel (`vocab_parallel_cross_entropy`): the (N, V) logits
    are the step's largest tensors (V >> h), so they are never gathered, each rank holds N·V/t of them;
  * norms, row-parallel biases and learned positions replicated: their gradients are computed
    identically on every rank (the residual stream and its gradient are the same everywhere), so they
    are never all-reduced; the global norm counts them once (`split_flags`).

The conjugate operators of Megatron's paper, as autograd Functions: `copy_to_tp` (f: identity forward,
all-reduce of the input gradient backward) at the input of attention, of the MLP and of the head;
`reduce_from_tp` (g: all-reduce forward, identity backward) after each row-parallel matmul, before its
bias. Per block: 2 all-reduces of (B, T, h) in forward, 2 in backward (and one more of each for the
recomputed forward of a checkpointed block), plus the embedding's forward and the head's backward.

The weights: the runtime draws every weight in full from the one-rank seed (models/sharded.py
`_init_unit`) and keeps this rank's slice (`local_slice`), so a TP run starts from the one-rank
weights. The design, the process groups and what the memory model counts: docs/models/tensor_parallel.md.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Any, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from contracts.specs import ModelSpec
from models.decoder import Decoder

# which dimension of a (out, in) weight a rank slices: its rows (output features) for a column-parallel
# Linear and the vocabulary, its columns (input features) for a row-parallel one
DIM_ROWS, DIM_COLS = 0, 1


@dataclass(frozen=True)
class TensorParallel:
    """This rank's place in its TP group: `rank` of `size`, `group` the torch.distributed group of the
    group's ranks (None: the default world group)."""

    size: int
    rank: int
    group: Any = None

    def __post_init__(self) -> None:
        if isinstance(self.size, bool) or not isinstance(self.size, int) or self.size < 1:
            raise ValueError(f"tensor-parallel size must be an integer >= 1, got {self.size!r}")
        if not 0 <= self.rank < self.size:
            raise ValueError(f"tensor-parallel rank {self.rank} is not in a group of {self.size}")


def check_tp(spec: ModelSpec, size: int) -> None:
    """ValueError unless `size` divides what tensor parallelism splits evenly (heads, kv heads, ffn)."""
    bad = [f"{name} {n} (remainder {n % size})" for name, n in
           (("num_heads", spec.num_heads), ("num_kv_heads", spec.num_kv_heads), ("ffn_hidden", spec.ffn_hidden))
           if n % size]
    if bad:
        raise ValueError(f"tensor-parallel degree {size} must divide {', '.join(bad)}")
    if spec.vocab_size < size:
        raise ValueError(f"tensor-parallel degree {size} > vocabulary {spec.vocab_size}")


def vocab_bounds(vocab: int, size: int) -> list[tuple[int, int]]:
    """Each TP rank's [start, end) rows of the vocabulary: V // t each, the first V % t ranks one more
    (rank 0 holds the most, which planner/core/memory.py prices)."""
    out, start = [], 0
    for r in range(size):
        n = vocab // size + (1 if r < vocab % size else 0)
        out.append((start, start + n))
        start += n
    return out


# ---- the conjugate operators (autograd Functions) ----------------------------------------------------
class _CopyToTP(torch.autograd.Function):
    """f: identity forward; the input gradient all-reduced over the TP group in backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)  # in place: the partial input gradients summed
        return grad, None


class _ReduceFromTP(torch.autograd.Function):
    """g: the partial outputs all-reduced (in place) over the TP group in forward; identity backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.mark_dirty(x)
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


def copy_to_tp(x: torch.Tensor, group: Any = None) -> torch.Tensor:
    return _CopyToTP.apply(x, group)


def reduce_from_tp(x: torch.Tensor, group: Any = None) -> torch.Tensor:
    return _ReduceFromTP.apply(x, group)


class _VocabEmbedding(torch.autograd.Function):
    """Rank r's rows [start, start + V_r) of the embedding: ids outside them look up row 0 and are
    zeroed, the partial lookups all-reduced. Saves the local ids (int64) and the mask (bool), N each;
    backward: the (V_r, h) dense gradient of the masked incoming gradient (an (N, h) copy)."""

    @staticmethod
    def forward(ctx, ids: torch.Tensor, weight: torch.Tensor, start: int, group: Any) -> torch.Tensor:
        mask = (ids < start) | (ids >= start + weight.shape[0])  # (B, T) bool: not this rank's rows
        local = (ids - start).masked_fill_(mask, 0)  # (B, T) int64
        out = F.embedding(local, weight)  # (B, T, h)
        out.masked_fill_(mask.unsqueeze(-1), 0.0)
        dist.all_reduce(out, group=group)
        ctx.save_for_backward(local, mask)
        ctx.rows = weight.shape[0]
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        local, mask = ctx.saved_tensors
        h = grad.shape[-1]
        g = grad.masked_fill(mask.unsqueeze(-1), 0.0)  # (B, T, h)
        dw = torch.zeros(ctx.rows, h, dtype=grad.dtype, device=grad.device)  # (V_r, h)
        dw.index_add_(0, local.reshape(-1), g.reshape(-1, h))
        return None, dw, None, None


class _VocabCrossEntropy(torch.autograd.Function):
    """Summed cross-entropy of (N, V_r) fp32 logit slices without gathering them (Megatron's
    vocab_parallel_cross_entropy): the row max all-reduced (MAX), then the target's shifted logit and
    the sum of exponentials all-reduced (SUM); loss_i = log Σ exp(z - m) - (z_t - m). Forward holds
    the logits and one (N, V_r) fp32 tensor (shifted, exponentiated and normalized in place: the
    softmax, saved); backward turns the saved softmax into the logits' gradient in place."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, targets: torch.Tensor, start: int, group: Any) -> torch.Tensor:
        rows = logits.shape[-1]
        m = torch.amax(logits, dim=-1)  # (N,)
        dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
        z = logits - m.unsqueeze(-1)  # (N, V_r)
        mask = (targets < start) | (targets >= start + rows)  # (N,) the target is not on this rank
        local = (targets - start).masked_fill_(mask, 0)  # (N,) int64
        picked = z.gather(1, local.unsqueeze(-1)).squeeze(-1).masked_fill_(mask, 0.0)  # (N,)
        z.exp_()
        sum_exp = z.sum(dim=-1)  # (N,)
        stats = torch.stack((picked, sum_exp))  # (2, N): one all-reduce for both
        dist.all_reduce(stats, group=group)
        picked, sum_exp = stats[0], stats[1]
        z.div_(sum_exp.unsqueeze(-1))  # the softmax, in place
        ctx.save_for_backward(z, local, mask)
        return (sum_exp.log() - picked).sum()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        softmax, local, mask = ctx.saved_tensors
        hit = (~mask).to(softmax.dtype).unsqueeze(-1)  # (N, 1): 1 where the target is on this rank
        softmax.scatter_add_(1, local.unsqueeze(-1), -hit)  # softmax - one_hot(target), in place
        softmax.mul_(grad)
        return softmax, None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, targets: torch.Tensor, start: int,
                                 group: Any = None) -> torch.Tensor:
    """Σ_i CE(logits_i, targets_i) over the full vocabulary from this rank's (N, V_r) slice starting at
    vocabulary row `start` (every rank of the group gets the same sum)."""
    return _VocabCrossEntropy.apply(logits, targets, start, group)


# ---- the parallel modules ------------------------------------------------------------------------------
class ParallelLinear(nn.Linear):
    """A Linear holding this rank's rows (column-parallel: output features) or columns (row-parallel:
    input features) of the full (out, in) weight. Row-parallel: y = g(x W_rᵀ) + b, the bias (replicated)
    added once, after the all-reduce."""

    def __init__(self, full: nn.Linear, dim: int, tp: TensorParallel):
        out_f, in_f = full.weight.shape
        n = (out_f if dim == DIM_ROWS else in_f) // tp.size
        super().__init__(in_f if dim == DIM_ROWS else n, n if dim == DIM_ROWS else out_f,
                         bias=full.bias is not None, device="meta")
        self.full_shape, self.dim, self.start, self.group = (out_f, in_f), dim, tp.rank * n, tp.group
        # parameters split over the TP group (the others are replicated)
        self.tp_split = {"weight", "bias"} if dim == DIM_ROWS else {"weight"}

    def local_slice(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's part of the full weight."""
        return full.narrow(self.dim, self.start, self.weight.shape[self.dim])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.dim == DIM_ROWS:
            return F.linear(x, self.weight, self.bias)
        y = reduce_from_tp(F.linear(x, self.weight), self.group)
        return y.add_(self.bias) if self.bias is not None else y  # in place: no second (B, T, h)


class VocabParallelEmbedding(nn.Embedding):
    """Rows `vocab_bounds(V, t)[rank]` of the token embedding; ids outside them contribute zeros."""

    def __init__(self, full: nn.Embedding, tp: TensorParallel):
        start, end = vocab_bounds(full.num_embeddings, tp.size)[tp.rank]
        super().__init__(end - start, full.embedding_dim, device="meta")
        self.full_shape, self.dim, self.start, self.group = tuple(full.weight.shape), DIM_ROWS, start, tp.group
        self.tp_split = {"weight"}

    def local_slice(self, full: torch.Tensor) -> torch.Tensor:
        return full.narrow(0, self.start, self.num_embeddings)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return _VocabEmbedding.apply(ids, self.weight, self.start, self.group)

    def local_rows(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(local ids, keep): `ids` as rows of this rank's table (0 where not its own) and the mask of
        those that are: what a gradient scattered by token id (the layer-wise step's embedding backward)
        needs to add only this rank's rows."""
        keep = (ids >= self.start) & (ids < self.start + self.num_embeddings)
        return (ids - self.start).masked_fill_(~keep, 0), keep


class VocabParallelHead(ParallelLinear):
    """The untied LM head, column-parallel over the vocabulary (rows `vocab_bounds`), like the embedding."""

    def __init__(self, full: nn.Linear, tp: TensorParallel):
        V, h = full.weight.shape
        start, end = vocab_bounds(V, tp.size)[tp.rank]
        nn.Linear.__init__(self, h, end - start, bias=False, device="meta")
        self.full_shape, self.dim, self.start, self.group = (V, h), DIM_ROWS, start, tp.group
        self.tp_split = {"weight"}


def apply_tp(model: Decoder, tp: TensorParallel) -> Decoder:
    """Cut a decoder built on the meta device into this rank's part (in place; returns it): the parallel
    modules above, each attention's local head counts, and the f operator at the input of attention,
    the MLP and the head (models/decoder.py's `tp_enter` hooks)."""
    check_tp(model.spec, tp.size)
    enter = partial(copy_to_tp, group=tp.group)
    for block in model.blocks:
        a, m = block.attn, block.mlp
        a.num_heads //= tp.size
        a.num_kv_heads //= tp.size
        for name in ("q_proj", "k_proj", "v_proj"):
            setattr(a, name, ParallelLinear(getattr(a, name), DIM_ROWS, tp))
        a.o_proj = ParallelLinear(a.o_proj, DIM_COLS, tp)
        if m.swiglu:
            m.gate_proj = ParallelLinear(m.gate_proj, DIM_ROWS, tp)
        m.up_proj = ParallelLinear(m.up_proj, DIM_ROWS, tp)
        m.down_proj = ParallelLinear(m.down_proj, DIM_COLS, tp)
        a.tp_enter = m.tp_enter = enter
    model.embed = VocabParallelEmbedding(model.embed, tp)
    if model.lm_head is not None:
        model.lm_head = VocabParallelHead(model.lm_head, tp)
    model.tp_enter = enter
    model.tp = tp
    return model


def split_flags(mods: Sequence[nn.Module]) -> list[bool]:
    """For every parameter of `mods` in the runtime's flat order (models/sharded.py `_build_unit`): True
    where it is split over the TP group, False where every TP rank holds it whole (replicated)."""
    return [name in getattr(sub, "tp_split", ()) for mod in mods for sub in mod.modules()
            for name, _ in sub.named_parameters(recurse=False)]


def replicated_ranges(mods: Sequence[nn.Module], offsets: Sequence[int],
                      numels: Sequence[int]) -> list[tuple[int, int]]:
    """The [start, end) flat ranges of a unit's replicated parameters (merged where adjacent)."""
    out: list[tuple[int, int]] = []
    for split, o, n in zip(split_flags(mods), offsets, numels):
        if split or n == 0:
            continue
        if out and out[-1][1] == o:
            out[-1] = (out[-1][0], o + n)
        else:
            out.append((o, o + n))
    return out


def tp_unit_numels(spec: ModelSpec, size: int, rank: int = 0) -> list[int]:
    """Elements of each runtime unit (contracts/units.py order: embed, blocks, head) on TP rank `rank`:
    the split parameters ÷ t, the replicated ones whole (planner/core/memory.py has the same formula)."""
    check_tp(spec, size)
    h, V = spec.hidden, spec.vocab_size
    start, end = vocab_bounds(V, size)[rank]
    norm = spec.final_norm_params()  # one norm's parameters (LayerNorm: weight and bias)
    row_bias = h * ((1 if spec.linear_bias or spec.o_bias else 0)
                    + (1 if spec.linear_bias or spec.mlp_bias else 0))  # o_proj's and down_proj's
    replicated = 2 * norm + row_bias
    block = (spec.block_params() - replicated) // size + replicated
    pos = spec.max_seq * h if spec.positional == "learned" else 0
    head = norm + (0 if spec.tied_embeddings else (end - start) * h)
    return [(end - start) * h + pos, *[block] * spec.num_layers, head]


def full_weight_init(sub: nn.Module, std: float, gen: torch.Generator) -> None:
    """N(0, std) into `sub.weight`: a parallel module draws its FULL weight from `gen` (the same
    numbers, in the same order, as the one-rank runtime) and keeps its slice; others draw in place."""
    if not hasattr(sub, "local_slice"):
        sub.weight.normal_(0.0, std, generator=gen)
        return
    full = torch.empty(sub.full_shape, dtype=sub.weight.dtype, device=sub.weight.device)
    full.normal_(0.0, std, generator=gen)
    sub.weight.copy_(sub.local_slice(full))


__all__ = ["TensorParallel", "apply_tp", "check_tp", "vocab_bounds", "copy_to_tp", "reduce_from_tp",
           "vocab_parallel_cross_entropy", "ParallelLinear", "VocabParallelEmbedding", "VocabParallelHead",
           "split_flags", "replicated_ranges", "tp_unit_numels", "full_weight_init"]
