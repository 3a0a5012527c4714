"""Cephalo's heterogeneous plan as an ILP: per device a (micro-batch, accumulation steps), a share of
the sharded training state, or nothing; no device over its memory; the shortest iteration.

The cost model (planner/costmodel/training.py) builds the coefficient tables; this module only
consumes them. Devices are counted per class, so the ILP grows with types × choices, not devices.
A step is T1 + T2 (every rank's compute and collectives, then every rank's optimizer). For a fixed
optimizer budget T2 and compute end T1 the problem is linear (each share capped by memory and by
T2/opt), so per budget the least T1 is found by bisection, each probe asking its LP relaxation (a
weak-duality proof) before CBC and a greedy plan before either, and the budgets are walked down from
the largest useful one; world sizes are searched by branch and bound over ranges priced at their
cheapest collectives; `solve_plan(zero="auto")` tries ZeRO 1, 2, 3 in order.
The search starts from the best baseline (planner/hetero/baselines.py) as its incumbent.

The formulation, the band rows, the bounds and why each is valid: docs/models/ilp.md.
"""
from __future__ import annotations

import itertools
import logging
import math
import os
import shlex
import tempfile
import time
from dataclasses import dataclass, replace
from typing import Callable, Sequence

import pulp

from contracts.catalog import GIB, get_gpu_type
from contracts.cluster import ClusterSpec
from planner.costmodel.training import (DENSE_ACCUM_STEPS, AccumBand, Choice, ClassTable, CostModel, ScopeTable,
                                       PARAM_DTYPE_AUTO, StepComm, StepConfig, last_fitting, validate_zero)
from contracts.plan import REDUCE_DTYPES, Assignment, Plan, ZeroCandidate
from planner.hetero.baselines import baseline_plans, estimate_baselines, estimate_memory_aware
from contracts.specs import get_model, with_max_seq
from contracts.constants import DTYPES, MEMORY_HEADROOM, RECOMPUTE, ZERO_STAGES

log = logging.getLogger(__name__)

ZERO_AUTO = "auto"  # solve each stage, keep the fastest that fits (ties: the lower stage)
ZERO_CHOICES = (ZERO_AUTO, *ZERO_STAGES)
# Default context when --seq is not given: the model's own, capped where activations of one
# sample would already crowd a 24 GB part for the 7B-class presets (Cephalo trains at 2,048).
DEFAULT_MAX_SEQ = 2048
# Shares below this are solver round-off, not a slice worth a rank's optimizer call.
SHARE_EPS = 1e-9
# "optimal" means within this relative distance of the proven lower bound (unless the caller
# gives another `gap`): 0.01 %, the default relative MIP gap of Gurobi and CPLEX, far below the noise of
# any measured step time. A tighter one buys nothing measurable and costs the world-size search
# many more ranges (comm(k) differs by ~A/k² between neighbouring k: bench/planner_scaling.py).
BISECTION_TOL = 1e-4
# Bisection steps of the water-filling that prices one configuration's shares (2^-60: exact in float).
WATER_FILL_STEPS = 60
# closing a bisection's interval, a probe at hi − NEAR_HI_STEP·(hi − lo): the incumbent is usually
# optimal already, so probes near hi are infeasible and each cuts the interval to a tenth
NEAR_HI_STEP = 0.1
# galloping up from a bucket's lower bound (solve_bucket), first by the LP relaxation, then by CBC:
# probes at lo·(1 + tol·RELAX_GALLOP^i)
RELAX_GALLOP = 16.0
# the relaxation's bisection stops within RELAX_WITHIN·tol of the least t it admits, where CBC starts
RELAX_WITHIN = 0.5
# the prefetch depths the ILP may give zero 3 (units gathered ahead: depth k holds k + 1 gathered units)
PREFETCH_DEPTHS = (0, 1, 2)
# the deepest prefetch the time model tells apart from a shallower one: it prices the step's
# collectives against the step's compute in total (docs/models/cost.md, "Overlap"), so any depth ≥ 1
# hides the same; a deeper one only costs memory and is not offered
OVERLAP_DEPTH = 1
PARAM_DTYPE_CHOICES = (PARAM_DTYPE_AUTO, *DTYPES)
# world-size ranges a scope's bound before its table may look at (its ranges split while they could
# still beat the incumbent): a few dozen cost no memory evaluation, the table thousands
PRE_TABLE_RANGES = 16
# optimizer budgets one scope's search may try (solve_scope); each is a whole search over world sizes.
# Past it the answer is a plan, not proven optimal (a walk this long has not been seen)
MAX_BUDGET_SOLVES = 32


@dataclass(frozen=True)
class HeteroResult:
    status: str  # "optimal" | "feasible" (time limit reached before the bisection closed)
    objective_s: float  # the least iteration time found (= plan.predicted_iteration_s up to bucket pricing)
    plan: Plan | None
    solve_time_s: float
    reason: str = ""


@dataclass(frozen=True)
class ScopeSolution:
    status: str
    objective_s: float
    per_device: dict[int, tuple[int, int, float]]  # device index -> (m, n, share)


# a configuration: (class index, choice, number of devices on it)
Config = list[tuple[int, Choice, int]]


def validate_inputs(global_batch: int, seq: int | None, dtype: str, recompute: str, headroom: float,
                    time_limit_s: float, gap: float) -> None:
    if isinstance(global_batch, bool) or not isinstance(global_batch, int) or global_batch < 1:
        raise ValueError(f"global batch must be a positive integer, got {global_batch!r}")
    if seq is not None and (isinstance(seq, bool) or not isinstance(seq, int) or seq < 1):
        raise ValueError(f"seq must be a positive integer, got {seq!r}")
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    if recompute not in RECOMPUTE:
        raise ValueError(f"recompute must be one of {', '.join(RECOMPUTE)}, got {recompute!r}")
    if isinstance(headroom, bool) or not isinstance(headroom, (int, float)) or not 0 < headroom <= 1:
        raise ValueError(f"headroom must be in (0, 1], got {headroom!r}")
    if not (isinstance(time_limit_s, (int, float)) and time_limit_s > 0):
        raise ValueError(f"time limit must be positive, got {time_limit_s!r}")
    if not (isinstance(gap, (int, float)) and 0 <= gap < 1):
        raise ValueError(f"gap must be in [0, 1), got {gap!r}")


class ProbeTimeout(Exception):
    """CBC ran out of time before it proved a probe feasible or infeasible."""


class SolverLimit(ValueError):
    """A solver budget (wall time, memory, problem size) ran out before any plan was found."""


# two share caps within this relative distance are a tie (float noise of equal step times)
CAP_TIE_REL = 1e-9
# Budgets of one CBC process: a wall limit enforced from outside (coreutils `timeout` kills it:
# CBC's own -sec was not honoured on big models) and an address-space limit (ulimit -v).
CBC_MEMORY_BYTES = 2 * GIB
CBC_GRACE_S = 0.5  # beyond the probe's share of the time limit, for CBC to start and write its answer
# Refused up front: a probe with more integer variables than this (the bands keep real ones in the
# hundreds; this only stops a caller's micro-batch list from building an unbounded problem).
MAX_PROBE_VARIABLES = 20_000


@dataclass(frozen=True)
class StepBudget(StepComm):
    """A step's collectives (StepComm) and the optimizer budget T2 a probe allows: every device's
    optimizer on its shard ends within `optimizer_budget_s` of the barrier after the collectives."""

    optimizer_budget_s: float = math.inf


def with_budget(comm: StepComm, budget_s: float) -> StepBudget:
    return StepBudget(comm.exposed_s, comm.hidden_s, budget_s)


def optimizer_cap(max_share: float, opt_s: float, budget_s: float) -> float:
    """The most state a device may hold: its memory's max_share and, where its optimizer takes
    time, budget_s/opt (its optimizer on the shard within the budget)."""
    return max_share if opt_s <= 0 else min(max_share, budget_s / opt_s)


def share_cap(cls: ClassTable, ch: Choice, t_s: float, comm: StepBudget) -> float:
    """The most state one device of `cls` on choice ch can hold in a step whose compute and
    collectives end by t_s (T1) and whose optimizer takes comm.optimizer_budget_s (T2):
    min(max_share, T2/opt); negative when the choice's compute and collectives end after t_s."""
    if comm.end_s(ch.compute_s) - t_s > 1e-12 * abs(t_s):  # beyond float round-off
        return -1.0
    return optimizer_cap(ch.max_share, cls.coeffs.optimizer_s, comm.optimizer_budget_s)


class BoundedCBC(pulp.PULP_CBC_CMD):
    """PuLP's bundled CBC run under a wall limit and a memory limit it cannot ignore: the executable
    PuLP starts is a two-line wrapper, `ulimit -v` then `exec timeout -s KILL <s> cbc ...`, so the
    kernel ends CBC at the limit even if this process dies first (no orphan outlives it)."""

    def __init__(self, wall_s: float, memory_bytes: int = CBC_MEMORY_BYTES, threads: int | None = None):
        # presolve and CGL preprocessing off: on these small probes they cost more than they save
        # (several times the solve time with presolve on large batches); the answers are the same
        super().__init__(msg=False, timeLimit=max(wall_s, 0.01), threads=threads, presolve=False,
                         options=["preprocess off"])
        self.wall_s, self.memory_bytes = wall_s, memory_bytes

    def actualSolve(self, lp, **kwargs):
        real = self.path
        fd, wrapper = tempfile.mkstemp(prefix="gpumix_cbc_", suffix=".sh")
        with os.fdopen(fd, "w") as f:
            f.write(f"#!/bin/sh\nulimit -v {self.memory_bytes // 1024}\n"
                    f"exec timeout -s KILL {self.wall_s + CBC_GRACE_S:.3f} {shlex.quote(real)} \"$@\"\n")
        os.chmod(wrapper, 0o700)
        self.path = wrapper
        try:
            return super().actualSolve(lp, **kwargs)
        except pulp.PulpSolverError as e:
            raise ProbeTimeout(f"CBC was stopped at its wall limit of {self.wall_s:.3g} s or its memory limit of "
                               f"{self.memory_bytes / GIB:g} GiB") from e
        finally:
            self.path = real
            os.unlink(wrapper)


def band_rows(band: AccumBand, opt_s: float, budget_s: float, n_top: int) -> list[tuple[float, float]]:
    """Rows (a, s) with F ≤ a·x + s·N that say exactly how much state x devices of a band can hold
    with N accumulation steps in total when each device's optimizer must end within budget_s (T2;
    the counts' compute is bounded by n_top): one row per line of the concave ℓ̂ (the memory room,
    the flat optimizer room budget/opt, the chord wherever the two cross between whole counts). Why
    these rows are exact: docs/models/ilp.md ("Accumulation bands")."""
    a1, s1 = band.room_line()
    lines = [(a1, s1)]
    if opt_s <= 0 or math.isinf(budget_s):  # no optimizer time, or none asked of it: only memory bounds the share
        return lines
    # the optimizer room budget/opt: flat in n (the optimizer runs after every rank's compute)
    lines.append((budget_s / opt_s, 0.0))
    rows = list(lines)

    def envelope(n: int) -> float:
        return min(a + s * n for a, s in lines)

    for i, (ai, si) in enumerate(lines):
        for aj, sj in lines[i + 1:]:
            if si == sj:
                continue
            j = math.floor((aj - ai) / (si - sj))  # the lines cross in [j, j + 1]
            if band.lo <= j < n_top:
                v0, v1 = envelope(j), envelope(j + 1)
                chord = (v0 - (v1 - v0) * j, v1 - v0)
                if chord not in rows:
                    rows.append(chord)
    return rows


@dataclass(frozen=True)
class _ChoiceVar:
    """A choice the probe offers class g at t_s: its room for the state per device, and how many may take it."""
    g: int
    c: int
    choice: Choice
    cap: float
    ub: int


@dataclass(frozen=True)
class _BandVar:
    """A band the probe offers class g at t_s: counts lo..n_top, the rows bounding its state (band_rows)."""
    g: int
    b: int
    band: AccumBand
    n_top: int
    ub: int
    rows: list[tuple[float, float]]


def probe_entries(table: ScopeTable, global_batch: int, comm: StepBudget, t_s: float) -> list[_ChoiceVar | _BandVar]:
    """What the probe at t_s (T1; the budget T2 in comm) may give each class: the choices whose
    compute and collectives end by t_s (per batch the roomiest) and the bands' counts that do."""
    out: list[_ChoiceVar | _BandVar] = []
    for g, cls in enumerate(table.classes):
        # at a fixed t_s two choices of one batch differ only in their share room: keep the roomiest
        best_of_batch: dict[int, tuple[float, int]] = {}
        for c, ch in enumerate(cls.choices):
            cap = share_cap(cls, ch, t_s, comm)
            if cap < 0 or (ch.batch == 0 and cap <= 0):
                continue  # too slow for t_s, or a state-only device that could hold nothing
            best = best_of_batch.get(ch.batch)
            # on a tie (a profile with α = 0 prices m=1 × n=4 like m=4 × n=1) take the larger
            # micro-batch: every accumulation step has fixed costs the profile may not resolve
            if best is None or cap > best[0] * (1 + CAP_TIE_REL) or (
                    cap >= best[0] * (1 - CAP_TIE_REL) and ch.micro_batch > cls.choices[best[1]].micro_batch):
                best_of_batch[ch.batch] = (cap, c)
        for batch, (cap, c) in sorted(best_of_batch.items()):
            ch = cls.choices[c]
            ub = cls.count if ch.batch == 0 else min(cls.count, global_batch // ch.batch)
            if ub >= 1:
                out.append(_ChoiceVar(g, c, ch, cap, ub))
        for b, band in enumerate(cls.bands):
            room_s = comm.compute_room_s(t_s)
            if room_s < 0:
                break  # the collectives alone end after t_s
            # the most steps one device may take by t_s (a device at n needs n·step ≤ t − exposed)
            n_top = min(band.hi, int(room_s / band.step_s) if band.step_s > 0 else band.hi)
            if n_top < band.lo:
                continue
            ub = min(cls.count, global_batch // (band.micro_batch * band.lo))
            if ub >= 1:
                out.append(_BandVar(g, b, band, n_top, ub,
                                    band_rows(band, cls.coeffs.optimizer_s, comm.optimizer_budget_s, n_top)))
    return out


# the relaxation proves a probe infeasible only when the most state it can hold falls this far short
# of the whole (CBC's own feasibility tolerance is ~1e-7: nearer than this, CBC decides)
RELAXATION_MARGIN = 1e-6


def _rays(entry: _ChoiceVar | _BandVar) -> list[tuple[float, float]]:
    """(batch, state share) per device at the vertices of what an entry offers with x and N real:
    a choice's own; a band's at the counts n where its room ℓ(n) = min over rows (a + s·n) kinks,
    ends or reaches 0 (ℓ is concave: every (x, N, F) of the band is a sum of these)."""
    if isinstance(entry, _ChoiceVar):
        return [(float(entry.choice.batch), entry.cap)]
    lo, hi, rows = entry.band.lo, entry.n_top, entry.rows
    points = {float(lo), float(hi)}
    for i, (a1, s1) in enumerate(rows):
        if s1 != 0:
            points.add(-a1 / s1)
        for a2, s2 in rows[i + 1:]:
            if s1 != s2:
                points.add((a2 - a1) / (s1 - s2))
    out = []
    for n in points:
        room = min(a + s * n for a, s in rows)
        if lo <= n <= hi and room >= -1e-12:
            out.append((entry.band.micro_batch * n, max(room, 0.0)))
    return out


def _upper_hull(rays: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The rays (batch, share) on the upper concave hull, by batch: max_j (c_j − λ·b_j) is attained
    on it for every λ, and so are the least and largest batch."""
    hull: list[tuple[float, float]] = []
    for b, c in sorted(rays, key=lambda r: (r[0], -r[1])):
        if hull and hull[-1][0] == b:
            continue  # the same batch with no more share
        while len(hull) >= 2 and ((hull[-1][0] - hull[-2][0]) * (c - hull[-2][1])
                                  >= (hull[-1][1] - hull[-2][1]) * (b - hull[-2][0])):
            hull.pop()  # the last point lies on or below the chord from the one before to (b, c)
        hull.append((b, c))
    return hull


def _greedy_batch(by_class: dict[int, list[tuple[float, float]]], counts: Sequence[int], k: int, pick) -> float:
    """The largest (pick=max) or least (pick=min) batch k devices take, each on its class's largest
    or least ray, the classes taken in that order."""
    per_class = sorted(((pick(b for b, _ in rays), counts[g]) for g, rays in by_class.items()),
                       reverse=pick is max)
    total, left = 0.0, k
    for b, count in per_class:
        take = min(count, left)
        total, left = total + take * b, left - take
    return total


def relaxation_infeasible(entries: Sequence[_ChoiceVar | _BandVar], counts: Sequence[int], global_batch: int,
                          world: tuple[int, int]) -> bool:
    """Whether the probe's LP relaxation proves that no configuration holds the whole state, without
    starting CBC (`relaxation_value` below 1 − RELAXATION_MARGIN)."""
    limit = 1 - RELAXATION_MARGIN
    return relaxation_value(entries, counts, global_batch, world, stop_below=limit) < limit


def relaxation_value(entries: Sequence[_ChoiceVar | _BandVar], counts: Sequence[int], global_batch: int,
                     world: tuple[int, int], stop_below: float = -math.inf) -> float:
    """An upper bound on the state the probe's configurations can hold (1 is all of it), from its LP
    relaxation (integrality and the per-entry bounds dropped); −inf where no configuration meets the
    batch and world rows at all. `stop_below`: return the first bound found below it (a proof is
    enough), else the least one. The bound is the dual value D(λ, μ) at its least vertex (weak
    duality, so D < 1 is a proof); the derivation: docs/models/ilp.md ("The LP relaxation as a proof")."""
    lo_k, hi_k = world
    by_class: dict[int, list[tuple[float, float]]] = {}
    for e in entries:
        by_class.setdefault(e.g, []).extend(_rays(e))
    by_class = {g: _upper_hull(rays) for g, rays in by_class.items() if rays}
    if sum(counts[g] for g in by_class) < lo_k:
        return -math.inf  # too few devices can take part at all
    # no y at all meets the batch and world rows (the dual is unbounded): the batch exceeds what the
    # hi devices of the largest batches take, or falls short of what the lo of the smallest must
    if (global_batch > _greedy_batch(by_class, counts, hi_k, max) * (1 + 1e-9)
            or global_batch < _greedy_batch(by_class, counts, lo_k, min) * (1 - 1e-9)):
        return -math.inf
    classes = [(counts[g], rays) for g, rays in by_class.items()]
    num = sum(count for count, _ in classes)
    rays_all = [r for _, rays in classes for r in rays]
    b_top = max(b for b, _ in rays_all)

    def dual(lam: float) -> float:
        """min over μ of D(λ, μ), plus a bound on its float error (so that D < 1 stays a proof)."""
        v = [max(c - lam * b for b, c in rays) for _, rays in classes]
        best = math.inf
        for mu in (*v, 0.0):
            d = lam * global_batch + hi_k * max(mu, 0.0) - lo_k * max(-mu, 0.0)
            d += sum(count * max(vg - mu, 0.0) for (count, _), vg in zip(classes, v))
            best = min(best, d + 1e-12 * (abs(lam) * (global_batch + b_top * num) + (hi_k + num) * (1.0 + abs(mu))))
        return best

    # rays of (nearly) one batch tie nowhere a proof could use: their λ would only be float noise
    lams = {(c1 - c2) / (b1 - b2) for i, (b1, c1) in enumerate(rays_all) for b2, c2 in rays_all[i + 1:]
            if abs(b1 - b2) > 1e-9 * b_top}
    lams.update(c / b for b, c in rays_all if b > 0)
    lams = sorted(lams | {0.0})
    lo_i, hi_i = 0, len(lams) - 1
    least = math.inf
    while lo_i < hi_i:
        mid = (lo_i + hi_i) // 2
        d_mid, d_next = dual(lams[mid]), dual(lams[mid + 1])
        least = min(least, d_mid, d_next)
        if least < stop_below:
            return least
        if d_mid == d_next:
            break  # a flat piece of a convex function is its least value
        lo_i, hi_i = (lo_i, mid) if d_mid < d_next else (mid + 1, hi_i)
    return min(least, dual(lams[lo_i]))


def relaxation_bound_at(table: ScopeTable, global_batch: int, world: tuple[int, int], comm: StepBudget,
                        t_s: float) -> float:
    """`relaxation_value` of the probe at t_s (−inf where it offers nothing): below
    1 − RELAXATION_MARGIN it proves the probe infeasible, no CBC run."""
    offered = probe_entries(table, global_batch, comm, t_s)
    return relaxation_value(offered, [cls.count for cls in table.classes], global_batch, world) if offered \
        else -math.inf


def _rejects(table: ScopeTable, offered: Sequence[_ChoiceVar | _BandVar], global_batch: int,
             world: tuple[int, int]) -> bool:
    return not offered or relaxation_infeasible(offered, [cls.count for cls in table.classes], global_batch, world)


def probe(table: ScopeTable, global_batch: int, world: tuple[int, int], comm: StepBudget, t_s: float,
          time_limit_s: float, threads: int | None = None, relaxed: bool = False) -> Config | None:
    """The ILP at a fixed compute end t_s (T1) and optimizer budget (T2, in comm): a configuration
    whose devices all end their compute and collectives by t_s and hold the state with each
    optimizer within the budget (up to the bands' 2·AFFINE_TOL of room: the caller prices it
    exactly), or None, which proves that no plan of the scope's world sizes does (by the LP
    relaxation where it suffices, else CBC).
    relaxed: the caller has found that the relaxation does not reject t_s, so CBC decides at once."""
    if time_limit_s <= 0:
        raise ProbeTimeout(f"no time left to decide t = {t_s:.6g} s")
    offered = probe_entries(table, global_batch, comm, t_s)
    if not relaxed and _rejects(table, offered, global_batch, world):
        return None
    if len(offered) > MAX_PROBE_VARIABLES:
        raise SolverLimit(f"the plan's integer program would have {len(offered)} device variables "
                          f"(more than {MAX_PROBE_VARIABLES}): use fewer micro-batch candidates")
    prob = pulp.LpProblem("gpumix_hetero_probe", pulp.LpMinimize)
    prob += pulp.lpSum([])  # feasibility: any configuration that fits is as good as another
    entries = []  # (g, choice, x, F)
    band_entries = []  # (g, band, x, N)
    for g, group in itertools.groupby(offered, key=lambda e: e.g):
        xs = []
        for e in group:
            if isinstance(e, _ChoiceVar):
                # x[g,c]: how many devices of class g take choice c
                x = pulp.LpVariable(f"x_{g}_{e.c}", lowBound=0, upBound=e.ub, cat="Integer")
                # F[g,c]: the state share those devices hold together (F = x·f, f their equal per-device share)
                F = pulp.LpVariable(f"F_{g}_{e.c}", lowBound=0)
                # memory and optimizer budget: each device's f ≤ cap = min(max_share, T2/opt), so F ≤ cap·x
                prob += F <= e.cap * x, f"cap_{g}_{e.c}"
                entries.append((g, e.choice, x, F))
            else:
                b, band = e.b, e.band
                # x[g,b]: devices of class g with a count in band b; N[g,b]: their accumulation steps in total
                x = pulp.LpVariable(f"xb_{g}_{b}", lowBound=0, upBound=e.ub, cat="Integer")
                N = pulp.LpVariable(f"N_{g}_{b}", lowBound=0, cat="Integer")
                F = pulp.LpVariable(f"Fb_{g}_{b}", lowBound=0)
                # counts: lo ≤ each n_i ≤ n_top, so lo·x ≤ N ≤ n_top·x (split evenly: n_i ∈ {⌊N/x⌋, ⌈N/x⌉})
                prob += N >= band.lo * x, f"band_lo_{g}_{b}"
                prob += N <= e.n_top * x, f"band_hi_{g}_{b}"
                # the most state the x devices hold: F ≤ a·x + s·N for each row (band_rows)
                for r, (a, sl) in enumerate(e.rows):
                    prob += F <= a * x + sl * N, f"band_room_{g}_{b}_{r}"
                entries.append((g, None, x, F))
                band_entries.append((g, band, x, N))
            xs.append(x)
        # devices: a class lends at most its count
        prob += pulp.lpSum(xs) <= table.classes[g].count, f"devices_{g}"
    # batch: Σ m·n·x (+ Σ m·N over the bands) = the global batch
    prob += (pulp.lpSum(ch.batch * x for _, ch, x, _ in entries if ch is not None)
             + pulp.lpSum(band.micro_batch * N for _, band, _, N in band_entries)) == global_batch, "batch"
    # shards: the devices can hold the whole state (≥: any surplus capacity is simply left unused)
    prob += pulp.lpSum(F for *_, F in entries) >= 1, "shards"
    # world size: the number of used devices lies in the bucket comm was priced for
    k = pulp.lpSum(x for _, _, x, _ in entries)
    prob += k >= world[0], "world_lo"
    prob += k <= world[1], "world_hi"
    started = time.monotonic()
    prob.solve(BoundedCBC(time_limit_s, threads=threads))
    left_s = time_limit_s - (time.monotonic() - started)
    if prob.status == pulp.LpStatusNotSolved and left_s > 1.0:
        # CBC ended without an answer well inside its limit (seen on a loaded machine): once more
        log.info("CBC returned no answer for t = %.6g s; solving once more", t_s)
        prob.solve(BoundedCBC(left_s, threads=threads))
    if prob.sol_status in (pulp.LpSolutionOptimal, pulp.LpSolutionIntegerFeasible):
        config = [(g, ch, int(round(x.value() or 0))) for g, ch, x, _ in entries
                  if ch is not None and round(x.value() or 0) > 0]
        for g, band, x, N in band_entries:
            count, steps = int(round(x.value() or 0)), int(round(N.value() or 0))
            if count <= 0:
                continue
            q, r = divmod(steps, count)  # r devices take q + 1 steps, the others q
            for n, num in ((q + 1, r), (q, count - r)):
                if num:
                    config.append((g, table.classes[g].choice(band.micro_batch, n), num))
        return config
    if prob.status == pulp.LpStatusInfeasible:
        return None
    raise ProbeTimeout(f"CBC stopped ({pulp.LpStatus[prob.status]}) before deciding t = {t_s:.6g} s")


def greedy_config(table: ScopeTable, global_batch: int, world: tuple[int, int], comm: StepBudget,
                  t_s: float) -> Config | None:
    """A configuration for the probe at t_s found without CBC, or None: each device on the largest
    batch it computes by t_s (a choice, or a band's most whole steps), the devices with the largest
    batches taken until they reach the batch (within the world range), then the surplus trimmed in
    whole steps, first on the devices with the longest steps (which end last). The caller prices it
    exactly (price_config): a plan like any other, which proves nothing about the probe; CBC
    decides where it is not good enough."""
    slack_s = comm.compute_room_s(t_s)
    if slack_s < 0:
        return None  # the collectives alone end after t_s
    devices = []  # (batch, g, m, n, least n it may be trimmed to, step s)
    for g, cls in enumerate(table.classes):
        best = None
        for ch in cls.choices:
            if ch.batch > 0 and share_cap(cls, ch, t_s, comm) >= 0 and (best is None or ch.batch > best[0]):
                best = (ch.batch, ch.micro_batch, ch.accum_steps, ch.accum_steps, 0.0)
        for b in cls.bands:
            n = _steps_within(slack_s, b.step_s, b.hi)
            if n >= b.lo and (best is None or b.micro_batch * n > best[0]):
                best = (b.micro_batch * n, b.micro_batch, n, b.lo, b.step_s)
        if best is not None:
            devices += [(best[0], g, *best[1:])] * cls.count
    devices.sort(key=lambda d: -d[0])
    taken, total = [], 0
    for d in devices:
        if total >= global_batch and len(taken) >= world[0]:
            break
        if len(taken) == world[1]:
            return None
        taken.append(list(d))
        total += d[0]
    surplus = total - global_batch
    if surplus < 0 or len(taken) < world[0]:
        return None
    order = sorted(range(len(taken)), key=lambda i: -taken[i][5])
    for i in order:
        _, g, m, n, least, _ = taken[i]
        cut = min(surplus // m, n - least)
        taken[i][3] -= cut
        surplus -= cut * m
    if surplus:
        return None
    counts: dict[tuple[int, int, int], int] = {}
    for _, g, m, n, _, _ in taken:
        counts[g, m, n] = counts.get((g, m, n), 0) + 1
    return [(g, table.classes[g].choice(m, n), x) for (g, m, n), x in sorted(counts.items())]


def price_config(table: ScopeTable, config: Config, comm: StepBudget) -> tuple[float, float, list[float]] | None:
    """A configuration's step: (T1, the end of its compute and collectives; T2, its least optimizer
    time; each entry's per-device share). T2 by water-filling: the least budget b with
    Σ x·min(max_share, b/opt) ≥ 1 (the capacity grows with b), by bisection. None if the state
    cannot fit within comm's budget."""
    def capacity(budget_s: float) -> float:
        return sum(x * optimizer_cap(ch.max_share, table.classes[g].coeffs.optimizer_s, budget_s)
                   for g, ch, x in config)

    t1 = max(comm.end_s(ch.compute_s) for _, ch, _ in config)
    lo = 0.0
    hi = min(comm.optimizer_budget_s, max(table.classes[g].coeffs.optimizer_s * ch.max_share for g, ch, _ in config))
    if capacity(hi) < 1 - 1e-12:
        return None
    if capacity(lo) < 1:
        for _ in range(WATER_FILL_STEPS):
            mid = 0.5 * (lo + hi)
            lo, hi = (lo, mid) if capacity(mid) >= 1 else (mid, hi)
        lo = hi
    caps = [optimizer_cap(ch.max_share, table.classes[g].coeffs.optimizer_s, lo) for g, ch, _ in config]
    total = sum(x * cap for (_, _, x), cap in zip(config, caps))
    return t1, lo, [cap / total for cap in caps]


def _breakpoints(table: ScopeTable, comm: StepComm, lo_s: float, hi_s: float) -> list[float]:
    """Compute ends (T1) at which the set of fast-enough choices changes, inside (lo_s, hi_s)."""
    pts = {comm.end_s(ch.compute_s) for cls in table.classes for ch in cls.choices}
    return sorted(t for t in pts if lo_s < t < hi_s)


class _Bisection:
    """The interval [lo, hi] known to hold the least compute end T1 of one scope and bucket at one
    optimizer budget, and the best configuration found (its exact T1 is hi)."""

    def __init__(self, table: ScopeTable, global_batch: int, world: tuple[int, int], lo_s: float, hi_s: float,
                 deadline: float, comm_k: int | None = None, budget_s: float = math.inf):
        self.table, self.global_batch, self.world, self.deadline = table, global_batch, world, deadline
        self.budget_s = budget_s
        self.comm = with_budget(table.step_comm(world[1] if comm_k is None else comm_k), budget_s)
        # how much more the range's largest world size pays for its collectives than comm, at most
        self.spread_s = max(table.step_comm(world[1]).total_s - self.comm.total_s, 0.0)
        self.lo, self.hi = lo_s, hi_s
        self.best: tuple[float, Config] | None = None
        self.proven_lo = True  # every rise of lo was a proof (an infeasible probe)
        self.stalled = False  # a probe moved neither end (CBC's tolerance): stop bisecting

    def try_at(self, t_s: float, relaxed: bool = False) -> bool:
        """Probe t_s: a feasible configuration lowers hi to its exact time, infeasibility raises lo.
        ProbeTimeout (undecided) moves neither. A configuration the probe accepted within the bands'
        tolerance that cannot hold the state when priced exactly raises lo all the same, unproven.
        relaxed: as probe's (the relaxation admits t_s)."""
        config = probe(self.table, self.global_batch, self.world, self.comm, t_s, self.deadline - time.monotonic(),
                       relaxed=relaxed)
        priced = price_config(self.table, config, self.comm) if config else None
        if priced is None:
            if config:
                self.proven_lo = False
            self.lo = max(self.lo, t_s)
            return False
        if self.best is None or priced[0] < self.hi:
            self.best, self.hi = (priced[0], config), min(self.hi, priced[0])
        elif priced[0] > t_s:
            # CBC accepted t_s within its own feasibility tolerance, the exact price is above t_s and
            # no better than hi: the interval cannot shrink from here (closed() decides "optimal")
            self.stalled = True
        return True

    def offer(self, config: Config | None) -> bool:
        """Price a configuration found elsewhere (greedy_config): it lowers hi if it ends sooner.
        Whether it did."""
        priced = price_config(self.table, config, self.comm) if config else None
        if priced is None or priced[0] >= self.hi:
            return False
        self.best, self.hi = (priced[0], config), priced[0]
        return True

    def relaxation_floor(self, cap_s: float, tol: float) -> float | None:
        """Raise lo by the LP relaxation alone (each t it rejects is a proof, at no CBC run): gallop
        up from lo by lo·tol·RELAX_GALLOP^i, then bisect to within RELAX_WITHIN·tol of the least t it
        admits. Where the gallop's last two rejections have finite bounds (the relaxation's state
        held, below 1), the line through them, which grows with t about linearly (each device's room
        for the state does), aims first: a narrow bracket around its crossing of 1 is tried, each of
        its two ends a proof or an admitted t, and the bisection goes on from whatever it leaves.
        Returns the least admitted t found (≤ cap_s), or None if it rejects cap_s."""
        limit = 1 - RELAXATION_MARGIN

        def value(t_s: float) -> float:
            return relaxation_bound_at(self.table, self.global_batch, self.world, self.comm, t_s)

        hi_t = cap_s
        if value(cap_s) < limit:
            self.lo = max(self.lo, cap_s)
            return None
        rejected: list[tuple[float, float]] = []  # (t, bound) of the gallop's rejections, in order
        step = tol
        while self.lo > 0 and self.lo * (1 + step) < hi_t:
            t = self.lo * (1 + step)
            v = value(t)
            if v >= limit:
                hi_t = t
                break
            self.lo, step = t, step * RELAX_GALLOP
            rejected.append((t, v))
        width = RELAX_WITHIN * tol * hi_t
        probes: list[float] = []
        if len(rejected) >= 2 and all(math.isfinite(v) for _, v in rejected[-2:]) and rejected[-1][1] > rejected[-2][1]:
            (t1, v1), (t2, v2) = rejected[-2:]
            cross = t2 + (limit - v2) * (t2 - t1) / (v2 - v1)
            if self.lo < cross < hi_t:
                spread = max(0.5 * width, 0.01 * (cross - self.lo))
                probes = [cross - spread, cross + spread]
        while hi_t - self.lo > RELAX_WITHIN * tol * hi_t:
            t = probes.pop(0) if probes else 0.5 * (self.lo + hi_t)
            if not self.lo < t < hi_t:
                continue
            if value(t) >= limit:
                hi_t = t
            else:
                self.lo = t
        return hi_t

    def closed(self, tol: float) -> bool:
        return self.hi - self.lo <= tol * self.hi

    def improves(self, target_s: float) -> bool:
        """Whether the best configuration, priced at its own world size, ends before target_s."""
        config = self.best[1]
        priced = price_config(self.table, config,
                              with_budget(self.table.step_comm(sum(x for _, _, x in config)), self.budget_s))
        return priced is not None and priced[0] < target_s

    def settled(self, tol: float) -> bool:
        """Closed, or narrower than the collectives' spread over the range: a range priced at its
        least world size cannot tell its plans apart more finely, so the caller splits it instead."""
        return self.closed(tol) or self.hi - self.lo <= self.spread_s

    def time_left(self) -> bool:
        return time.monotonic() < self.deadline and not self.stalled


def solve_bucket(table: ScopeTable, global_batch: int, world: tuple[int, int], lower_s: float, upper_s: float,
                 deadline: float, tol: float, comm_k: int | None = None,
                 budget_s: float = math.inf) -> tuple[float, Config | None, bool] | None:
    """Least compute end T1 with k in `world` and every optimizer within `budget_s` (T2), by
    bisection on T1, below `upper_s` (an incumbent's T1), the collectives priced at `comm_k` devices
    (default: world's top). Returns (bound, the best
    configuration, proven) or None if nothing beats upper_s: bound is the least time within tol
    when the interval closed, else the proven lower end of a range the caller must split (its
    collectives' spread, comm(top) − comm(comm_k), is wider than what the bisection could still resolve,
    or its best plan does not beat upper_s at its own world size). The configuration is None where
    the relaxation's bound alone leaves less than that spread below upper_s (no CBC run)."""
    comm_k = world[1] if comm_k is None else comm_k
    top_s = upper_s
    if math.isinf(top_s):  # no incumbent: the slowest choice bounds every plan
        top_s = max([ch.compute_s for cls in table.classes for ch in cls.choices]
                    + [b.hi * b.step_s for cls in table.classes for b in cls.bands])
        top_s += table.step_comm(comm_k).total_s  # exposed + max(c, hidden) ≤ c + every collective
    search = _Bisection(table, global_batch, world, lower_s, top_s, deadline, comm_k, budget_s)
    cap_s = top_s if math.isinf(upper_s) else upper_s * (1 - tol)  # is there any plan at all below it?
    try:
        # the relaxation's free proofs lift lo to just below the least t it admits; CBC starts
        # there (the optimum usually lies within a few tol of it) and climbs geometrically from lo
        # until a configuration appears, each infeasible answer a proof
        t = search.relaxation_floor(cap_s, tol)
        if t is not None and world[0] < world[1] and cap_s - search.lo <= search.spread_s:
            # what is left below the incumbent is narrower than the collectives' spread: CBC could
            # not settle the range either, so the caller splits it on the relaxation's bound alone
            return search.lo, None, search.proven_lo
        if t is not None and search.offer(greedy_config(table, global_batch, world, search.comm, t)) \
                and search.closed(tol):
            # a plan within tol of the relaxation's proven floor, found without CBC
            return search.best[0], search.best[1], search.proven_lo
        step = tol
        while t is not None and not search.try_at(t, relaxed=True):
            if t >= cap_s:
                return None
            t = min(cap_s, search.lo * (1 + step)) if search.lo > 0 else cap_s
            step *= RELAX_GALLOP
        if t is None:
            return None
        if world[0] < world[1] and not search.improves(upper_s * (1 - tol)):
            # the relaxation admits a plan the real collectives do not: bisecting it would only
            # sharpen a bound the range's halves beat anyway, so the caller splits the range at once
            return search.lo, search.best[1], search.proven_lo
        points = _breakpoints(table, search.comm, search.lo, search.hi)
        while points and search.time_left() and not search.settled(tol):
            mid = points[len(points) // 2]
            ok = search.try_at(mid)
            points = [t for t in points if search.lo < t < search.hi and (t < mid if ok else t > mid)]
        # between breakpoints only the shares' room changes: the best configuration found so far is
        # usually already optimal (price_config placed its shares exactly), which one probe just below proves
        # so probe near hi: each infeasible probe there cuts the interval to NEAR_HI_STEP of itself (a
        # midpoint only halves it); after a feasible one (hi moved down) the next probe is the midpoint,
        # so a run of improvements still closes the interval geometrically
        near_hi = True
        while not search.settled(tol) and search.time_left():
            gap = search.hi - search.lo
            t = search.hi - max(tol * search.hi, NEAR_HI_STEP * gap) if near_hi else search.lo + 0.5 * gap
            if not search.lo < t < search.hi:  # rounding at the tolerance's edge: a midpoint always moves
                t = search.lo + 0.5 * gap
            near_hi = not search.try_at(t)
    except ProbeTimeout as e:  # undecided: the search stops with what it has, unproven
        log.warning("%s", e)
        if search.best is None:
            raise
        return search.best[0], search.best[1], False
    assert search.best is not None
    if search.closed(tol):
        return search.best[0], search.best[1], search.proven_lo
    # settled by the collectives' spread (the caller splits the range), or stopped short of it (the
    # time limit, or a stall at CBC's tolerance: not proven)
    return search.lo, search.best[1], search.proven_lo and search.settled(tol)


def solve_scope(table: ScopeTable, global_batch: int, deadline: float, tol: float,
                upper_s: float = math.inf) -> ScopeSolution | None:
    """The best plan of one scope, T1 + T2 least over every optimizer budget T2 and world size, or
    None if none beats upper_s.

    T1(b), the least compute end of the plans whose optimizers all end within b, is non-increasing
    in b; the search walks b down from the largest useful budget (`_budget_range`). Each step asks
    least_compute_end at b (to tol/2) for T1(b) and a configuration c, whose own least budget T2(c)
    ≤ b prices it at T1(c) + T2(c): every budget in [T2(c), b] is then settled (T1 is T1(c) there,
    within tol/2). The next b lies tol/2 of the incumbent below T2(c) (the budgets skipped cannot
    beat it by more than tol); the walk stops where T1(b)·(1 − tol/2) + the least budget at which
    the state fits at all reaches the incumbent. So the answer is within tol of the best over every
    budget, in one step per level of T1 that could still win (docs/models/ilp.md, "The optimizer
    budget")."""
    budgets = _budget_range(table)
    if budgets is None:
        return None  # the state does not fit on the scope's devices
    least_b, budget_s = budgets
    half = tol / 2
    best: tuple[float, Config, int] | None = None
    proven = True
    floor_s = 0.0  # T1 at every budget not yet settled is at least this

    def settled() -> bool:
        incumbent = best[0] if best else upper_s
        return floor_s * (1 - half) + least_b >= incumbent * (1 - tol) or budget_s < least_b

    for _ in range(MAX_BUDGET_SOLVES):
        incumbent = best[0] if best else upper_s
        if settled():
            break
        if time.monotonic() >= deadline:
            proven = False
            break
        # only a T1 below incumbent − least_b can still beat the incumbent at some budget ≤ budget_s
        found = least_compute_end(table, global_batch, deadline, half, incumbent - least_b, budget_s)
        if found is None:
            break
        t1_s, config, k, ok = found
        proven = proven and ok
        _, t2_s, _ = price_config(table, config, with_budget(table.step_comm(k), budget_s))
        if t1_s + t2_s < incumbent:
            best = (t1_s + t2_s, config, k)
            incumbent = t1_s + t2_s
        floor_s = max(floor_s, t1_s)
        budget_s = t2_s - half * incumbent
    else:
        proven = proven and settled()  # MAX_BUDGET_SOLVES ran out: proven only if nothing is left
    if best is None:
        return None
    t_s, config, k = best
    config = fewest_steps(table, config)
    t1_s, t2_s, shares = price_config(table, config, with_budget(table.step_comm(k), math.inf))
    per_device: dict[int, tuple[int, int, float]] = {}
    free = {g: list(cls.device_indices) for g, cls in enumerate(table.classes)}
    for (g, ch, x), share in zip(config, shares):
        for _ in range(x):
            per_device[free[g].pop(0)] = (ch.micro_batch, ch.accum_steps, share)
    return ScopeSolution("optimal" if proven else "feasible", t1_s + t2_s, per_device)


def _budget_range(table: ScopeTable) -> tuple[float, float] | None:
    """(the least optimizer budget at which the scope's devices can hold the state at all, each at
    its class's largest room; the largest budget that still caps a share: max over classes of
    opt·room), None where even every device at its room cannot hold it. Every plan's T2 lies in it."""
    rooms = [(max([ch.max_share for ch in cls.choices] + [max(b.max_share_lo, b.max_share_hi) for b in cls.bands],
                  default=-1.0), cls.count, cls.coeffs.optimizer_s) for cls in table.classes]
    rooms = [(min(room, 1.0), count, opt_s) for room, count, opt_s in rooms if room > 0]

    def capacity(budget_s: float) -> float:
        return sum(count * optimizer_cap(room, opt_s, budget_s) for room, count, opt_s in rooms)

    hi = max((room * opt_s for room, _, opt_s in rooms), default=0.0)
    if capacity(hi) < 1 - 1e-12:
        return None
    lo = 0.0
    if capacity(lo) < 1:
        for _ in range(WATER_FILL_STEPS):
            mid = 0.5 * (lo + hi)
            lo, hi = (lo, mid) if capacity(mid) >= 1 else (mid, hi)
        lo = hi
    return lo, max(lo, max(room * opt_s for room, _, opt_s in rooms))


def least_compute_end(table: ScopeTable, global_batch: int, deadline: float, tol: float, upper_s: float,
                      budget_s: float) -> tuple[float, Config, int, bool] | None:
    """The least compute end T1 of one scope's plans whose optimizers all end within budget_s (T2),
    over every world size k: (T1, the configuration, its k, proven), or None if none beats upper_s
    (a T1).

    Branch and bound over ranges [lo, hi] of k, starting with all of them: a range is solved with
    its collectives priced at lo, the cheapest any k of it pays (comm grows with k), so its optimum
    is a lower bound of every plan in the range, and the configuration found, priced at its own k,
    is a real plan (the incumbent when faster). A range whose bound cannot beat the incumbent is
    closed; a single k is exact; any other range is split in two. So no world size is skipped and
    "optimal" means the plan is within the tolerance of the best over all k."""
    fluid_s = _lower_bound_s(table, global_batch, compute_only=True)
    reach = _table_reach(table)
    best: tuple[float, Config, int] | None = None
    proven = True
    # (lo, hi, a lower bound of the range's plans): first the ranges between powers of two, where
    # the collectives' latency (⌈log2 k⌉ hops) is constant and the ring's (k − 1)/k varies least, so
    # comm(lo) bounds the whole range tightly (one range [1, K] priced at comm(1) = 0 bounds nothing);
    # the most promising range is searched first (popped last)
    stack = sorted(world_segments(table.num_devices), key=lambda r: -_range_bound_s(table, global_batch, *r))
    stack = [(lo, hi, 0.0) for lo, hi in stack]
    while stack:
        lo, hi, parent_s = stack.pop()
        incumbent = best[0] if best else upper_s
        lower_s = max(parent_s, fluid_s, _range_bound_s(table, global_batch, lo, hi))
        if lower_s < incumbent * (1 - tol):
            lower_s = _capacity_bound_s(reach, table.step_comm(lo), global_batch, hi, lower_s, incumbent, tol)
        if lower_s >= incumbent * (1 - tol):
            continue
        if time.monotonic() >= deadline:
            proven = False
            break
        try:
            found = solve_bucket(table, global_batch, (lo, hi), lower_s, incumbent, deadline, tol, comm_k=lo,
                                 budget_s=budget_s)
        except ProbeTimeout:  # this range stays undecided: whatever is returned is not proven optimal
            proven = False
            continue
        if found is None:
            continue
        bound_s, config, ok = found
        proven = proven and ok
        k = hi  # no configuration (the relaxation's bound alone): the upper half first
        if config is not None:
            k = sum(x for _, _, x in config)
            priced = price_config(table, config, with_budget(table.step_comm(k), budget_s))
            if priced is not None and priced[0] < incumbent:
                best = (priced[0], config, k)
                incumbent = priced[0]
        if lo == hi or bound_s >= incumbent * (1 - tol):
            continue
        mid = (lo + hi) // 2
        halves = [(lo, mid, bound_s), (mid + 1, hi, bound_s)]
        stack.extend(halves if k > mid else halves[::-1])  # the half holding k is searched first
    if best is None:
        return None
    t_s, config, k = best
    return t_s, config, k, proven


def world_segments(num_devices: int) -> list[tuple[int, int]]:
    """[1, 1], [2, 2], [3, 4], [5, 8], ... up to num_devices: world sizes between powers of two."""
    out, lo = [], 1
    while lo <= num_devices:
        hi = min(num_devices, 1 if lo == 1 else 2 * (lo - 1))
        out.append((lo, hi))
        lo = hi + 1
    return out


def _steps_within(compute_s: float, step_s: float, top: int) -> int:
    """Whole accumulation steps of step_s that end within compute_s (float round-off forgiven), ≤ top."""
    if step_s <= 0 or math.isinf(compute_s):
        return top
    return min(top, math.floor(compute_s / step_s * (1 + 1e-12)))


def _capacity_bound_s(reach: Sequence[tuple[Callable[[float], float], int]], comm: StepComm, global_batch: int,
                      hi: int, lower_s: float, upper_s: float, tol: float) -> float:
    """A lower bound, at least lower_s, on every plan of at most hi devices whose collectives take
    at least comm: each device computes its samples within T − comm.exposed_s (and no T below the
    collectives' own end, exposed + hidden, admits any), so the hi devices that
    compute the most in that time (`reach`: per class, its samples within a compute time, and its
    device count) must take the batch. Tighter than the fluid bound where a device's fastest
    micro-batch fits only short accumulations. The least such T to tol by bisection in
    [lower_s, upper_s], upper_s itself when even that does not suffice (the range is closed)."""
    def enough(t_s: float) -> bool:
        room_s = comm.compute_room_s(t_s)
        if room_s < 0:
            return False
        per_class = sorted(((within(room_s), count) for within, count in reach), reverse=True)
        left, total = hi, 0.0
        for samples, count in per_class:
            take = min(count, left)
            total, left = total + take * samples, left - take
            if left == 0:
                break
        return total >= global_batch

    if not enough(upper_s):
        return upper_s
    while upper_s - lower_s > tol * upper_s:
        mid = 0.5 * (lower_s + upper_s)
        lower_s, upper_s = (lower_s, mid) if enough(mid) else (mid, upper_s)
    return lower_s


def class_reach(cls: ClassTable) -> "_Reach":
    """What one device of the class computes, from its table: its n = 1 choices (a state-only choice
    computes nothing) and per micro-batch the top of its bands (a micro-batch's bands run without a
    gap from DENSE_ACCUM_STEPS + 1 to the most counts that fit: CostModel.bands)."""
    tops: dict[int, tuple[float, int]] = {}
    for b in cls.bands:
        tops[b.micro_batch] = (b.step_s, max(b.hi, tops.get(b.micro_batch, (0.0, 0))[1]))
    return _Reach(tuple((ch.batch, ch.compute_s) for ch in cls.choices if ch.batch),
                  tuple((m, step_s, top) for m, (step_s, top) in tops.items()))


def _table_reach(table: ScopeTable) -> list[tuple[Callable[[float], float], int]]:
    return [(class_reach(cls).within, cls.count) for cls in table.classes]


def _range_bound_s(table: ScopeTable, global_batch: int, lo: int, hi: int) -> float:
    """No plan with lo ≤ k ≤ hi devices ends its compute and collectives (T1) before the hi fastest
    devices' fluid bound with the collectives of lo devices (StepComm.bound_s)."""
    return table.step_comm(lo).bound_s(_lower_bound_s(table, global_batch, hi, compute_only=True))


def fewest_steps(table: ScopeTable, config: Config) -> Config:
    """Each entry's batch in the fewest accumulation steps that are no slower and hold no less state:
    where the profile prices m = 1 × n = 4 like m = 4 × n = 1 (α = 0), every accumulation step still
    has fixed costs the profile may not resolve. The configuration's time cannot rise."""
    out = []
    for g, ch, x in config:
        cls = table.classes[g]
        if ch.batch == 0:  # a state-only entry computes nothing: no micro-batch to enlarge (0 divides by any)
            out.append((g, ch, x))
            continue
        sizes = {c.micro_batch for c in cls.choices} | {b.micro_batch for b in cls.bands}
        for m in sorted((m for m in sizes if m > ch.micro_batch and ch.batch % m == 0), reverse=True):
            alt = cls.choice(m, ch.batch // m)
            if alt.compute_s <= ch.compute_s * (1 + 1e-12) and alt.max_share >= ch.max_share * (1 - 1e-12):
                ch = alt
                break
        out.append((g, ch, x))
    return out


def _best_rate(cls: ClassTable) -> float:
    """The most samples per second one device of the class computes on any of its choices or bands
    (α amortized over the largest micro-batch that fits)."""
    rates = [ch.batch / ch.compute_s for ch in cls.choices if ch.batch and ch.compute_s > 0]
    rates += [b.micro_batch / b.step_s for b in cls.bands if b.step_s > 0]
    return max(rates, default=0.0)


# per class of a scope: (its best rate in samples/s, its device count, its optimizer_s)
Rates = list[tuple[float, int, float]]


def _table_rates(table: ScopeTable) -> tuple[Rates, bool]:
    """Each class's (best rate, count, optimizer_s), and whether a state-only device may hold state."""
    state_only = any(any(ch.batch == 0 and ch.max_share > 0 for ch in cls.choices) for cls in table.classes)
    return [(_best_rate(cls), cls.count, cls.coeffs.optimizer_s) for cls in table.classes], state_only


def _lower_bound_s(table: ScopeTable, global_batch: int, max_devices: int | None = None,
                   compute_only: bool = False) -> float:
    """_fluid_bound_s of the table; compute_only: of the compute alone (a bound on T1), B / R."""
    rates, state_only = _table_rates(table)
    return _fluid_bound_s(rates, state_only or compute_only, global_batch, max_devices)


def _fluid_bound_s(per_class: Rates, state_only: bool, global_batch: int, max_devices: int | None = None) -> float:
    """Fluid bound of the `max_devices` fastest devices (no collectives): a device i that takes b_i
    samples and holds f_i of the state needs T ≥ b_i / r_i + f_i·opt_i at its best rate r_i (or any
    rate above it), so Σ r_i·T ≥ B + Σ r_i·f_i·opt_i ≥ B + min_i r_i·opt_i (Σ f_i = 1); with Σ r_i
    at most the fastest devices' sum R, T ≥ (B + min_i r_i·opt_i) / R."""
    rates = sorted((r for r, count, _ in per_class for _ in range(count) if r > 0), reverse=True)
    rate = sum(rates[:max_devices] if max_devices is not None else rates)
    if rate <= 0:
        return math.inf
    # state-only devices (rate 0) may hold the whole state: then no optimizer time is forced on the workers
    opt_term = 0.0 if state_only else min(r * opt_s for r, _, opt_s in per_class if r > 0)
    return (global_batch + opt_term) / rate


def _most_samples(table: ScopeTable) -> int:
    """The most samples the scope's devices can take in one step, each on its largest choice or band."""
    return sum(cls.count * max([ch.batch for ch in cls.choices] + [b.micro_batch * b.hi for b in cls.bands],
                               default=0)
               for cls in table.classes)


def _scope_lower_bound_s(table: ScopeTable, global_batch: int) -> float:
    return _segments_bound_s(*_table_rates(table), table.step_comm, global_batch, table.num_devices)


def _segments_bound_s(per_class: Rates, state_only: bool, comm: Callable[[int], StepComm], global_batch: int,
                      num_devices: int) -> float:
    """No plan of a scope is faster than the least bound of its world-size ranges (`world_segments`,
    `_range_bound_s`), each at least the fluid bound of all its devices."""
    fluid_s = _fluid_bound_s(per_class, state_only, global_batch)
    return min(max(fluid_s, comm(lo).bound_s(_fluid_bound_s(per_class, state_only, global_batch, hi)))
               for lo, hi in world_segments(num_devices))


def _rate_above(cost: CostModel, device, global_batch: int, micro_batches: Sequence[int] | None,
                max_compute_s: float) -> float | None:
    """A rate no choice or band of `device`'s table (CostModel.choices, .bands) beats, from a few
    memory checks instead of the whole table: a micro-batch's rate m/(α + β·m) grows with m, so it
    is that of the largest m whose n = 1 (choices) or n = 2 (bands, the least memory of any count)
    fits at f = 0 within the compute bound. None where a negative α or β breaks the monotony."""
    c = cost.coeffs[device]
    if min(c.alpha_s, c.beta_s, c.recompute_alpha_s or 0.0, c.recompute_beta_s or 0.0) < 0:
        return None
    rate = 0.0
    ms = cost.micro_batch_candidates(global_batch, micro_batches)
    for m in reversed(ms):  # choices: n = 1
        one_s = c.compute_s(m, 1)
        if rate * one_s >= m:
            break  # no smaller m beats the rate found
        if one_s <= max_compute_s and cost.max_share(device, m, 1) >= 0:
            rate = max(rate, m / one_s) if one_s > 0 else rate
            break
    for m in reversed(ms):  # bands: n ≥ 2, priced per micro-batch at compute(m, 2) / 2
        step_s = c.compute_s(m, 2) / 2
        if step_s <= 0 or rate * step_s >= m:
            break
        top = min(global_batch // m, int(max_compute_s / step_s) if math.isfinite(max_compute_s) else global_batch)
        if top >= DENSE_ACCUM_STEPS + 1 and c.fits(m, DENSE_ACCUM_STEPS + 1, 0.0):
            rate = m / step_s
            break
    return rate


@dataclass(frozen=True)
class _Reach:
    """What one device of a kind can compute in a step, found as its table (CostModel.choices,
    .bands) would find it but without building the table: each micro-batch whose n = 1 fits at
    f = 0 within the compute bound (`ones`: (batch, compute s)), and each micro-batch's run of counts
    from DENSE_ACCUM_STEPS + 1 to the most that fit at f = 0 within it (`runs`: (m, step s, top),
    the top of its bands). `class_reach` builds the same from a table."""
    ones: tuple[tuple[int, float], ...]
    runs: tuple[tuple[int, float, int], ...]

    def most(self) -> int:
        """The most samples in one step, however long it takes."""
        return max([m for m, _ in self.ones] + [m * top for m, _, top in self.runs], default=0)

    def within(self, compute_s: float) -> float:
        """The most samples computed within compute_s: a choice that ends in time, or a run's whole
        steps that end in time (within float round-off), capped at its top."""
        most = max((m for m, one_s in self.ones if one_s <= compute_s), default=0)
        for m, step_s, top in self.runs:
            n = _steps_within(compute_s, step_s, top)
            if n > DENSE_ACCUM_STEPS:
                most = max(most, m * n)
        return most


def _count_cap(c, m: int, global_batch: int, max_compute_s: float) -> int:
    """The most counts of micro-batch m the batch and the compute bound allow (CostModel.bands' top
    before memory)."""
    step_s = c.compute_s(m, 2) / 2
    top = global_batch // m
    if step_s > 0 and math.isfinite(max_compute_s):
        top = min(top, int(max_compute_s / step_s))
    return top


def _reach_before_table(cost: CostModel, device, global_batch: int, micro_batches: Sequence[int] | None,
                        max_compute_s: float) -> _Reach:
    c = cost.coeffs[device]
    ones, runs = [], []
    lo = DENSE_ACCUM_STEPS + 1
    for m in cost.micro_batch_candidates(global_batch, micro_batches):
        one_s = c.compute_s(m, 1)
        if one_s <= max_compute_s and c.fits(m, 1, 0.0):
            ones.append((m, one_s))
        top = _count_cap(c, m, global_batch, max_compute_s)
        if top >= lo and c.fits(m, lo, 0.0):
            runs.append((m, c.compute_s(m, 2) / 2, last_fitting(c, m, 0.0, lo, top)))
    return _Reach(tuple(ones), tuple(runs))


def _most_before_table(cost: CostModel, device, global_batch: int, micro_batches: Sequence[int] | None,
                       max_compute_s: float) -> int:
    """`_reach_before_table(...).most()` in fewer memory checks: the micro-batches are tried in order
    of their most conceivable samples, m·`_count_cap`, and the search stops where that cannot beat
    what was found (at large batches, where the answer alone often closes a stage, most of them)."""
    c = cost.coeffs[device]
    ms = cost.micro_batch_candidates(global_batch, micro_batches)
    most = 0
    for m in reversed(ms):  # n = 1: the first fitting m from the top is the largest
        if c.compute_s(m, 1) <= max_compute_s and c.fits(m, 1, 0.0):
            most = m
            break
    lo = DENSE_ACCUM_STEPS + 1
    tops = sorted(((m * top, m, top) for m in ms if (top := _count_cap(c, m, global_batch, max_compute_s)) >= lo),
                  reverse=True)
    for conceivable, m, top in tops:
        if conceivable <= most:
            break
        if c.fits(m, lo, 0.0):
            most = max(most, m * last_fitting(c, m, 0.0, lo, top))
    return most


def _scope_bound_before_table(cost: CostModel, multi_node: bool, members: Sequence[int], global_batch: int,
                              micro_batches: Sequence[int] | None, max_compute_s: float, tol: float,
                              reach_of: dict) -> float:
    """A lower bound on the scope's plans, from a few memory checks per kind of device instead of
    its table (at large batches the tables of ZeRO 2 and 3, built only to be skipped, were most of a
    solve): the fluid bound by world-size range from `_rate_above` per kind; inf where the
    devices cannot take the batch at all; else per world-size range the larger of that bound and
    the capacity bound (`_capacity_bound_s`) over each kind's `_reach_before_table`, a range that
    could still beat the incumbent split in two as solve_scope splits it. Rates, most
    samples and reach are cached per kind in `reach_of` (the same for every scope of one solve). 0
    where the rates are unknown (a profile with a negative α or β)."""
    devices = cost.cluster.devices()
    counts: dict = {}
    for i in members:
        counts[devices[i][1]] = counts.get(devices[i][1], 0) + 1
    per_class = []
    for d, count in counts.items():
        if ("rate", d) not in reach_of:
            reach_of["rate", d] = _rate_above(cost, d, global_batch, micro_batches, max_compute_s)
        if reach_of["rate", d] is None:
            per_class = None
            break
        per_class.append((reach_of["rate", d], count, cost.coeffs[d].optimizer_s))
    comm = cost.comm_model(counts, multi_node)
    if per_class is not None:
        state_only = any(cost.max_share(d, 0, 0) > 0 for d in counts)
        if _segments_bound_s(per_class, state_only, comm.step, global_batch,
                             len(members)) >= max_compute_s * (1 - tol):
            return max_compute_s
    for d in counts:
        if ("most", d) not in reach_of:
            reach_of["most", d] = _most_before_table(cost, d, global_batch, micro_batches, max_compute_s)
    if sum(count * reach_of["most", d] for d, count in counts.items()) < global_batch:
        return math.inf
    if per_class is None:
        return 0.0
    for d in counts:
        if d not in reach_of:
            reach_of[d] = _reach_before_table(cost, d, global_batch, micro_batches, max_compute_s)
    reach = [(reach_of[d].within, count) for d, count in counts.items()]
    fluid_s = _fluid_bound_s(per_class, state_only, global_batch)
    # the least bound over world-size ranges, each range split in two (as solve_scope splits them)
    # while its bound does not reach the incumbent, up to PRE_TABLE_RANGES ranges in all
    best, looked = math.inf, 0
    stack = [(lo, hi, 0.0) for lo, hi in world_segments(len(members))]
    while stack:
        lo, hi, parent_s = stack.pop()
        looked += 1
        lower_s = max(parent_s, fluid_s, comm.step(lo).bound_s(_fluid_bound_s(per_class, state_only, global_batch, hi)))
        if lower_s < max_compute_s * (1 - tol):
            lower_s = _capacity_bound_s(reach, comm.step(lo), global_batch, hi, lower_s, max_compute_s, tol)
        if lower_s >= max_compute_s * (1 - tol):
            continue  # no plan of this range beats the incumbent
        if lo == hi or looked + len(stack) >= PRE_TABLE_RANGES:
            best = min(best, lower_s)
            continue
        mid = (lo + hi) // 2
        stack += [(lo, mid, lower_s), (mid + 1, hi, lower_s)]
    return min(best, max_compute_s)


def explain_infeasible(cost: CostModel, global_batch: int) -> str:
    """Why no plan exists: which devices cannot hold even the smallest shard or micro-batch, or
    how much of the state the devices can hold (with no batch, and beside a micro-batch of 1)."""
    problems, can_compute, room_idle, room_busy = [], False, 0.0, 0.0
    state = "optimizer state" if cost.zero == 1 else "training state"
    for _, d in cost.cluster.devices():
        c = cost.coeffs[d]
        idle, busy = cost.max_share(d, 0, 0), cost.max_share(d, 1, 1)
        if c.layerwise:  # accumulating layer by layer, two micro-batches of 1 may fit where one does not
            busy = max(busy, cost.max_share(d, 1, 2))
        room_idle += max(idle, 0.0)
        room_busy += max(busy, idle, 0.0) if busy < 0 else busy
        if idle < 0:
            problems.append(f"{d.label} cannot hold even the smallest shard (needs "
                            f"{c.memory_bytes(0, 0, 0.0) / GIB:.2f} GiB > {c.capacity_bytes / GIB:.2f} GiB = "
                            "capacity × headroom)")
        elif busy < 0:
            problems.append(f"{d.label} cannot hold micro-batch 1 (needs {c.memory_bytes(1, 1, 0.0) / GIB:.2f} GiB > "
                            f"{c.capacity_bytes / GIB:.2f} GiB)")
        else:
            can_compute = True
    problems = list(dict.fromkeys(problems))  # one line per kind of device
    detail = f" ({'; '.join(problems)})" if problems else ""
    if not can_compute:
        return "no device can hold a micro-batch of 1: " + "; ".join(problems)
    if room_idle < 1.0:
        return f"the sharded {state} does not fit: the devices hold at most {room_idle:.0%} of it{detail}"
    if room_busy < 1.0:
        return (f"the sharded {state} does not fit beside the micro-batches: with micro-batch 1 the devices "
                f"hold at most {room_busy:.0%} of it{detail}")
    most = sum(_max_batch(cost, d, global_batch) for _, d in cost.cluster.devices())
    if most < global_batch:
        return (f"the devices can take at most {most} samples per step in all (the memory of a device grows with "
                f"its accumulation steps), fewer than the global batch {global_batch}{detail}")
    return f"the global batch {global_batch} cannot be split over the candidate micro-batches and devices{detail}"


def _max_batch(cost: CostModel, device, global_batch: int) -> int:
    """The most samples one device can take in a step that fits its memory (any candidate): its
    largest choice, or per micro-batch m·(the top count of CostModel.bands, the largest n that fits
    at f = 0, found as bands finds it but without cutting the bands into affine pieces)."""
    c = cost.coeffs[device]
    batches = [ch.batch for ch in cost.choices(device, global_batch)]
    lo = DENSE_ACCUM_STEPS + 1
    for m in cost.micro_batch_candidates(global_batch, None):
        if global_batch // m >= lo and c.fits(m, lo, 0.0):
            batches.append(m * last_fitting(c, m, 0.0, lo, global_batch // m))
    return max(batches, default=0)


# a plan known before the search (a baseline's): its iteration time and per-device (m, n, share)
KnownPlan = tuple[float, Sequence[tuple[int, int, float]]]


def known_scope(cost: CostModel, per_device: Sequence[tuple[int, int, float]]) -> str:
    """The scope a known plan runs in: the one node all its used devices share, else all nodes."""
    nodes = {node.name for (node, _), (m, n, f) in zip(cost.cluster.devices(), per_device) if m * n > 0 or f > 0}
    return f"node {nodes.pop()}" if len(nodes) == 1 else "all nodes"


def solve_with_cost_model(cost: CostModel, global_batch: int, time_limit_s: float = 10.0, gap: float = 0.0,
                          micro_batches: Sequence[int] | None = None, known: KnownPlan | None = None,
                          beat_s: float = math.inf) -> tuple[ScopeSolution, str] | None:
    """The best plan over every scope: (solution, scope name). `known` (a plan found before the
    search, a baseline's) is the first incumbent: every choice slower than it drops out of the
    tables, every scope and world size whose bound cannot beat it is skipped, and it is the answer
    when nothing beats it. `beat_s` (another stage's plan): only a plan faster than it by more than
    the tolerance counts; None when there is none. Raises ValueError when nothing fits."""
    deadline = time.monotonic() + time_limit_s
    tol = gap if gap > 0 else BISECTION_TOL
    best: tuple[ScopeSolution, str, float] | None = None
    if known is not None and known[0] < beat_s * (1 - tol):
        best = (ScopeSolution("optimal", known[0], dict(enumerate(known[1]))), known_scope(cost, known[1]), known[0])
    upper_bound_s = best[2] if best else beat_s
    tables = []
    reach_of: dict = {}
    for name, multi, members in cost.scopes():
        members = [i for _, ix in members for i in ix]
        if _scope_bound_before_table(cost, multi, members, global_batch, micro_batches, upper_bound_s, tol,
                                     reach_of) < upper_bound_s * (1 - tol):
            tables.append(cost.scope_table(name, multi, members, global_batch, micro_batches, upper_bound_s))
    bounds = {t.name: _scope_lower_bound_s(t, global_batch) for t in tables}
    proven = True
    for table in sorted(tables, key=lambda t: bounds[t.name]):
        incumbent = best[2] if best else beat_s
        if bounds[table.name] >= incumbent * (1 - tol) or _most_samples(table) < global_batch:
            continue  # cannot beat the incumbent, or cannot take the batch even with every device full
        if time.monotonic() >= deadline:
            proven = False
            break
        sol = solve_scope(table, global_batch, deadline, tol, incumbent)
        if sol is None:
            continue
        proven = proven and sol.status == "optimal"
        t_s, _ = cost.estimate_iteration_s([sol.per_device.get(i, (0, 0, 0.0))
                                            for i in range(cost.cluster.num_devices)])
        if t_s < incumbent:
            best = (sol, table.name, t_s)
    if best is None and beat_s < math.inf:
        return None
    if best is None:
        if time.monotonic() >= deadline:
            raise ValueError(f"the solver's time limit of {time_limit_s:g} s ran out before it found a plan; "
                             "allow more time (planner plan --time-limit S)")
        raise ValueError(f"no feasible plan: {explain_infeasible(cost, global_batch)}")
    sol = best[0]
    if not proven:
        sol = ScopeSolution("feasible", sol.objective_s, sol.per_device)
    return sol, best[1]


def build_plan(cost: CostModel, model: str, global_batch: int, seq: int, dtype: str, recompute: str,
               per_device: Sequence[tuple[int, int, float]], notes: Sequence[str] = (), solve_s: float = 0.0,
               baselines: dict | None = None) -> Plan:
    """A Plan from per-device (m, n, share): shares renormalized to sum to 1, predictions filled."""
    devices = cost.cluster.devices()
    shares = [f if f > SHARE_EPS else 0.0 for _, _, f in per_device]
    total = sum(shares)
    shares = [f / total for f in shares] if total > 0 else shares
    # a device without samples runs no micro-batch: (0, 0), whatever (m, 0) or (0, n) it was given, so its
    # memory is its shard and state alone and its step has no compute
    per_device = [((m, n) if m * n > 0 else (0, 0)) + (f,) for (m, n, _), f in zip(per_device, shares)]
    iteration_s, steps = cost.estimate_iteration_s(per_device)
    assignments = []
    for i, ((node, dev), (m, n, f)) in enumerate(zip(devices, per_device)):
        mem = int(cost.estimate_memory_bytes(dev, m, n, f)) if (m * n > 0 or f > 0) else 0
        assignments.append(Assignment(i, node.name, dev.type, m, n, m * n, f, mem, steps[i],
                                      dev.emulated, dev.slowdown, dev.memory_gb))
    wire_bytes, exposed_s = cost.estimate_comm(per_device)
    return Plan(cost.cluster, model, global_batch, seq, dtype, recompute, tuple(assignments), iteration_s,
                global_batch / iteration_s, dict(baselines or {}), solve_s, tuple(notes), zero=cost.zero,
                param_dtype=cost.step.param_dtype, reduce_dtype=cost.step.reduce_dtype, prefetch=cost.step.prefetch,
                reduce_in_flight=cost.step.reduce_in_flight, predicted_wire_bytes_per_step=wire_bytes, predicted_exposed_comm_s=exposed_s)


def recompute_notes(cost: CostModel, per_device: dict) -> list[str]:
    """A note naming the kinds whose accumulating devices (zero >= 2, more than one micro-batch: every
    unit recomputed in its backward) were priced on an estimated recompute-full profile."""
    devices = cost.cluster.devices()
    kinds = sorted({devices[i][1].type for i, (_, n, _) in per_device.items()
                    if n > 1 and devices[i][1] in cost.coeffs and not cost.coeffs[devices[i][1]].recompute_measured})
    return [f"recomputed step times estimated (not measured) for {', '.join(kinds)}"] if kinds else []


def plan_notes(cost: CostModel, dtype: str) -> list[str]:
    notes = []
    for t in sorted({d.type for d in cost.coeffs}):
        if dtype == "bf16" and not get_gpu_type(t).supports_bf16:
            notes.append(f"{t} has no bf16: it trains in fp16")
    estimated = sorted({d.type for d, c in cost.coeffs.items() if not c.measured})
    if estimated:
        notes.append(f"step times estimated (not measured) for {', '.join(estimated)}")
    if cost.cluster.emulated:
        notes.append("some devices are emulated (slowdown / memory limit from the cluster file)")
    return notes


def validate_zero_choice(zero: int | str, param_dtype: str = PARAM_DTYPE_AUTO) -> tuple[int, ...]:
    """The stages to try: all of them for "auto" (only zero 3 where an explicit half `param_dtype` is
    asked: only zero 3 gathers parameters), else the one forced."""
    half_params = param_dtype not in (PARAM_DTYPE_AUTO, "fp32")
    if zero == ZERO_AUTO:
        return (3,) if half_params else ZERO_STAGES
    try:
        stage = validate_zero(zero)
    except ValueError:
        raise ValueError(f"zero must be one of {', '.join(map(str, ZERO_CHOICES))}, got {zero!r}") from None
    if half_params and stage != 3:
        raise ValueError(f"--param-dtype {param_dtype} needs zero 3 (got zero {stage}): zero 1 and 2 keep replicated "
                         "fp32 parameters and gather them in fp32; use --param-dtype auto or fp32, or --zero 3")
    return (stage,)


def validate_step_dtypes(dtype: str, param_dtype: str, reduce_dtype: str) -> None:
    """The mixed-precision flags on their own: `param_dtype` one of PARAM_DTYPE_CHOICES (fp16 only
    with an fp16 compute dtype, whose loss scaler keeps fp16 values in range; bf16 not beside fp16
    compute), `reduce_dtype` one of REDUCE_DTYPES."""
    if param_dtype not in PARAM_DTYPE_CHOICES:
        raise ValueError(f"param dtype must be one of {', '.join(PARAM_DTYPE_CHOICES)}, got {param_dtype!r}")
    if reduce_dtype not in REDUCE_DTYPES:
        raise ValueError(f"reduce dtype must be one of {', '.join(REDUCE_DTYPES)}, got {reduce_dtype!r}")
    if param_dtype == "fp16" and dtype != "fp16":
        raise ValueError(f"--param-dtype fp16 needs --dtype fp16 (got {dtype}): fp16 parameters need the loss "
                         "scaler, which runs with fp16 compute only")
    if param_dtype == "bf16" and dtype == "fp16":
        raise ValueError("--param-dtype bf16 with --dtype fp16 would gather bf16 weights for fp16 compute: use "
                         "--param-dtype fp16 or auto")


def step_candidates(zero: int, param_dtype: str, reduce_dtype: str) -> list[StepConfig]:
    """The runtime settings the ILP chooses among at one stage, most wanted first (a later one must
    beat the earlier ones): the reduce dtypes the user allowed (bf16 first where asked, then fp32),
    and at zero 3 the prefetch depths of PREFETCH_DEPTHS the time model tells apart, deepest first
    (prefetch 0 wins only where a deeper one does not fit or is slower), and at zero 2 and 3
    reduce-scatters left in flight, 1 then 0 (0 wins only where keeping a reduce's buffers through
    the next unit's backward does not fit or is slower; zero 1 has none to leave). `param_dtype`
    stays as asked (CostModel.build resolves auto)."""
    reduces = ("bf16", "fp32") if reduce_dtype == "bf16" else ("fp32",)
    depths = sorted((p for p in PREFETCH_DEPTHS if p <= OVERLAP_DEPTH), reverse=True) if zero == 3 else [1]
    flights = (1, 0) if zero >= 2 else (0,)
    return [StepConfig(param_dtype, r, p, f) for r in reduces for p in depths for f in flights]


def step_notes(cost: CostModel, reduce_dtype: str) -> list[str]:
    """What the chosen runtime settings are and, where the ILP left the default, why."""
    st = cost.step
    notes = [f"runtime: parameters gathered in {st.param_dtype}, gradients reduced in {st.reduce_dtype}"
             + (f", prefetch {st.prefetch}" if cost.zero == 3 else "")
             + (f", {st.reduce_in_flight} reduce-scatter left in flight" if cost.zero >= 2 else "")]
    if cost.zero == 3 and st.prefetch == 0:
        notes.append("prefetch 0: gathering the next unit ahead did not fit in memory or was not faster")
    if cost.zero >= 2 and st.reduce_in_flight == 0:
        notes.append("reduce_in_flight 0: leaving a reduce-scatter in flight did not fit in memory or was not faster")
    if reduce_dtype == "bf16" and st.reduce_dtype == "fp32":
        notes.append("reduce dtype fp32 although bf16 was allowed: the bf16 reduce did not fit or was not faster")
    return notes


@dataclass(frozen=True)
class _StageSolution:
    cost: CostModel
    solution: ScopeSolution
    scope: str
    iteration_s: float
    baselines: dict


def _solve_stage(cost: CostModel, global_batch: int, deadline: float, gap: float,
                 micro_batches: Sequence[int] | None, beat_s: float) -> _StageSolution | None:
    """The best plan under one cost model (a ZeRO stage and runtime settings), or None if it does not
    beat `beat_s` (another's time). Raises ValueError when nothing fits under it."""
    cluster = cost.cluster
    plans = baseline_plans(cost, global_batch)
    baselines = {name: r for name, (r, _) in plans.items()}
    known = min(((r.predicted_iteration_s, per_device)
                 for r, per_device in (*plans.values(), estimate_memory_aware(cost, global_batch))
                 if per_device is not None), key=lambda k: k[0], default=None)
    found = solve_with_cost_model(cost, global_batch, max(deadline - time.monotonic(), 0.01), gap, micro_batches,
                                  known, beat_s)
    if found is None:
        return None
    sol, scope = found
    t_s, _ = cost.estimate_iteration_s([sol.per_device.get(i, (0, 0, 0.0)) for i in range(cluster.num_devices)])
    return _StageSolution(cost, sol, scope, t_s, baselines)


def solve_candidates(costs: Sequence[CostModel], global_batch: int, deadline: float, gap: float = 0.0,
                     micro_batches: Sequence[int] | None = None,
                     beat_s: float = math.inf) -> tuple[_StageSolution | None, list[str]]:
    """The fastest plan over cost models of one stage that differ in runtime settings (step_candidates),
    each later one kept only where it beats the best so far (and `beat_s`) by more than the tolerance:
    (the best, or None where none beats beat_s; the ValueError messages of those nothing fits)."""
    best: _StageSolution | None = None
    errors: list[str] = []
    for cost in costs:
        try:
            found = _solve_stage(cost, global_batch, deadline, gap, micro_batches,
                                 min(beat_s, best.iteration_s if best else math.inf))
        except ValueError as e:
            if time.monotonic() >= deadline and best is None:
                raise
            errors.append(str(e))
            continue
        if found is not None:
            best = found
    return best, errors


def solve_plan(cluster: ClusterSpec, model: str, global_batch: int, seq: int | None = None, dtype: str = "fp32",
               recompute: str = "none", headroom: float = MEMORY_HEADROOM, time_limit_s: float = 10.0, gap: float = 0.0,
               micro_batches: Sequence[int] | None = None, profiles_dir: str | None = None,
               zero: int | str = ZERO_AUTO, param_dtype: str = PARAM_DTYPE_AUTO,
               reduce_dtype: str = "fp32") -> HeteroResult:
    """The fastest plan of `model` on `cluster` at `global_batch` under the cost model (planner/costmodel/training.py).

    `zero`: "auto" solves each ZeRO stage (1, 2, 3, in that order) and keeps the shortest predicted
    iteration that fits; a later stage must beat the earlier ones by more than the solver's
    tolerance, so ties go to the lower stage. An int forces that stage. `gap`: "optimal" means within
    this relative distance of the proven lower bound (0: BISECTION_TOL; tighter costs more ranges of
    world sizes, tests/unit/test_ilp_exact.py asks 5e-7); `time_limit_s` bounds the whole search, every
    stage together.
    `micro_batches` replaces the candidate micro-batches (default: powers of two). `param_dtype`:
    the dtype zero 3 gathers parameters in (auto: the compute dtype; an explicit half dtype limits
    "auto" to zero 3 and refuses zero 1 and 2); `reduce_dtype`: bf16 allows bf16 reduce-scatters,
    which the ILP takes unless fp32 ones are faster; fp32 (default) keeps them fp32. Per stage the
    ILP also chooses the prefetch depth and the reduce-scatters left in flight (step_candidates). Raises ValueError on bad input and when
    no plan fits at any stage tried, naming why."""
    validate_inputs(global_batch, seq, dtype, recompute, headroom, time_limit_s, gap)
    validate_step_dtypes(dtype, param_dtype, reduce_dtype)
    stages = validate_zero_choice(zero, param_dtype)
    if micro_batches is not None and (not micro_batches or any(
            isinstance(m, bool) or not isinstance(m, int) or m < 1 for m in micro_batches)):
        raise ValueError(f"micro_batches must be positive integers, got {micro_batches!r}")
    spec = get_model(model)
    seq = seq if seq is not None else min(spec.max_seq, DEFAULT_MAX_SEQ)
    spec = with_max_seq(spec, seq)
    started = time.perf_counter()
    deadline = time.monotonic() + time_limit_s
    profile_cache: dict = {}
    best: _StageSolution | None = None
    candidates: dict[int, ZeroCandidate] = {}
    failures: dict[int, str] = {}
    for z in stages:
        costs = [CostModel.build(cluster, spec, seq, dtype, recompute, headroom, profiles_dir, zero=z,
                                 profile_cache=profile_cache, param_dtype=st.param_dtype,
                                 reduce_dtype=st.reduce_dtype, prefetch=st.prefetch,
                                 reduce_in_flight=st.reduce_in_flight, step_tokens=global_batch * seq)
                 for st in step_candidates(z, param_dtype, reduce_dtype)]
        found, errors = solve_candidates(costs, global_batch, deadline, gap, micro_batches,
                                         best.iteration_s if best else math.inf)
        if found is None and len(errors) == len(costs):  # nothing fits at this stage
            # the last candidate needs the least memory (fp32 reduce, prefetch 0, no reduce in flight): its
            # reason is the one to give
            if len(stages) == 1 or time.monotonic() >= deadline:
                raise ValueError(errors[-1])
            failures[z] = errors[-1]
            candidates[z] = ZeroCandidate(None, False, errors[-1])
            continue
        if found is None:  # feasible, but not faster than a lower stage
            candidates[z] = ZeroCandidate(None, None, f"no plan faster than zero {best.cost.zero}'s")
            continue
        best = found
        candidates[z] = ZeroCandidate(found.iteration_s, True)
    if best is None:
        raise ValueError("no feasible plan at any ZeRO stage: " + "; ".join(
            f"zero {z}: {msg.removeprefix('no feasible plan: ')}" for z, msg in failures.items()))
    solve_s = time.perf_counter() - started
    for z, c in candidates.items():
        if c.feasible and c.predicted_iteration_s is not None:
            candidates[z] = ZeroCandidate(c.predicted_iteration_s, True, "chosen" if z == best.cost.zero else "slower")
    sol, cost = best.solution, best.cost
    notes = plan_notes(cost, dtype) + [f"scope: {best.scope}", f"zero {cost.zero}" + (
        " (auto: the fastest predicted stage that fits)" if len(stages) > 1 else " (forced)")]
    if zero == ZERO_AUTO and len(stages) == 1:
        notes.append(f"zero 3 only: --param-dtype {param_dtype} gathers parameters, which only zero 3 does")
    notes += step_notes(cost, reduce_dtype)
    notes += recompute_notes(cost, sol.per_device)
    plan = build_plan(cost, model, global_batch, seq, dtype, recompute,
                      [sol.per_device.get(i, (0, 0, 0.0)) for i in range(cluster.num_devices)],
                      notes, solve_s, best.baselines)
    plan = replace(plan, zero_candidates=candidates)
    log.info("plan for %s on %s: zero %d, %.4g s/iteration (%s, %s) in %.3f s", model, cluster.name, cost.zero,
             plan.predicted_iteration_s, sol.status, best.scope, solve_s)
    reason = "" if sol.status == "optimal" else (
        f"not proven optimal: the time limit of {time_limit_s:g} s (--time-limit) ran out before the search closed "
        f"to {BISECTION_TOL:.0e} of its lower bound")
    return HeteroResult(sol.status, sol.objective_s, plan, solve_s, reason)


def evaluate_plan(plan: Plan, headroom: float = MEMORY_HEADROOM, profiles_dir: str | None = None) -> Plan:
    """The same plan with its predictions (memory, step and iteration time, baselines) recomputed
    by the current cost model at the plan's own ZeRO stage; a note for each device predicted over
    capacity × headroom. The other stages' figures from the solve are kept as they were."""
    spec = with_max_seq(get_model(plan.model), plan.seq)
    cost = CostModel.build(plan.cluster, spec, plan.seq, plan.dtype, plan.recompute, headroom, profiles_dir,
                           zero=plan.zero, param_dtype=plan.param_dtype, reduce_dtype=plan.reduce_dtype,
                           prefetch=plan.prefetch, reduce_in_flight=plan.reduce_in_flight,
                           step_tokens=plan.global_batch * plan.seq)
    per_device = [(a.micro_batch, a.accum_steps, a.shard_fraction) for a in plan.assignments]
    notes = plan_notes(cost, plan.dtype)
    fits = True
    for a in plan.assignments:
        dev = plan.cluster.devices()[a.device_index][1]
        cap = cost.coeffs[dev].capacity_bytes
        if a.used and cost.estimate_memory_bytes(dev, a.micro_batch, a.accum_steps, a.shard_fraction) > cap:
            fits = False
            notes.append(f"device {a.device_index} ({dev.label}) is predicted over its memory "
                         f"capacity × headroom {headroom:g}")
    evaluated = build_plan(cost, plan.model, plan.global_batch, plan.seq, plan.dtype, plan.recompute, per_device,
                           notes, plan.solve_s, estimate_baselines(cost, plan.global_batch))
    candidates = dict(plan.zero_candidates)
    candidates[plan.zero] = ZeroCandidate(evaluated.predicted_iteration_s, fits, "re-evaluated")
    return replace(evaluated, zero_candidates=candidates)
