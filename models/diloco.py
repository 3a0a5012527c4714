"""DiLoCo (Douillard et al. 2023) over the uneven sharded runtime, or over pipeline replicas.

The plan's groups (contracts/plan.py `DilocoSpec`, one per datacenter) each train as uneven sharded
data parallelism (models/sharded.py) on their own process group and part of the step's samples, for
H inner steps of the inner optimizer (models/optim.py, AdamW or SGD). Then an outer step over the WAN,
in fp32 on each rank's master slices: the outer gradient Δ = Σ_g w_g · (θ_synced − θ_g), w_g the
group's share of the batch's tokens, applied by SGD with (Nesterov) momentum (torch.optim.SGD's
update); every group restarts from the result. With H = 1, inner SGD, outer_lr 1 and momentum 0 this
is synchronous data parallelism.

Groups shard each unit differently, so the exchange fills a zero vector of each unit's full length
with the rank's own slice of w_g · Δ_g and sums it with one world all-reduce per fragment (wire dtype
fp32, bf16, or int8 with a per-fragment scale); fragments are synchronised in turn (streaming), and
the exchange may overlap the next inner step. Over pipelines (models/pipeline.py) each group runs a
whole pipeline and a rank exchanges its stage's units with the ranks holding that stage in the other
groups; a tied embedding's copies (first and last stage) are exchanged together, half a delta each.
The derivation, the bytes, the int8 bound and why this is not torchft's implementation:
docs/models/diloco.md.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

from contracts.plan import DilocoSpec
from models.collectives import Collectives, ProcessGroupCollectives
from models.sharded import ShardedRuntime, StepResult, UnitState

log = logging.getLogger(__name__)

WIRE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "int8": torch.int8}
INT8_MAX = 127


@dataclass
class _Part:
    """One all-reduce of a fragment's exchange, issued: the summed buffer (wire dtype) and what to apply
    it to."""
    units: list[UnitState]
    offsets: list[int]  # each unit's start in `wire`
    wire: torch.Tensor
    scale: torch.Tensor | None  # int8: the scale agreed over the part's ranks
    work: Any  # the all-reduce's Work while in flight; None once done
    payload_bytes: int


@dataclass
class _Exchange:
    """A fragment's outer exchange, issued: one part per set of ranks it is summed over."""
    fragment: int
    step: int
    parts: list[_Part]
    send_s: float  # wall seconds this rank spent issuing it

    @property
    def units(self) -> list[UnitState]:
        return [u for p in self.parts for u in p.units]

    @property
    def payload_bytes(self) -> int:
        return sum(p.payload_bytes for p in self.parts)


@dataclass(frozen=True)
class OuterSync:
    """One outer step of one fragment, as this rank saw it."""
    step: int  # the inner step after which it was issued (counted from 1)
    fragment: int
    num_units: int
    payload_bytes: int  # what this rank put into the exchange (the vectors, and int8's scale)
    seconds: float  # wall seconds the inner steps waited for it: issue, wait and the outer update


def split_fragments(num_units: int, fragments: int) -> list[list[int]]:
    """The unit indices of each fragment: `fragments` contiguous runs, sizes differing by at most one."""
    if not 1 <= fragments <= num_units:
        raise ValueError(f"diloco: {fragments} fragments for a model of {num_units} units "
                         f"(need 1 <= fragments <= units)")
    base, extra = divmod(num_units, fragments)
    out, start = [], 0
    for f in range(fragments):
        n = base + (1 if f < extra else 0)
        out.append(list(range(start, start + n)))
        start += n
    return out


def sync_offset(fragment: int, inner_steps: int, fragments: int) -> int:
    """The value of step % H after which fragment f is synchronised."""
    return fragment * inner_steps // fragments


def int8_levels(num_groups: int) -> int:
    """The largest |q| one group may send so that the sum over the groups fits in int8."""
    levels = INT8_MAX // num_groups
    if levels < 1:
        raise ValueError(f"diloco: int8 compression needs at most {INT8_MAX} groups, got {num_groups}")
    return levels


def int8_error_bound(scale: float, num_groups: int) -> float:
    """The largest error of an element of the int8 exchange: half a level per group."""
    return num_groups * scale / 2


def quantize_int8(x: torch.Tensor, scale: torch.Tensor, levels: int) -> torch.Tensor:
    """round(x / scale), clamped to ±levels, as int8 (scale > 0, a 0-d fp32 tensor)."""
    return torch.round(x / scale).clamp_(-levels, levels).to(torch.int8)


def outer_update_(synced: torch.Tensor, outer_grad: torch.Tensor, momentum: torch.Tensor | None, lr: float,
                  mu: float, nesterov: bool) -> None:
    """torch.optim.SGD(lr, momentum=mu, nesterov=nesterov)'s step on a flat fp32 slice, in place:
    m = mu·m + g; d = g + mu·m (nesterov) or m; synced -= lr·d. `momentum` None: mu is 0."""
    if momentum is None:
        synced.add_(outer_grad, alpha=-lr)
        return
    momentum.mul_(mu).add_(outer_grad)
    if nesterov:
        synced.add_(outer_grad, alpha=-lr).add_(momentum, alpha=-lr * mu)
    else:
        synced.add_(momentum, alpha=-lr)


class DilocoRuntime:
    """One rank of a DiLoCo run: its group's runtime (`inner`: a ShardedRuntime on the group's process
    group, or one stage of the group's pipeline, models/pipeline.py) plus the outer state of its
    slices: `synced` (the parameters at the last sync) and the outer momentum, per unit. `outer`
    reaches the ranks holding these units in every group (its all_reduce only): every rank of every
    group, or of a pipeline the ranks of this stage in every group. `tied` (a pipeline of a tied model,
    on its first and last stages): the ranks of both stages in every group, over which the embedding
    (unit 0) is exchanged instead, each of its two copies adding half its delta, so both copies get
    the one same sum."""

    def __init__(self, inner: ShardedRuntime, spec: DilocoSpec, *, group: int, weight: float,
                 outer: Collectives, tied: Collectives | None = None):
        if not 0 <= group < spec.num_groups:
            raise ValueError(f"diloco: group {group} is not one of the plan's {spec.num_groups} groups")
        if not 0.0 < weight <= 1.0:
            raise ValueError(f"diloco: group weight (its share of the global batch's tokens) must be in "
                             f"(0, 1], got {weight!r}")
        if inner.tp is not None:
            raise ValueError("diloco: tensor-parallel groups are not supported")
        self.inner, self.spec, self.group, self.weight, self.outer = inner, spec, group, float(weight), outer
        self.tied = tied if any(u.index == 0 for u in inner.units) else None
        self.wire_dtype = WIRE_DTYPES[spec.compress]
        if spec.compress == "int8":  # refused here, not at the first outer step
            int8_levels(spec.num_groups * (2 if self.tied is not None else 1))
        self._slot = {u.index: i for i, u in enumerate(inner.units)}  # unit index -> its place in `synced`
        self.fragments = split_fragments(len(inner.units), spec.fragments)
        self.synced: list[torch.Tensor] = []
        self.momentum: list[torch.Tensor | None] = []
        self.inner_step = 0
        self.since_sync = [0] * len(self.fragments)  # inner steps since each fragment's last sync
        self.syncs: list[OuterSync] = []  # the outer steps of the last train_step (or sync_all)
        self._pending: list[_Exchange] = []  # overlap: exchanges issued after the last inner step
        self.snapshot()

    def __repr__(self) -> str:
        s = self.spec
        return (f"DilocoRuntime(group {self.group} of {s.num_groups}, H={s.inner_steps}, "
                f"F={s.fragments}, {s.compress}, {self.inner!r})")

    # ---- the outer state ----------------------------------------------------------------------
    @torch.no_grad()
    def snapshot(self) -> None:
        """Take the current master slices as the synced parameters; the outer momentum restarts."""
        self.synced = [u.master.detach().clone() for u in self.inner.units]  # by place in inner.units
        mu = self.spec.outer_momentum
        self.momentum = [torch.zeros_like(s) if mu > 0 else None for s in self.synced]

    def load_parameters(self, read: Callable[[str, int, int], torch.Tensor]) -> None:
        """ShardedRuntime.load_parameters, then those parameters become the synced ones."""
        self.inner.load_parameters(read)
        self.snapshot()

    # ---- training -----------------------------------------------------------------------------
    def train_step(self, batches: Sequence[tuple[torch.Tensor, torch.Tensor]], group_tokens: int, lr: float,
                   after_compute: Callable[[float], None] | None = None) -> StepResult:
        """One inner step of this group (its loss normalised by the group's own `group_tokens`), then
        the outer steps it makes due (`self.syncs` lists those completed): with `overlap` the exchanges
        started after the previous step complete, and the fragments due now start theirs; without,
        the fragments due now are exchanged and updated."""
        r = self.inner.train_step(batches, group_tokens, lr, after_compute=after_compute)
        self.inner_step += 1
        self.since_sync = [n + 1 for n in self.since_sync]
        h, nf = self.spec.inner_steps, len(self.fragments)
        due = [f for f in range(nf) if self.inner_step % h == sync_offset(f, h, nf)]
        if not self.spec.overlap:
            self.syncs = [self._finish(self._start(f, async_op=False), merge=False) for f in due]
            return r
        finished, self._pending = self._pending, []
        self.syncs = [self._finish(x, merge=True) for x in finished]
        self._pending = [self._start(f, async_op=True) for f in due]
        return r

    def sync_all(self) -> list[OuterSync]:
        """Complete the exchanges in flight (no inner step trained over them: the masters become the
        synced parameters), then the outer step of every fragment trained since its last sync (a
        run's end: every group then holds the same parameters)."""
        finished, self._pending = self._pending, []
        self.syncs = [self._finish(x, merge=False) for x in finished]
        self.syncs += [self._finish(self._start(f, async_op=False), merge=False)
                       for f, n in enumerate(self.since_sync) if n > 0]
        return self.syncs

    @torch.no_grad()
    def _start(self, f: int, async_op: bool) -> _Exchange:
        """Fragment f's exchange issued: the tied embedding (if this rank holds a copy) over `tied`,
        the other units over `outer`."""
        t0 = time.perf_counter()
        units = [self.inner.units[i] for i in self.fragments[f]]
        self.inner.settle()  # zero 3: the gathers issued beside the update hold the pre-sync weights
        shared = [u for u in units if self.tied is not None and u.index == 0]
        own = [u for u in units if not shared or u.index != 0]
        parts = [self._issue(own, self.outer, self.weight, self.spec.num_groups, async_op)]
        if shared:  # the G groups' 2 copies each: half a delta per copy, so the sum is Σ w_g Δ_g
            parts.append(self._issue(shared, self.tied, self.weight / 2, 2 * self.spec.num_groups, async_op))
        self.since_sync[f] = 0
        return _Exchange(f, self.inner_step, parts, time.perf_counter() - t0)

    def _issue(self, units: list[UnitState], outer: Collectives, weight: float, contributors: int,
               async_op: bool) -> _Part:
        """`weight` · (synced − masters) on this rank's slices of `units` (zeros elsewhere), cast to the
        wire dtype and its sum over `outer` issued; int8: the scale's max all-reduce first (blocking),
        each value within the levels `contributors` summands may each send."""
        offsets, total = [], 0
        for u in units:
            offsets.append(total)
            total += u.numel
        delta = torch.zeros(total, dtype=torch.float32, device=self.inner.device)
        for u, o in zip(units, offsets):  # w_g · (synced - current) on this rank's slice, zeros elsewhere
            torch.sub(self.synced[self._slot[u.index]], u.master, out=delta[o + u.start:o + u.end]).mul_(weight)
        scale, extra = None, 0
        if self.wire_dtype == torch.float32:
            wire = delta
        elif self.wire_dtype == torch.bfloat16:
            wire = delta.to(torch.bfloat16)
        else:
            levels = int8_levels(contributors)
            amax = delta.abs().max().reshape(1) if total else torch.zeros(1, device=delta.device)
            outer.all_reduce(amax, "max")
            scale = (amax[0] / levels).clamp_min(torch.finfo(torch.float32).tiny)
            wire, extra = quantize_int8(delta, scale, levels), amax.numel() * amax.element_size()
        work = self._sum(wire, outer, async_op)
        return _Part(units, offsets, wire, scale, work, wire.numel() * wire.element_size() + extra)

    @staticmethod
    def _sum(t: torch.Tensor, outer: Collectives, async_op: bool) -> Any:
        """The sum of `t` over `outer` in place; with `async_op` on a process group, its Work (else done)."""
        if async_op and isinstance(outer, ProcessGroupCollectives):
            return dist.all_reduce(t, op=dist.ReduceOp.SUM, group=outer.group, async_op=True)
        outer.all_reduce(t, "sum")
        return None

    @torch.no_grad()
    def _finish(self, x: _Exchange, merge: bool) -> OuterSync:
        """Wait for the sum, apply the outer step to the synced slices, and set the masters to them;
        `merge` (an exchange overlapped by one inner step): masters = α · masters + (1 - α) · synced,
        α = merge_alpha, keeping that share of the step trained meanwhile."""
        t0 = time.perf_counter()
        alpha = self.spec.merge_alpha if merge else 0.0
        self.inner.settle()
        for part in x.parts:
            if part.work is not None:
                part.work.wait()
            summed = part.wire.float()
            if part.scale is not None:
                summed.mul_(part.scale)
            for u, o in zip(part.units, part.offsets):
                i = self._slot[u.index]
                synced = self.synced[i]
                outer_update_(synced, summed[o + u.start:o + u.end], self.momentum[i],
                              self.spec.outer_lr, self.spec.outer_momentum, self.spec.nesterov)
                if alpha > 0:
                    u.master.mul_(alpha).add_(synced, alpha=1 - alpha)
                else:
                    u.master.copy_(synced)
        if alpha == 0 and merge:
            self.since_sync[x.fragment] = 0  # the step trained meanwhile is replaced for this fragment
        self._refresh(x.units)
        return OuterSync(x.step, x.fragment, len(x.units), x.payload_bytes, x.send_s + time.perf_counter() - t0)

    def _refresh(self, units: list[UnitState]) -> None:
        """Make the group's copies of the updated units agree with the new masters: zero 1/2 gather
        the replicated parameters; zero 3 drops a unit still gathered so its next use gathers again."""
        inner = self.inner
        if inner.zero in (1, 2):
            works = [inner.comm.all_gather(u.full, u.master, u.bounds, async_op=True) for u in units]
            for w in works:
                w.wait()
            return
        for u in units:
            inner._free(u)

    # ---- what the worker and the checkpoint see -----------------------------------------------
    @property
    def units(self) -> list[UnitState]:
        return self.inner.units

    @property
    def zero(self) -> int:
        return self.inner.zero

    def set_batch_split(self, samples: Sequence[int] | None, seq: int | None = None) -> None:
        self.inner.set_batch_split(samples, seq)

    def eval_loss(self, tokens: torch.Tensor, targets: torch.Tensor) -> float:
        return self.inner.eval_loss(tokens, targets)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        return self.inner.full_state_dict()

    def settle(self) -> None:
        self.inner.settle()

    def shard_numel(self) -> int:
        return self.inner.shard_numel()

    def resident_tensors(self) -> list[torch.Tensor]:
        """The inner runtime's tensors and the outer state (synced slices, momentum)."""
        return self.inner.resident_tensors() + self.synced + [m for m in self.momentum if m is not None]

    def scalar_state(self) -> dict[str, Any]:
        return self.inner.scalar_state()


__all__ = ["DilocoRuntime", "OuterSync", "int8_error_bound", "int8_levels", "outer_update_", "quantize_int8",
           "split_fragments", "sync_offset"]
