"""Stage profiles: a pipeline stage's forward and backward of one micro-batch, measured as the stage runs.

A step profile (planner/core/profiles.py) times the whole model on one device and the pipeline cost
model splits that time over a stage's layers by their FLOPs. A stage profile is measured instead: the
plan's stages run as a pipeline on this machine (profiler/stage_run.py: the stage's layers, its rows of
a micro-batch, its sends and receives, the other stages' ranks beside it), and each stage's
forward and backward of one micro-batch, its optimizer step per parameter and its sends' own time are
recorded. The pipeline simulator of a plan (planner/geo/emulated.py) prices a stage by its stage
profile where one matches and is not older than the step profile of the stage's device kind (the
newest measurement wins), and names which it used.

Stored as JSON files under `<profiles>/stages/`, one per device kind, model, sequence, dtype,
recompute, layer range (with the embedding / head) and rows; a new measurement replaces the old.
Pure Python (no torch). The fields and the command: docs/profiler.md ("Stage profiles").
"""
from __future__ import annotations

import logging
import os
from dataclasses import asdict, dataclass, fields
from typing import Any

from contracts.specs import ModelSpec
from planner.core.profiles import _read_json, _safe, _write_json, store_root

log = logging.getLogger(__name__)

HOW_STAGE_RUN = "stage run"  # StageProfile.how: the plan's stages run together as a pipeline on this machine
HOW_ON_LINKS = "stage run on the plan's emulated links"  # the same, on the plan's WAN links (--emulate-wan)


@dataclass(frozen=True)
class StageProfile:
    """One pipeline stage on one device kind: seconds of one micro-batch of `rows` rows through it."""

    device_type: str  # the device's profile key (a CPU-quota kind is its own)
    model: str
    num_matmul_params: int  # identifies the architecture (ModelSpec.matmul_params)
    seq: int
    dtype: str
    recompute: str
    first_layer: int
    num_layers: int
    first: bool  # holds the embedding
    last: bool  # holds the head
    rows: int  # the rank's rows of one micro-batch
    forward_s: float  # one micro-batch's forward through the stage (wall time, compute only)
    backward_s: float
    optimizer_s_per_param: float | None  # the rank's AdamW step (median over the steps) over its shard's numel
    send_s: float | None  # the time a send itself takes on the rank (not the wire's), per micro-batch
    num_microbatches: int  # of the run it was measured in
    schedule: str
    steps: int  # steps measured (after the warm-up)
    noise: float | None  # IQR / median of the per-step compute
    created: str  # UTC ISO time
    how: str = HOW_STAGE_RUN
    host: str = ""
    load_avg: float | None = None  # os.getloadavg()[0] when the run started
    num_cpus: int = 0
    together_with: tuple[str, ...] = ()  # every rank's device kind in the run, this one's included
    run_step_s: float | None = None  # the stages' run's median step (after the warm-up), the whole pipeline's

    def matches(self, spec: ModelSpec) -> bool:
        return self.model == spec.name and self.num_matmul_params in (0, spec.matmul_params())

    def describe(self) -> str:
        """One line naming the measurement: the stage, when, how, under which load, how noisy."""
        ends = "".join(x for x in (" + embedding" if self.first else "", " + head" if self.last else ""))
        load = f"load {self.load_avg:.2f} on {self.num_cpus} CPUs" if self.load_avg is not None else "load not recorded"
        noise = f"noise {self.noise:.1%} (IQR/median of per-step compute)" if self.noise is not None else "noise not recorded"
        return (f"{self.device_type} stage L{self.first_layer}-{self.first_layer + self.num_layers - 1}{ends}, "
                f"{self.rows} row(s): measured {self.created}, {self.how} ({len(self.together_with)} ranks), "
                f"{load}, {noise}")

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["together_with"] = list(self.together_with)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "StageProfile":
        known = {f.name for f in fields(cls)}
        d = {k: v for k, v in d.items() if k in known}
        d["together_with"] = tuple(str(x) for x in d.get("together_with", ()))
        return cls(**d)


def stage_profile_path(device_type: str, model: str, seq: int, dtype: str, recompute: str, first_layer: int,
                       num_layers: int, first: bool, last: bool, rows: int, store_dir: str | None = None) -> str:
    span = f"L{first_layer}-{num_layers}" + ("e" if first else "") + ("h" if last else "")
    parts = (device_type, model, f"s{seq}", dtype, recompute, span, f"r{rows}")
    return os.path.join(store_root(store_dir), "stages", "__".join(_safe(p) for p in parts) + ".json")


def save_stage_profile(p: StageProfile, store_dir: str | None = None) -> str:
    """Write a stage profile; it replaces the one with the same key."""
    path = stage_profile_path(p.device_type, p.model, p.seq, p.dtype, p.recompute, p.first_layer, p.num_layers,
                              p.first, p.last, p.rows, store_dir)
    return _write_json(path, p.to_dict())


def get_stage_profile(device_type: str, spec: ModelSpec, seq: int, dtype: str, recompute: str, first_layer: int,
                      num_layers: int, first: bool, last: bool, rows: int,
                      store_dir: str | None = None) -> StageProfile | None:
    """The stored stage profile of exactly this stage, device kind and rows (None: none, or another
    architecture under the same model name)."""
    d = _read_json(stage_profile_path(device_type, spec.name, seq, dtype, recompute, first_layer, num_layers,
                                      first, last, rows, store_dir))
    if d is None:
        return None
    try:
        p = StageProfile.from_dict(d)
    except (TypeError, ValueError, KeyError) as e:
        log.warning("skipping malformed stage profile of %s: %s", device_type, e)
        return None
    return p if p.matches(spec) else None


__all__ = ["StageProfile", "HOW_STAGE_RUN", "HOW_ON_LINKS", "stage_profile_path", "save_stage_profile", "get_stage_profile"]
