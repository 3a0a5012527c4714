"""The sharded training runtime: ZeRO stages 1, 2 and 3 with UNEVEN shards (Cephalo's real mode).

The model is cut into units (contracts/units.py: the embedding, each block, the head), each one flat
fp32 parameter; plan position p owns the slice `shard_bounds(numel, fractions)[p]` of every unit (its
master parameters, their gradient and AdamW moments, models/optim.py). ZeRO 1/2 keep every unit's
full parameters, ZeRO 3 gathers a unit only while it computes (the next one prefetched). At ZeRO 2/3
a step accumulates LAYER BY LAYER: every micro-batch passes through a unit before the next starts,
so each unit is gathered and reduce-scattered once per step and uneven ranks issue the same
collectives in the same order. Then the global norm, clipping, an fp16 loss scale, AdamW on the
slices. Start-up builds the decoder on the meta device and materializes one unit at a time.

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
from models.optim import (DynamicLossScaler, OptimConfig, adamw_step_, clip_coefficient, decay_ranges,
                          global_grad_norm_sq)
from models.runtime import shard_bounds
from contracts.specs import ModelSpec
from contracts.constants import check_zero
from contracts.units import Unit, runtime_units

log = logging.getLogger(__name__)

INIT_STD = 0.02  # GPT-2 / Llama initializer_range (models/decoder.py)
SEED_STRIDE = 1_000_003  # unit u of seed s draws from generator seed s·SEED_STRIDE + u


def host_float(t: torch.Tensor) -> float:
    """A scalar tensor's value; 0.0 under FakeTensorMode (the profiler traces shapes, no data)."""
    return 0.0 if is_fake(t) else float(t)


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
    full: torch.Tensor | None = None  # fp32 (numel,) full parameters; storage size 0 while not held
    held: bool = False
    full_grad: torch.Tensor | None = None  # fp32 (numel,) full gradient while held
    grad_fresh: bool = True  # the next reduce-scatter overwrites `grad` (first of the step)
    pending: Any = field(default=None, repr=False)  # an in-flight gather's Work


@dataclass(frozen=True)
class StepResult:
    loss: float  # the step's global mean loss (all ranks, all micro-batches)
    grad_norm: float  # global gradient norm before clipping (unscaled); nan when skipped
    skipped: bool  # fp16 overflow: no update this step
    compute_s: float  # wall seconds in forward/backward compute (collective waits excluded)
    work_s: float  # the same on the worker's clock (thread CPU time on CPU, wall on CUDA)
    loss_scale: float
    optimizer_s: float = 0.0  # wall seconds of the AdamW update of this rank's slices


class ShardedRuntime:
    """One rank of a (possibly uneven) sharded data-parallel run of a ModelSpec (docs/models/memory.md)."""

    def __repr__(self) -> str:
        return (f"ShardedRuntime({self.spec.name!r}, zero={self.zero}, position={self.position} of "
                f"{len(self.fractions)}, {self.shard_numel()} of {self.spec.num_params} parameters)")

    def __init__(self, spec: ModelSpec, *, zero: int, fractions: Sequence[float], position: int,
                 comm: Collectives, device: torch.device, recompute: str = "none",
                 autocast_dtype: torch.dtype | None = None, optim: OptimConfig | None = None,
                 seed: int = 0, loss_scaling: bool = False, materialize: bool = True, expand_kv: bool = False):
        check_zero(zero)
        if not 0 <= position < len(fractions):
            raise ValueError(f"position {position} is not one of the {len(fractions)} shard fractions")
        self.spec, self.zero, self.position, self.comm = spec, zero, position, comm
        self.device, self.recompute, self.autocast_dtype = device, recompute, autocast_dtype
        self.optim = optim or OptimConfig()
        self.scaler = DynamicLossScaler(enabled=loss_scaling)
        self.step_count = 0
        self.fractions = list(fractions)
        with torch.device("meta"):
            # expand_kv: repeat K/V to every head where GQA alone would fall back to SDPA's math
            # kernel on this device (planner/attention.select_kernel decides; the memory model follows)
            self.model: Decoder = build_model(spec, recompute, expand_kv=expand_kv)
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
        layout, groups = runtime_units(self.spec), self._unit_modules()
        return [self._build_unit(i, layout[i], groups[i], seed, materialize) for i in self._unit_indices()]

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
        else:
            unit.master = full[s:e]
        return unit

    @torch.no_grad()
    def _init_unit(self, mods: list[nn.Module], gen: torch.Generator) -> None:
        # GPT-2 / Llama: N(0, 0.02) for every matrix and embedding, zero biases, unit norm gains
        for mod in mods:
            for sub in mod.modules():
                if isinstance(sub, (nn.Linear, nn.Embedding)):
                    sub.weight.normal_(0.0, INIT_STD, generator=gen)
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

    # ---- gathers (zero 3) ----------------------------------------------------------------------
    def _start_gather(self, unit: UnitState | None) -> None:
        if unit is None or self.zero != 3 or unit.held or unit.pending is not None:
            return
        full = unit.full
        full.untyped_storage().resize_(unit.numel * full.element_size())
        # the collective writes in place; autograd must not see it as a change of saved tensors
        with torch.autograd._unsafe_preserve_version_counter(full):
            unit.pending = self.comm.all_gather(full, unit.master, unit.bounds, async_op=True)

    def _gathered(self, unit: UnitState) -> None:
        if self.zero != 3 or unit.held:
            return
        self._start_gather(unit)
        unit.pending.wait()
        unit.pending = None
        unit.held = True

    def _free(self, unit: UnitState) -> None:
        if self.zero == 3 and unit.held:
            self._release(unit)

    # ---- gradients ---------------------------------------------------------------------------
    def _grad_buffer(self, unit: UnitState) -> torch.Tensor:
        """The unit's full fp32 gradient, its parameters' .grad viewing into it (AccumulateGrad
        then adds every micro-batch in place)."""
        if unit.full_grad is None:
            unit.full_grad = torch.zeros(unit.numel, dtype=torch.float32, device=self.device)
            for p, o in zip(unit.params, unit.offsets):
                p.grad = unit.full_grad[o:o + p.numel()].view(p.shape)
        return unit.full_grad

    def _flatten_grads(self, unit: UnitState) -> None:
        """Keep mode: autograd made each parameter's .grad on its own (no buffer waited through the
        backward); copy them into one flat buffer for the reduce-scatter, freeing each as copied."""
        if unit.full_grad is not None:
            return
        have_all = all(p.grad is not None for p in unit.params)
        full = (torch.empty if have_all else torch.zeros)(unit.numel, dtype=torch.float32, device=self.device)
        for p, o in zip(unit.params, unit.offsets):
            if p.grad is not None:
                full[o:o + p.numel()].copy_(p.grad.reshape(-1))
                p.grad = None
        unit.full_grad = full

    def _reduce(self, unit: UnitState) -> None:
        """Reduce-scatter the unit's full gradient into the owners' slices (summing into `grad`
        when this is the unit's second contribution of the step: a tied embedding), then free it.
        The slice's gradient exists from the unit's first reduce of the step to the update."""
        self._flatten_grads(unit)
        full = unit.full_grad
        st = unit.grad.untyped_storage()
        if st.nbytes() == 0:
            st.resize_(unit.grad.numel() * unit.grad.element_size())
        if unit.grad_fresh:
            self.comm.reduce_scatter(unit.grad, full, unit.bounds).wait()
            unit.grad_fresh = False
        else:
            part = torch.empty_like(unit.grad)
            self.comm.reduce_scatter(part, full, unit.bounds).wait()
            unit.grad.add_(part)
            del part
        for p in unit.params:
            p.grad = None
        unit.full_grad = None

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
        if token_normalizer <= 0:
            raise ValueError(f"token_normalizer must be > 0, got {token_normalizer}")
        self._clock = [0.0, 0.0]
        scale = self.scaler.scale
        for u in self.units:
            u.grad_fresh = True
        if self.zero == 1:
            loss = self._step_replicated(batches, token_normalizer, scale)
        else:
            loss = self._step_layerwise(batches, token_normalizer, scale)
        if after_compute is not None:
            after_compute(self._clock[1])
        return self._finish_step(loss, lr, scale)

    def _timed(self, fn: Callable[[], Any]) -> Any:
        w0, c0 = time.perf_counter(), self._work_clock()
        out = fn()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self._clock[0] += time.perf_counter() - w0
        self._clock[1] += self._work_clock() - c0
        return out

    def _step_replicated(self, batches, normalizer: int, scale: float) -> float:
        """Zero 1: the whole model per micro-batch, gradients accumulating in the full buffers."""
        for u in self.units:
            self._grad_buffer(u)
        total = 0.0

        def one(x: torch.Tensor, y: torch.Tensor) -> float:
            with self._autocast():
                logits = self.model(x)  # (B, T, V)
            loss = self._loss(logits, y, normalizer)
            del logits
            (loss * scale if scale != 1.0 else loss).backward()
            return host_float(loss.detach())

        for x, y in batches:
            total += self._timed(lambda: one(x, y))
        for u in self.units:
            self._reduce(u)
        return total

    def _step_layerwise(self, batches, normalizer: int, scale: float) -> float:
        """Zero 2/3: unit by unit over all micro-batches (docs/models/memory.md)."""
        n = len(batches)
        keep = n == 1 and self.recompute == "none"  # keep every unit's graph: no recomputation
        units = self.units
        embed, blocks, head = units[0], units[1:-1], units[-1]
        tied = self.spec.tied_embeddings
        # a rank without samples (n == 0) runs the same code: the same collectives in the same order
        rope = self.model.rope(batches[0][0].shape[1], self.device) if n else None

        # forward: embeddings, then each block over every micro-batch
        self._gathered(embed)
        self._start_gather(blocks[0] if blocks else head)

        def embed_fwd() -> list[torch.Tensor]:
            with torch.no_grad(), self._autocast():
                return [self.model.embed_tokens(x) for x, _ in batches]
        xs = self._timed(embed_fwd)
        self._free(embed)  # a tied embedding is gathered again for the head
        bounds_in: list[list[torch.Tensor]] = []  # bounds_in[b][j]: input of block b, micro-batch j
        graphs: list[list[tuple[torch.Tensor, torch.Tensor]]] = []
        for b, unit in enumerate(blocks):
            self._gathered(unit)
            self._start_gather(blocks[b + 1] if b + 1 < len(blocks) else head)
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
        self._start_gather(blocks[-1] if blocks else None)
        if not keep:  # several micro-batches accumulate in place; one (keep mode) needs no buffer yet
            self._grad_buffer(head)
            if tied:
                self._grad_buffer(embed)
        total = 0.0

        def head_fb() -> tuple[list[torch.Tensor], float]:
            dxs, tot = [], 0.0
            for x, (_, y) in zip(xs, batches):
                xin = x.detach().requires_grad_()
                with self._autocast():
                    logits = self.model.head_logits(xin)
                loss = self._loss(logits, y, normalizer)
                del logits
                (loss * scale if scale != 1.0 else loss).backward()
                tot += host_float(loss.detach())
                dxs.append(xin.grad)
            return dxs, tot
        dxs, total = self._timed(head_fb)
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
            self._start_gather(blocks[b - 1] if b > 0 else None)
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

        # the embedding's gradient needs only the token ids: scatter-add, no gather
        grad = self._grad_buffer(embed)

        def embed_bwd() -> None:
            h = self.spec.hidden
            V_h = self.spec.vocab_size * h  # the token table comes first in the unit
            tok = grad[:V_h].view(-1, h)
            for (x, _), dx in zip(batches, dxs):
                tok.index_add_(0, x.reshape(-1), dx.reshape(-1, h))
                if self.model.pos_embed is not None:
                    grad[V_h:V_h + x.shape[1] * h].view(-1, h).add_(dx.sum(0))
        self._timed(embed_bwd)
        del dxs
        self._reduce(embed)
        return total

    @torch.no_grad()
    def _finish_step(self, loss: float, lr: float, scale: float) -> StepResult:
        sq = global_grad_norm_sq(u.grad for u in self._norm_units()).to(self.device)  # fp64 scalar
        # one all-reduce for the squared norm, the overflow flag and the step's loss
        stats = torch.stack([sq, torch.tensor(0.0 if math.isfinite(host_float(sq)) else 1.0, dtype=torch.float64,
                                              device=self.device),
                             torch.tensor(loss, dtype=torch.float64, device=self.device)])
        self._reduce_stats(stats)
        loss = host_float(stats[2])
        found_inf = host_float(stats[1]) > 0 or not math.isfinite(host_float(stats[0]))
        scale_used = self.scaler.scale
        self.scaler.update(found_inf)
        if found_inf:
            if not self.scaler.enabled:
                raise FloatingPointError("non-finite gradient (no loss scaling in this dtype): the run diverged")
            log.warning("fp16 overflow at loss scale %g: step skipped, scale now %g", scale_used, self.scaler.scale)
            self._free_slice_grads()
            return StepResult(loss, float("nan"), True, self._clock[0], self._clock[1], scale_used)
        norm = math.sqrt(host_float(stats[0])) / scale
        coef = clip_coefficient(norm, self.optim.max_grad_norm) / scale
        self.step_count += 1
        t0 = time.perf_counter()
        for u in self.units:
            if u.end > u.start:
                if coef != 1.0:
                    u.grad.mul_(coef)
                adamw_step_(u.master, u.grad, u.exp_avg, u.exp_avg_sq, self.step_count, lr, self.optim, u.decay)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        optimizer_s = time.perf_counter() - t0
        self._free_slice_grads()
        if self.zero in (1, 2):
            works = [self.comm.all_gather(u.full, u.master, u.bounds, async_op=True) for u in self.units]
            for w in works:
                w.wait()
        return StepResult(loss, norm, False, self._clock[0], self._clock[1], scale_used, optimizer_s)

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
            if not u.held:
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
