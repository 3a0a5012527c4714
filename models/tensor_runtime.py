"""The sharded runtime with tensor parallelism: one rank = (data-parallel position p, TP index k).

`TensorParallelRuntime` is models/sharded.py's ShardedRuntime (zero 1, uneven shards, uneven batches)
whose model is this rank's TP part (models/tensor.py): each DP position is a TP group of t ranks, and
the t ranks of TP index k across the DP positions shard that index's parameters among themselves, as a
one-rank-per-position run shards the whole model. What the TP group changes in the step:

  * the loss: the vocabulary-parallel cross-entropy of this rank's logit slice (no gather);
  * the global norm: the split parameters' squares summed over the TP group, the replicated ones
    counted once (TP index 0 counts them; the others leave them out);
  * the step's statistics: summed over the DP group, then over the TP group, the loss counted once.

With tp None it is ShardedRuntime exactly (models/pipeline.py derives from it). The process groups:
`build_groups` (every rank calls it, in the same order). docs/models/tensor_parallel.md.
"""
from __future__ import annotations

from types import SimpleNamespace
from typing import Sequence

import torch
import torch.distributed as dist

from models.collectives import ProcessGroupCollectives
from models.sharded import ShardedRuntime, UnitState
from models.tensor import TensorParallel, replicated_ranges, vocab_bounds, vocab_parallel_cross_entropy


def build_groups(layout: Sequence[Sequence[int]], rank: int) -> tuple[int, TensorParallel, ProcessGroupCollectives]:
    """The groups of a TP × DP run: `layout[p]` = the global ranks of data-parallel position p's TP group,
    by TP index (every position the same size t). Creates the t DP groups (TP index k: layout[p][k] for
    every p, in position order) then the TP groups (one per position), on EVERY rank in the same order
    (torch.distributed requires it), and returns this rank's (position, TensorParallel, DP collectives)."""
    t = len(layout[0]) if layout else 0
    if t < 1 or any(len(g) != t for g in layout):
        raise ValueError("every data-parallel position needs a TP group of the same size, got "
                         f"{list(map(list, layout))}")
    flat = [r for g in layout for r in g]
    if len(set(flat)) != len(flat):
        raise ValueError(f"a rank appears twice in the TP × DP layout {list(map(list, layout))}")
    unordered = [list(g) for g in layout if list(g) != sorted(g)]
    if unordered:
        raise ValueError(f"TP group {unordered[0]}: list its ranks in increasing order (TP index = group rank)")
    dp_groups = [dist.new_group([g[k] for g in layout]) for k in range(t)]
    tp_groups = [dist.new_group(list(g)) for g in layout]
    pos, k = next((p, g.index(rank)) for p, g in enumerate(layout) if rank in g)
    ranks = [g[k] for g in layout]
    order = sorted(ranks)  # a group's ranks are numbered in the order of their global ranks
    comm = ProcessGroupCollectives(pos, [order.index(r) for r in ranks], group=dp_groups[k])
    return pos, TensorParallel(t, k, tp_groups[pos]), comm


class TensorParallelRuntime(ShardedRuntime):
    """ShardedRuntime(..., tp=TensorParallel(t, k, group)) with the TP step (module doc)."""

    def __repr__(self) -> str:
        tp = f", tp {self.tp.rank} of {self.tp.size}" if self.tp is not None else ""
        return super().__repr__()[:-1] + tp + ")"

    def _loss(self, logits: torch.Tensor, targets: torch.Tensor, normalizer: int) -> torch.Tensor:
        if self.tp is None:
            return super()._loss(logits, targets, normalizer)
        start = vocab_bounds(self.spec.vocab_size, self.tp.size)[self.tp.rank][0]
        V_r = logits.shape[-1]
        # CE in fp32, summed over the full vocabulary from this rank's (N, V_r) slice, / the GLOBAL token count
        return vocab_parallel_cross_entropy(logits.float().view(-1, V_r), targets.reshape(-1), start,
                                            self.tp.group) / normalizer

    def _norm_units(self) -> list:
        return self._tp_norm_views(super()._norm_units())

    def _tp_norm_views(self, units: Sequence[UnitState]) -> list:
        """What the global norm counts on this rank: every unit's slice gradient on TP index 0; on the
        others the slice less its replicated parameters (their gradients equal index 0's)."""
        if self.tp is None or self.tp.rank == 0:
            return list(units)
        mods = self._unit_modules()
        out = []
        for u in units:
            ranges = replicated_ranges(mods[u.index], u.offsets, [p.numel() for p in u.params])
            cut = u.start
            for a, b in ranges:
                a, b = max(a, u.start), min(b, u.end)
                if a < b:
                    if a > cut:
                        out.append(SimpleNamespace(grad=u.grad[cut - u.start:a - u.start]))
                    cut = b
            if u.end > cut:
                out.append(SimpleNamespace(grad=u.grad[cut - u.start:]))
        return out

    def _reduce_stats(self, stats: torch.Tensor) -> None:
        """(squared norm, overflow flag, loss) summed over the DP group, then over the TP group; every
        TP rank computed the same loss, so only TP index 0 adds it."""
        if self.tp is not None and self.tp.rank:
            stats[2].zero_()
        super()._reduce_stats(stats)
        if self.tp is not None:
            dist.all_reduce(stats, group=self.tp.group)

    def load_parameters(self, read) -> None:
        if self.tp is not None:
            raise NotImplementedError("loading a Hugging Face model into a tensor-parallel runtime is not implemented")
        super().load_parameters(read)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        if self.tp is not None:
            raise NotImplementedError("the full state of a tensor-parallel runtime (a gather over the TP group) "
                                      "is not implemented")
        return super().full_state_dict()


__all__ = ["TensorParallelRuntime", "build_groups"]
