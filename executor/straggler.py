"""The straggler, named: which rank is slower than its profile, on which device, since which step,
and what that costs the step.

Rank 0 has every rank's figures of every step (executor/worker.py gathers them). For each rank it
compares the measured compute (the runtime's compute seconds plus any arithmetic `slowdown` sleep)
with the profile's prediction of the same micro-batches (planner/costmodel/training.py's
`DeviceCoeffs.compute_s`): its ratio to the profile, r_i = measured / predicted.

A profile may be off for every rank alike (an estimated profile, a machine busy with other work),
and then no rank holds the others up. So a rank's *slowdown* is its ratio over the median ratio of
the other ranks: r_i / median_{j != i} r_j, "how much slower than its profile, against how the
others match theirs". A rank is the straggler when the median of its slowdown over the newest
WINDOW_STEPS steps is at least SLOWDOWN_THRESHOLD; the worst such rank is named, named again when
that median reaches SLOWDOWN_THRESHOLD times the slowdown it was named with (a straggler that got
worse: a device slowed further, or a mild one named on noise before a real slowdown), and cleared
when that median falls below CLEAR_THRESHOLD. `since_step` is the first step of its run of steps at
or above the threshold. Its cost to the step is what its compute exceeds both its compute at the
others' pace (compute / slowdown) and the slowest other rank's compute: the seconds the others wait
for it (median over the window).

Nothing here reads the emulated quota: the slowdown is measured.
"""
from __future__ import annotations

import collections
import statistics
from dataclasses import asdict, dataclass
from typing import Sequence

SLOWDOWN_THRESHOLD = 1.3  # a rank 30 % slower than its profile, relative to the others, is a straggler
CLEAR_THRESHOLD = 1.15  # hysteresis: named until its window's median falls below this
WINDOW_STEPS = 3  # steps in the window ("for several steps"); named within WINDOW_STEPS + 1 of a change


@dataclass(frozen=True)
class Straggler:
    """The straggler as `executor metrics --json` reports it (`straggler`)."""

    rank: int
    device: str  # the device's kind (profile key, e.g. cpu@share1) and where it is
    slowdown: float  # measured/profile compute over the other ranks' median of theirs (window median)
    since_step: int
    cost_s: float  # seconds per step the others wait for it (window median)
    compute_vs_profile: float  # its own measured/profile compute ratio (window median)
    step: int  # the step it was named at

    def to_dict(self) -> dict:
        return {k: (round(v, 4) if isinstance(v, float) else v) for k, v in asdict(self).items()}

    def describe(self) -> str:
        return (f"rank {self.rank} on {self.device} is {self.slowdown:.2f}x slower than its profile (relative to the "
                f"other ranks; {self.compute_vs_profile:.2f}x its profile's compute) since step {self.since_step}, "
                f"costing the step {self.cost_s:.3f} s")


def slowdowns(ratios: Sequence[float]) -> list[float]:
    """Each rank's ratio to its profile over the median of the other ranks' ratios (1.0 for one rank)."""
    if len(ratios) < 2:
        return [1.0] * len(ratios)
    out = []
    for i, r in enumerate(ratios):
        others = statistics.median(x for j, x in enumerate(ratios) if j != i)
        out.append(r / others if others > 0 else 1.0)
    return out


def straggler_cost_s(computes: Sequence[float], rank: int, slowdown: float) -> float:
    """Seconds the other ranks wait for `rank` in one step: its compute beyond both its compute at the
    others' pace and the slowest other rank's compute (never negative)."""
    others = max((c for j, c in enumerate(computes) if j != rank), default=0.0)
    return max(0.0, computes[rank] - max(computes[rank] / max(slowdown, 1.0), others))


class StragglerDetector:
    """Follows the ranks' measured and predicted compute step by step (`observe`) and says when a
    straggler is named or cleared. `devices[i]`: rank i's device, as reported."""

    def __init__(self, devices: Sequence[str], threshold: float = SLOWDOWN_THRESHOLD,
                 clear_threshold: float = CLEAR_THRESHOLD, window: int = WINDOW_STEPS):
        if not (threshold > clear_threshold >= 1.0) or window < 1:
            raise ValueError(f"straggler detector: need threshold > clear_threshold >= 1 and window >= 1, got "
                             f"{threshold}, {clear_threshold}, {window}")
        self.devices = list(devices)
        self.threshold, self.clear_threshold, self.window = threshold, clear_threshold, window
        # (step, slowdowns, ratios, computes) of the newest steps
        self.history: collections.deque = collections.deque(maxlen=window)
        self.above_since: dict[int, int | None] = {i: None for i in range(len(self.devices))}
        self.current: Straggler | None = None

    def observe(self, step: int, computes: Sequence[float], predicted: Sequence[float]) -> tuple[str, Straggler] | None:
        """One step's measured and predicted compute per rank (seconds). Returns ("named", straggler)
        when one is named (or another rank replaces it), ("cleared", the one that was) when it is
        cleared, else None. A step with a missing or non-positive figure is skipped."""
        if len(computes) != len(self.devices) or len(predicted) != len(self.devices):
            raise ValueError(f"straggler detector: {len(self.devices)} ranks, got {len(computes)} computes and "
                             f"{len(predicted)} predictions")
        if any(c is None or p is None or p <= 0 or c <= 0 for c, p in zip(computes, predicted)):
            return None
        ratios = [c / p for c, p in zip(computes, predicted)]
        slows = slowdowns(ratios)
        for i, s in enumerate(slows):
            if s >= self.threshold:
                if self.above_since[i] is None:
                    self.above_since[i] = step
            else:
                self.above_since[i] = None
        self.history.append((step, slows, ratios, list(computes)))
        if len(self.history) < self.window:
            return None
        med = [statistics.median(h[1][i] for h in self.history) for i in range(len(self.devices))]
        worst = max(range(len(med)), key=lambda i: med[i])
        cur = self.current
        worse = cur is not None and worst == cur.rank and med[worst] >= cur.slowdown * self.threshold
        if cur is not None and med[cur.rank] >= self.clear_threshold and not worse and (
                med[worst] < self.threshold or worst == cur.rank):
            return None  # still the same straggler
        if worse:  # named again: slower by the threshold's factor than when named, since that began
            since = next(h[0] for h in self.history if h[1][worst] >= cur.slowdown * self.threshold)
        elif med[worst] >= self.threshold:
            first_window_step = self.history[0][0]
            since = self.above_since[worst] if self.above_since[worst] is not None else first_window_step
            since = min(since, next((h[0] for h in self.history if h[1][worst] >= self.threshold), since))
        if worse or med[worst] >= self.threshold:
            cost = statistics.median(straggler_cost_s(h[3], worst, h[1][worst]) for h in self.history)
            ratio = statistics.median(h[2][worst] for h in self.history)
            self.current = Straggler(worst, self.devices[worst], med[worst], since, cost, ratio, step)
            return "named", self.current
        if cur is not None:
            self.current = None
            return "cleared", cur
        return None

    def reset(self) -> None:
        """Forget the window (a new split: its first step is not compared with the old one's)."""
        self.history.clear()
