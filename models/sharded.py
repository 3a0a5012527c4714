"""The sharded training runtime: ZeRO stages 1, 2 and 3 with UNEVEN shards (Cephalo's real mode).

The model is cut into units (contracts/units.py: the embedding, each block, the head), each one flat
fp32 parameter; plan position p owns the slice `shard_bounds(numel, fractions)[p]` of every unit (its
fp32 master parameters, their fp32 gradient and AdamW moments, models/optim.py). ZeRO 1/2 keep every
unit's full fp32 parameters; ZeRO 3 gathers a unit, in `param_dtype`, only while it computes. At
ZeRO 2/3 a step accumulates LAYER BY LAYER: every micro-batch passes through a unit before the next
starts, so each unit is gathered and reduce-scattered once per step and uneven ranks issue the same
collectives in the same order. Then the global norm, clipping, an fp16 loss scale, AdamW on the
slices. Start-up builds the decoder on the meta device and materializes one unit at a time.

Mixed precision and overlap (FSDP2's MixedPrecisionPolicy and prefetching), the buffers that exist:
  * param_dtype (zero 3): a unit's `full` buffer is param_dtype, its parameters are views of it
    (autocast makes no weight copies); a gather casts the master slice into full's own slice (no
    other buffer) and resizes full's storage when it is ISSUED. Autograd's gradients are
    param_dtype, so is the flat gradient buffer `full_grad` (several micro-batches or recompute);
    with one micro-batch the per-parameter gradients are copied straight into a reduce_dtype
    flat buffer.
  * reduce_dtype: a param_dtype flat gradient is cast to a numel-sized reduce_dtype buffer (then
    freed); the unit's first reduce of the step lands in the fp32 slice gradient directly when
    reduce_dtype is fp32, else in a slice-sized reduce_dtype temporary copied (a second one, the
    tied embedding's: added) into it.
  * prefetch k: after a unit's wait, the gathers of the next k units of the step's order of uses
    (`_use_order`: forward, head with a tied embedding, blocks in reverse) are issued, so up to k+1
    gathered units exist (k+2 at the head of a tied model).
  * reduce_in_flight 1: a reduce-scatter is waited at the start of the next one (before its
    buffers exist) or when the step's gradients are needed, so its reduce_dtype buffer and
    temporary stay alive through the next unit's backward; 0 (default): waited as issued.
No host synchronization inside a step (`start_step`): the loss is summed on the device, the
overflow flag and clip coefficient are tensors, CUDA timers are events; `PendingStep.result()`
reads them once (fp16 with loss scaling reads the overflow flag before the update as well).

What a rank holds at each stage, and the trade layer-wise accumulation makes:
docs/models/memory.md ("The runtime being modelled"), which planner/core/memory.py prices exactly.
"""
from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn
from torch._subclasses.fake_tensor import is_fake

from models.collectives import Collectives
from models.decoder import Decoder, build_model
from models.optim import (DynamicLossScaler, OptimConfig, adamw_prepare_, adamw_step_, clip_coefficient_t,
                          decay_ranges, global_grad_norm_sq, grad_norm_sq_in_place)
from models.runtime import shard_bounds
from models.tensor import TensorParallel, apply_tp, full_weight_init, tp_unit_numels
from contracts import wire
from contracts.plan import check_step_dtypes
from contracts.specs import ModelSpec
from contracts.constants import check_zero
from contracts.units import Unit, runtime_units

log = logging.getLogger(__name__)

INIT_STD = 0.02  # GPT-2 / Llama initializer_range (models/decoder.py)
SEED_STRIDE = 1_000_003  # unit u of seed s draws from generator seed s·SEED_STRIDE + u


# torch dtypes by the names plans and contracts use
DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


def host_float(t: torch.Tensor) -> float:
    """A scalar tensor's value; 0.0 under FakeTensorMode (the profiler traces shapes, no data)."""
    return 0.0 if is_fake(t) else float(t)


def host_floats(t: torch.Tensor) -> list[float]:
    """A 1-D tensor's values in one device-to-host read; zeros under FakeTensorMode."""
    return [0.0] * t.numel() if is_fake(t) else [float(v) for v in t.tolist()]


def check_runtime_options(zero: int, param_dtype: torch.dtype, reduce_dtype: torch.dtype, prefetch: int) -> None:
    """ValueError naming the first bad gather/reduce option of ShardedRuntime (a plan's rules,
    contracts/plan.check_step_dtypes, on torch dtypes)."""
    check_step_dtypes(zero, DTYPE_NAMES.get(param_dtype, str(param_dtype)),
                      DTYPE_NAMES.get(reduce_dtype, str(reduce_dtype)), prefetch, what="ShardedRuntime")


@dataclass(repr=False)
class UnitState:
    """One unit on one rank: its modules' parameters laid out flat, and this rank's slice."""

    def __repr__(self) -> str:  # never the tensors: a freed unit's storage has no data to print
        return f"UnitState({self.name!r}, numel={self.numel}, slice=[{self.start}, {self.end}), held={self.held})"

    name: str
    index: int
    params: list[nn.Parameter]
    offsets: list[int]
    numel: int
    bounds: list[tuple[int, int]]  # every position's slice of this unit
    start: int
    end: int
    master: torch.Tensor  # fp32 (end - start,): this rank's parameters (a view of `full` at zero 1/2)
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor
    grad: torch.Tensor  # fp32 (end - start,): this slice's gradient of the step
    decay: list[tuple[int, int]]  # weight-decay ranges in slice coordinates
    full: torch.Tensor | None = None  # param_dtype (numel,) full parameters; storage size 0 while not held
    held: bool = False
    full_grad: torch.Tensor | None = None  # (numel,) full gradient (param_dtype) while accumulated
    grad_fresh: bool = True  # the next reduce-scatter overwrites `grad` (first of the step)
    pending: Any = field(default=None, repr=False)  # an in-flight gather's Work


@dataclass
class _InFlightReduce:
    """A reduce-scatter issued and not yet waited: it keeps `sent` (the full gradient in
    reduce_dtype) and `out` (its slice result) alive until `_complete` ran."""
    unit: UnitState
    work: Any
    sent: torch.Tensor
    out: torch.Tensor  # unit.grad itself (fp32, first of the step) or a (end - start,) temporary
    first: bool  # the unit's first reduce of the step: `out` overwrites `grad`, else adds to it


@dataclass
class _InFlightRows:
    """The embedding unit's rows exchange (contracts.wire.token_rows_exchange) issued and not yet
    waited: this rank's ids and rows (the gathers' inputs) and everyone's (their outputs)."""
    unit: UnitState
    works: list
    ids: torch.Tensor | None  # (tokens,) int64, this rank's token ids
    rows: torch.Tensor | None  # (tokens * hidden,) reduce_dtype, their gradient rows
    ids_full: torch.Tensor | None  # every rank's ids, in plan-position order
    rows_full: torch.Tensor | None
    first: bool


@dataclass(frozen=True)
class StepResult:
    loss: float  # the step's global mean loss (all ranks, all micro-batches)
    grad_norm: float  # global gradient norm before clipping (unscaled); nan when skipped
    skipped: bool  # fp16 overflow: no update this step
    compute_s: float  # wall seconds in forward/backward compute (collective waits excluded)
    work_s: float  # the same on the worker's clock (thread CPU time on CPU, CUDA events on CUDA)
    loss_scale: float
    optimizer_s: float = 0.0  # wall seconds of the AdamW update of this rank's slices
    # wall seconds compute waited on communication (gathers and reduce-scatters) in the step:
    # on CPU time blocked in Work.wait(), on CUDA the compute stream's stall measured by events
    comm_wait_s: float = 0.0
    # comm_wait_s by where compute waited (WAIT_SITES): a gather, a reduce-scatter inside backward,
    # or the reduces drained for the update (the step's tail)
    comm_wait_by: dict[str, float] = field(default_factory=dict)


WAIT_SITES = ("gather", "reduce", "tail")


def _by_site(waits: Sequence[tuple[str, float]]) -> dict[str, float]:
    """Seconds summed per wait site, every site of WAIT_SITES present."""
    out = dict.fromkeys(WAIT_SITES, 0.0)
    for site, s in waits:
        out[site] += s
    return out


class PendingStep:
    """A step whose work is issued: `result()` reads its statistics and timers to the host, the
    step's one synchronization with the device (fp16 with loss scaling reads the overflow flag
    once more, before the update, to skip it)."""

    def __init__(self, stats: torch.Tensor, scale_used: float, skipped: bool, clock: list[float],
                 comm_wait_s: float, compute_ev: list, wait_ev: list, optimizer_ev: Any, optimizer_s: float,
                 waits: Sequence[tuple[str, float]] = ()):
        self._stats, self._scale, self._skipped = stats, scale_used, skipped
        self._clock, self._wait_s, self._compute_ev, self._wait_ev = clock, comm_wait_s, compute_ev, wait_ev
        self._waits = list(waits)  # (site, wall seconds) on CPU
        self._optimizer_ev, self._optimizer_s = optimizer_ev, optimizer_s
        self._result: StepResult | None = None

    def result(self) -> StepResult:
        if self._result is not None:
            return self._result
        sq, flag, loss = host_floats(self._stats)
        compute_s, work_s = self._clock
        wait_s, optimizer_s, waits = self._wait_s, self._optimizer_s, self._waits
        if self._compute_ev or self._wait_ev or self._optimizer_ev is not None:  # CUDA: done once stats are read
            compute_s = work_s = _elapsed_s(self._compute_ev)
            waits = [(site, a.elapsed_time(b) / 1e3) for a, b, site in self._wait_ev]
            wait_s = sum(w for _, w in waits)
            optimizer_s = _elapsed_s([self._optimizer_ev] if self._optimizer_ev is not None else [])
        if self._skipped:
            self._result = StepResult(loss, float("nan"), True, compute_s, work_s, self._scale, 0.0, wait_s,
                                      _by_site(waits))
            return self._result
        if flag > 0 or not math.isfinite(sq):
            raise FloatingPointError("non-finite gradient (no loss scaling in this dtype): the run diverged")
        norm = math.sqrt(sq) / self._scale
        self._result = StepResult(loss, norm, False, compute_s, work_s, self._scale, optimizer_s, wait_s,
                                  _by_site(waits))
        return self._result


def _elapsed_s(pairs: Sequence[tuple[Any, Any]]) -> float:
    """Seconds summed over (start, end) CUDA event pairs already completed."""
    return sum(a.elapsed_time(b) for a, b in pairs) / 1e3


class ShardedRuntime:
    """One rank of a (possibly uneven) sharded data-parallel run of a ModelSpec (docs/models/memory.md)."""

    def __repr__(self) -> str:
        return (f"ShardedRuntime({self.spec.name!r}, zero={self.zero}, position={self.position} of "
                f"{len(self.fractions)}, {self.shard_numel()} of {self.spec.num_params} parameters)")

    _batch_split: tuple[list[int], int] | None = None  # set_batch_split: samples per position, seq

    def __init__(self, spec: ModelSpec, *, zero: int, fractions: Sequence[float], position: int,
                 comm: Collectives, device: torch.device, recompute: str = "none",
                 autocast_dtype: torch.dtype | None = None, optim: OptimConfig | None = None,
                 seed: int = 0, loss_scaling: bool = False, materialize: bool = True, expand_kv: bool = False,
                 param_dtype: torch.dtype = torch.float32, reduce_dtype: torch.dtype = torch.float32,
                 prefetch: int = 1, reduce_in_flight: int = 0, tp: TensorParallel | None = None):
        check_zero(zero)
        if tp is not None and tp.size > 1 and zero != 1:
            # the layer-wise step (zero 2/3) scatters the embedding's gradient by token id into the full
            # vocabulary; a vocabulary-parallel embedding holds V/t rows (docs/models/tensor_parallel.md)
            raise ValueError(f"tensor parallelism (tp {tp.size}) runs at zero 1 only, got zero {zero}")
        check_runtime_options(zero, param_dtype, reduce_dtype, prefetch)
        if param_dtype != torch.float32 and autocast_dtype != param_dtype:
            raise ValueError(f"param_dtype {DTYPE_NAMES[param_dtype]} needs autocast_dtype {DTYPE_NAMES[param_dtype]} "
                             f"(got {autocast_dtype}): the decoder's fp32 norms feed matmuls with these weights")
        if isinstance(reduce_in_flight, bool) or reduce_in_flight not in (0, 1):
            raise ValueError(f"reduce_in_flight must be 0 or 1 (reduce-scatters left in flight), "
                             f"got {reduce_in_flight!r}")
        if not 0 <= position < len(fractions):
            raise ValueError(f"position {position} is not one of the {len(fractions)} shard fractions")
        self.spec, self.zero, self.position, self.comm = spec, zero, position, comm
        self.device, self.recompute, self.autocast_dtype = device, recompute, autocast_dtype
        # param_dtype: the gathered full parameters (zero 3), so their gradients too; every rank of a
        # run must use the same prefetch (the collectives are issued in the order it decides)
        self.param_dtype, self.reduce_dtype, self.prefetch = param_dtype, reduce_dtype, prefetch
        # reduce-scatters left in flight: 1 overlaps each with the next unit's backward (and keeps
        # its buffers alive through it); 0 waits each as it is issued
        self.reduce_depth = reduce_in_flight
        self._reduces: list[_InFlightReduce] = []
        self._cuda = device.type == "cuda"
        self._clock = [0.0, 0.0]
        self._comm_wait_s = 0.0
        self._waits: list[tuple[str, float]] = []  # (site, seconds) of the step's waits on CPU
        self._compute_ev: list = []
        self._wait_ev: list = []  # CUDA: (start, end, site) event triples
        self._order: list[UnitState] = []
        self.optim = optim or OptimConfig()
        self.scaler = DynamicLossScaler(enabled=loss_scaling)
        self.step_count = 0
        self.fractions = list(fractions)
        with torch.device("meta"):
            # expand_kv: repeat K/V to every head where GQA alone would fall back to SDPA's math
            # kernel on this device (planner/attention.select_kernel decides; the memory model follows)
            self.model: Decoder = build_model(spec, recompute, expand_kv=expand_kv)
            # tensor parallel: this rank's part of every block, embedding and head (models/tensor.py)
            self.tp = tp if tp is not None and tp.size > 1 else None
            if self.tp is not None:
                apply_tp(self.model, self.tp)
        self.model.init_buffers(device)
        self.units = self._build_units(seed, materialize)
        self._work_clock: Callable[[], float] = (time.perf_counter if device.type == "cuda" else time.thread_time)

    # ---- layout and start-up -----------------------------------------------------------------
    def _unit_modules(self) -> list[list[nn.Module]]:
        m = self.model
        embed = [m.embed] + ([m.pos_embed] if m.pos_embed is not None else [])
        head = [m.norm] + ([m.lm_head] if m.lm_head is not None else [])
        return [embed, *[[b] for b in m.blocks], head]

    def _unit_indices(self) -> list[int]:
        """Global indices (contracts/units.py order) of the units this rank holds: all of them here
        (models/pipeline.py: its stage's)."""
        return list(range(len(runtime_units(self.spec))))

    def _build_units(self, seed: int, materialize: bool) -> list[UnitState]:
        layout, groups = self._unit_layout(), self._unit_modules()
        return [self._build_unit(i, layout[i], groups[i], seed, materialize) for i in self._unit_indices()]

    def _unit_layout(self) -> tuple[Unit, ...]:
        """contracts/units.py's units; tensor parallel: their sizes on this TP rank (models/tensor.py)."""
        layout = runtime_units(self.spec)
        if self.tp is None:
            return layout
        numels = tp_unit_numels(self.spec, self.tp.size, self.tp.rank)
        return tuple(Unit(u.name, n) for u, n in zip(layout, numels))

    def _build_unit(self, i: int, lu: Unit, mods: list[nn.Module], seed: int, materialize: bool) -> UnitState:
        """Unit i (layout entry `lu`, its modules `mods`): one flat fp32 buffer whose views become the
        modules' parameters, this rank's slice, its moments and (empty) gradient; initialized from the
        generator seed·SEED_STRIDE + i, so a unit's weights do not depend on which units a rank holds."""
        # (owning module, attribute) of each parameter, in registration order
        slots = [(sub, name) for mod in mods for sub in mod.modules()
                 for name, _ in sub.named_parameters(recurse=False)]
        offsets, off, shapes = [], 0, []
        for sub, name in slots:
            offsets.append(off)
            shapes.append(tuple(getattr(sub, name).shape))
            off += math.prod(shapes[-1])
        if off != lu.numel:
            raise AssertionError(f"unit {lu.name}: modules hold {off} parameters, contracts/units.py says {lu.numel}")
        bounds = shard_bounds(lu.numel, self.fractions)
        s, e = bounds[self.position]
        full = torch.empty(lu.numel, dtype=torch.float32, device=self.device)
        params = []
        for (sub, name), o, shape in zip(slots, offsets, shapes):
            # the meta parameter becomes a view of the unit's full buffer, for good
            param = nn.Parameter(full[o:o + math.prod(shape)].view(shape))
            sub._parameters[name] = param
            params.append(param)
        unit = UnitState(lu.name, i, params, offsets, lu.numel, bounds, s, e, master=full[s:e],
                         exp_avg=torch.zeros(e - s, device=self.device),
                         exp_avg_sq=torch.zeros(e - s, device=self.device),
                         grad=torch.empty(e - s, device=self.device),
                         decay=decay_ranges(shapes, s, e), full=full, held=True)
        if materialize:
            gen = torch.Generator(device=self.device).manual_seed(seed * SEED_STRIDE + i)
            self._init_unit(mods, gen)
        unit.grad.untyped_storage().resize_(0)  # no gradient until the unit's first reduce
        if self.zero == 3:  # keep the slice only; the full unit dies before the next one exists
            unit.master = full[s:e].clone()
            self._release(unit)
            if self.param_dtype != torch.float32:
                self._retype_full(unit, slots, shapes)
        else:
            unit.master = full[s:e]
        return unit

    def _retype_full(self, unit: UnitState, slots: list[tuple[nn.Module, str]], shapes: list[tuple[int, ...]]) -> None:
        """Zero 3, param_dtype below fp32: the unit's full buffer becomes a param_dtype one (its fp32
        storage already freed), the parameters views of it, so the gathered weights ARE the compute
        weights (autocast makes no copies); its storage is allocated once here and freed at once."""
        full = torch.empty(unit.numel, dtype=self.param_dtype, device=self.device)
        unit.params = []
        for (sub, name), o, shape in zip(slots, unit.offsets, shapes):  # views need the storage
            param = nn.Parameter(full[o:o + math.prod(shape)].view(shape))
            sub._parameters[name] = param
            unit.params.append(param)
        unit.full = full
        self._release(unit)

    @torch.no_grad()
    def _init_unit(self, mods: list[nn.Module], gen: torch.Generator) -> None:
        # GPT-2 / Llama: N(0, 0.02) for every matrix and embedding, zero biases, unit norm gains; a
        # tensor-parallel module draws its full weight and keeps its slice (the one-rank numbers)
        for mod in mods:
            for sub in mod.modules():
                if isinstance(sub, (nn.Linear, nn.Embedding)):
                    full_weight_init(sub, INIT_STD, gen)
                    if getattr(sub, "bias", None) is not None:
                        sub.bias.zero_()
                elif isinstance(sub, nn.LayerNorm):
                    sub.weight.fill_(1.0)
                    sub.bias.zero_()
                elif hasattr(sub, "weight") and isinstance(sub.weight, nn.Parameter) and sub.weight.dim() == 1:
                    sub.weight.fill_(1.0)  # RMSNorm

    # Freeing and gathering resize the storage of a unit's full buffer in place (as FSDP2 does);
    # the parameters stay views of it, so the tensors autograd saved in forward see the
    # parameters again when backward re-gathers them.
    def _release(self, unit: UnitState) -> None:
        unit.full.untyped_storage().resize_(0)
        unit.held = False

    # ---- waiting on communication -------------------------------------------------------------
    def _wait(self, work: Any, site: str) -> None:
        """Wait for a collective and count how long compute waited, by `site` (WAIT_SITES): wall
        seconds on CPU; on CUDA a pair of events around Work.wait(), which makes the compute stream
        wait without blocking the host (the pair is read after the step)."""
        if self._cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            work.wait()
            end.record()
            self._wait_ev.append((start, end, site))
            return
        t0 = time.perf_counter()
        work.wait()
        dt = time.perf_counter() - t0
        self._comm_wait_s += dt
        self._waits.append((site, dt))

    # ---- gathers (zero 3) ----------------------------------------------------------------------
    def _start_gather(self, unit: UnitState | None) -> None:
        if unit is None or self.zero != 3 or unit.held or unit.pending is not None:
            return
        full = unit.full
        full.untyped_storage().resize_(unit.numel * full.element_size())
        # the collective writes in place; autograd must not see it as a change of saved tensors
        with torch.autograd._unsafe_preserve_version_counter(full):
            shard = unit.master
            if full.dtype != shard.dtype:  # cast the master slice into its place: no other buffer
                shard = full[unit.start:unit.end]
                shard.copy_(unit.master)
            unit.pending = self.comm.all_gather(full, shard, unit.bounds, async_op=True)

    def _gathered(self, unit: UnitState) -> None:
        if self.zero != 3 or unit.held:
            return
        self._start_gather(unit)
        self._wait(unit.pending, "gather")
        unit.pending = None
        unit.held = True

    def settle(self) -> None:
        """Wait for the gathers left in flight (the next step's, issued beside the update): before the
        process group is destroyed or the runtime dropped, when no next step will wait for them (a
        gloo work still running at teardown aborts the process)."""
        for unit in self.units:
            if unit.pending is not None:
                unit.pending.wait()
                unit.pending = None
                unit.held = True

    def _prefetch(self, pos: int) -> None:
        """Start the gathers of the `prefetch` units after position `pos` of the step's order of
        uses (`_use_order`); a unit held or already in flight is left as it is. The head and a tied
        embedding are used together: prefetching the head prefetches the embedding too."""
        end = pos + 1 + self.prefetch
        if self.prefetch and self.spec.tied_embeddings and end <= len(self._order) and \
                self._order[end - 1] is self.units[-1]:
            end += 1
        for unit in self._order[pos + 1:end]:
            self._start_gather(unit)

    def _use_order(self) -> list[UnitState]:
        """The units in the order a zero-3 step needs them gathered: forward, the head (with a tied
        embedding), then the blocks in reverse; the embedding's backward needs no gather."""
        embed, blocks, head = self.units[0], self.units[1:-1], self.units[-1]
        tied = [embed] if self.spec.tied_embeddings else []
        return [embed, *blocks, head, *tied, *reversed(blocks)]

    def _free(self, unit: UnitState) -> None:
        if self.zero == 3 and unit.held:
            self._release(unit)

    # ---- gradients ---------------------------------------------------------------------------
    def _grad_dtype(self) -> torch.dtype:
        return self.param_dtype if self.zero == 3 else torch.float32

    def _grad_buffer(self, unit: UnitState) -> torch.Tensor:
        """The unit's full gradient (the parameters' dtype), its parameters' .grad viewing into it
        (AccumulateGrad then adds every micro-batch in place)."""
        if unit.full_grad is None:
            unit.full_grad = torch.zeros(unit.numel, dtype=self._grad_dtype(), device=self.device)
            for p, o in zip(unit.params, unit.offsets):
                p.grad = unit.full_grad[o:o + p.numel()].view(p.shape)
        return unit.full_grad

    def _flatten_grads(self, unit: UnitState) -> None:
        """Keep mode: autograd made each parameter's .grad on its own (no buffer waited through the
        backward); copy them, cast to reduce_dtype, into one flat buffer for the reduce-scatter,
        freeing each as copied."""
        if unit.full_grad is not None:
            return
        have_all = all(p.grad is not None for p in unit.params)
        full = (torch.empty if have_all else torch.zeros)(unit.numel, dtype=self.reduce_dtype, device=self.device)
        for p, o in zip(unit.params, unit.offsets):
            if p.grad is not None:
                full[o:o + p.numel()].copy_(p.grad.reshape(-1))
                p.grad = None
        unit.full_grad = full

    def _reduce(self, unit: UnitState, last: bool = False) -> None:
        """Reduce-scatter the unit's full gradient, cast to reduce_dtype, into the owners' slices
        and drop it. The first reduce of the step writes the fp32 slice `grad` (directly when
        reduce_dtype is fp32), a second one (a tied embedding) adds to it. It is issued async and
        left in flight (`reduce_in_flight` 1): the previous one is waited first, before
        this one's buffers exist, the last ones when the step's gradients are needed (`_drain_reduces`). The slice's gradient
        exists from the unit's first reduce of the step to the update."""
        # before any new buffer exists; the step's last reduce (the embedding's) does not wait for the one
        # before it when reduces stay in flight: both are drained together for the update
        while len(self._reduces) >= max(self.reduce_depth, 1) and not (last and self.reduce_depth):
            self._complete(self._reduces.pop(0), "reduce")
        self._flatten_grads(unit)
        full, unit.full_grad = unit.full_grad, None
        for p in unit.params:
            p.grad = None
        sent = full if full.dtype == self.reduce_dtype else full.to(self.reduce_dtype)  # (numel,) cast
        del full
        st = unit.grad.untyped_storage()
        if st.nbytes() == 0:
            st.resize_(unit.grad.numel() * unit.grad.element_size())
        first = unit.grad_fresh
        unit.grad_fresh = False
        direct = first and sent.dtype == unit.grad.dtype
        out = unit.grad if direct else torch.empty(unit.end - unit.start, dtype=sent.dtype, device=self.device)
        work = self.comm.reduce_scatter(out, sent, unit.bounds, async_op=True)
        self._reduces.append(_InFlightReduce(unit, work, sent, out, first))
        if self.reduce_depth == 0:
            self._drain_reduces("reduce")

    def _complete(self, r: _InFlightReduce | _InFlightRows, site: str) -> None:
        if isinstance(r, _InFlightRows):
            self._complete_rows(r, site)
            return
        self._wait(r.work, site)
        if r.out is not r.unit.grad:
            if r.first:
                r.unit.grad.copy_(r.out)
            else:
                r.unit.grad.add_(r.out)

    def _drain_reduces(self, site: str) -> None:
        """Wait for every reduce-scatter in flight, oldest first (their buffers die with them)."""
        while self._reduces:
            self._complete(self._reduces.pop(0), site)

    # ---- one step ----------------------------------------------------------------------------
    def _autocast(self):
        return torch.autocast(self.device.type, dtype=self.autocast_dtype or torch.bfloat16,
                              enabled=self.autocast_dtype is not None)

    def _loss(self, logits: torch.Tensor, targets: torch.Tensor, normalizer: int) -> torch.Tensor:
        V = logits.shape[-1]
        # CE in fp32, summed, divided by the GLOBAL token count (models/runtime.micro_batch_loss)
        return F.cross_entropy(logits.float().view(-1, V), targets.reshape(-1), reduction="sum") / normalizer

    def train_step(self, batches: Sequence[tuple[torch.Tensor, torch.Tensor]], token_normalizer: int, lr: float,
                   after_compute: Callable[[float], None] | None = None) -> StepResult:
        """Forward and backward of this rank's micro-batches, the gradient reduction, clipping and
        the optimizer step. `token_normalizer` is the GLOBAL token count of the step; `after_compute`
        (the worker's emulated slowdown) is called with this rank's work seconds before the first
        collective that waits for every rank's gradients."""
        return self.start_step(batches, token_normalizer, lr, after_compute).result()

    def start_step(self, batches: Sequence[tuple[torch.Tensor, torch.Tensor]], token_normalizer: int, lr: float,
                   after_compute: Callable[[float], None] | None = None) -> PendingStep:
        """train_step without its final read: the whole step is issued, nothing waits for the device
        (on CUDA `torch.cuda.set_sync_debug_mode("error")` passes around this call, bf16 and fp32;
        fp16 with loss scaling reads its overflow flag, and `after_compute` on CUDA reads the
        compute timers). `.result()` of the returned PendingStep reads the statistics."""
        if token_normalizer <= 0:
            raise ValueError(f"token_normalizer must be > 0, got {token_normalizer}")
        self._clock, self._comm_wait_s, self._compute_ev, self._wait_ev = [0.0, 0.0], 0.0, [], []
        self._waits = []
        scale = self.scaler.scale
        for u in self.units:
            u.grad_fresh = True
        if self.zero == 1:
            loss = self._step_replicated(batches, token_normalizer, scale)
        else:
            loss = self._step_layerwise(batches, token_normalizer, scale)
        if after_compute is not None:
            if self._cuda:  # the emulated slowdown needs the device's compute time now: a sync
                if self._compute_ev:
                    self._compute_ev[-1][1].synchronize()
                after_compute(_elapsed_s(self._compute_ev))
            else:
                after_compute(self._clock[1])
        return self._update(loss, lr, scale)

    def _timed(self, fn: Callable[[], Any]) -> Any:
        """Run compute `fn`, adding its time to the step's compute clocks: the wall and the worker's
        clock on CPU; on CUDA a pair of events (read after the step) and the host's wall time."""
        w0, c0 = time.perf_counter(), self._work_clock()
        if self._cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            out = fn()
            end.record()
            self._compute_ev.append((start, end))
        else:
            out = fn()
        self._clock[0] += time.perf_counter() - w0
        self._clock[1] += self._work_clock() - c0
        return out

    def _zero_loss(self) -> torch.Tensor:
        return torch.zeros((), dtype=torch.float64, device=self.device)

    def _step_replicated(self, batches, normalizer: int, scale: float) -> torch.Tensor:
        """Zero 1: the whole model per micro-batch, gradients accumulating in the full buffers.
        Returns the rank's summed loss, a device scalar (fp64)."""
        for u in self.units:
            self._grad_buffer(u)
        total = self._zero_loss()

        def one(x: torch.Tensor, y: torch.Tensor) -> None:
            with self._autocast():
                logits = self.model(x)  # (B, T, V)
            loss = self._loss(logits, y, normalizer)
            del logits
            (loss * scale if scale != 1.0 else loss).backward()
            total.add_(loss.detach())

        for x, y in batches:
            self._timed(lambda: one(x, y))
        for u in self.units:
            self._reduce(u)
        return total

    def _step_layerwise(self, batches, normalizer: int, scale: float) -> torch.Tensor:
        """Zero 2/3: unit by unit over all micro-batches (docs/models/memory.md). Gathers follow
        `_use_order`, `prefetch` units ahead; returns the rank's summed loss, a device scalar."""
        n = len(batches)
        keep = n == 1 and self.recompute == "none"  # keep every unit's graph: no recomputation
        units = self.units
        embed, blocks, head = units[0], units[1:-1], units[-1]
        tied = self.spec.tied_embeddings
        # a rank without samples (n == 0) runs the same code: the same collectives in the same order
        rope = self.model.rope(batches[0][0].shape[1], self.device) if n else None
        self._order = self._use_order()
        L = len(blocks)
        pos_head = L + 1 + int(tied)  # the head's last position in the order (its tied embedding)

        # forward: embeddings, then each block over every micro-batch
        self._gathered(embed)
        self._prefetch(0)

        def embed_fwd() -> list[torch.Tensor]:
            with torch.no_grad(), self._autocast():
                return [self.model.embed_tokens(x) for x, _ in batches]
        xs = self._timed(embed_fwd)
        if not tied:  # a tied embedding stays gathered for the head (as FSDP2 keeps its root's parameters)
            self._free(embed)
        bounds_in: list[list[torch.Tensor]] = []  # bounds_in[b][j]: input of block b, micro-batch j
        graphs: list[list[tuple[torch.Tensor, torch.Tensor]]] = []
        for b, unit in enumerate(blocks):
            self._gathered(unit)
            self._prefetch(1 + b)
            block = self.model.blocks[b]
            if keep:
                def fwd_keep() -> list[tuple[torch.Tensor, torch.Tensor]]:
                    out = []
                    for x in xs:
                        xin = x.detach().requires_grad_()
                        with self._autocast():
                            out.append((xin, block(xin, rope)))
                    return out
                g = self._timed(fwd_keep)
                graphs.append(g)
                xs = [y for _, y in g]
            else:
                bounds_in.append(xs)

                def fwd() -> list[torch.Tensor]:
                    with torch.no_grad(), self._autocast():
                        return [block(x, rope) for x in xs]
                xs = self._timed(fwd)
            self._free(unit)

        # the head: forward and backward of each micro-batch at once
        self._gathered(head)
        if tied:
            self._gathered(embed)
        self._prefetch(pos_head)
        if not keep:  # several micro-batches accumulate in place; one (keep mode) needs no buffer yet
            self._grad_buffer(head)
            if tied:
                self._grad_buffer(embed)
        total = self._zero_loss()

        def head_fb() -> list[torch.Tensor]:
            dxs = []
            for x, (_, y) in zip(xs, batches):
                xin = x.detach().requires_grad_()
                with self._autocast():
                    logits = self.model.head_logits(xin)
                loss = self._loss(logits, y, normalizer)
                del logits
                (loss * scale if scale != 1.0 else loss).backward()
                total.add_(loss.detach())
                dxs.append(xin.grad)
            return dxs
        dxs = self._timed(head_fb)
        del xs
        self._reduce(head)
        self._free(head)
        if tied:
            self._reduce(embed)
            self._free(embed)

        # blocks in reverse
        for b in range(len(blocks) - 1, -1, -1):
            unit = blocks[b]
            self._gathered(unit)
            self._prefetch(pos_head + L - b)
            if not keep:
                self._grad_buffer(unit)
            block = self.model.blocks[b]
            if keep:
                g = graphs.pop()

                def bwd_keep() -> list[torch.Tensor]:
                    out = []
                    for (xin, y), dy in zip(g, dxs):
                        y.backward(dy)
                        out.append(xin.grad)
                    return out
                dxs = self._timed(bwd_keep)
                del g
            else:
                xins = bounds_in.pop()

                def bwd_recompute() -> list[torch.Tensor]:
                    out = []
                    for j, dy in enumerate(dxs):
                        xin = xins[j].detach().requires_grad_()
                        with self._autocast():
                            y = block(xin, rope)
                        y.backward(dy)
                        del y
                        xins[j] = None  # the boundary is consumed
                        out.append(xin.grad)
                    return out
                dxs = self._timed(bwd_recompute)
            self._reduce(unit)
            self._free(unit)

        if self._rows_exchange():  # fewer bytes as rows than as the table (contracts.wire)
            ids, rows = self._timed(lambda: self._token_rows(batches, dxs))
            del dxs
            self._exchange_rows(embed, ids, rows)
            return total

        # the embedding's gradient needs only the token ids: scatter-add, no gather
        grad = self._grad_buffer(embed)

        def embed_bwd() -> None:
            h = self.spec.hidden
            V_h = self.spec.vocab_size * h  # the token table comes first in the unit
            tok = grad[:V_h].view(-1, h)
            for (x, _), dx in zip(batches, dxs):
                dx = dx.to(grad.dtype)  # no copy unless the boundary's dtype is not the parameters'
                tok.index_add_(0, x.reshape(-1), dx.reshape(-1, h))
                if self.model.pos_embed is not None:
                    grad[V_h:V_h + x.shape[1] * h].view(-1, h).add_(dx.sum(0))
        self._timed(embed_bwd)
        del dxs
        self._reduce(embed, last=True)
        return total

    # ---- the embedding's gradient as rows -----------------------------------------------------
    def set_batch_split(self, samples: Sequence[int] | None, seq: int | None = None) -> None:
        """Every plan position's samples per step and their length, as the plan splits the global
        batch (every rank of the run must be given the same). With them a layer-wise step (zero 2/3)
        sends the embedding unit's gradient as the step's rows, when contracts.wire's
        `token_rows_exchange` says that is fewer bytes than the table; None: always the table."""
        if samples is None:
            self._batch_split = None
            return
        samples = [int(b) for b in samples]
        if len(samples) != self.comm.world or any(b < 0 for b in samples):
            raise ValueError(f"set_batch_split: {len(samples)} sample counts for {self.comm.world} positions, "
                             f"each >= 0 expected, got {samples}")
        if seq is None or seq < 1:
            raise ValueError(f"set_batch_split: seq must be a positive integer, got {seq!r}")
        self._batch_split = (samples, int(seq))

    def _rows_exchange(self) -> bool:
        split = self._batch_split
        pos = self.model.pos_embed
        if split is None or (pos is not None and split[1] > pos.num_embeddings):
            return False
        table_rows = self.spec.vocab_size + (pos.num_embeddings if pos is not None else 0)
        if self.units[0].numel != table_rows * self.spec.hidden:  # a unit that is not only the tables
            return False
        samples, seq = split
        return wire.token_rows_exchange(sum(samples) * seq, self.units[0].numel, self.spec.hidden,
                                        self.reduce_dtype.itemsize, self.comm.world)

    def _token_rows(self, batches, dxs) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's token ids and their gradient rows (the reduce dtype), in micro-batch order."""
        samples, seq = self._batch_split
        mine = sum(x.shape[0] for x, _ in batches)
        if mine != samples[self.position] or any(x.shape[1] != seq for x, _ in batches):
            raise ValueError(f"set_batch_split gave position {self.position} {samples[self.position]} samples of "
                             f"{seq} tokens, the step has {[tuple(x.shape) for x, _ in batches]}")
        h = self.spec.hidden
        ids = torch.empty(mine * seq, dtype=torch.long, device=self.device)
        rows = torch.empty(mine * seq * h, dtype=self.reduce_dtype, device=self.device)
        o = 0
        for (x, _), dx in zip(batches, dxs):
            k = x.numel()
            ids[o:o + k].copy_(x.reshape(-1))
            rows[o * h:(o + k) * h].view(k, h).copy_(dx.reshape(k, h))
            o += k
        return ids, rows

    def _exchange_rows(self, unit: UnitState, ids: torch.Tensor, rows: torch.Tensor) -> None:
        """Issue the all_gathers of every rank's ids and rows (each rank's piece in plan-position
        order); `_complete_rows` adds the rows into the slice. Left in flight like the last reduce."""
        samples, seq = self._batch_split
        h = self.spec.hidden
        bounds, o = [], 0
        for b in samples:
            bounds.append((o, o + b * seq))
            o += b * seq
        st = unit.grad.untyped_storage()
        if st.nbytes() == 0:
            st.resize_(unit.grad.numel() * unit.grad.element_size())
        first = unit.grad_fresh
        unit.grad_fresh = False
        ids_full = torch.empty(o, dtype=torch.long, device=self.device)
        rows_full = torch.empty(o * h, dtype=rows.dtype, device=self.device)
        works = [self.comm.all_gather(ids_full, ids, bounds, async_op=True),
                 self.comm.all_gather(rows_full, rows, [(s * h, e * h) for s, e in bounds], async_op=True)]
        self._reduces.append(_InFlightRows(unit, works, ids, rows, ids_full, rows_full, first))
        if self.reduce_depth == 0:
            self._drain_reduces("reduce")

    def _complete_rows(self, r: _InFlightRows, site: str) -> None:
        """Wait for the rows exchange and add into the unit's fp32 slice the rows that land in it:
        the unit is a table of (vocab + positions) rows of `hidden` (the token table, then GPT-2's
        position table), row `id` for a token, row vocab + p for position p (a row's place in its
        sample). A table of the slice's rows (fp32, one spare row that takes every row landing
        elsewhere) is filled by index_add_, then copied (a tied embedding: added) into the slice."""
        for w in r.works:
            self._wait(w, site)
        r.works, r.ids, r.rows = [], None, None  # this rank's pieces are sent
        unit, h = r.unit, self.spec.hidden
        seq = self._batch_split[1]
        tokens = r.ids_full.numel()
        r0 = unit.start // h
        nrows = -(-unit.end // h) - r0
        table = torch.zeros(nrows + 1, h, dtype=torch.float32, device=self.device)
        src = r.rows_full.view(tokens, h)
        if src.dtype != torch.float32:
            src = src.float()

        def add(idx: torch.Tensor) -> None:
            idx.masked_fill_((idx < 0) | (idx >= nrows), nrows)
            table.index_add_(0, idx, src)

        idx = r.ids_full - r0
        r.ids_full = None
        add(idx)
        if self.model.pos_embed is not None:  # row r of the step is position r % seq of its sample
            del idx
            idx = torch.arange(tokens, device=self.device)
            idx.remainder_(seq).add_(self.spec.vocab_size - r0)
            add(idx)
        del idx, src
        r.rows_full = None
        part = table.view(-1)[unit.start - r0 * h:unit.end - r0 * h]
        if r.first:
            unit.grad.copy_(part)
        else:
            unit.grad.add_(part)

    def _finish_step(self, loss: float | torch.Tensor, lr: float, scale: float) -> StepResult:
        """The step's end (`_update`) and its statistics read (models/pipeline.py's entry)."""
        return self._update(loss, lr, scale).result()

    @torch.no_grad()
    def _update(self, loss: float | torch.Tensor, lr: float, scale: float) -> PendingStep:
        """Wait for the reduce-scatters in flight, then the global norm, clipping and AdamW on the
        slices, all on the device: the overflow flag (torch.isfinite) and the clip coefficient
        (clamp) are tensors, read only by PendingStep.result. fp16 with loss scaling reads the
        stats here, before the update, to skip it on overflow: its one sync."""
        # fp16 may skip the step on overflow: nothing changes before its stats are read
        prepared = not self.scaler.enabled
        if prepared:  # the update's gradient-free passes, while the last gradients travel
            for u in self.units:
                if u.end > u.start:
                    adamw_prepare_(u.master, u.exp_avg_sq, lr, self.optim, u.decay)
        sq = self._grad_norm_sq_beside_tail()  # fp64 scalar
        if not isinstance(loss, torch.Tensor):  # models/pipeline.py sums on the host
            loss = torch.full((), float(loss), dtype=torch.float64, device=self.device)
        # one all-reduce for the squared norm, the overflow flag and the step's loss
        stats = torch.stack([sq, (~torch.isfinite(sq)).to(torch.float64), loss.to(torch.float64)])
        self._reduce_stats(stats)
        scale_used = self.scaler.scale
        timers = dict(clock=list(self._clock), comm_wait_s=self._comm_wait_s, compute_ev=self._compute_ev,
                      wait_ev=self._wait_ev, waits=self._waits)
        self._comm_wait_s, self._compute_ev, self._wait_ev, self._waits = 0.0, [], [], []
        if self.scaler.enabled:
            sq_host, flag, _ = host_floats(stats)
            found_inf = flag > 0 or not math.isfinite(sq_host)
            self.scaler.update(found_inf)
            if found_inf:
                log.warning("fp16 overflow at loss scale %g: step skipped, scale now %g", scale_used,
                            self.scaler.scale)
                self._free_slice_grads()
                return PendingStep(stats, scale_used, True, optimizer_ev=None, optimizer_s=0.0, **timers)
        # clip_grad_norm_'s coefficient on the device, with 1/scale to unscale in the same pass
        coef = clip_coefficient_t(stats[0].sqrt() / scale, self.optim.max_grad_norm) / scale
        scaled = self.optim.max_grad_norm is not None or scale != 1.0
        self.step_count += 1
        t0 = time.perf_counter()
        ev = None
        if self._cuda:
            ev = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            ev[0].record()
        for i, u in enumerate(self.units):
            if u.end > u.start:
                if scaled:
                    u.grad.mul_(coef)
                adamw_step_(u.master, u.grad, u.exp_avg, u.exp_avg_sq, self.step_count, lr, self.optim, u.decay,
                            prepared=prepared)
            if self.zero == 3 and i <= min(self.prefetch, len(self.units) - 2):
                # the next step's first gathers (the embedding, updated first, and the `prefetch`
                # blocks after it) run beside the rest of the update instead of before the next
                # forward; those units stay gathered until then
                self._start_gather(u)
        if ev is not None:
            ev[1].record()
        optimizer_s = time.perf_counter() - t0
        self._free_slice_grads()
        if self.zero in (1, 2):
            works = [self.comm.all_gather(u.full, u.master, u.bounds, async_op=True) for u in self.units]
            for w in works:
                w.wait()
        return PendingStep(stats, scale_used, False, optimizer_ev=ev, optimizer_s=optimizer_s, **timers)

    def _grad_norm_sq_beside_tail(self) -> torch.Tensor:
        """The local squared norm of `_norm_units`' gradients: the units whose reduces are done are
        summed while those still in flight travel (grad_norm_sq_in_place: no buffer beside theirs),
        then the tail is drained (`_drain_reduces`) and the rest added (global_grad_norm_sq)."""
        units = self._norm_units()
        busy = {id(r.unit) for r in self._reduces}
        ready = grad_norm_sq_in_place(u.grad for u in units if id(u) not in busy).to(self.device)
        self._drain_reduces("tail")
        return ready + global_grad_norm_sq(u.grad for u in units if id(u) in busy).to(self.device)

    def _norm_units(self) -> list[UnitState]:
        """The units whose gradients the global norm counts on this rank (models/pipeline.py leaves out
        the tied replica, counted by the first stage)."""
        return self.units

    def _reduce_stats(self, stats: torch.Tensor) -> None:
        """Sum the step's (squared norm, overflow flag, loss) over every rank that trains the model: the
        data-parallel group here (models/pipeline.py: the world, every stage)."""
        self.comm.all_reduce(stats, "sum")

    def _free_slice_grads(self) -> None:
        """Between steps a rank holds no gradient at all (as FSDP2): the slices' storage is resized
        to 0 and comes back at the unit's first reduce of the next step."""
        for u in self.units:
            u.grad.untyped_storage().resize_(0)

    # ---- evaluation, state, export ------------------------------------------------------------
    @torch.no_grad()
    def eval_loss(self, tokens: torch.Tensor, targets: torch.Tensor) -> float:
        """Mean next-token loss of one batch with the current parameters (every rank computes it;
        at zero 3 the units are gathered one by one)."""
        if self.zero != 3:
            with self._autocast():
                logits = self.model(tokens)
            return float(self._loss(logits, targets, targets.numel()))
        units = self.units
        rope = self.model.rope(tokens.shape[1], self.device)
        self._gathered(units[0])
        with self._autocast():
            x = self.model.embed_tokens(tokens)
        if not self.spec.tied_embeddings:
            self._free(units[0])
        for b, unit in enumerate(units[1:-1]):
            self._gathered(unit)
            with self._autocast():
                x = self.model.blocks[b](x, rope)
            self._free(unit)
        self._gathered(units[-1])
        with self._autocast():
            logits = self.model.head_logits(x)
        self._free(units[-1])
        self._free(units[0])
        return float(self._loss(logits, targets, targets.numel()))

    @torch.no_grad()
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Every parameter by its decoder name, full and fp32 (collective: gathers each unit).
        Names are the decoder's (`embed.weight`, `blocks.0.attn.q_proj.weight`, ...)."""
        names = {id(p): n for n, p in self.model.named_parameters()}
        out = {}
        for u in self.units:
            if not u.held or u.full.dtype != torch.float32:  # the fp32 masters, not a bf16 copy
                full = torch.empty(u.numel, dtype=torch.float32, device=self.device)
                self.comm.all_gather(full, u.master, u.bounds).wait()
            else:
                full = u.full.clone()
            for p, o in zip(u.params, u.offsets):
                out[names[id(p)]] = full[o:o + p.numel()].view(p.shape).clone()
        return out

    @torch.no_grad()
    def load_parameters(self, read: Callable[[str, int, int], torch.Tensor]) -> None:
        """Fill this rank's slices from a full model stored elsewhere (a Hugging Face folder),
        reading ONLY the elements this rank owns: `read(name, a, b)` returns elements [a, b) of the
        decoder parameter `name` flattened row-major (fp32 or castable). Collective at zero 1/2
        (the replicated parameters are gathered afterwards, `after_load`)."""
        names = {id(p): n for n, p in self.model.named_parameters()}
        for u in self.units:
            for p, o in zip(u.params, u.offsets):
                a, b = max(u.start, o), min(u.end, o + p.numel())
                if a < b:
                    u.master[a - u.start:b - u.start].copy_(read(names[id(p)], a - o, b - o).reshape(-1))
        self.after_load()

    def scalar_state(self) -> dict[str, Any]:
        return {"step": self.step_count, **{f"scaler_{k}": v for k, v in self.scaler.state_dict().items()}}

    def load_scalar_state(self, d: dict[str, Any]) -> None:
        self.step_count = int(d["step"])
        self.scaler.load_state_dict({k[len("scaler_"):]: v for k, v in d.items() if k.startswith("scaler_")})

    @torch.no_grad()
    def after_load(self) -> None:
        """After the master slices were overwritten (a checkpoint): refresh the replicated copies."""
        if self.zero in (1, 2):
            works = [self.comm.all_gather(u.full, u.master, u.bounds, async_op=True) for u in self.units]
            for w in works:
                w.wait()

    def resident_tensors(self) -> list[torch.Tensor]:
        """Every tensor the runtime keeps between steps (the memory tracker's starting set)."""
        out: list[torch.Tensor] = []
        for u in self.units:
            out += [u.master, u.exp_avg, u.exp_avg_sq, u.grad]
            if u.held:
                out.append(u.full)
            if u.full_grad is not None:
                out.append(u.full_grad)
        return out

    def shard_numel(self) -> int:
        return sum(u.end - u.start for u in self.units)


__all__ = ["ShardedRuntime", "StepResult", "UnitState"]
