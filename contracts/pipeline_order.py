"""The order in which a pipeline stage runs its forwards and backwards: the one definition that the
runtime (models/pipeline.py) runs and the memory model and simulator (planner/) price.
"""
from __future__ import annotations

from contracts.plan import PIPELINE_SCHEDULES


def schedule_order(schedule: str, num_stages: int, stage: int, num_microbatches: int) -> list[tuple[str, int]]:
    """The (op "F" | "B", micro-batch) order stage `stage` runs: GPipe every forward then every backward;
    1F1B min(S-1-s, M) forwards, then one forward and one backward alternately, then the remaining
    backwards. The one definition of the schedule: models/pipeline.py runs it, the cost model and the
    simulator price it (pure Python here, so the planner needs no torch)."""
    schedule_in_flight(schedule, num_stages, stage, num_microbatches)  # validates
    M = num_microbatches
    if schedule == "gpipe":
        return [("F", k) for k in range(M)] + [("B", k) for k in range(M)]
    warm = min(num_stages - 1 - stage, M)
    order = [("F", k) for k in range(warm)]
    for k in range(M - warm):
        order += [("F", warm + k), ("B", k)]
    return order + [("B", k) for k in range(M - warm, M)]


def schedule_in_flight(schedule: str, num_stages: int, stage: int, num_microbatches: int) -> int:
    """Micro-batches whose activations stage `stage` holds at once: 1F1B min(S-s, M), GPipe M."""
    if schedule not in PIPELINE_SCHEDULES:
        raise ValueError(f"pipeline schedule must be one of {', '.join(PIPELINE_SCHEDULES)}, got {schedule!r}")
    if not 0 <= stage < num_stages or num_microbatches < 1:
        raise ValueError(f"stage {stage} of {num_stages} with {num_microbatches} micro-batches is no pipeline stage")
    return num_microbatches if schedule == "gpipe" else min(num_stages - stage, num_microbatches)
