"""Live rebalancing: re-split the global batch from measured rates at a step boundary, no restart.

`executor launch --rebalance auto|off` (the plan's `rebalance` field, default auto). Rank 0 follows
each rank's measured compute against the profile's prediction of its micro-batches (`Rebalancer`);
when a rank's ratio departs from the one the current split assumed by more than
DEPARTURE_THRESHOLD (relative to the other ranks, median over WINDOW_STEPS steps), it re-solves
the split (`solve_split`) with the rates measured since that rank departed (DEPARTED_STEPS steps)
and, when that is predicted at least MIN_GAIN faster, every rank takes the new split at the next
step (rank 0 decides, executor/worker.py broadcasts it). A new split is a trial: its first
window's measured step must beat the split it replaced, or the split before it comes back.

What changes and what does not:
- only each rank's batch and its micro-batch × accumulation steps; the shard fractions stay (the
  runtime's state is sharded by them; changing them would be a restart), and every new
  (micro-batch, accumulation) must fit the device's memory under the planner's memory model at
  its shard (`DeviceCoeffs.fits`);
- the global batch and the sample order: the step's windows are the same for any split
  (executor/corpus.py's GlobalSampler), a split only cuts them into consecutive pieces
  (`batch_slices`), and the loss is normalised by the global token count, so every sample is used
  once and the gradient is the same sum whichever rank computes it (up to float summation order).

The solver. The planner's ILP (planner/hetero/solve.py) chooses batches and shards together; with
the shards fixed, every rank has the same collectives and the same optimizer work whatever its
batch, so the step is the cost model's max-plus chain, max over ranks of (compute + the rank's own
non-compute time), and only the compute depends on the split. Rank i's step with b samples is its
measured rate × the cost model's `compute_s(m, n)` (α n + β m n, or the recompute profile where the
plan accumulates layer by layer) for the best (m, n = b / m) that fits, m among the planner's
candidate micro-batches (powers of two), plus the step's non-compute time, the same for every
rank: measured on the slowest rank of each step of the window (its step time beyond its compute;
`_overheads`).
`solve_split` finds the split whose slowest rank is least, exactly: the least bound T for which
batches within T sum to the global batch, by bisection over the candidate times, each tested by a
subset-sum over bitsets. The event's `predicted_step_s` is that bound.
"""
from __future__ import annotations

import collections
import logging
import statistics
import time
from dataclasses import dataclass, replace
from typing import Callable, Sequence

log = logging.getLogger(__name__)

DEPARTURE_THRESHOLD = 1.25  # a rank's rate 25 % off what the split assumed (relative to the others)
# apply a new split only when its predicted step is >= 10 % shorter: rates measured over a few steps
# of a shared machine wander by several per cent, and each change costs a step of new shapes
MIN_GAIN = 0.10
# measured steps a decision rests on (a new split's first step is skipped): one more than the
# straggler's window, so a passing disturbance of a step or two on a shared machine moves nothing
WINDOW_STEPS = 4
MIN_BATCH = 1  # every rank keeps at least one sample (a rank without samples would still gather)
# steps since a rank departed that a new split is solved on (fewer than the window where the change
# began inside it; the decision waits a step or two for them)
DEPARTED_STEPS = 3
# a coarser split (batches in multiples of a power of two, so micro-batches stay large) is taken
# when its predicted compute is within this of the finest split's: a profile's α (the fixed cost of
# a micro-batch) is its least certain figure, and a split of odd batches runs micro-batches of one
UNIT_TOLERANCE = 0.10


def solve_coarse_split(global_batch: int, tables: Sequence[Sequence[tuple[float, int, int] | None]],
                       current: Sequence[int] | None, max_unit: int,
                       tolerance: float = UNIT_TOLERANCE) -> SplitResult:
    """solve_split at the largest power-of-two unit <= `max_unit` whose slowest compute is within
    `tolerance` of the unit-1 optimum (the unit-1 split when none is)."""
    finest = solve_split(global_batch, tables, current)
    unit = 1 << max(0, max_unit.bit_length() - 1)
    while unit > 1:
        try:
            coarse = solve_split(global_batch, tables, current, unit)
        except ValueError:
            coarse = None
        if coarse is not None and coarse.makespan_s <= finest.makespan_s * (1.0 + tolerance):
            return replace(coarse, solve_time_s=coarse.solve_time_s + finest.solve_time_s)
        unit //= 2
    return finest


@dataclass(frozen=True)
class SplitResult:
    """A solved split: per rank (micro_batch, accum_steps), each rank's predicted compute (s) and the
    slowest's (the objective), and the solve's time."""

    pieces: tuple[tuple[int, int], ...]
    compute_s: tuple[float, ...]
    makespan_s: float
    solve_time_s: float

    @property
    def batches(self) -> list[int]:
        return [m * n for m, n in self.pieces]


def best_pieces(compute_s: Callable[[int, int], float], fits: Callable[[int, int], bool], global_batch: int,
                micro_batches: Sequence[int], min_batch: int = MIN_BATCH) -> list[tuple[float, int, int] | None]:
    """For b = 0..global_batch: (compute seconds, m, n) of the fastest (m, n = b / m) that fits, m
    among `micro_batches` dividing b; None where none does or b < min_batch."""
    out: list[tuple[float, int, int] | None] = [None] * (global_batch + 1)
    for b in range(max(min_batch, 1), global_batch + 1):
        best = None
        for m in micro_batches:
            if m > b:
                break
            if b % m == 0 and fits(m, b // m):
                t = compute_s(m, b // m)
                if best is None or t < best[0]:
                    best = (t, m, b // m)
        out[b] = best
    return out


def _reach(options: Sequence[Sequence[int]], total: int) -> list[int]:
    """reach[k]: bitset of the sums the first k ranks' options can make (bit s set: sum s), up to total."""
    mask = (1 << (total + 1)) - 1
    reach = [1]
    for opts in options:
        prev, cur = reach[-1], 0
        for b in opts:
            cur |= prev << b
        reach.append(cur & mask)
    return reach


def solve_split(global_batch: int, tables: Sequence[Sequence[tuple[float, int, int] | None]],
                current: Sequence[int] | None = None, unit: int = 1) -> SplitResult:
    """The split of `global_batch` over the ranks of `tables` (each best_pieces' list, in rank order)
    whose slowest rank's compute is least, every batch a multiple of `unit`; among splits as fast,
    the batches nearest `current`. ValueError when no split fits (a rank that cannot hold any
    batch, or the ranks together not the global batch)."""
    started = time.perf_counter()
    if not tables:
        raise ValueError("solve_split: no ranks")
    for i, t in enumerate(tables):
        if len(t) != global_batch + 1:
            raise ValueError(f"solve_split: rank {i}'s table covers {len(t) - 1} samples, not the global batch "
                             f"{global_batch}")
        if not any(x is not None for x in t):
            raise ValueError(f"solve_split: rank {i} fits no batch of 1 to {global_batch} samples")
    times = sorted({x[0] for t in tables for b, x in enumerate(t) if x is not None and b % unit == 0})
    if not times:
        raise ValueError(f"solve_split: no rank fits a batch that is a multiple of {unit}")

    def feasible(bound_s: float) -> list[int] | None:
        options = [[b for b, x in enumerate(t) if x is not None and x[0] <= bound_s and b % unit == 0]
                   for t in tables]
        reach = _reach(options, global_batch)
        if not (reach[-1] >> global_batch) & 1:
            return None
        batches, left = [0] * len(tables), global_batch  # back from the last rank, nearest `current` first
        for k in range(len(tables) - 1, -1, -1):
            want = current[k] if current is not None else left
            for b in sorted(options[k], key=lambda b: (abs(b - want), b)):
                if b <= left and (reach[k] >> (left - b)) & 1:
                    batches[k], left = b, left - b
                    break
        return batches

    lo, hi = 0, len(times) - 1
    if feasible(times[hi]) is None:
        raise ValueError(f"solve_split: the ranks together cannot take the global batch {global_batch} within "
                         "their memory")
    while lo < hi:  # the least candidate time whose split exists
        mid = (lo + hi) // 2
        if feasible(times[mid]) is not None:
            hi = mid
        else:
            lo = mid + 1
    batches = feasible(times[lo])
    assert batches is not None
    pieces = tuple((tables[i][b][1], tables[i][b][2]) for i, b in enumerate(batches))
    computes = tuple(tables[i][b][0] for i, b in enumerate(batches))
    return SplitResult(pieces, computes, max(computes), time.perf_counter() - started)


# ---- the rank-0 side of a run ------------------------------------------------------------------


@dataclass(frozen=True)
class Decision:
    """A new split to apply from `step` on (per plan position), and what the event records."""

    step: int  # the first step trained with the new split
    pieces: tuple[tuple[int, int], ...]
    detail: dict  # the rebalance event's detail: old and new split, reason, predictions
    message: str


class Rebalancer:
    """Rank 0's view of the split: the current (micro_batch, accum_steps) per plan position, the
    rates it assumed (measured compute / profile compute, 1.0 each for the plan's own split), and the
    newest measured steps. `observe` each step; a Decision when a new split is to be applied.

    Every new split is a trial judged by measurement: its first window (after its first step) gives
    its median step time and each rank's rate on its own shapes (a profile's error differs from one
    micro-batch to another, so the rates a split assumes are those measured on it). Measured no
    faster than the split before it, the trial is undone (one more change, back to the previous
    split and its rates), unless the rates measured on the trial price the split before it MIN_GAIN
    slower than the trial (the speeds changed after the split before was measured: its step is no
    yardstick); kept, the split is re-solved once more with the rates measured on it (a window that
    straddled the slowdown under-measured it), a new trial only where the model's split is MIN_GAIN
    faster than the step measured. So the run keeps a split measured slower than the one it replaced
    only where the speeds measured on it say the one it replaced would be slower still.

    `compute_s(i, m, n)`, `fits(i, m, n)`: position i's profile compute and memory check
    (planner/costmodel's DeviceCoeffs at its kind and shard); `devices[i]`: how events name it."""

    def __init__(self, global_batch: int, pieces: Sequence[tuple[int, int]], devices: Sequence[str],
                 compute_s: Callable[[int, int, int], float], fits: Callable[[int, int, int], bool],
                 micro_batches: Sequence[int], threshold: float = DEPARTURE_THRESHOLD, min_gain: float = MIN_GAIN,
                 window: int = WINDOW_STEPS, last_step: int | None = None):
        if threshold <= 1.0 or not 0.0 <= min_gain < 1.0 or window < 1:
            raise ValueError(f"rebalancer: need threshold > 1, 0 <= min_gain < 1, window >= 1; got {threshold}, "
                             f"{min_gain}, {window}")
        self.global_batch = global_batch
        self.pieces = [tuple(p) for p in pieces]
        self.devices = list(devices)
        self.compute_s, self.fits = compute_s, fits
        self.micro_batches = sorted(micro_batches)
        self.threshold, self.min_gain, self.window = threshold, min_gain, window
        self.assumed = [1.0] * len(self.pieces)
        # (step, ratios, the slowest rank's non-compute seconds, step seconds)
        self.history: collections.deque = collections.deque(maxlen=window)
        self.skip_next = False
        self.changes = 0
        self.trial: Trial | None = None  # the split being judged, and what it replaced
        # the run's last step: a new split whose first window would not be measured by then is not
        # tried (an unjudged trial could only cost: nothing would undo it were it slower)
        self.last_step = last_step

    def judgeable_from(self, first: int) -> bool:
        """Whether a split taken from step `first` has its first step (skipped) and a measured window
        before the run's last step ends (always, without a last step)."""
        return self.last_step is None or first + self.window <= self.last_step

    def predicted(self, pieces: Sequence[tuple[int, int]] | None = None) -> list[float]:
        """The profile's compute (s) of each position's micro-batches (the current split by default)."""
        return [self.compute_s(i, m, n) if m * n else 0.0 for i, (m, n) in enumerate(pieces or self.pieces)]

    def observe(self, step: int, computes: Sequence[float], step_s: float) -> Decision | None:
        """Step `step`'s measured compute per position and its step time; a Decision to train step
        `step` + 1 on when the measured rates call for a new split (or a trial split is undone)."""
        if self.skip_next:  # the first step of a new split (new shapes) does not count
            self.skip_next = False
            return None
        pred = self.predicted()
        if any(c is None or c <= 0 for c in computes) or any(p <= 0 for p in pred):
            return None
        ratios = [c / p for c, p in zip(computes, pred)]
        slowest = max(range(len(computes)), key=lambda i: computes[i])
        self.history.append((step, ratios, max(0.0, step_s - computes[slowest]), step_s))
        if len(self.history) < self.window:
            return None
        history = list(self.history)
        self.history.clear()  # the next decision rests on new steps, whatever this one is
        if self.trial is not None:
            return self._judge(step, history)
        rates = _median_rates(history)
        from executor.straggler import slowdowns  # each rank against the median of the others

        departures = slowdowns([r / a for r, a in zip(rates, self.assumed)])
        # the rank furthest off; of two as far (two ranks: reciprocal departures), the slower one
        worst = max(range(len(departures)),
                    key=lambda i: (round(max(departures[i], 1 / departures[i]), 6), departures[i]))
        d = departures[worst]
        if max(d, 1 / d) < self.threshold:
            self.history.extend(history[1:])  # a sliding window while nothing departs
            return None
        # the rates and the step time the new split is solved with and must beat: the window's steps
        # from the first one in which that rank departed on, once there are DEPARTED_STEPS of them. The
        # whole window's median says that a rank departed; where the change began inside the window,
        # that median mixes steps before it with steps after it and prices the new speed only in part
        # (a rank slowed 3x from the window's second step reads 2x), and a split solved for that would
        # be re-solved only after its own trial window. The steps since the change measure it whole,
        # and a median of three of them stands one disturbed step.
        need = min(DEPARTED_STEPS, self.window)
        first = next((k for k, h in enumerate(history)
                      if _departed(slowdowns([r / a for r, a in zip(h[1], self.assumed)])[worst], d, self.threshold)),
                     len(history))
        recent = history[first:]
        if len(recent) < need:
            self.history.extend(history[1:])  # the next step may make them enough
            return None
        rates = _median_rates(recent)
        reason = (f"rank {worst} on {self.devices[worst]} measured {max(d, 1 / d):.2f}x "
                  f"{'slower' if d > 1 else 'faster'} than its split assumed (relative to the other ranks, "
                  f"median of steps {history[0][0]}-{step}; the split solved at the rates of steps "
                  f"{recent[0][0]}-{step})")
        return self._decide(step, rates, _overheads(recent, rates), statistics.median(h[3] for h in recent),
                            reason, worst, departure=d)

    def _judge(self, step: int, history: list) -> Decision | None:
        """The trial split's first window measured: undone when no faster than the split before it,
        else kept with the rates measured on it and re-solved with them."""
        trial, self.trial = self.trial, None
        rates = _median_rates(history)
        now_s = statistics.median(h[3] for h in history)
        overhead_now = _overheads(history, rates)
        # the split before, priced at the rates measured now: MIN_GAIN slower than this one there, its
        # measured step predates a change of speeds (a window that straddled a slowdown measured it
        # in part) and is no yardstick
        old_now = max(r * c + o for r, c, o in zip(rates, self.predicted(trial.pieces), overhead_now))
        this_now = max(r * c + o for r, c, o in zip(rates, self.predicted(), overhead_now))
        stale = this_now < (1.0 - self.min_gain) * old_now
        if now_s >= trial.before_s and not stale:
            reason = (f"the new split measured {now_s:.4f} s a step (median of steps {history[0][0]}-{step}), "
                      f"the split before it {trial.before_s:.4f} s: back to that split")
            overhead = _overheads(history, trial.rates)
            before = max(r * c + o for r, c, o in zip(rates, self.predicted(), overhead))
            back = max(r * c + o for r, c, o in zip(trial.rates, self.predicted(trial.pieces), overhead))
            return self._apply(step, trial.pieces, trial.rates, reason, None, before, back,
                               {"rank": trial.rank, "undone": True, "measured_step_s": round(now_s, 6)})
        self.assumed = list(rates)
        reason = (f"the new split measured {now_s:.4f} s a step against {trial.before_s:.4f} s before it"
                  + (f" (at the rates measured now the split before it prices at {old_now:.4f} s, this one at "
                     f"{this_now:.4f} s: the speeds changed since it was measured)" if now_s >= trial.before_s else "")
                  + f": re-solved with the rates measured on it (steps {history[0][0]}-{step})")
        return self._decide(step, rates, overhead_now, now_s, reason, trial.rank, measured_s=now_s)

    def _decide(self, step: int, rates: list[float], overhead_s: list[float], before_s: float, reason: str,
                rank: int, departure: float | None = None, measured_s: float | None = None) -> Decision | None:
        """Re-solve with rank i's step = rates[i] × its profile compute + overhead_s[i]; a trial
        Decision when the best split is new and predicted MIN_GAIN faster than the current one under
        the same rates, and than `measured_s` where given (a split measured on its own shapes: the
        model's gain must hold against the measured step, not only against its own price of it).
        `before_s`: the current split's measured step, what the trial must beat."""
        tables = [best_pieces(lambda m, n, i=i: rates[i] * self.compute_s(i, m, n) + overhead_s[i],
                              lambda m, n, i=i: self.fits(i, m, n), self.global_batch, self.micro_batches)
                  for i in range(len(rates))]
        old_batches = [m * n for m, n in self.pieces]
        try:
            result = solve_coarse_split(self.global_batch, tables, old_batches, max(m for m, _ in self.pieces))
        except ValueError as e:
            log.warning("rebalance at step %d: %s", step, e)
            return None
        old_s = max(r * c + o for r, c, o in zip(rates, self.predicted(), overhead_s))
        new_s = result.makespan_s
        if list(result.pieces) == self.pieces or new_s > (1.0 - self.min_gain) * min(
                old_s, measured_s if measured_s is not None else old_s):
            log.info("rebalance at step %d: kept the split (predicted %.3f s, best %.3f s)", step, old_s, new_s)
            self.assumed = list(rates)
            return None
        if not self.judgeable_from(step + 1):
            log.info("rebalance at step %d: kept the split: a new one from step %d would not be judged by the last "
                     "step %d (its first step and a window of %d)", step, step + 1, self.last_step, self.window)
            self.assumed = list(rates)
            return None
        trial = Trial(tuple(self.pieces), list(rates), before_s, rank)
        extra = {"rank": rank, "predicted_compute_s": [round(c - o, 6) for c, o in zip(result.compute_s, overhead_s)],
                 "overhead_s": [round(o, 6) for o in overhead_s], "solve_s": round(result.solve_time_s, 6),
                 "measured_step_s_before": round(before_s, 6)}
        if departure is not None:
            extra["departure"] = round(departure, 4)
        return self._apply(step, result.pieces, rates, reason, trial, old_s, new_s, extra)

    def _apply(self, step: int, pieces: Sequence[tuple[int, int]], rates: list[float], reason: str,
               trial: Trial | None, old_s: float, new_s: float, extra: dict) -> Decision:
        """Take `pieces` from step + 1 on, assuming `rates`; the rebalance event's detail and message."""
        old_batches = [m * n for m, n in self.pieces]
        new_batches = [m * n for m, n in pieces]
        detail = dict(extra, reason=reason,
                      old_split=[{"rank": i, "batch": m * n, "micro_batch": m, "accum_steps": n}
                                 for i, (m, n) in enumerate(self.pieces)],
                      new_split=[{"rank": i, "batch": m * n, "micro_batch": m, "accum_steps": n}
                                 for i, (m, n) in enumerate(pieces)],
                      rates_vs_profile=[round(r, 4) for r in rates], predicted_step_s_before=round(old_s, 6),
                      predicted_step_s=round(new_s, 6), from_step=step + 1)
        message = (f"rebalance from step {step + 1}: batches {old_batches} -> {new_batches} ({reason}); "
                   f"predicted step {old_s:.3f} s -> {new_s:.3f} s")
        self.pieces = [tuple(p) for p in pieces]
        self.assumed = list(rates)
        self.trial = trial
        self.skip_next = True
        self.changes += 1
        return Decision(step + 1, tuple(self.pieces), detail, message)


@dataclass(frozen=True)
class Trial:
    """A split on trial: the one it replaced (`pieces`, its measured `rates`, its measured step
    `before_s`) and the rank whose departure started it."""

    pieces: tuple[tuple[int, int], ...]
    rates: list[float]
    before_s: float
    rank: int


def _departed(step_departure: float, departure: float, threshold: float) -> bool:
    """Whether one step's departure of a rank lies as far as `threshold` on the side of the window's
    `departure` (slower: > 1, faster: < 1)."""
    return step_departure >= threshold if departure > 1 else step_departure <= 1 / threshold


def _median_rates(history: Sequence[tuple]) -> list[float]:
    """Each position's median ratio of measured to profile compute over `history`'s steps."""
    return [statistics.median(h[1][i] for h in history) for i in range(len(history[0][1]))]


def _overheads(history: Sequence[tuple], rates: Sequence[float]) -> list[float]:
    """The step's non-compute time (the gradient collectives, the optimizer on the fixed shards),
    the same for every rank: measured on the slowest rank of each step (the step's time beyond its
    compute, where it waits for no one). A split moves only compute: the collectives are the ranks'
    together (one all-reduce or reduce-scatter, as slow as its slowest member whoever computed
    more), and each rank's optimizer works on its shard, which no split changes; so a slowed rank
    is not charged the collectives' time again at its rate. `rates`: one entry per rank."""
    common_s = statistics.median(h[2] for h in history)
    return [common_s for _ in rates]


def kind_rates(kinds: Sequence[str], rates: Sequence[float]) -> dict[str, float]:
    """Each device kind's measured rate (measured / profile compute): the median over its ranks."""
    by: dict[str, list[float]] = {}
    for k, r in zip(kinds, rates):
        by.setdefault(k, []).append(r)
    return {k: statistics.median(v) for k, v in by.items()}


def learned_profile(base, rate: float, run_dir: str, steps: str):
    """The profile store's entry of a kind as a run measured it: `base` (planner.core.profiles'
    StepProfile the run was planned with) with its α, β and optimizer time × `rate`, labelled
    measured in the run."""
    return replace(base, alpha_s=base.alpha_s * rate, beta_s=base.beta_s * rate,
                   optimizer_s_per_param=base.optimizer_s_per_param * rate, measured=True, r2=None,
                   micro_batches=(), step_times_s=(), efficiency=None,
                   created=time.strftime("%Y-%m-%dT%H:%M:%S"),
                   source=f"measured in a run ({run_dir}, steps {steps}): {rate:.3g}x the {base.kind} profile "
                          f"({base.source[:120]})")


# ---- the run's monitor on rank 0: predictions, the straggler, the split ----------------------------


class SplitMonitor:
    """Rank 0's follower of a data-parallel run (executor/worker.py): each step's per-rank
    predictions (`predictions`), the straggler (executor/straggler.py) and, with `auto`, the live
    split (Rebalancer), each change recorded in `store` as a step event and the rates learned written
    to the profile store. Positions are the plan's used devices in order; `owner[p]` is p's rank.
    Built from the planner's cost model of the plan (its kinds' profiles, memory model and
    collectives at the plan's ZeRO stage and runtime settings)."""

    def __init__(self, plan, run_dir: str, store, owner: dict[int, int], auto: bool, last_step: int | None = None):
        from contracts.constants import MEMORY_HEADROOM
        from contracts.specs import get_model, with_max_seq
        from executor.straggler import StragglerDetector
        from planner.core.profiles import get_step_profile
        from planner.costmodel.training import CostModel

        self.plan, self.run_dir, self.store, self.owner, self.auto = plan, run_dir, store, owner, auto
        self.spec = with_max_seq(get_model(plan.model), plan.seq)
        self.cost = CostModel.build(plan.cluster, self.spec, plan.seq, plan.dtype, plan.recompute, MEMORY_HEADROOM,
                                    zero=plan.zero, param_dtype=plan.param_dtype, reduce_dtype=plan.reduce_dtype,
                                    prefetch=plan.prefetch, reduce_in_flight=plan.reduce_in_flight)
        devices = plan.cluster.devices()
        used = plan.used
        self.kinds = [devices[a.device_index][1] for a in used]
        self.coeffs = [self.cost.coeffs[d] for d in self.kinds]
        self.shards = [a.shard_fraction for a in used]
        self.names = [f"{d.profile_key} (device {a.device_index} on {a.node})" for d, a in zip(self.kinds, used)]
        # the profiles the run was planned with: what a learned rate multiplies (never a learned one)
        self.base_profiles = {d.profile_key: get_step_profile(d.profile_key, self.spec, plan.seq, plan.dtype,
                                                              plan.recompute) for d in self.kinds}
        self.detector = StragglerDetector(self.names)
        self.rebalancer = Rebalancer(
            plan.global_batch, [(a.micro_batch, a.accum_steps) for a in used], self.names,
            compute_s=lambda i, m, n: self.coeffs[i].compute_s(m, n),
            fits=lambda i, m, n: self.coeffs[i].fits(m, n, self.shards[i]),
            micro_batches=self.cost.micro_batch_candidates(plan.global_batch, None), last_step=last_step)
        self._cluster_index = [a.device_index for a in used]
        self._predicted: tuple | None = None  # (split, compute, wait) of the last split asked

    @property
    def pieces(self) -> list[tuple[int, int]]:
        return list(self.rebalancer.pieces)

    def predictions(self) -> tuple[list[float], list[float]]:
        """Per position, the profile's compute of its micro-batches and its wait: the cost model's
        iteration of the current split less the position's compute and optimizer on its shard."""
        per_device = [(0, 0, 0.0)] * len(self.plan.cluster.devices())
        for i, (m, n) in enumerate(self.rebalancer.pieces):
            per_device[self._cluster_index[i]] = (m, n, self.shards[i])
        key = tuple(self.rebalancer.pieces)
        if self._predicted is None or self._predicted[0] != key:  # once per split: rank 0 may be the slow one
            iteration_s, _ = self.cost.estimate_iteration_s(per_device)
            compute = self.rebalancer.predicted()
            wait = [max(0.0, iteration_s - c - self.coeffs[i].optimizer_s * self.shards[i])
                    for i, c in enumerate(compute)]
            self._predicted = (key, compute, wait)
        return list(self._predicted[1]), list(self._predicted[2])

    def observe(self, step: int, computes: Sequence[float], step_s: float) -> Decision | None:
        """Step `step`'s measured compute per position (the runtime's compute plus any emulated
        sleep): straggler events, and with `auto` a new split to apply from the next step."""
        pred, _ = self.predictions()
        change = self.detector.observe(step, computes, pred)
        if change is not None:
            what, s = change
            rank = self.owner.get(s.rank, s.rank)
            if what == "named":
                d = dict(s.to_dict(), rank=rank, position=s.rank)
                self.store.add_step_event("straggler", step, d, s.describe(), rank)
            else:
                self.store.add_step_event("straggler_end", step, {"rank": rank, "position": s.rank},
                                          f"rank {rank} on {s.device} no longer a straggler", rank)
        if not self.auto:
            return None
        decision = self.rebalancer.observe(step, computes, step_s)
        if decision is None:
            return None
        detail = dict(decision.detail)
        for key in ("old_split", "new_split"):  # positions -> ranks
            detail[key] = [dict(r, rank=self.owner.get(r["rank"], r["rank"]), position=r["rank"])
                           for r in detail[key]]
        detail["rank"] = self.owner.get(detail["rank"], detail["rank"])
        self.store.add_step_event("rebalance", decision.step, detail, decision.message, 0)
        self.store.set_rank_split({self.owner.get(i, i): p for i, p in enumerate(decision.pieces)})
        self._learn(detail["rates_vs_profile"], f"{step - self.rebalancer.window + 1}-{step}")
        self.detector.reset()
        return decision

    def _learn(self, rates: Sequence[float], steps: str) -> None:
        """Each kind's measured rate into the profile store (planner.core.profiles), labelled measured
        in this run; a failure to write is a warning, never the run's end."""
        from planner.core.profiles import save_step_profile

        for kind, rate in kind_rates([d.profile_key for d in self.kinds], rates).items():
            try:
                path = save_step_profile(learned_profile(self.base_profiles[kind], rate, self.run_dir, steps))
                log.info("profile of %s learned in this run (%.3gx its planned profile): %s", kind, rate, path)
            except (OSError, ValueError) as e:
                log.warning("could not write the learned profile of %s: %s", kind, e)
