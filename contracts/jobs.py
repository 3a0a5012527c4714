"""A training job as users submit it: a model and how much to train it, no hardware.

`requested_type` / `requested_gpus` are what a user would have asked for by hand
(DESIGN.md, job trace). Only the `fifo` baseline honours them; GPUMix (`frenzy`)
picks the devices itself from the memory model (planner/schedule/options.py).
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields
from typing import Any

from contracts.specs import ModelSpec, get_model


def _positive_int(value: Any, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{what} must be a positive integer, got {value!r}")
    return value


@dataclass(frozen=True)
class JobSpec:
    job_id: str
    model: str  # preset name or config.json path, as given
    global_batch: int  # samples per optimizer step
    seq: int  # tokens per sample
    steps: int  # optimizer steps to run
    submit_s: float  # arrival time (seconds from the trace's origin)
    priority: int = 0  # higher runs first among otherwise equal jobs
    requested_type: str | None = None  # the user's own request (fifo baseline only)
    requested_gpus: int | None = None

    def __post_init__(self) -> None:
        where = f"job {self.job_id!r}"
        if not isinstance(self.job_id, str) or not self.job_id:
            raise ValueError(f"job_id must be a non-empty string, got {self.job_id!r}")
        if not isinstance(self.model, str) or not self.model:
            raise ValueError(f"{where}: model must be a non-empty string")
        _positive_int(self.global_batch, f"{where}: global_batch")
        _positive_int(self.seq, f"{where}: seq")
        _positive_int(self.steps, f"{where}: steps")
        s = self.submit_s
        if isinstance(s, bool) or not isinstance(s, (int, float)) or not math.isfinite(s) or s < 0:
            raise ValueError(f"{where}: submit_s must be a finite number >= 0, got {s!r}")
        if isinstance(self.priority, bool) or not isinstance(self.priority, int):
            raise ValueError(f"{where}: priority must be an integer, got {self.priority!r}")
        if (self.requested_type is None) != (self.requested_gpus is None):
            raise ValueError(f"{where}: requested_type and requested_gpus go together (both or neither)")
        if self.requested_gpus is not None:
            _positive_int(self.requested_gpus, f"{where}: requested_gpus")

    @property
    def spec(self) -> ModelSpec:
        return get_model(self.model)

    @property
    def tokens(self) -> int:
        return self.steps * self.global_batch * self.seq

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Any) -> "JobSpec":
        if not isinstance(d, dict):
            raise ValueError(f"job: expected an object, got {type(d).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = set(d) - known
        if unknown:
            raise ValueError(f"job: unknown keys {sorted(unknown)}")
        missing = {"job_id", "model", "global_batch", "seq", "steps", "submit_s"} - set(d)
        if missing:
            raise ValueError(f"job: missing keys {sorted(missing)}")
        return cls(**d)
