"""A planned run against the even split of the same devices: the measured comparison.

Does the heterogeneous plan pay off? Only a measurement says so: the same devices, model, global
batch, sequence, dtype and ZeRO stage, the batch split evenly (and the state sharded evenly) as a
practitioner would run it, launched as a normal run, and the two runs' median step times side
by side. The planner builds that even plan (planner.entry.even_plan); this module names the even
runs of a planned run and compares two runs as executor.store.read_metrics returns them
(`step_median`, `compare_runs`). The dashboard's Launch page and bench/hetero_speedup.py both use
it. Nothing here imports torch.

Medians are over steps SKIP_STEPS + 1 onwards: step 1 carries the warm-up and the memory
tracker, step 2 the allocator's warm-up; what remains is what a long run repeats.
"""
from __future__ import annotations

import os
import re
import statistics
from dataclasses import dataclass
from typing import Any

from contracts.plan import Plan

SKIP_STEPS = 2  # warm-up + the memory-tracked first step; then the allocator settles
MIN_COMPARED_STEPS = 5  # a median of fewer steps after the warm-up is not a measurement to compare
EVEN_RUN_SUFFIX = "-even"  # <planned run folder>-even[-k]: the even-split measurements of that run
_EVEN_RUN = re.compile(rf"^(?P<planned>.+){EVEN_RUN_SUFFIX}(?:-(?P<k>[0-9]+))?$")


# ---- a plan against its even split ------------------------------------------------------------


def split_of(plan: Plan) -> list[tuple[int, int, float]]:
    """(batch, micro_batch, shard fraction) per device: what two plans must share to be the same split."""
    return [(a.batch, a.micro_batch, round(a.shard_fraction, 6)) for a in plan.assignments]


def already_even(plan: Plan, even: Plan) -> bool:
    """The plan splits as the even baseline does (a homogeneous cluster's plan usually does):
    nothing to compare."""
    return [(b, s) for b, _, s in split_of(plan)] == [(b, s) for b, _, s in split_of(even)]


# ---- the even runs of a planned run ------------------------------------------------------------
# A run's even-split measurements sit beside it, named after it: found again after a browser
# reload or an app restart, and listed in the run history as the normal runs they are.


def planned_run_of(run_dir: str) -> str | None:
    """The planned run an even-split run measured against (its folder name says so), else None."""
    m = _EVEN_RUN.match(os.path.basename(os.path.normpath(run_dir)))
    return os.path.join(os.path.dirname(os.path.normpath(run_dir)), m["planned"]) if m else None


def _even_runs(planned_dir: str) -> list[tuple[int, str]]:
    planned_dir = os.path.normpath(planned_dir)
    parent, name = os.path.dirname(planned_dir), os.path.basename(planned_dir)
    found = []
    for entry in os.listdir(parent) if os.path.isdir(parent) else ():
        m = _EVEN_RUN.match(entry)
        if m and m["planned"] == name and os.path.isdir(os.path.join(parent, entry)):
            found.append((int(m["k"] or 1), os.path.join(parent, entry)))
    return sorted(found)


def even_run_dirs(planned_dir: str) -> list[str]:
    """The even-split runs of `planned_dir` that exist, oldest first."""
    return [d for _, d in _even_runs(planned_dir)]


def next_even_run_dir(planned_dir: str) -> str:
    """The folder of the next even-split run of `planned_dir` (not created): `-even`, then `-even-2`, ..."""
    k = max((k for k, _ in _even_runs(planned_dir)), default=0) + 1
    return os.path.normpath(planned_dir) + EVEN_RUN_SUFFIX + (f"-{k}" if k > 1 else "")


# ---- measured against measured -------------------------------------------------------------


def step_times(metrics: dict[str, Any], skip: int = SKIP_STEPS) -> list[float]:
    """The run's measured step times after the first `skip` steps (read_metrics' `steps`)."""
    return [s["step_s"] for s in metrics["steps"][skip:] if s["step_s"] is not None]


def step_median(metrics: dict[str, Any], skip: int = SKIP_STEPS) -> float | None:
    """Median measured step time over steps skip + 1 onwards; None with fewer than MIN_COMPARED_STEPS."""
    times = step_times(metrics, skip)
    return statistics.median(times) if len(times) >= MIN_COMPARED_STEPS else None


def prediction_gap(measured_s: float, predicted_s: float) -> float:
    """(measured - predicted) / predicted: + is slower than predicted."""
    if predicted_s <= 0:
        raise ValueError(f"a predicted step time must be positive, got {predicted_s!r}")
    return (measured_s - predicted_s) / predicted_s


@dataclass(frozen=True)
class Comparison:
    """Two runs of the same global batch, measured: step medians (steps SKIP_STEPS + 1 onwards)."""
    planned_step_s: float
    even_step_s: float
    planned_steps: int  # steps in each median
    even_steps: int
    planned_predicted_s: float | None
    even_predicted_s: float | None

    @property
    def speedup(self) -> float:
        """Planned samples/s over even samples/s (the same global batch: the inverse step ratio)."""
        return self.even_step_s / self.planned_step_s

    @property
    def planned_gap(self) -> float | None:
        """The planned run's measured step against its prediction (relative; + slower)."""
        if not self.planned_predicted_s:
            return None
        return prediction_gap(self.planned_step_s, self.planned_predicted_s)

    @property
    def even_gap(self) -> float | None:
        if not self.even_predicted_s:
            return None
        return prediction_gap(self.even_step_s, self.even_predicted_s)


def comparable(planned: dict[str, Any], even: dict[str, Any]) -> str | None:
    """Why two runs' step times do not compare (None when they do): a different model, global
    batch, seq or dtype makes a step a different amount of work."""
    for key in ("model", "global_batch", "seq", "dtype"):
        if planned.get(key) != even.get(key):
            return f"the runs differ in {key.replace('_', ' ')} ({planned.get(key)} vs {even.get(key)})"
    return None


def compare_runs(planned: dict[str, Any], even: dict[str, Any], skip: int = SKIP_STEPS) -> Comparison:
    """The planned run against the even one, from their read_metrics dicts. Raises ValueError when
    they are not the same work or either has too few steps after the warm-up."""
    why = comparable(planned, even)
    if why:
        raise ValueError(f"cannot compare: {why}")
    medians = []
    for name, m in (("planned", planned), ("even", even)):
        med = step_median(m, skip)
        if med is None:
            raise ValueError(f"cannot compare: the {name} run has {len(step_times(m, skip))} steps after the "
                             f"first {skip}, at least {MIN_COMPARED_STEPS} are needed")
        medians.append(med)
    return Comparison(medians[0], medians[1], len(step_times(planned, skip)), len(step_times(even, skip)),
                      planned.get("predicted_iteration_s"), even.get("predicted_iteration_s"))

