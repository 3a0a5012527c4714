"""How many more tokens DiLoCo needs than synchronous data parallelism to reach the same loss.

DiLoCo with H inner steps and G groups (models/diloco.py) trains each group on its own for H steps
between outer steps, so it may need more tokens than synchronous DP to reach a loss. The planner
prices that as a multiplier k(H, G) >= 1 on the tokens DP needs (planner/geo/cuts.py).

k is measured, not assumed: `bench/diloco_convergence.py` runs DP and DiLoCo at several H on the
same model, data, schedule and global batch; k at a DiLoCo validation point = its tokens over the
tokens DP's measured validation curve took to the same loss (`measure_multiplier`). The model
interpolates those measurements:

    k(H, G_m) = the measured k at G_m, piecewise linear in ln H between measured H, constant beyond
    k(H, G)   = 1 + (k(H, G_m) − 1) · (G − 1) / (G_m − 1)   G_m the measured group count nearest G
    k(H, 1)   = 1 (one group is data parallelism), and k is never below 1

each for the wire dtype of the outer deltas (`compress`: fp32, bf16, int8; models/diloco.py) it was
measured at: a compression is priced only where its k was measured (`compresses`), never borrowed
from another's.

No shape in H is imposed: on the runs measured (`convergence_fit.json`'s provenance) k fell as H
grew, the opposite of the papers' large-model trend, and a formula fitted to the papers' shape would
hide that. Where (H, G) lies outside what was measured the estimate says EXTRAPOLATED (`estimate`);
the plan carries that note. The bench writes the measurements and their provenance to
`convergence_fit.json` beside this module; the planner reads it (`load_fit`).
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from typing import Any, Sequence

WIRE_DTYPES = ("fp32", "bf16", "int8")  # models/diloco.py's outer-delta wire dtypes
FIT_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "convergence_fit.json")


@dataclass(frozen=True)
class MeasuredMultiplier:
    """One measured k: DiLoCo at (inner_steps, num_groups, compress) against DP on the same runs' settings."""
    inner_steps: int
    num_groups: int
    multiplier: float  # tokens DiLoCo took to its loss / tokens DP took to the same loss
    num_points: int = 1  # loss points of the DiLoCo curve the multiplier is the mean of
    compress: str = "fp32"  # the outer deltas' wire dtype in the runs measured

    def to_dict(self) -> dict[str, Any]:
        return {"inner_steps": self.inner_steps, "num_groups": self.num_groups, "multiplier": self.multiplier,
                "num_points": self.num_points, "compress": self.compress}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "MeasuredMultiplier":
        return cls(int(d["inner_steps"]), int(d["num_groups"]), float(d["multiplier"]), int(d.get("num_points", 1)),
                   str(d.get("compress", "fp32")))


@dataclass(frozen=True)
class ConvergenceEstimate:
    """k(H, G) and whether it lies inside what was measured."""
    multiplier: float
    extrapolated: bool
    note: str


@dataclass(frozen=True)
class ConvergenceFit:
    """k(H, G) interpolated from `measured` (one entry per measured (H, G)); `provenance` says how."""
    measured: tuple[MeasuredMultiplier, ...]
    provenance: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.measured:
            raise ValueError("convergence fit: no measured multiplier")
        keys = [(m.inner_steps, m.num_groups, m.compress) for m in self.measured]
        if len(set(keys)) != len(keys):
            raise ValueError("convergence fit: an (H, G, compress) is measured twice; merge them first "
                             "(fit_multipliers)")
        for m in self.measured:
            _check(m.inner_steps, m.num_groups)
            _check_compress(m.compress)
            if m.num_groups < 2 or not math.isfinite(m.multiplier) or m.multiplier <= 0:
                raise ValueError(f"convergence fit: measured k {m.multiplier!r} at H={m.inner_steps}, "
                                 f"G={m.num_groups}: need G >= 2 and a positive k")

    @property
    def compresses(self) -> tuple[str, ...]:
        """The wire dtypes some k was measured at (fp32 first)."""
        return tuple(c for c in WIRE_DTYPES if any(m.compress == c for m in self.measured))

    def groups_measured(self, compress: str = "fp32") -> tuple[int, ...]:
        return tuple(sorted({m.num_groups for m in self._at(compress)}))

    def inner_steps_range(self, num_groups: int, compress: str = "fp32") -> tuple[int, int]:
        """The measured H range at the measured G nearest `num_groups`."""
        ref = self._reference_groups(num_groups, compress)
        hs = [m.inner_steps for m in self._at(compress) if m.num_groups == ref]
        return min(hs), max(hs)

    def _at(self, compress: str) -> list[MeasuredMultiplier]:
        """The measurements at `compress`; ValueError naming the measured ones when there are none."""
        _check_compress(compress)
        ms = [m for m in self.measured if m.compress == compress]
        if not ms:
            raise ValueError(f"convergence fit: no k measured at compress={compress!r} "
                             f"(measured: {', '.join(self.compresses)})")
        return ms

    def _reference_groups(self, num_groups: int, compress: str = "fp32") -> int:
        return min(self.groups_measured(compress), key=lambda g: (abs(g - num_groups), g))

    def multiplier(self, inner_steps: int, num_groups: int, compress: str = "fp32") -> float:
        """k(H, G) at `compress` as the module docstring says (>= 1)."""
        _check(inner_steps, num_groups)
        ms = self._at(compress)
        if num_groups == 1:
            return 1.0
        ref = self._reference_groups(num_groups, compress)
        pts = sorted((math.log(m.inner_steps), m.multiplier) for m in ms if m.num_groups == ref)
        x = math.log(inner_steps)
        if x <= pts[0][0]:
            k = pts[0][1]
        elif x >= pts[-1][0]:
            k = pts[-1][1]
        else:
            (x0, k0), (x1, k1) = next((a, b) for a, b in zip(pts, pts[1:]) if a[0] <= x <= b[0])
            k = k0 + (x - x0) / (x1 - x0) * (k1 - k0)
        return max(1.0, 1.0 + (k - 1.0) * (num_groups - 1) / (ref - 1))

    def estimate(self, inner_steps: int, num_groups: int, compress: str = "fp32") -> ConvergenceEstimate:
        """k(H, G) at `compress` with a note saying where it was measured; `extrapolated` when H lies
        outside the measured H range or G is not a measured group count."""
        k = self.multiplier(inner_steps, num_groups, compress)
        lo, hi = self.inner_steps_range(num_groups, compress)
        groups = self.groups_measured(compress)
        outside = []
        if num_groups > 1 and not lo <= inner_steps <= hi:
            outside.append(f"H={inner_steps} outside the measured H {lo}-{hi}")
        if num_groups > 1 and num_groups not in groups:
            outside.append(f"G={num_groups} not measured (G measured: {', '.join(map(str, groups))})")
        where = self.provenance.get("command", "bench/diloco_convergence.py")
        what = f"convergence k(H={inner_steps}, G={num_groups}" + ("" if compress == "fp32" else f", {compress}")
        if outside:
            note = f"{what}) = {k:.3f} EXTRAPOLATED: {'; '.join(outside)} ({where})"
        else:
            note = f"{what}) = {k:.3f} interpolated from measured runs ({where})"
        return ConvergenceEstimate(k, bool(outside), note)

    def to_dict(self) -> dict[str, Any]:
        return {"model": "k piecewise linear in ln H between measured H (constant beyond), "
                         "(k - 1) scaled by (G - 1) / (G_measured - 1), k >= 1",
                "measured": [m.to_dict() for m in self.measured], "provenance": dict(self.provenance)}

    @classmethod
    def from_dict(cls, d: Any) -> "ConvergenceFit":
        if not isinstance(d, dict) or not isinstance(d.get("measured"), list):
            raise ValueError("convergence fit: expected an object with a 'measured' list")
        return cls(tuple(MeasuredMultiplier.from_dict(m) for m in d["measured"]), dict(d.get("provenance") or {}))

    def save(self, path: str = FIT_PATH) -> None:
        with open(path + ".tmp", "w", encoding="utf-8") as fh:
            json.dump(self.to_dict(), fh, indent=1)
            fh.write("\n")
        os.replace(path + ".tmp", path)


def _check_compress(compress: str) -> None:
    if compress not in WIRE_DTYPES:
        raise ValueError(f"convergence: compress must be one of {', '.join(WIRE_DTYPES)}, got {compress!r}")


def _check(inner_steps: int, num_groups: int) -> None:
    if not isinstance(inner_steps, int) or inner_steps < 1:
        raise ValueError(f"convergence: inner_steps H must be an integer >= 1, got {inner_steps!r}")
    if not isinstance(num_groups, int) or num_groups < 1:
        raise ValueError(f"convergence: num_groups G must be an integer >= 1, got {num_groups!r}")


def fit_multipliers(measured: Sequence[MeasuredMultiplier], provenance: dict[str, Any] | None = None
                    ) -> ConvergenceFit:
    """The model over `measured`: several measurements of one (H, G, compress) (repeats, seeds)
    merged into their mean weighted by their points; ValueError when none has G >= 2."""
    by_key: dict[tuple[str, int, int], list[MeasuredMultiplier]] = {}
    for m in measured:
        by_key.setdefault((m.compress, m.inner_steps, m.num_groups), []).append(m)
    merged = []
    for (c, h, g), ms in sorted(by_key.items(), key=lambda kv: (WIRE_DTYPES.index(kv[0][0]), kv[0][1:])):
        n = sum(m.num_points for m in ms)
        merged.append(MeasuredMultiplier(h, g, sum(m.multiplier * m.num_points for m in ms) / n, n, c))
    if not any(m.num_groups >= 2 for m in merged):
        raise ValueError("convergence fit: no measured point with G >= 2")
    return ConvergenceFit(tuple(m for m in merged if m.num_groups >= 2), dict(provenance or {}))


def tokens_to_loss(curve: Sequence[tuple[float, float]], loss: float) -> float | None:
    """The tokens a measured (tokens, loss) curve took to reach `loss`, linearly interpolated between
    its points (the curve's first point where the loss falls to `loss`); None when the curve never
    gets that low, or `loss` is above its first point (outside what it measured)."""
    pts = sorted(curve)
    if not pts or loss > pts[0][1]:
        return None
    if loss == pts[0][1]:
        return pts[0][0]
    for (t0, l0), (t1, l1) in zip(pts, pts[1:]):
        if l1 <= loss < l0:
            return t0 + (l0 - loss) / (l0 - l1) * (t1 - t0)
    return None


def measure_multiplier(dp_curve: Sequence[tuple[float, float]], diloco_curve: Sequence[tuple[float, float]],
                       inner_steps: int, num_groups: int, compress: str = "fp32") -> MeasuredMultiplier | None:
    """k from two measured validation curves, (tokens, loss) each: for every DiLoCo point whose loss
    DP's curve reaches, its tokens over DP's tokens to that loss; the mean of those ratios. A DiLoCo
    point below DP's lowest loss or above its first is outside DP's measured curve and skipped; None
    when no point is inside it."""
    _check(inner_steps, num_groups)
    _check_compress(compress)
    ratios = []
    for tokens, loss in diloco_curve:
        dp_tokens = tokens_to_loss(dp_curve, loss)
        if dp_tokens is not None and dp_tokens > 0:
            ratios.append(tokens / dp_tokens)
    if not ratios:
        return None
    return MeasuredMultiplier(inner_steps, num_groups, sum(ratios) / len(ratios), len(ratios), compress)


def load_fit(path: str = FIT_PATH) -> ConvergenceFit | None:
    """The committed fit, or None when no file was written (the planner then does not price DiLoCo)."""
    if not os.path.exists(path):
        return None
    with open(path, encoding="utf-8") as fh:
        try:
            return ConvergenceFit.from_dict(json.load(fh))
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"convergence fit {path}: {e}") from e


__all__ = ["ConvergenceEstimate", "ConvergenceFit", "FIT_PATH", "MeasuredMultiplier", "fit_multipliers",
           "load_fit", "measure_multiplier", "tokens_to_loss"]
