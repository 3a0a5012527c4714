"""A planned run against the even split of the same devices: the measured comparison.

Does the heterogeneous plan pay off? Only a measurement says so: the same devices, model, global
batch, sequence, dtype and ZeRO stage, the batch split evenly (and the state sharded evenly) as a
practitioner would run it, launched as a normal run, and the two runs' median step times side
by side. The planner builds that even plan (planner.entry.even_plan); this module names the even
runs of a planned run and compares two runs as executor.store.read_metrics returns them
(`step_median`, `compare_runs`). The dashboard's Launch page and bench/hetero_speedup.py both use
it. `predicted_vs_measured` sets one run against its own plan file (`executor metrics`). Nothing here
imports torch.

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
from planner.geo.plan_file import PRICED

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



# ---- measured against predicted: `executor metrics` ----------------------------------------------
# The prediction is the plan file's (the planner's cost model, written before the run); the
# measurement is the run store's rows (the workers' timers): two independent code paths.

PREDICTION_SKIP_STEPS = 3  # warm-up, the memory-tracked step, the allocator settling


def _median_or_none(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def _gap_or_none(measured: float | None, predicted: float | None) -> float | None:
    return prediction_gap(measured, predicted) if measured is not None and predicted else None


def rank_step_s(row: dict[str, Any]) -> float | None:
    """A rank's whole step from its rank_steps row: compute + emulated delay + optimizer + wait (the
    worker's split of the step it timed), None when a part is missing."""
    parts = [row.get("compute_s"), row.get("emulated_delay_s") or 0.0, row.get("optimizer_s"), row.get("wait_s")]
    return None if any(p is None for p in parts) else sum(parts)


def profile_of_kind(plan: Plan, kind: str) -> str:
    """The plan's note naming the step profile `kind` was priced by (planner.core.profiles.profile_notes), or
    why there is none: a plan written before plans named their profiles."""
    prefix = f"profile {kind}:"
    return next((n[len("profile "):] for n in plan.notes if n.startswith(prefix)),
                f"{kind}: not named in the plan (planned before plans named their profiles)")


def priced_from(plan: Plan, stage: int) -> str | None:
    """The plan's note naming the measurement stage `stage`'s compute was priced from (a stage profile or
    its kind's step profile: planner/geo/plan_file.py; a stage of several kinds or row counts has one note
    per replica, "stage J (kind, rows): …", joined by "; "), None where the plan does not name it."""
    whole, replica = f"{PRICED} stage {stage}: ", f"{PRICED} stage {stage} ("
    found = [n[len(whole):] if n.startswith(whole) else n[len(f"{PRICED} stage {stage} "):]
             for n in plan.notes if n.startswith(whole) or n.startswith(replica)]
    return "; ".join(found) if found else None


def predicted_vs_measured(metrics: dict[str, Any], plan: Plan, skip: int = PREDICTION_SKIP_STEPS) -> dict[str, Any]:
    """The run's measured medians (steps skip + 1 onwards) against the plan's predictions: the
    iteration, each rank (its device, kind, the profile its prediction came from) and, where the
    plan has pipeline stages, each stage (its slowest rank). `error` = (measured − predicted) /
    predicted; None where either is missing."""
    devices = plan.cluster.devices()
    by_index = {a.device_index: a for a in plan.assignments}
    rows_of: dict[int, list[float]] = {}
    for row in metrics.get("rank_steps", []):
        t = rank_step_s(row)
        if row["step"] > skip and t is not None:
            rows_of.setdefault(row["rank"], []).append(t)
    ranks = []
    for r in metrics["ranks"]:
        a = by_index.get(r["device_index"])
        dev = devices[r["device_index"]][1] if r["device_index"] < len(devices) else None
        kind = dev.profile_key if dev is not None else r.get("type", "?")
        measured = _median_or_none(rows_of.get(r["rank"], []))
        predicted = a.predicted_step_s if a is not None else None
        ranks.append({"rank": r["rank"], "device_index": r["device_index"], "device": dev.label if dev else kind,
                      "kind": kind, "measured_step_s": measured, "predicted_step_s": predicted,
                      "error": _gap_or_none(measured, predicted), "profile": profile_of_kind(plan, kind)})
    measured_it = _median_or_none(step_times(metrics, skip))
    return {"skip_steps": skip, "steps": len(step_times(metrics, skip)),
            "iteration": {"measured_s": measured_it, "predicted_s": plan.predicted_iteration_s,
                          "error": _gap_or_none(measured_it, plan.predicted_iteration_s)},
            "ranks": ranks, "stages": _stages(plan, ranks)}


def _stages(plan: Plan, ranks: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per pipeline stage: its slowest rank's measured and predicted step ([] without stages)."""
    if plan.pipeline is None:
        return []
    out = []
    for s, stage in enumerate(plan.pipeline.stages):
        mine = [r for r in ranks if r["device_index"] in stage.devices]
        measured = [r["measured_step_s"] for r in mine if r["measured_step_s"] is not None]
        predicted = [r["predicted_step_s"] for r in mine if r["predicted_step_s"] is not None]
        m, p = (max(measured) if measured else None), (max(predicted) if predicted else None)
        out.append({"stage": s, "layers": f"{stage.first_layer}-{stage.first_layer + stage.num_layers - 1}",
                    "ranks": [r["rank"] for r in mine], "measured_step_s": m, "predicted_step_s": p,
                    "error": _gap_or_none(m, p), "priced_from": priced_from(plan, s)})
    return out
