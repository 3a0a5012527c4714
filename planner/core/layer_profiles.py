"""Measured per-layer times (the GPUMix layer-profile format) and the step profiles fitted from them.

A `LayerProfiles` holds, for one model at one (seq, dtype, recompute), the forward, backward and
optimizer-update seconds of every layer (embedding, blocks, head) per device type, micro-batch and
tensor-parallel degree: what a per-layer profiler measures (Sailor's `profiles_tmp.json` is read into
it by profiler/importer.py). `fit_step_profiles` sums the layers into one step per micro-batch and fits
`α + β·m` (the store's StepProfile); `save_layer_profiles` keeps the per-layer table beside the store's
step profiles (layers/), merged with what is there, for planners that split layers into stages.
The file format: docs/profiler.md ("The GPUMix layer-profile format"). Pure Python (no torch).
"""
from __future__ import annotations

import os
import statistics
from dataclasses import dataclass
from typing import Any

from contracts.catalog import get_gpu_type
from contracts.constants import RECOMPUTE
from contracts.specs import ModelSpec
from planner.core.profiles import (StepProfile, _read_json, _safe, _write_json, analytic_flops_per_sample, fit_line,
                                   peak_tflops, store_root)

FORMAT = "gpumix-layer-profiles"
VERSION = 1
TFLOPS = 1e12


def _number(value: Any, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0 or value == float("inf"):
        raise ValueError(f"{what} must be a finite number >= 0, got {value!r}")
    return float(value)


def _positive_int(value: Any, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{what} must be a positive integer, got {value!r}")
    return value


@dataclass(frozen=True)
class LayerMeasurement:
    """One device type at one micro-batch and TP degree: (forward_s, backward_s, update_s) per layer."""

    device_type: str  # a catalog type (contracts/catalog.py)
    micro_batch: int
    tp: int
    layers_s: tuple[tuple[float, float, float], ...]

    @property
    def step_s(self) -> float:
        """Forward + backward of one micro-batch: the layers' sum (they run one after another)."""
        return sum(f + b for f, b, _ in self.layers_s)

    @property
    def update_s(self) -> float:
        return sum(u for _, _, u in self.layers_s)

    def to_dict(self) -> dict[str, Any]:
        return {"device_type": self.device_type, "micro_batch": self.micro_batch, "tp": self.tp,
                "layers_s": [list(t) for t in self.layers_s]}

    @classmethod
    def from_dict(cls, d: Any, where: str) -> "LayerMeasurement":
        if not isinstance(d, dict):
            raise ValueError(f"{where}: expected an object, got {type(d).__name__}")
        for key in ("device_type", "micro_batch", "layers_s"):
            if key not in d:
                raise ValueError(f"{where}: missing {key!r}")
        device = d["device_type"]
        if not isinstance(device, str):
            raise ValueError(f"{where}: device_type must be a string, got {device!r}")
        get_gpu_type(device)  # unknown type: ValueError naming the known ones
        tp = _positive_int(d.get("tp", 1), f"{where}: tp")  # any degree: Sailor measured OPT-30 at 7
        rows = d["layers_s"]
        if not isinstance(rows, list) or not rows:
            raise ValueError(f"{where}: layers_s must be a non-empty list of [forward_s, backward_s, update_s]")
        layers = []
        for i, row in enumerate(rows):
            if not isinstance(row, list) or len(row) != 3:
                raise ValueError(f"{where}: layers_s[{i}] must be [forward_s, backward_s, update_s], got {row!r}")
            layers.append(tuple(_number(v, f"{where}: layers_s[{i}]") for v in row))
        return cls(device, _positive_int(d["micro_batch"], f"{where}: micro_batch"), tp, tuple(layers))


@dataclass(frozen=True)
class LayerProfiles:
    """Per-layer measurements of one model at one (seq, dtype, recompute), labelled with their source."""

    model: str  # the GPUMix model name (ModelSpec.name) the layers belong to
    seq: int
    dtype: str
    recompute: str
    source: str  # one line: who measured, with what, where the numbers come from
    measurements: tuple[LayerMeasurement, ...]

    def to_dict(self) -> dict[str, Any]:
        return {"format": FORMAT, "version": VERSION, "model": self.model, "seq": self.seq, "dtype": self.dtype,
                "recompute": self.recompute, "source": self.source,
                "measurements": [m.to_dict() for m in self.measurements]}

    @classmethod
    def from_dict(cls, d: Any, where: str = "layer profiles") -> "LayerProfiles":
        if not isinstance(d, dict):
            raise ValueError(f"{where}: expected a JSON object")
        if d.get("format") != FORMAT:
            raise ValueError(f"{where}: format must be {FORMAT!r}, got {d.get('format')!r}")
        if d.get("version") != VERSION:
            raise ValueError(f"{where}: version {d.get('version')!r} is not supported (expected {VERSION})")
        for key in ("model", "seq", "dtype", "source", "measurements"):
            if key not in d:
                raise ValueError(f"{where}: missing {key!r}")
        if not isinstance(d["model"], str) or not d["model"]:
            raise ValueError(f"{where}: model must be a model name")
        if d["dtype"] not in ("fp32", "bf16", "fp16"):
            raise ValueError(f"{where}: dtype must be fp32, bf16 or fp16, got {d['dtype']!r}")
        recompute = d.get("recompute", "none")
        if recompute not in RECOMPUTE:
            raise ValueError(f"{where}: recompute must be one of {RECOMPUTE}, got {recompute!r}")
        if not isinstance(d["source"], str):
            raise ValueError(f"{where}: source must be a string")
        rows = d["measurements"]
        if not isinstance(rows, list) or not rows:
            raise ValueError(f"{where}: measurements must be a non-empty list")
        ms = tuple(LayerMeasurement.from_dict(r, f"{where}: measurements[{i}]") for i, r in enumerate(rows))
        return cls(d["model"], _positive_int(d["seq"], f"{where}: seq"), d["dtype"], recompute, d["source"], ms)

    def check_model(self, spec: ModelSpec, where: str = "") -> None:
        """Every measurement lists the model's layers: its blocks plus 2 or 3 others (embedding, head,
        and a final norm where the profiler timed it apart)."""
        for m in self.measurements:
            extra = len(m.layers_s) - spec.num_layers
            if extra not in (2, 3):
                raise ValueError(f"{where + ': ' if where else ''}{m.device_type} micro-batch {m.micro_batch} tp {m.tp}: "
                                 f"{len(m.layers_s)} layers, "
                                 f"but {spec.name} has {spec.num_layers} blocks (expected {spec.num_layers + 2} "
                                 f"or {spec.num_layers + 3} with embedding and head)")


@dataclass(frozen=True)
class FittedProfile:
    """A stored step profile and the points its fit came from (for the importer's report)."""

    profile: StepProfile
    num_points: int


def fit_step_profiles(layers: LayerProfiles, spec: ModelSpec, created: str = "") -> list[FittedProfile]:
    """One StepProfile per (device type, TP degree): Σ layers' forward + backward per micro-batch, fitted
    to `α + β·m` by least squares over the micro-batches (α < 0 refits through the origin; a single
    micro-batch gives α = 0, β = t / m and no R²); the optimizer time per parameter is the median over
    micro-batches of Σ update over the rank's parameters (num_params / tp)."""
    if spec.name != layers.model:
        raise ValueError(f"the layer profiles are of model {layers.model!r}, not {spec.name!r}")
    layers.check_model(spec)
    groups: dict[tuple[str, int], dict[int, list[LayerMeasurement]]] = {}
    for m in layers.measurements:
        groups.setdefault((m.device_type, m.tp), {}).setdefault(m.micro_batch, []).append(m)
    out = []
    for (device, tp), by_mb in sorted(groups.items()):
        sizes = sorted(by_mb)
        times = [statistics.median(m.step_s for m in by_mb[mb]) for mb in sizes]
        if len(sizes) >= 2:
            alpha, beta, r2 = fit_line(sizes, times, nonnegative_intercept=True)
        else:
            alpha, beta, r2 = 0.0, times[0] / sizes[0], None
        rank_params = -(-spec.num_params // tp)
        opt = statistics.median(m.update_s for mb in sizes for m in by_mb[mb]) / rank_params
        flops = analytic_flops_per_sample(spec, layers.seq, layers.recompute) / tp
        peak = peak_tflops(device, layers.dtype)
        eff = flops / beta / (peak * TFLOPS) if beta > 0 else None
        source = f"{layers.source}; tp {tp}" if tp != 1 else layers.source
        p = StepProfile(device, spec.name, layers.seq, layers.dtype, layers.recompute, alpha, beta, opt, r2, True,
                        source, flops, rank_params, spec.num_layers, tuple(sizes), tuple(times), eff, peak,
                        created=created, num_matmul_params=spec.matmul_params(), tp=tp)
        out.append(FittedProfile(p, len(sizes)))
    return out


def layer_profiles_path(model: str, seq: int, dtype: str, recompute: str, store_dir: str | None = None) -> str:
    name = "__".join(_safe(p) for p in (model, f"s{seq}", dtype, recompute)) + ".json"
    return os.path.join(store_root(store_dir), "layers", name)


def load_layer_profiles(model: str, seq: int, dtype: str, recompute: str = "none",
                        store_dir: str | None = None) -> LayerProfiles | None:
    """The stored per-layer table of one model key, or None (an unreadable file raises ValueError)."""
    path = layer_profiles_path(model, seq, dtype, recompute, store_dir)
    d = _read_json(path)
    return None if d is None else LayerProfiles.from_dict(d, path)


def save_layer_profiles(layers: LayerProfiles, store_dir: str | None = None) -> str:
    """Merge into the stored table: a (device type, micro-batch, tp) measured again replaces the old one."""
    path = layer_profiles_path(layers.model, layers.seq, layers.dtype, layers.recompute, store_dir)
    old = _read_json(path)
    kept: tuple[LayerMeasurement, ...] = ()
    sources = [layers.source]
    if old is not None:
        try:
            prev = LayerProfiles.from_dict(old, path)
        except ValueError:
            prev = None  # an unreadable table is replaced, not merged
        if prev is not None:
            new_keys = {(m.device_type, m.micro_batch, m.tp) for m in layers.measurements}
            kept = tuple(m for m in prev.measurements if (m.device_type, m.micro_batch, m.tp) not in new_keys)
            if kept and prev.source not in sources:
                sources.append(prev.source)
    merged = LayerProfiles(layers.model, layers.seq, layers.dtype, layers.recompute, " | ".join(sources),
                           kept + layers.measurements)
    return _write_json(path, merged.to_dict())


__all__ = ["LayerMeasurement", "LayerProfiles", "FittedProfile", "fit_step_profiles", "layer_profiles_path",
           "load_layer_profiles", "save_layer_profiles", "FORMAT", "VERSION"]
