"""Uneven all-gather and reduce-scatter of a 1-D flat buffer whose slices belong to different ranks.

`bounds[p] = (start, end)` is plan position p's slice of the flat buffer: contiguous, in position
order, covering [0, numel); a slice may be empty (a rank with shard fraction 0). Positions map to
ranks of the process group through `position_to_rank`, so the plan's order need not be the ranks'.

    all_gather(full, shard, bounds)        full[s_p:e_p] = position p's shard, for every p
    reduce_scatter(shard_out, full, bounds) shard_out = sum over ranks of their full[s_me:e_me]
    all_reduce(t, op)                      in place, "sum" or "max"

The method per call is contracts.wire's rule (`gather_method`, `reduce_scatter_method`), chosen by
bench/uneven_collectives.py's measurement (docs/models/cost.md):
  gloo gather: one async broadcast per non-empty owner into views of `full`;
  gloo reduce-scatter: on 2 ranks "direct" (each rank sends the other's slice, point to point, and
    adds its own to what it receives: every byte once); else one async reduce per non-empty owner,
    or, where it sends fewer bytes from the busiest rank, one all_reduce of `full` (both clobber `full`);
  NCCL: the native single-tensor forms for an even split in rank order, else torch's list forms, which
    NCCL runs as one group of broadcasts / reduces (one call, no padding).
Any dtype the backend reduces (fp32, bf16). `scratch_bytes` is what a call allocates beyond its
arguments (contracts.wire; 0 except NCCL's list forms on an even split out of rank order). With
`async_op=True`, touch neither buffer before `Work.wait()`. Several calls may be in flight at once and
waited in any order: every rank issues the same calls in the same order, and the backend matches them
by issue order (gloo tags each call when it is issued; NCCL runs one stream in issue order).
"""
from __future__ import annotations

import logging
from typing import Callable, Sequence

import torch
import torch.distributed as dist

from contracts import wire

log = logging.getLogger(__name__)

Bounds = Sequence[tuple[int, int]]
REDUCE_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}
P2P_TAG_WRAP = 2**24  # send/recv tags of the "direct" reduce-scatter cycle below this
# torch 2.13 renamed the single-tensor forms (all_gather_into_tensor, reduce_scatter_tensor)
ALL_GATHER_SINGLE = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
REDUCE_SCATTER_SINGLE = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class Work:
    """Pending sub-operations of one call and what to do once they are done; `wait()` blocks until
    the result is in place (idempotent; a no-op for completed synchronous calls)."""

    def __init__(self, works: Sequence = (), then: Callable[[], None] | None = None):
        self._works = list(works)
        self._then = then

    def wait(self) -> None:
        works, self._works = self._works, []
        for w in works:
            w.wait()
        then, self._then = self._then, None
        if then is not None:
            then()


DONE = Work()


def validate_bounds(bounds: Bounds, world: int, numel: int | None = None) -> tuple[tuple[int, int], ...]:
    """`bounds` as a tuple of (start, end); ValueError unless they tile [0, numel) in order."""
    b = tuple((int(s), int(e)) for s, e in bounds)
    if len(b) != world:
        raise ValueError(f"bounds has {len(b)} slices for a world of {world} positions")
    expected_start = 0
    for p, (s, e) in enumerate(b):
        if s != expected_start:
            raise ValueError(f"bounds are not contiguous: slice {p} starts at {s}, expected {expected_start} "
                             f"(the end of slice {p - 1})" if p else
                             f"bounds are not contiguous: slice 0 starts at {s}, expected 0")
        if e < s:
            raise ValueError(f"bounds slice {p} = [{s}, {e}) ends before it starts")
        expected_start = e
    if numel is not None and expected_start != numel:
        raise ValueError(f"bounds cover [0, {expected_start}) but the full buffer has {numel} elements")
    return b


def _check_args(full: torch.Tensor, shard: torch.Tensor, bounds: Bounds, world: int, position: int,
                shard_name: str) -> tuple[tuple[int, int], ...]:
    if full.dim() != 1 or shard.dim() != 1:
        raise ValueError(f"full and {shard_name} must be 1-D, got shapes {tuple(full.shape)} and {tuple(shard.shape)}")
    if not full.is_contiguous() or not shard.is_contiguous():
        raise ValueError(f"full and {shard_name} must be contiguous (a slice of a flat buffer is)")
    if full.dtype != shard.dtype or full.device != shard.device:
        raise ValueError(f"full is {full.dtype} on {full.device} but {shard_name} is {shard.dtype} on {shard.device}")
    b = validate_bounds(bounds, world, full.numel())
    s, e = b[position]
    if shard.numel() != e - s:
        raise ValueError(f"{shard_name} has {shard.numel()} elements but position {position}'s slice "
                         f"[{s}, {e}) has {e - s}")
    return b


def _backend_name(backend: str) -> str:
    """"gloo" or "nccl" from the group's backend string ("gloo", "nccl", "cpu:gloo,cuda:nccl" is nccl:
    the runtime's buffers live on the GPU wherever a group has NCCL)."""
    name = backend.lower()
    for known in ("nccl", "gloo"):
        if known in name:
            return known
    raise ValueError(f"collectives run on gloo or nccl, not on the group's backend {backend!r}")


class Collectives:
    """Uneven collectives for the rank at plan `position` of `world` positions (docs/models/cost.md)."""

    position: int
    world: int

    def __init__(self, position: int, world: int):
        if world < 1 or not 0 <= position < world:
            raise ValueError(f"position {position} is not in a world of {world} positions")
        self.position, self.world = position, world

    def all_gather(self, full: torch.Tensor, shard: torch.Tensor, bounds: Bounds, async_op: bool = False) -> Work:
        b = _check_args(full, shard, bounds, self.world, self.position, "shard")
        s, e = b[self.position]
        full[s:e].copy_(shard)  # the own slice; the gather itself broadcasts from full's views
        return self._gather(full, b, async_op)

    def reduce_scatter(self, shard_out: torch.Tensor, full: torch.Tensor, bounds: Bounds,
                       async_op: bool = False) -> Work:
        b = _check_args(full, shard_out, bounds, self.world, self.position, "shard_out")
        return self._reduce_scatter(shard_out, full, b, async_op)

    def all_reduce(self, t: torch.Tensor, op: str = "sum") -> None:
        if op not in REDUCE_OPS:
            raise ValueError(f"all_reduce op must be one of {sorted(REDUCE_OPS)}, got {op!r}")
        self._all_reduce(t, op)

    def scratch_bytes(self, bounds: Bounds, element_size: int) -> int:
        """Torch-allocator bytes one all_gather or reduce_scatter over `bounds` allocates beyond its
        arguments, the larger of the two (contracts.wire's `*_scratch_bytes`; docs/models/cost.md)."""
        validate_bounds(bounds, self.world)
        if element_size <= 0:
            raise ValueError(f"element_size must be positive, got {element_size}")
        return self._scratch_bytes([e - s for s, e in bounds], element_size)

    def _scratch_bytes(self, sizes: list[int], element_size: int) -> int:
        return 0

    # the backend's part: `full`'s own slice is already in place for _gather
    def _gather(self, full, bounds, async_op) -> Work:
        raise NotImplementedError

    def _reduce_scatter(self, shard_out, full, bounds, async_op) -> Work:
        raise NotImplementedError

    def _all_reduce(self, t, op) -> None:
        raise NotImplementedError


class LocalCollectives(Collectives):
    """One process standing in for `position` of a `world`-rank run (the memory tracer, also under
    FakeTensorMode): the real methods' own copies, no communication, and, as they do, no other
    allocation. The other positions' slices of `full` stay as they are; all_reduce does nothing."""

    def _gather(self, full, bounds, async_op) -> Work:
        return DONE

    def _reduce_scatter(self, shard_out, full, bounds, async_op) -> Work:
        s, e = bounds[self.position]
        shard_out.copy_(full[s:e])
        return DONE

    def _all_reduce(self, t, op) -> None:
        return None


class ProcessGroupCollectives(Collectives):
    """torch.distributed: `position_to_rank[p]` is the rank, in `group` (default: the world), of
    plan position p; the backend (gloo or nccl) is read from the group."""

    def __init__(self, position: int, position_to_rank: Sequence[int], group=None):
        super().__init__(position, len(position_to_rank))
        ranks = [int(r) for r in position_to_rank]
        size = dist.get_world_size(group)
        if sorted(ranks) != list(range(size)):
            raise ValueError(f"position_to_rank {ranks} is not a permutation of the group's {size} ranks")
        me = dist.get_rank(group)
        if ranks[position] != me:
            raise ValueError(f"position {position} maps to rank {ranks[position]} but this process is rank {me}")
        self.position_to_rank = tuple(ranks)
        self.group = group
        self.backend = _backend_name(str(dist.get_backend(group)))
        log.debug("collectives: position %d of %d on %s", position, self.world, self.backend)

    def _sizes(self, bounds) -> list[int]:
        return [e - s for s, e in bounds]

    def _scratch_bytes(self, sizes: list[int], element_size: int) -> int:
        args = (sizes, element_size, self.world, self.backend, self.position_to_rank)
        return max(wire.gather_scratch_bytes(*args), wire.reduce_scatter_scratch_bytes(*args))

    def _rank_views(self, full, bounds) -> list[torch.Tensor]:
        """The views of `full`, indexed by group rank (torch's list forms take them in rank order)."""
        views: list[torch.Tensor] = [full] * self.world
        for p, (a, b) in enumerate(bounds):
            views[self.position_to_rank[p]] = full[a:b]
        return views

    def _gather(self, full, bounds, async_op) -> Work:
        if self.world == 1:
            return DONE
        s, e = bounds[self.position]
        method = wire.gather_method(self._sizes(bounds), full.element_size(), self.world, self.backend,
                                    self.position_to_rank)
        if method == "native":
            works = [ALL_GATHER_SINGLE(full, full[s:e], group=self.group, async_op=async_op)]
        elif method == "grouped":
            works = [dist.all_gather(self._rank_views(full, bounds), full[s:e], group=self.group, async_op=async_op)]
        else:  # "broadcast": the rule never picks another method on gloo
            works = [dist.broadcast(full[a:b], group_src=self.position_to_rank[p], group=self.group,
                                    async_op=async_op)
                     for p, (a, b) in enumerate(bounds) if b > a]
        return Work(works if async_op else [])

    def _reduce_scatter(self, shard_out, full, bounds, async_op) -> Work:
        s, e = bounds[self.position]
        if self.world == 1:
            shard_out.copy_(full[s:e])
            return DONE
        method = wire.reduce_scatter_method(self._sizes(bounds), full.element_size(), self.world, self.backend,
                                            self.position_to_rank)
        if method == "native":
            works = [REDUCE_SCATTER_SINGLE(shard_out, full, group=self.group, async_op=async_op)]
            return Work(works if async_op else [])
        if method == "grouped":
            works = [dist.reduce_scatter(shard_out, self._rank_views(full, bounds), group=self.group,
                                         async_op=async_op)]
            return Work(works if async_op else [])
        if method == "direct":
            return self._direct_reduce_scatter(shard_out, full, bounds, async_op)
        if method == "allreduce":  # one call: every rank's full summed in place, then the own slice
            works = [dist.all_reduce(full, group=self.group, async_op=async_op)]
        else:  # "reduce": one per non-empty owner, into its view of full
            works = [dist.reduce(full[a:b], group_dst=self.position_to_rank[p], group=self.group, async_op=async_op)
                     for p, (a, b) in enumerate(bounds) if b > a]
        work = Work(works if async_op else [], then=lambda: shard_out.copy_(full[s:e]))
        if not async_op:
            work.wait()
        return work

    def _direct_reduce_scatter(self, shard_out, full, bounds, async_op) -> Work:
        """Every other owner's slice of `full` sent to it; the peers' parts of this rank's slice
        received (the first into shard_out, the others into buffers), then this rank's own added.
        A tag per call, the same on every rank (they issue the same calls in the same order), keeps
        calls in flight at once apart."""
        s, e = bounds[self.position]
        self._p2p_tag = (getattr(self, "_p2p_tag", 0) + 1) % P2P_TAG_WRAP
        tag = self._p2p_tag
        works = [dist.isend(full[a:b], group_dst=self.position_to_rank[p], group=self.group, tag=tag)
                 for p, (a, b) in enumerate(bounds) if p != self.position and b > a]
        received = []
        if e > s:
            for i, p in enumerate(q for q in range(self.world) if q != self.position):
                buf = shard_out if i == 0 else torch.empty_like(shard_out)
                works.append(dist.irecv(buf, group_src=self.position_to_rank[p], group=self.group, tag=tag))
                received.append(buf)

        def then() -> None:
            for buf in received[1:]:
                shard_out.add_(buf)
            if received:
                shard_out.add_(full[s:e])
            else:
                shard_out.copy_(full[s:e])
        work = Work(works, then=then)
        if not async_op:
            work.wait()
        return work

    def _all_reduce(self, t, op) -> None:
        dist.all_reduce(t, op=REDUCE_OPS[op], group=self.group)
