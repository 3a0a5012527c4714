"""The plan file: the planner's output and the executor's input.

One `Assignment` per device of the cluster, in the cluster's device order.
A device the plan leaves out has `batch == 0` and `shard_fraction == 0`.
The JSON written by `python -m planner plan --json` *is* a plan file.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Any

from planner.core.cluster import ClusterSpec
from planner.core.jsonio import dumps, load_json_file, save_json_file
from planner.core.constants import ZERO_STAGES

PLAN_VERSION = 1


@dataclass(frozen=True)
class Assignment:
    device_index: int  # position in ClusterSpec.devices()
    node: str
    type: str
    micro_batch: int
    accum_steps: int
    batch: int  # micro_batch * accum_steps
    shard_fraction: float  # share of the sharded training state this device holds
    predicted_memory_bytes: int
    predicted_step_s: float
    emulated: bool = False
    slowdown: float = 1.0
    memory_gb: float | None = None

    @property
    def used(self) -> bool:
        return self.batch > 0 or self.shard_fraction > 0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class BaselineResult:
    predicted_iteration_s: float | None  # None when the baseline runs out of memory
    oom: bool
    note: str = ""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)




@dataclass(frozen=True)
class ZeroCandidate:
    """What the planner found at one ZeRO stage it tried (`--zero auto` tries each)."""

    predicted_iteration_s: float | None  # None when no plan fits, or none beats a lower stage's
    feasible: bool | None  # None: not decided (nothing faster than a lower stage's plan exists)
    note: str = ""  # "chosen", why it is infeasible, ...

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class Plan:
    cluster: ClusterSpec
    model: str  # preset name or config path, as given
    global_batch: int
    seq: int
    dtype: str  # "fp32" | "bf16" | "fp16"
    recompute: str  # "none" | "full"
    assignments: tuple[Assignment, ...]
    predicted_iteration_s: float
    predicted_samples_per_s: float
    baselines: dict[str, BaselineResult] = field(default_factory=dict)
    solve_s: float = 0.0
    notes: tuple[str, ...] = ()
    # the ZeRO stage the sharded runtime runs (planner/core/units.py): 1 AdamW state sharded by
    # shard_fraction, 2 + gradients, 3 + parameters; a one-device plan says 1
    zero: int = 1
    # the stages the planner tried and their predicted iteration times (zero -> candidate)
    zero_candidates: dict[int, ZeroCandidate] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if isinstance(self.zero, bool) or self.zero not in ZERO_STAGES:
            raise ValueError(f"plan: zero must be one of {', '.join(map(str, ZERO_STAGES))}, got {self.zero!r}")
        total = sum(a.batch for a in self.assignments)
        if total != self.global_batch:
            raise ValueError(f"plan: batches sum to {total}, not the global batch {self.global_batch}")
        frac = sum(a.shard_fraction for a in self.assignments)
        if abs(frac - 1.0) > 1e-6:
            raise ValueError(f"plan: shard fractions sum to {frac:.6f}, not 1")
        for a in self.assignments:
            if a.batch != a.micro_batch * a.accum_steps:
                raise ValueError(
                    f"plan: device {a.device_index} batch {a.batch} != micro_batch {a.micro_batch} × accum_steps {a.accum_steps}"
                )

    @property
    def used(self) -> list[Assignment]:
        return [a for a in self.assignments if a.used]

    def to_dict(self) -> dict[str, Any]:
        return {
            "version": PLAN_VERSION,
            "cluster": self.cluster.to_dict(),
            "model": self.model,
            "global_batch": self.global_batch,
            "seq": self.seq,
            "dtype": self.dtype,
            "recompute": self.recompute,
            "zero": self.zero,
            "assignments": [a.to_dict() for a in self.assignments],
            "predicted_iteration_s": self.predicted_iteration_s,
            "predicted_samples_per_s": self.predicted_samples_per_s,
            "baselines": {k: v.to_dict() for k, v in self.baselines.items()},
            "solve_s": self.solve_s,
            "notes": list(self.notes),
            "zero_candidates": {str(z): c.to_dict() for z, c in sorted(self.zero_candidates.items())},
        }

    def to_json(self) -> str:
        return dumps(self.to_dict())

    def save(self, path: str) -> None:
        save_json_file(path, self.to_dict())

    @classmethod
    def from_dict(cls, d: Any, source: str = "plan") -> "Plan":
        if not isinstance(d, dict):
            raise ValueError(f"{source}: expected a JSON object")
        try:
            afields = {f.name for f in fields(Assignment)}
            assignments = tuple(Assignment(**{k: v for k, v in a.items() if k in afields}) for a in d["assignments"])
            return cls(
                cluster=ClusterSpec.from_dict(d["cluster"], f"{source}: cluster"),
                model=str(d["model"]),
                global_batch=int(d["global_batch"]),
                seq=int(d["seq"]),
                dtype=str(d.get("dtype", "fp32")),
                recompute=str(d.get("recompute", "none")),
                assignments=assignments,
                predicted_iteration_s=float(d["predicted_iteration_s"]),
                predicted_samples_per_s=float(d["predicted_samples_per_s"]),
                baselines={k: BaselineResult(**v) for k, v in d.get("baselines", {}).items()},
                solve_s=float(d.get("solve_s", 0.0)),
                notes=tuple(d.get("notes", ())),
                zero=int(d.get("zero", 1)),
                zero_candidates={int(z): ZeroCandidate(**c) for z, c in d.get("zero_candidates", {}).items()},
            )
        except KeyError as e:
            raise ValueError(f"{source}: missing key {e.args[0]!r}") from None
        except (TypeError, AttributeError) as e:
            raise ValueError(f"{source}: malformed plan: {e}") from None

    @classmethod
    def load(cls, path: str) -> "Plan":
        return cls.from_dict(load_json_file(path, "plan file"), source=path)
