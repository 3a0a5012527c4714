"""The planner's cost model: time and memory of one device, and the coefficient tables the ILP consumes.

What one optimizer step costs on the executor's sharded runtime (models/sharded.py) at ZeRO stage z:
n micro-batches of `α + β·m` (the device kind's profile times its emulated `slowdown`), AdamW over
its shard, and the collectives `contracts.units.step_collectives` lists, priced by
planner/costmodel/collectives.py in the plan's `param_dtype` and `reduce_dtype`. What compute can
hide (prefetched gathers, reduce-scatters left in flight) overlaps it; the rest stays exposed. The
optimizer runs between two barriers (the gradient-norm all-reduce, the next step's first gather), so
a step is a max-plus chain: `T = max_i (E + max(compute_i, H)) + max_i optimizer_i` (`StepComm`).
Memory is the memory model's for the actual (m, n, f) and the plan's runtime settings; the tables
hold each candidate's largest shard that fits (`Choice.max_share`): a `Choice` per micro-batch at
n = 1 and exact `AccumBand`s over n, which planner/hetero/solve.py counts in total.

The formulas, the overlap, the candidates and why a band is exact: docs/models/cost.md.
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from functools import lru_cache
from typing import TYPE_CHECKING, Callable, Iterable, Sequence

from contracts.catalog import CPU_TYPE, device_dtype
from contracts.cluster import PROFILE_KEY_SHARE, ClusterSpec, DeviceSpec, NodeSpec
from contracts.plan import DEFAULT_PREFETCH, check_step_dtypes
from contracts.specs import ModelSpec
from contracts.units import runtime_units, step_collectives
from contracts.wire import TOKEN_ID_BYTES
from planner.costmodel.collectives import (ASYNC_BESIDE_COMPUTE, BESIDE_COMPUTE, INTER_NODE_HOP_LATENCY_S,
                                          INTRA_NODE_HOP_LATENCY_S, Link, all_reduce_s, bytes_per_s, exposed_share,
                                          ring_wire_bytes, sharded_step_comm_s)
from contracts.constants import FP32_BYTES, HALF_BYTES, MAX_MICRO_BATCH, check_zero

if TYPE_CHECKING:
    from planner.core.profiles import CollectiveProfile

log = logging.getLogger(__name__)

# Accumulation counts enumerated one by one as Choices; from the next count on, bands (AccumBand).
DENSE_ACCUM_STEPS = 1
# A band's room is affine in n when its midpoint lies within this of the chord (shard-fraction
# units; max_share itself is found to SHARE_TOL, and its float noise is about 1e-8). A concave
# curve within AFFINE_TOL of its chord at the midpoint is within 2·AFFINE_TOL of it everywhere, so
# the ILP adds 2·AFFINE_TOL to the chord: a relaxation, never a lost plan (what a plan holds is
# priced exactly from its own counts).
AFFINE_TOL = 1e-7
# The stage a plan says when nothing else was chosen (a one-device plan, an old plan file).
RUNTIME_ZERO_STAGE = 1
# `--param-dtype auto`: gather in the compute dtype at zero 3, fp32 at zero 1 and 2
PARAM_DTYPE_AUTO = "auto"
DTYPE_BYTES = {"fp32": FP32_BYTES, "bf16": HALF_BYTES, "fp16": HALF_BYTES}
# collective calls a step issues beside those of contracts.units.step_collectives: the all-reduce of the
# step's statistics before the update (models/sharded.py _reduce_stats), 24 bytes, latency only
STATS_CALLS = 1


@dataclass(frozen=True)
class StepConfig:
    """How the sharded runtime runs one step's collectives, as the plan file says: parameters
    gathered in `param_dtype` (zero 3; fp32 at zero 1/2), gradients reduce-scattered in
    `reduce_dtype`, `prefetch` zero-3 units gathered ahead of the one computing, `reduce_in_flight`
    reduce-scatters left in flight behind the next unit's backward (0 or 1; 1 only at zero 2/3)."""

    param_dtype: str = "fp32"
    reduce_dtype: str = "fp32"
    prefetch: int = DEFAULT_PREFETCH
    reduce_in_flight: int = 0
    # the step's tokens over every rank (global batch x seq; 0: not given): at zero 2/3 the embedding
    # unit's gradient goes out as rows where contracts.wire.token_rows_exchange says so
    step_tokens: int = 0


@dataclass(frozen=True)
class StepComm:
    """One step's collectives on k ranks, split by what compute can hide: `exposed_s` runs with no
    compute beside it (the first gather, the last reduce-scatter, every reduce-scatter waited as
    issued, everything at zero 1), `hidden_s` beside the compute (prefetched gathers, reduce-scatters
    left in flight). A rank of compute c ends its
    collectives at `end_s(c)` = exposed + max(c, hidden): the network and the compute run side by
    side, each a chain. docs/models/cost.md ("Overlap")."""

    exposed_s: float = 0.0
    hidden_s: float = 0.0

    @property
    def total_s(self) -> float:
        """Every collective of the step, none hidden: an upper bound on what they add to compute."""
        return self.exposed_s + self.hidden_s

    def end_s(self, compute_s: float) -> float:
        """Compute and collectives of a rank computing compute_s (its optimizer excluded)."""
        return self.exposed_s + max(compute_s, self.hidden_s)

    def exposed_of_s(self, compute_s: float) -> float:
        """The communication a rank computing compute_s waits for: end_s − compute."""
        return self.end_s(compute_s) - compute_s

    def compute_room_s(self, t_s: float) -> float:
        """The most compute a rank may do and still end its collectives by t_s; −inf when even no
        compute does (t_s < exposed + hidden)."""
        if t_s < self.total_s * (1 - 1e-12):
            return -math.inf
        return t_s - self.exposed_s

    def bound_s(self, fluid_s: float) -> float:
        """A lower bound on a step whose compute (and optimizer) need at least fluid_s:
        exposed + max(fluid, hidden) (max_i max(c_i, hidden) + max_i opt_i ≥ max(c + opt, hidden)
        for every rank)."""
        return self.exposed_s + max(fluid_s, self.hidden_s)

MemoryFn = Callable[[int, int, float], float]  # (micro_batch, accum_steps, shard_fraction) -> peak bytes
PhasesFn = Callable[[int, int, float], tuple[float, ...]]  # the same -> bytes at each candidate peak moment


@dataclass(frozen=True)
class DeviceCoeffs:
    """The cost figures of one kind of device (type + emulation) for one model, seq, dtype and ZeRO
    stage. Times include the emulated slowdown."""

    device: DeviceSpec
    dtype: str  # what this type trains in (bf16 falls back to fp16 where unsupported)
    alpha_s: float  # fixed cost of one micro-batch (the plan's recompute)
    beta_s: float  # cost per sample of a micro-batch (the plan's recompute)
    optimizer_s: float  # AdamW over the whole state (f = 1)
    capacity_bytes: float  # memory × headroom: what a plan may use
    memory_fn: MemoryFn = field(compare=False, repr=False)  # (m, n, f) -> bytes
    measured: bool = False  # the step profile was measured (else estimated)
    recompute_measured: bool = True  # the recompute-full profile (accumulation at zero >= 2) was measured
    source: str = ""
    # layer-wise accumulation (zero ≥ 2): n > 1 recomputes every unit's forward, priced by the
    # recompute="full" profile below, and memory depends on n
    layerwise: bool = False
    recompute_alpha_s: float | None = None
    recompute_beta_s: float | None = None
    # the memory model's peak moments (m, n, f) -> bytes each: max_share in four evaluations
    phases_fn: PhasesFn | None = field(default=None, compare=False, repr=False)

    def compute_s(self, micro_batch: int, accum_steps: int) -> float:
        if micro_batch <= 0:
            return 0.0
        if self.layerwise and accum_steps > 1 and self.recompute_alpha_s is not None:
            return accum_steps * (self.recompute_alpha_s + (self.recompute_beta_s or 0.0) * micro_batch)
        return accum_steps * (self.alpha_s + self.beta_s * micro_batch)

    def step_s(self, micro_batch: int, accum_steps: int, shard_fraction: float) -> float:
        """Compute plus the optimizer step on the device's shard (collectives excluded)."""
        return self.compute_s(micro_batch, accum_steps) + self.optimizer_s * shard_fraction

    def memory_accum_steps(self, accum_steps: int) -> int:
        """The accumulation steps memory is asked at: the choice's own n (≥ 1), at every stage (at
        zero 1 the memory model ignores it; asking costs little: bench/planner_scaling.py)."""
        return max(accum_steps, 1)

    def memory_bytes(self, micro_batch: int, accum_steps: int, shard_fraction: float) -> float:
        return self.memory_fn(micro_batch, self.memory_accum_steps(accum_steps), shard_fraction)

    def fits(self, micro_batch: int, accum_steps: int, shard_fraction: float) -> bool:
        """(m, n, f) within capacity × headroom: one memory-model evaluation (max_share takes several)."""
        return self.memory_bytes(micro_batch, accum_steps, shard_fraction) <= self.capacity_bytes

    def max_share(self, micro_batch: int, accum_steps: int) -> float:
        """The largest shard fraction that fits beside (m, n); −1 if none does (max_share_fitting,
        in four evaluations from the memory model's peak moments where it has them)."""
        n = self.memory_accum_steps(accum_steps)
        if self.phases_fn is not None and micro_batch > 0:
            share = share_from_phases(self.phases_fn, self.memory_fn, micro_batch, n, self.capacity_bytes)
            if share is not None:
                return share
        return max_share_fitting(self.memory_fn, micro_batch, self.capacity_bytes, n)

    @property
    def speed_samples_per_s(self) -> float:
        """Throughput at large micro-batches (α amortized): what `proportional` splits by."""
        return 1.0 / self.beta_s


@dataclass(frozen=True)
class CommModel:
    """Collective costs of one optimizer step for the devices of one scope (one node, or several):
    what contracts.units.step_collectives says the runtime all-gathers and reduce-scatters, and how
    much of it no compute hides (`step_overlap`)."""

    bandwidth_bytes_per_s: float  # ring bus bandwidth per rank (all-gathers; reduce-scatters too unless below)
    hop_latency_s: float
    gather_bytes: float  # all-gathered per step, full buffers in the plan's param_dtype
    reduce_bytes: float  # reduce-scattered per step, full buffers in the plan's reduce_dtype
    num_calls: int = 0  # collective calls per step (each pays a latency)
    source: str = ""
    # measured (profiler bench between local workers): the reduce-scatters' bus bandwidth and the latency of one call
    reduce_bandwidth_bytes_per_s: float | None = None
    call_latency_s: float | None = None
    # the part no compute hides, of the same buffers and calls; None: all of it (nothing overlaps)
    exposed_gather_bytes: float | None = None
    exposed_reduce_bytes: float | None = None
    exposed_calls: int | None = None
    # the share of the collectives compute may hide that it measurably does not (profiler/run_profile.py's
    # async gather beside compute; 0: all of it hidden, as on GPUs, where nothing measured otherwise)
    overlap_exposed_share: float = 0.0
    # calls beside the units' collectives, each a latency with nothing beside it (STATS_CALLS where the
    # profiling path measured a call as a step issues it; 0 elsewhere, a few µs on a GPU link)
    stats_calls: int = 0

    @property
    def gather_link(self) -> Link:
        return Link(self.bandwidth_bytes_per_s, self.hop_latency_s, self.call_latency_s)

    @property
    def reduce_link(self) -> Link:
        return Link(self.reduce_bandwidth_bytes_per_s or self.bandwidth_bytes_per_s, self.hop_latency_s,
                    self.call_latency_s)

    def comm_s(self, world_size: int) -> float:
        """planner.costmodel.collectives.sharded_step_comm_s of this step's bytes on k ranks: every
        collective, hidden or not."""
        return sharded_step_comm_s(self.gather_bytes, self.reduce_bytes, self.num_calls + self.stats_calls,
                                   world_size, self.gather_link, self.reduce_link)

    def step(self, world_size: int) -> StepComm:
        """The collectives on k ranks split into what stays exposed and what compute may hide; of the
        latter, `overlap_exposed_share` counts as exposed (measured not to overlap)."""
        total = self.comm_s(world_size)
        if self.exposed_gather_bytes is None:
            return StepComm(total, 0.0)
        exposed = sharded_step_comm_s(self.exposed_gather_bytes, self.exposed_reduce_bytes or 0.0,
                                      (self.exposed_calls or 0) + self.stats_calls, world_size, self.gather_link,
                                      self.reduce_link)
        hidden = max(total - exposed, 0.0)
        unhidden = self.overlap_exposed_share * hidden  # runs beside compute but slows it by as much
        return StepComm(exposed + unhidden, hidden - unhidden)

    def wire_bytes(self, world_size: int) -> int:
        """Bytes one step puts on the network, every rank's sends together."""
        return ring_wire_bytes(self.gather_bytes, world_size) + ring_wire_bytes(self.reduce_bytes, world_size)


@dataclass(frozen=True)
class Choice:
    """One (micro_batch, accum_steps) a device may take; (0, 0) holds state only."""

    micro_batch: int
    accum_steps: int
    compute_s: float
    memory_fixed_bytes: float  # at shard fraction 0
    memory_per_share_bytes: float  # memory at f = 1 minus at f = 0 (the slope where the peak is affine)
    max_share: float  # largest per-device shard fraction that fits (≤ 1)

    @property
    def batch(self) -> int:
        return self.micro_batch * self.accum_steps


@dataclass(frozen=True)
class AccumBand:
    """Accumulation counts lo..hi (> DENSE_ACCUM_STEPS) at micro-batch m for devices of one class,
    over which a device's compute is n·step_s and its room for the shard is affine in n, from
    max_share_lo at n = lo to max_share_hi at n = hi (≥ 0: every n of the band fits)."""

    micro_batch: int
    lo: int
    hi: int
    step_s: float  # compute of one micro-batch (n > 1: the layer-wise recompute profile at zero ≥ 2)
    max_share_lo: float
    max_share_hi: float
    room_tol: float = 2 * AFFINE_TOL  # how far the room may lie above the chord (CostModel.affine_tol)

    def room_line(self) -> tuple[float, float]:
        """(a, s): the room of n counts is at most a + s·n on the band (the chord plus room_tol)."""
        s = 0.0 if self.hi == self.lo else (self.max_share_hi - self.max_share_lo) / (self.hi - self.lo)
        return self.max_share_lo - s * self.lo + self.room_tol, s


@dataclass(frozen=True)
class ClassTable:
    """Identical devices of one scope (same DeviceSpec) and the choices each may take."""

    device: DeviceSpec
    device_indices: tuple[int, ...]  # ClusterSpec.devices() order
    coeffs: DeviceCoeffs
    choices: tuple[Choice, ...]
    bands: tuple[AccumBand, ...] = ()

    @property
    def count(self) -> int:
        return len(self.device_indices)

    def choice(self, micro_batch: int, accum_steps: int) -> Choice:
        """The Choice of any (m, n), a band's count included (memory asked at that n)."""
        return make_choice(self.coeffs, micro_batch, accum_steps, self.coeffs.max_share(micro_batch, accum_steps))


@dataclass(frozen=True)
class ScopeTable:
    """The coefficient tables of one scope: the devices a plan may use with one link bandwidth."""

    name: str
    multi_node: bool
    classes: tuple[ClassTable, ...]
    comm: CommModel

    @property
    def num_devices(self) -> int:
        return sum(c.count for c in self.classes)

    def comm_s(self, world_size: int) -> float:
        return self.comm.comm_s(world_size)

    def step_comm(self, world_size: int) -> StepComm:
        return self.comm.step(world_size)


# ---- edges: units and the two models this one consumes ----------------------------------------


# The memory model takes shard fractions in (0, 1]; a device without a shard is asked at this one
# (round(f·P) = 0 parameters for any model below 10^12 parameters).
NO_SHARE = 1e-12
# max_share is found to this precision in the shard fraction (far below one parameter's worth
# that matters: the runtime rounds slices to whole parameters anyway).
SHARE_TOL = 1e-9
# share_from_phases stays this far below the moments' exact root: a few rounding steps of a slice
PHASE_ROOT_MARGIN = 1e-7


def cached_memory_fn(memory_at: Callable[[int, int, float], float]) -> MemoryFn:
    """The memory model as (m, n, f) -> bytes, cached; f = 0 asked at NO_SHARE; micro-batch 0 (state
    only) extrapolated from 1 and 2 if the model refuses it (each of its phases is affine in m)."""

    @lru_cache(maxsize=None)
    def fn(m: int, n: int, f: float) -> float:
        f = max(f, NO_SHARE)
        n = max(n, 1)
        if m == 0:
            try:
                return float(memory_at(0, 1, f))
            except ValueError:
                return 2.0 * fn(1, 1, f) - fn(2, 1, f)
        return float(memory_at(m, n, f))

    return fn


def last_fitting(c: DeviceCoeffs, m: int, f: float, lo: int, hi: int) -> int:
    """The largest n in [lo, hi] at which (m, n, f) fits, given that it fits at lo. Every peak moment
    is affine in n (the unit boundaries kept grow with it), so the moments at lo and hi give the
    answer in four evaluations, checked against the memory model (fits at n, not at n + 1); bisection
    where the check fails or the moments are unknown."""
    if c.fits(m, hi, f):
        return hi
    if c.phases_fn is not None:
        at_lo, at_hi = c.phases_fn(m, lo, f), c.phases_fn(m, hi, f)
        cap = c.capacity_bytes
        n = min((lo + math.floor((cap - a) * (hi - lo) / (b - a)) for a, b in zip(at_lo, at_hi) if b > cap and b > a),
                default=None)
        if n is not None:
            n = min(max(n, lo), hi - 1)
            if c.fits(m, n, f) and not c.fits(m, n + 1, f):
                return n
    return _last_true(lambda k: c.fits(m, k, f), lo, hi)


def _last_true(pred: Callable[[int], bool], lo: int, hi: int) -> int:
    """The largest n in [lo, hi] with pred(n), for a pred true at lo that stays false once false
    (memory non-decreasing in n): bisection."""
    if pred(hi):
        return hi
    good, bad = lo, hi
    while bad - good > 1:
        mid = (good + bad) // 2
        good, bad = (mid, bad) if pred(mid) else (good, mid)
    return good


def share_from_phases(phases_fn: PhasesFn, memory_fn: MemoryFn, m: int, n: int, capacity_bytes: float) -> float | None:
    """max_share_fitting from the peak moments: each is affine in f (planner.core.memory.
    estimate_peak_phases), so the largest f under capacity is the least of their roots, taken from f = 0
    and f = 1, less PHASE_ROOT_MARGIN (each unit's slice is rounded to whole parameters, so the
    curve steps every 1/numel of a unit, ~3e-8 for a 1.5B model's block). Checked against the memory
    model itself; None where it does not fit there, for the caller's search."""
    at0, at1 = phases_fn(m, n, 0.0), phases_fn(m, n, 1.0)
    if max(at1) <= capacity_bytes:
        return 1.0
    if max(at0) > capacity_bytes:
        return -1.0
    f = min(((capacity_bytes - a) / (b - a) for a, b in zip(at0, at1) if b > capacity_bytes and b > a), default=None)
    if f is None:  # the moments disagree with the peak: the caller searches
        return None
    f = min(max(f - PHASE_ROOT_MARGIN, 0.0), 1.0)
    return f if memory_fn(m, n, f) <= capacity_bytes else None


def max_share_fitting(memory_fn: MemoryFn, micro_batch: int, capacity_bytes: float, accum_steps: int = 1) -> float:
    """The largest shard fraction f ≤ 1 with memory(m, n, f) ≤ capacity; −1 if even f = 0 does not fit.
    Memory grows with f and is piecewise affine (the peak is the largest of a few affine moments of the
    step): secant steps alternating with bisection, which always halves; a secant point that fits is
    checked one SHARE_TOL above, which on one affine piece ends the search in 4 evaluations."""
    def mem(f: float) -> float:
        return memory_fn(micro_batch, accum_steps, f)

    lo, hi = 0.0, 1.0
    mem_lo, mem_hi = mem(lo), mem(hi)
    if mem_hi <= capacity_bytes:
        return 1.0
    if mem_lo > capacity_bytes:
        return -1.0
    for step in range(200):
        if hi - lo <= SHARE_TOL:
            break
        secant = step % 2 == 0
        x = lo + (capacity_bytes - mem_lo) * (hi - lo) / (mem_hi - mem_lo) if secant else 0.5 * (lo + hi)
        x = min(max(x, lo + SHARE_TOL / 2), hi - SHARE_TOL / 2)
        mem_x = mem(x)
        if mem_x > capacity_bytes:
            hi, mem_hi = x, mem_x
            continue
        lo, mem_lo = x, mem_x
        if secant and x + SHARE_TOL < hi:
            above = mem(x + SHARE_TOL)
            if above > capacity_bytes:
                hi, mem_hi = x + SHARE_TOL, above
            else:
                lo, mem_lo = x + SHARE_TOL, above
    return lo


def make_choice(c: DeviceCoeffs, micro_batch: int, accum_steps: int, max_share: float) -> Choice:
    fixed = c.memory_bytes(micro_batch, accum_steps, 0.0)
    return Choice(micro_batch, accum_steps, c.compute_s(micro_batch, accum_steps), fixed,
                  c.memory_bytes(micro_batch, accum_steps, 1.0) - fixed, max_share)


def runtime_memory_fns(spec: ModelSpec, seq: int, dtype: str, recompute: str, world_size: int,
                       zero: int = RUNTIME_ZERO_STAGE, device_type: str = CPU_TYPE,
                       step: StepConfig = StepConfig()) -> tuple[MemoryFn, PhasesFn]:
    """The memory model of planner/core/memory.py for the sharded runtime at ZeRO stage `zero` with the
    plan's dtypes, prefetch depth and reduce-scatters in flight (`step`), asked at
    the choice's own micro-batch, accumulation steps and shard fraction: (peak bytes, its moments
    (estimate_peak_phases) in a fixed order). One cached evaluation serves both: the searches ask
    the peak and the moments of the same points."""
    from planner.core.memory import MemoryConfig, estimate_with_phases

    known: dict[tuple[int, int, float], tuple[float, tuple[float, ...]]] = {}

    def at(m: int, n: int, f: float) -> tuple[float, tuple[float, ...]]:
        key = (m, n, f)
        if key not in known:
            cfg = MemoryConfig(micro_batch=m, accum_steps=n, seq=seq, dtype=dtype, recompute=recompute,
                               dp=max(world_size, 1), zero=zero, shard_fraction=f, device_type=device_type,
                               param_dtype=step.param_dtype, reduce_dtype=step.reduce_dtype,
                               prefetch=step.prefetch, reduce_in_flight=step.reduce_in_flight,
                               step_tokens=step.step_tokens)
            breakdown, phases = estimate_with_phases(spec, cfg)
            known[key] = float(breakdown.peak_bytes), tuple(float(phases[k]) for k in sorted(phases))
        return known[key]

    def line(m: int, n: int, f: float) -> tuple[float, ...]:
        """The moments at n > 3 from those at n = 2 and 3: from n = 2 on every moment is affine in
        n, at every stage (the inputs of all the micro-batches, and at zero 2 and 3 their unit
        boundaries, grow by the same bytes per micro-batch); the arithmetic is on whole bytes, exact
        below 2^53. tests/unit/test_memory.py checks the line against the model itself."""
        two, three = at(m, 2, f)[1], at(m, 3, f)[1]
        return tuple(a + (n - 2) * (b - a) for a, b in zip(two, three))

    def phases_at(m: int, n: int, f: float) -> tuple[float, ...]:
        n, f = max(n, 1), max(f, NO_SHARE)
        return line(m, n, f) if m > 0 and n > 3 else at(m, n, f)[1]

    def peak_at(m: int, n: int, f: float) -> float:
        # the peak is the largest moment: on the line too, where the points at 2 and 3 are known
        # already (the searches ask f = 0 and 1 at many counts; a new f costs one evaluation either way)
        if m > 0 and n > 3 and (m, 2, f) in known and (m, 3, f) in known:
            return max(line(m, n, f))
        return at(m, n, f)[0]

    return cached_memory_fn(peak_at), phases_at


def validate_zero(zero: int) -> int:
    return check_zero(zero)


def compute_dtype(device_type: str, dtype: str) -> str:
    """The dtype a device computes in under a plan of `dtype`: fp32 on the CPU (the worker runs no
    autocast there), fp16 where a GPU has no bf16 (contracts.catalog.device_dtype), else `dtype`."""
    return "fp32" if device_type == CPU_TYPE else device_dtype(device_type, dtype)


def compute_dtype_bytes(device_type: str, dtype: str) -> int:
    """Bytes per element of a device's compute dtype (`compute_dtype`): 4 for fp32, 2 for bf16/fp16."""
    return DTYPE_BYTES[compute_dtype(device_type, dtype)]


def resolve_param_dtype(requested: str, zero: int, dtype: str, device_types: Iterable[str]) -> str:
    """The dtype zero 3 gathers parameters in. `auto`: the compute dtype every device shares
    (`compute_dtype`; fp32 where they differ, as a CPU beside a GPU does), and fp32 at zero 1 and 2,
    whose replicated parameters are fp32. An explicit dtype is kept as given (contracts.plan.
    check_step_dtypes refuses a non-fp32 one at zero 1 and 2)."""
    if requested != PARAM_DTYPE_AUTO:
        return requested
    if zero != 3:
        return "fp32"
    dtypes = {compute_dtype(t, dtype) for t in device_types}
    return dtypes.pop() if len(dtypes) == 1 else "fp32"


def step_overlap(spec: ModelSpec, zero: int, prefetch: int,
                 reduce_in_flight: int = 0) -> tuple[float, float, int] | None:
    """What of a step's collectives no compute hides, as the runtime orders them: (elements
    gathered, elements reduce-scattered, calls), None where nothing is hidden. Zero 1 reduces after
    the backward and gathers after the optimizer: all exposed (None). At zero 2 and 3 with
    `reduce_in_flight` 1 each unit's reduce-scatter stays in flight behind the next unit's backward,
    so only the last one (the embedding's) is exposed; with 0 each is waited as issued: all exposed.
    Zero 2 gathers after the optimizer (all exposed), zero 3 with prefetch ≥ 1 gathers every unit
    behind the one computing, except the first (the embedding's), and with prefetch 0 waits for each
    gather."""
    check_zero(zero)
    if zero == 1:
        return None
    units = runtime_units(spec)
    first = units[0].numel  # the embedding: gathered first, reduced last
    sc = step_collectives(spec, zero)
    reduce_calls = len(units) + (1 if spec.tied_embeddings else 0)
    reduced, reduces = (float(first), 1) if reduce_in_flight else (float(sc.reduce_numel), reduce_calls)
    if zero == 3 and prefetch >= 1:
        return float(first), reduced, 1 + reduces
    gather_calls = len(units) if zero == 2 else sc.num_calls - reduce_calls
    return float(sc.gather_numel), reduced, gather_calls + reduces


def slice_sizes(numel: int, fractions: Sequence[float]) -> list[int]:
    """Each plan position's slice of a unit of `numel` elements, as the runtime cuts it
    (models/runtime.shard_bounds: cumulative boundaries rounded half up, the last at numel)."""
    total, acc, start, out = float(sum(fractions)), 0.0, 0, []
    for i, f in enumerate(fractions):
        acc += f
        end = numel if i == len(fractions) - 1 else min(numel, math.floor(numel * acc / total + 0.5))
        out.append(end - start)
        start = end
    return out


def rows_exchange(spec: ModelSpec, zero: int, step: StepConfig, world: int) -> bool:
    """Whether the runtime sends the embedding unit's gradient as the step's rows
    (contracts.wire.token_rows_exchange at the step's tokens; zero 2/3 only)."""
    from contracts.wire import token_rows_exchange

    return zero >= 2 and step.step_tokens > 0 and token_rows_exchange(
        step.step_tokens, runtime_units(spec)[0].numel, spec.hidden, DTYPE_BYTES[step.reduce_dtype], world)


def step_wire_bytes(spec: ModelSpec, zero: int, step: StepConfig, fractions: Sequence[float], backend: str,
                    token_sizes: Sequence[int] | None = None) -> int:
    """Bytes one optimizer step puts on the network, every rank's sends together, at the shard
    fractions of the plan's positions: each collective contracts.units.step_collectives counts (zero
    1/2: every unit gathered and reduced once; zero 3: each block gathered twice; a tied embedding unit
    (held from its forward to the head's) reduced once more at zero 2 and 3), priced by contracts.wire as
    models/collectives.py runs it on `backend` ("gloo": its framing included; "nccl": ring payload)."""
    from contracts.wire import gather_send_bytes, reduce_scatter_send_bytes, token_rows_send_bytes

    k = len(fractions)
    if k <= 1:
        return 0
    units = runtime_units(spec)
    gathers: dict[int, int] = {}  # elements per call -> calls per step
    reduces: dict[int, int] = {}
    for i, u in enumerate(units):
        twice = zero == 3 and 0 < i < len(units) - 1  # a block: gathered for its forward and its backward
        gathers[u.numel] = gathers.get(u.numel, 0) + (2 if twice else 1)
        reduces[u.numel] = reduces.get(u.numel, 0) + 1
    if spec.tied_embeddings:  # the whole embedding unit again (gpt2: its positions too)
        tied = units[0].numel
        if zero >= 2:  # layer-wise steps reduce it after the head and again after the embedding
            reduces[tied] = reduces.get(tied, 0) + 1
    pbytes, rbytes = DTYPE_BYTES[step.param_dtype], DTYPE_BYTES[step.reduce_dtype]
    rows = 0
    if rows_exchange(spec, zero, step, k):  # the embedding's last reduce goes out as rows
        if token_sizes is None or len(token_sizes) != k or sum(token_sizes) != step.step_tokens:
            raise ValueError(f"the rows exchange needs every rank's tokens summing to {step.step_tokens}, "
                             f"got {token_sizes}")
        reduces[units[0].numel] -= 1
        rows = sum(token_rows_send_bytes(token_sizes, spec.hidden, rbytes, k, backend))
    total = rows + sum(calls * sum(gather_send_bytes(slice_sizes(numel, fractions), pbytes, k, backend))
                       for numel, calls in gathers.items() if numel)
    total += sum(calls * sum(reduce_scatter_send_bytes(slice_sizes(numel, fractions), rbytes, k, backend))
                 for numel, calls in reduces.items() if numel)
    return total


def build_device_coeffs(device: DeviceSpec, spec: ModelSpec, seq: int, dtype: str, recompute: str,
                        headroom: float, world_size: int, profiles_dir: str | None = None,
                        zero: int = RUNTIME_ZERO_STAGE, profile_cache: dict | None = None,
                        step: StepConfig = StepConfig()) -> DeviceCoeffs:
    """One device kind's coefficients from its step profiles (measured or estimated) and the memory
    model (at the plan's dtypes and prefetch, `step`). `profile_cache` shares the profile look-ups
    between the stages of one solve."""
    from planner.core.profiles import get_step_profile

    cache = {} if profile_cache is None else profile_cache

    def profile(rec: str):
        key = (device.profile_key, dt, rec)  # a CPU-quota device is its own kind, profiled under its quota
        if key not in cache:
            cache[key] = get_step_profile(device.profile_key, spec, seq, dt, recompute=rec, store_dir=profiles_dir)
        return cache[key]

    dt = device_dtype(device.type, dtype)
    prof = profile(recompute)
    layerwise = zero >= 2
    full = profile("full") if layerwise else None
    memory_fn, phases_fn = runtime_memory_fns(spec, seq, dt, recompute, world_size, zero, device.type, step)
    return DeviceCoeffs(
        device=device, dtype=dt,
        alpha_s=prof.alpha_s * device.slowdown,
        beta_s=prof.beta_s * device.slowdown,
        optimizer_s=prof.optimizer_s_per_param * spec.num_params * device.slowdown,
        capacity_bytes=device.memory_bytes * headroom,
        memory_fn=memory_fn, phases_fn=phases_fn,
        measured=bool(prof.measured), recompute_measured=bool(full is None or full.measured), source=prof.source,
        layerwise=layerwise,
        recompute_alpha_s=full.alpha_s * device.slowdown if full else None,
        recompute_beta_s=full.beta_s * device.slowdown if full else None,
    )


def step_issue_figures(prof: "CollectiveProfile", latency_s: float) -> tuple[float, float, str]:
    """(latency of one call, overlap_exposed_share, a note) from what the profiling path measured of
    the collectives issued as a step issues them (planner.costmodel.collectives.BESIDE_COMPUTE,
    ASYNC_BESIDE_COMPUTE): a call after a burst of compute pays the ranks' skew and their wake-up,
    which ops timed one after another do not; an async gather beside compute may slow the compute by
    most of its own time. `latency_s` and a share of 0 where the profile has neither (older profiles)."""
    beside, both = prof.fit(BESIDE_COMPUTE), prof.fit(ASYNC_BESIDE_COMPUTE)
    share = 0.0
    if both is not None and len(both.times_s) == 3 and both.times_s[1] > 0:
        share = exposed_share(*both.times_s)
    if beside is not None:
        latency_s = max(beside.latency_s, 0.0)
    if beside is None and both is None:
        return latency_s, share, ""
    return latency_s, share, (f"; as a step issues them: {latency_s * 1e3:.2f} ms a call, "
                              f"{share:.0%} of an async one not hidden by compute")


def build_comm_model(devices: Iterable[DeviceSpec], multi_node: bool, cluster: ClusterSpec, spec: ModelSpec,
                     zero: int, dtype: str, profiles_dir: str | None = None,
                     step: StepConfig | None = None, interleaved: bool = True) -> CommModel:
    """Link figures for a scope and the bytes the runtime moves at `zero` (contracts.units), gathers
    in `step.param_dtype` and reduce-scatters in `step.reduce_dtype` (default: `auto` resolved for
    these devices, fp32 reduces), and what no compute hides (`step_overlap`): measured gloo/NCCL
    fits for local CPU workers on one node when `profiler bench` has them, else the cluster file's
    bandwidth (slowest link among the devices). `interleaved` (the sharded runtime's step: each
    collective waited between bursts of compute): CPU ranks' calls are priced at the probe's per-call
    latency and overlap share where the profile has them (`step_issue_figures`); False prices calls
    issued back to back (a pipeline stage's syncs after its last backward) at the benchmark's fit."""
    devices = list(devices)
    if step is None:
        step = StepConfig(resolve_param_dtype(PARAM_DTYPE_AUTO, zero, dtype, (d.type for d in devices)))
    collectives = step_collectives(spec, zero)
    pbytes, rbytes = DTYPE_BYTES[step.param_dtype], DTYPE_BYTES[step.reduce_dtype]
    gather_bytes = float(collectives.gather_numel * pbytes)
    reduce_bytes = float(collectives.reduce_numel * rbytes)
    calls = collectives.num_calls
    hidden = step_overlap(spec, zero, step.prefetch, step.reduce_in_flight)
    exposed = {} if hidden is None else {"exposed_gather_bytes": hidden[0] * pbytes,
                                         "exposed_reduce_bytes": hidden[1] * rbytes, "exposed_calls": hidden[2]}
    # the embedding's last reduce-scatter sent as the step's rows instead (two all-gathers, priced as
    # the gathers are; the rule holds for any world of 2 or more, and one rank sends nothing anyway)
    if rows_exchange(spec, zero, step, 2):
        rows_bytes = float(step.step_tokens * (TOKEN_ID_BYTES + spec.hidden * rbytes))
        table_bytes = float(runtime_units(spec)[0].numel * rbytes)
        gather_bytes, reduce_bytes, calls = gather_bytes + rows_bytes, reduce_bytes - table_bytes, calls + 1
        if exposed:  # the last reduce is exposed in every mode: the rows take its place
            exposed = {"exposed_gather_bytes": exposed["exposed_gather_bytes"] + rows_bytes,
                       "exposed_reduce_bytes": exposed["exposed_reduce_bytes"] - table_bytes,
                       "exposed_calls": exposed["exposed_calls"] + 1}
    types = {d.type for d in devices}
    if not multi_node and types == {CPU_TYPE}:
        from planner.core.profiles import collective_set_key, get_collective_profile

        # measured between these very kinds (emulated CPU shares, each rank under its quota, as the
        # Plan page's "Profile now" measures them), else between plain CPU ranks (`profiler bench`)
        kinds = collective_set_key(d.profile_key for d in devices)
        prof = (get_collective_profile(kinds, profiles_dir) if kinds != CPU_TYPE else None) or \
            get_collective_profile(CPU_TYPE, profiles_dir)
        gather = prof.fit("all_gather") if prof else None
        reduce = prof.fit("all_reduce") if prof else None
        if (gather is not None and reduce is not None and gather.bandwidth_bytes_per_s > 0
                and reduce.bandwidth_bytes_per_s > 0 and prof.world_size > 1):
            w = prof.world_size
            # the fits' bandwidths are size/time (algorithm bandwidth); per rank a ring all-gather moves
            # (w−1)/w of the size, an all-reduce 2(w−1)/w. profiler bench times no reduce-scatter: it is
            # priced as half an all-reduce (a ring all-reduce is a reduce-scatter and an all-gather)
            gather_bus = gather.bandwidth_bytes_per_s * (w - 1) / w
            reduce_bus = reduce.bandwidth_bytes_per_s * 2 * (w - 1) / w
            latency = max(gather.latency_s, 0.0)
            how = f"{w} ranks" + (f" of {prof.device_type}, each under its CPU quota" if PROFILE_KEY_SHARE in prof.device_type else "")
            latency, share, as_run = step_issue_figures(prof, latency) if interleaved else (latency, 0.0, "")
            return CommModel(gather_bus, 0.0, gather_bytes, reduce_bytes, calls,
                             f"measured {prof.backend} collectives, {how}{as_run}", reduce_bus, latency, **exposed,
                             overlap_exposed_share=share, stats_calls=STATS_CALLS if as_run else 0)
    net = cluster.network
    gbps = min(net.intra_node_gbps, net.inter_node_gbps) if multi_node else net.intra_node_gbps
    hop = INTER_NODE_HOP_LATENCY_S if multi_node else INTRA_NODE_HOP_LATENCY_S
    where = "inter_node_gbps" if multi_node else "intra_node_gbps"
    return CommModel(bytes_per_s(gbps), hop, gather_bytes, reduce_bytes, calls,
                     f"cluster file {where} {gbps:g}", **exposed)


# ---- the cost model of one (cluster, model, seq, dtype) ----------------------------------------


class CostModel:
    """Per-device costs for one cluster and training setup; evaluates plans and builds ILP tables."""

    def __init__(self, cluster: ClusterSpec, num_params: int, coeffs: dict[DeviceSpec, DeviceCoeffs],
                 comm_for: Callable[[Sequence[DeviceSpec], bool], CommModel], zero: int = RUNTIME_ZERO_STAGE,
                 share_step: float = 0.0, step: StepConfig = StepConfig(), spec: ModelSpec | None = None,
                 seq: int | None = None):
        self.cluster = cluster
        self.seq = seq  # each rank's tokens per step, micro-batch x micro-batches x seq (the rows exchange's)
        self.spec = spec  # for the wire bytes of a plan's own shards (None: the ring's, CommModel.wire_bytes)
        self.num_params = num_params
        # the room curve's own roughness: each unit's slice is a whole number of parameters (rounded),
        # which moves memory by up to half a parameter's state per unit, about (units / P) of the
        # state in all (the bands' affinity test allows twice that)
        self.affine_tol = max(AFFINE_TOL, 2.0 * share_step)
        self.coeffs = coeffs
        self.zero = validate_zero(zero)
        check_step_dtypes(self.zero, step.param_dtype, step.reduce_dtype, step.prefetch, what="cost model",
                          reduce_in_flight=step.reduce_in_flight)
        self.step = step  # the runtime's dtypes, prefetch depth and reduces in flight the tables are priced at
        self._comm_for = comm_for
        self._comm_cache: dict[tuple[frozenset, bool], CommModel] = {}
        self._share_cache: dict[tuple[DeviceSpec, int, int], float] = {}

    @classmethod
    def build(cls, cluster: ClusterSpec, spec: ModelSpec, seq: int, dtype: str, recompute: str,
              headroom: float, profiles_dir: str | None = None, zero: int = RUNTIME_ZERO_STAGE,
              profile_cache: dict | None = None, param_dtype: str = PARAM_DTYPE_AUTO, reduce_dtype: str = "fp32",
              prefetch: int = DEFAULT_PREFETCH, reduce_in_flight: int = 0, step_tokens: int = 0) -> "CostModel":
        """The cost model of `spec` on `cluster` at ZeRO stage `zero`, the runtime gathering in
        `param_dtype` (`auto`: resolve_param_dtype over the cluster's devices), reducing in
        `reduce_dtype`, `prefetch` units ahead, `reduce_in_flight` reduce-scatters left in flight,
        `step_tokens` tokens a step over every rank (global batch x seq; 0: the embedding's gradient
        priced as the table, never as rows). ValueError on a combination the runtime refuses."""
        validate_zero(zero)
        kinds = sorted({d for _, d in cluster.devices()}, key=lambda d: (d.type, d.slowdown, d.memory_gb or 0))
        step = StepConfig(resolve_param_dtype(param_dtype, zero, dtype, (d.type for d in kinds)), reduce_dtype,
                          prefetch, reduce_in_flight, step_tokens)
        check_step_dtypes(zero, step.param_dtype, step.reduce_dtype, step.prefetch, what="cost model",
                          reduce_in_flight=step.reduce_in_flight)
        coeffs = {d: build_device_coeffs(d, spec, seq, dtype, recompute, headroom, cluster.num_devices, profiles_dir,
                                         zero, profile_cache, step)
                  for d in kinds}

        def comm_for(devices: Sequence[DeviceSpec], multi_node: bool) -> CommModel:
            return build_comm_model(devices, multi_node, cluster, spec, zero, dtype, profiles_dir, step)

        return cls(cluster, spec.num_params, coeffs, comm_for, zero,
                   share_step=len(runtime_units(spec)) / spec.num_params, step=step, spec=spec, seq=seq)

    def comm_model(self, devices: Iterable[DeviceSpec], multi_node: bool) -> CommModel:
        key = (frozenset(devices), multi_node)
        if key not in self._comm_cache:
            self._comm_cache[key] = self._comm_for(sorted(key[0], key=lambda d: d.type), multi_node)
        return self._comm_cache[key]

    def _used_comm(self, per_device: Sequence[tuple[int, int, float]]) -> tuple[list[int], CommModel]:
        devices = self.cluster.devices()
        used = [i for i, (m, n, f) in enumerate(per_device) if m * n > 0 or f > 0]
        if not used:
            raise ValueError("a plan must use at least one device")
        nodes = {devices[i][0].name for i in used}
        return used, self.comm_model({devices[i][1] for i in used}, len(nodes) > 1)

    def estimate_iteration_s(self, per_device: Sequence[tuple[int, int, float]]) -> tuple[float, list[float]]:
        """Predicted iteration time of `(micro_batch, accum_steps, shard_fraction)` per device of
        the cluster (ClusterSpec.devices() order), and each used device's own work in a step (0 if
        unused): StepComm.end_s(its compute) plus its optimizer on its shard.

        The iteration is the max-plus chain the sharded runtime runs (docs/models/cost.md, "The
        step's structure"): every rank's compute and collectives, a barrier (the all-reduce of the
        gradient norm), every rank's optimizer on its shard, a barrier again (the next step's first
        gather needs every owner's update): max_i end_s(compute_i) + max_i optimizer_i·f_i, not
        max_i (end_s + optimizer·f). The iteration minus a device's own work is its wait at the
        two barriers."""
        devices = self.cluster.devices()
        used, comm = self._used_comm(per_device)
        step = comm.step(len(used))
        steps = [0.0] * len(devices)
        end_s = optimizer_s = 0.0
        for i in used:
            m, n, f = per_device[i]
            c = self.coeffs[devices[i][1]]
            end_i, opt_i = step.end_s(c.compute_s(m, n)), c.optimizer_s * f
            steps[i] = end_i + opt_i
            end_s, optimizer_s = max(end_s, end_i), max(optimizer_s, opt_i)
        return end_s + optimizer_s, steps

    def estimate_comm(self, per_device: Sequence[tuple[int, int, float]]) -> tuple[int, float]:
        """(bytes the step puts on the network, every rank together; the communication the slowest
        rank waits for, s): the plan file's predicted_wire_bytes_per_step and predicted_exposed_comm_s.
        The slowest rank is the one whose compute and collectives end last (it sets the barrier
        before the optimizer; ties: the most work in all), so its exposed communication is on the
        iteration's critical path."""
        devices = self.cluster.devices()
        used, comm = self._used_comm(per_device)
        step = comm.step(len(used))
        _, steps = self.estimate_iteration_s(per_device)
        computes = {i: self.coeffs[devices[i][1]].compute_s(*per_device[i][:2]) for i in used}
        slowest = max(used, key=lambda i: (step.end_s(computes[i]), steps[i]))
        exposed_s = step.exposed_of_s(computes[slowest])
        if self.spec is None:
            return comm.wire_bytes(len(used)), exposed_s
        backend = "gloo" if any(devices[i][1].type == CPU_TYPE for i in used) else "nccl"
        fractions = [per_device[i][2] for i in used]
        if sum(fractions) <= 0:
            fractions = [1.0] * len(used)
        tokens = [per_device[i][0] * per_device[i][1] * self.seq for i in used] if self.seq else None
        return step_wire_bytes(self.spec, self.zero, self.step, fractions, backend, tokens), exposed_s

    def estimate_memory_bytes(self, device: DeviceSpec, micro_batch: int, accum_steps: int,
                              shard_fraction: float) -> float:
        return self.coeffs[device].memory_bytes(micro_batch, accum_steps, shard_fraction)

    def max_share(self, device: DeviceSpec, micro_batch: int, accum_steps: int) -> float:
        """DeviceCoeffs.max_share, cached per (device, m, n)."""
        c = self.coeffs[device]
        key = (device, micro_batch, c.memory_accum_steps(accum_steps))
        if key not in self._share_cache:
            self._share_cache[key] = c.max_share(micro_batch, accum_steps)
        return self._share_cache[key]

    # ---- coefficient tables -------------------------------------------------------------------

    def micro_batch_candidates(self, global_batch: int, micro_batches: Sequence[int] | None) -> list[int]:
        """Powers of two up to the global batch and MAX_MICRO_BATCH, or the caller's."""
        ms = sorted(set(micro_batches)) if micro_batches else [
            1 << i for i in range(min(global_batch, MAX_MICRO_BATCH).bit_length())]
        return [m for m in ms if 0 < m <= global_batch]

    def choices(self, device: DeviceSpec, global_batch: int, micro_batches: Sequence[int] | None = None,
                max_compute_s: float = math.inf) -> tuple[Choice, ...]:
        """The state-only choice, then every (m, n) with m from `micro_batch_candidates` whose memory
        at f = 0 fits, n from 1 to DENSE_ACCUM_STEPS while m·n ≤ the global batch, the memory still
        fits (at zero ≥ 2 it grows with n from n = 2 on: the first such n that does not fit ends the
        run) and the compute time stays within `max_compute_s` (an upper bound on the optimum: a
        slower device would only finish later). Larger n: `bands`."""
        c = self.coeffs[device]
        out = []
        for m in [0] + self.micro_batch_candidates(global_batch, micro_batches):
            for n in ([0] if m == 0 else range(1, min(global_batch // m, DENSE_ACCUM_STEPS) + 1)):
                if c.compute_s(m, n) > max_compute_s:
                    break
                max_share = self.max_share(device, m, n)
                if max_share < 0:
                    # layer-wise accumulation keeps only unit boundaries once n > 1: n = 2 may fit where
                    # n = 1 (every activation of the micro-batch kept) does not; from n = 2 on memory grows with n
                    if n == 1 and c.layerwise:
                        continue
                    break
                out.append(make_choice(c, m, n, max_share))
        return tuple(out)

    def bands(self, device: DeviceSpec, global_batch: int, micro_batches: Sequence[int] | None = None,
              max_compute_s: float = math.inf) -> tuple[AccumBand, ...]:
        """Accumulation counts above DENSE_ACCUM_STEPS, per micro-batch, up to min(B/m, the compute
        bound) and the largest n whose memory fits (memory is non-decreasing in n: found by
        bisection), cut into pieces over which the room is affine in n (`_affine_pieces`)."""
        c = self.coeffs[device]
        out = []
        for m in self.micro_batch_candidates(global_batch, micro_batches):
            step_s = c.compute_s(m, 2) / 2  # n > 1: the per-micro-batch time of a long accumulation
            top = global_batch // m
            if step_s > 0 and math.isfinite(max_compute_s):
                top = min(top, int(max_compute_s / step_s))
            lo = DENSE_ACCUM_STEPS + 1
            if top < lo or not c.fits(m, lo, 0.0):
                continue
            top = last_fitting(c, m, 0.0, lo, top)  # the largest n that fits at all
            # the room is capped at the whole state (1) up to some n: that plateau is one band, found
            # directly, so the cap's kink costs no cascade of cuts
            whole = last_fitting(c, m, 1.0, lo, top) if c.fits(m, lo, 1.0) else lo - 1
            if whole >= lo:
                out.append(AccumBand(m, lo, whole, step_s, 1.0, 1.0))
            if whole < top:
                for a, b in self._affine_pieces(device, m, whole + 1, top):
                    out.append(AccumBand(m, a, b, step_s, self.max_share(device, m, a), self.max_share(device, m, b),
                                     2 * self.affine_tol))
        return tuple(out)

    def offered(self, device: DeviceSpec, global_batch: int, micro_batches: Sequence[int] | None = None,
                max_compute_s: float = math.inf) -> set[tuple[int, int]]:
        """Every (m, n) with m·n > 0 the ILP may give `device`: its choices and every count of its
        bands (for tests and explanations: a band of a large batch holds millions of counts)."""
        out = {(c.micro_batch, c.accum_steps) for c in self.choices(device, global_batch, micro_batches,
                                                                    max_compute_s) if c.batch}
        for b in self.bands(device, global_batch, micro_batches, max_compute_s):
            out.update((b.micro_batch, n) for n in range(b.lo, b.hi + 1))
        return out

    def _affine_pieces(self, device: DeviceSpec, m: int, lo: int, hi: int) -> list[tuple[int, int]]:
        """[lo, hi] cut into ranges of n over which max_share(m, n) is affine (AFFINE_TOL): a range
        whose midpoint lies off its chord is cut there. The room is concave in n, so a range within
        the tolerance at its midpoint is within twice it everywhere; cuts happen only around the
        few kinks of the curve (where the memory peak moves to another moment of the step)."""
        out, todo = [], [(lo, hi)]
        while todo:
            a, b = todo.pop()
            if b - a <= 1:
                out.append((a, b))
                continue
            mid = (a + b) // 2
            ra, rb, rm = self.max_share(device, m, a), self.max_share(device, m, b), self.max_share(device, m, mid)
            if abs(rm - (ra + (rb - ra) * (mid - a) / (b - a))) <= self.affine_tol:
                out.append((a, b))
            else:
                todo += [(mid, b), (a, mid - 1)] if mid > a else [(a + 1, b), (a, a)]
        return sorted(out)

    def scopes(self) -> list[tuple[str, bool, list[tuple[NodeSpec, list[int]]]]]:
        """The device sets a plan's link bandwidth depends on: all nodes (when there are several),
        then each node on its own; nodes of identical composition are one scope."""
        by_node: dict[str, list[int]] = {}
        for i, (n, _) in enumerate(self.cluster.devices()):
            by_node.setdefault(n.name, []).append(i)
        out = []
        nodes = self.cluster.nodes
        if len(nodes) > 1:
            out.append(("all nodes", True, [(n, by_node[n.name]) for n in nodes]))
        seen = set()
        for n in nodes:
            comp = tuple(sorted((d.profile_key, d.slowdown, d.memory_gb or 0.0) for d in n.devices))
            if comp in seen:
                continue
            seen.add(comp)
            out.append((f"node {n.name}", False, [(n, by_node[n.name])]))
        return out

    def scope_table(self, name: str, multi_node: bool, members: Sequence[int], global_batch: int,
                    micro_batches: Sequence[int] | None = None, max_compute_s: float = math.inf) -> ScopeTable:
        devices = self.cluster.devices()
        by_kind: dict[DeviceSpec, list[int]] = {}
        for i in sorted(members):
            by_kind.setdefault(devices[i][1], []).append(i)
        classes = tuple(
            ClassTable(d, tuple(ix), self.coeffs[d], self.choices(d, global_batch, micro_batches, max_compute_s),
                       self.bands(d, global_batch, micro_batches, max_compute_s))
            for d, ix in by_kind.items())
        return ScopeTable(name, multi_node, classes, self.comm_model(by_kind, multi_node))


# ---- tensor parallelism: the TP group's all-reduces (models/tensor.py) ------------------------------------
@dataclass(frozen=True)
class TensorParallelComm:
    """The all-reduces one micro-batch issues inside a TP group (Megatron: 2 of (b, s, h) per block in
    forward, 2 in backward), as models/tensor.py issues them: `calls` = ((buffer_bytes, count), ...).
    They run on the critical path (each waits before the next matmul), so none is hidden."""

    calls: tuple[tuple[int, int], ...]

    @property
    def num_calls(self) -> int:
        return sum(n for _, n in self.calls)

    @property
    def buffer_bytes(self) -> int:
        """Bytes all-reduced per micro-batch (the buffers, before the ring's 2·(t−1)/t)."""
        return sum(b * n for b, n in self.calls)

    def comm_s(self, tp: int, link: Link) -> float:
        """Seconds of the micro-batch's all-reduces on a TP group of `tp` ranks (ring, collectives.py)."""
        return sum(n * all_reduce_s(b, tp, link) for b, n in self.calls)


def estimate_tp_comm(spec: ModelSpec, micro_batch: int, seq: int, dtype: str = "fp32",
                     recompute: str = "none") -> TensorParallelComm:
    """The TP all-reduces of one micro-batch of `micro_batch` rows through the whole model (a pipeline
    stage: scale the per-block part by its share of the layers). N = b·s tokens, h hidden, w the compute
    dtype's bytes (autocast: the row-parallel matmuls' outputs are w-byte; the input gradients, of fp32
    norm outputs, and the embedding's fp32 lookups are 4-byte):
      forward: 2 per block (o_proj, down_proj: g) of N·h·w, the vocabulary-parallel embedding's N·h·4;
      backward: 2 per block (f at the attention's and the MLP's input) of N·h·4, the head's f of N·h·4;
      recompute "full": each block's forward again in its backward (2 more per block);
      the cross-entropy's statistics: the row max (N fp32) and the target logit with the sum of
      exponentials (2·N fp32)."""
    N, h, L = micro_batch * seq, spec.hidden, spec.num_layers
    w = DTYPE_BYTES[dtype] if dtype in DTYPE_BYTES else FP32_BYTES
    forwards = 2 * L * (2 if recompute == "full" else 1)
    calls = ((N * h * w, forwards), (N * h * FP32_BYTES, 2 * L + 2), (N * FP32_BYTES, 1), (2 * N * FP32_BYTES, 1))
    return TensorParallelComm(tuple(c for c in calls if c[1]))
