"""Measured bandwidth-vs-message-size curves, and ring collectives priced with them.

A curve is a polynomial in log2(message MB) giving GB/s, capped at a measured maximum, as Sailor fits
its measurements (sailor/providers/gcp/model_networking.py: bandwidth(x) = Σ c_i·log2(x / 1e6)^(n−1−i)
GB/s for a message of x bytes; its file keeps the cap, in bytes/s, beside the coefficients). A
`NetworkProfile` holds such curves per pair of endpoints (zone, GPU type, GPUs per node) and lives in
the profile store (network/), labelled with its source; profiler/importer.py writes it.

A ring of k GPUs over a buffer of N bytes sends k−1 (all-gather, reduce-scatter) or 2(k−1) (all-reduce)
chunks of N/k bytes one after another, each at the curve's bandwidth for an N/k-byte message (Sailor's
`estimate_ar_time`); no separate latency: the curve's fall at small messages carries it. Below
`min_message_bytes` the fit is not used: smaller messages take its bandwidth there.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Any, Iterable

from contracts.constants import BITS_PER_BYTE, GBIT
from planner.core.profiles import _read_json, _safe, _write_json, store_root

BYTES_PER_MB = 1e6  # the fit's x axis: log2 of decimal megabytes (Sailor divides by 1e6)
BYTES_PER_GB = 1e9  # the fit's y axis: decimal GB/s
# Sailor prices its gradient buckets (500 MB / k per ring step, tens of MB and up) and the pipeline's
# activations (MBs); below 1 MB its quadratic fits turn over (the A100 inter-node fit reaches 0 near
# 8 kB), so smaller messages are priced at the 1 MB bandwidth.
DEFAULT_MIN_MESSAGE_BYTES = 1e6
OPS = ("all_reduce", "all_gather", "reduce_scatter")


@dataclass(frozen=True)
class BandwidthCurve:
    """Bandwidth between two endpoints (a = sender, b = receiver) as a function of the message size."""

    gpu_type_a: str
    num_gpus_a: int  # GPUs per node of the sender's node type the curve was measured with
    gpu_type_b: str
    num_gpus_b: int
    coeffs_gb_per_s: tuple[float, ...]  # polynomial in log2(message MB), highest power first, GB/s
    max_bytes_per_s: float  # the measured maximum: the curve is capped there
    zone_a: str = ""  # "" inside one node (an intra-node curve)
    zone_b: str = ""
    min_message_bytes: float = DEFAULT_MIN_MESSAGE_BYTES

    def __post_init__(self) -> None:
        if not self.coeffs_gb_per_s or not all(math.isfinite(c) for c in self.coeffs_gb_per_s):
            raise ValueError(f"{self.label}: coefficients must be finite numbers, got {self.coeffs_gb_per_s!r}")
        if not (math.isfinite(self.max_bytes_per_s) and self.max_bytes_per_s > 0):
            raise ValueError(f"{self.label}: the maximum bandwidth must be > 0 bytes/s, got {self.max_bytes_per_s!r}")
        if self._fit_bytes_per_s(self.min_message_bytes) <= 0:
            raise ValueError(f"{self.label}: the fit gives no positive bandwidth at "
                             f"{self.min_message_bytes / BYTES_PER_MB:g} MB")

    @property
    def label(self) -> str:
        a = f"{self.zone_a}/{self.gpu_type_a}x{self.num_gpus_a}" if self.zone_a else f"{self.gpu_type_a}x{self.num_gpus_a}"
        b = f"{self.zone_b}/{self.gpu_type_b}x{self.num_gpus_b}" if self.zone_b else f"{self.gpu_type_b}x{self.num_gpus_b}"
        return f"curve {a} -> {b}"

    def _fit_bytes_per_s(self, message_bytes: float) -> float:
        x = math.log2(message_bytes / BYTES_PER_MB)
        n = len(self.coeffs_gb_per_s)
        return sum(c * x ** (n - 1 - i) for i, c in enumerate(self.coeffs_gb_per_s)) * BYTES_PER_GB

    def bandwidth_bytes_per_s(self, message_bytes: float) -> float:
        """The bandwidth one message of `message_bytes` gets: the fit, capped at the measured maximum."""
        if not (message_bytes > 0 and math.isfinite(message_bytes)):
            raise ValueError(f"message size must be a positive number of bytes, got {message_bytes!r}")
        fit = self._fit_bytes_per_s(max(message_bytes, self.min_message_bytes))
        if fit <= 0:
            raise ValueError(f"{self.label}: a {message_bytes:.3g}-byte message is outside the fit (no positive "
                             "bandwidth)")
        return min(fit, self.max_bytes_per_s)

    def bandwidth_gbps(self, message_bytes: float) -> float:
        """The same in Gbit/s, the unit of the cluster file's network figures (collectives.bytes_per_s)."""
        return self.bandwidth_bytes_per_s(message_bytes) * BITS_PER_BYTE / GBIT

    def message_time_s(self, message_bytes: float) -> float:
        return message_bytes / self.bandwidth_bytes_per_s(message_bytes) if message_bytes > 0 else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {"zone_a": self.zone_a, "gpu_type_a": self.gpu_type_a, "num_gpus_a": self.num_gpus_a,
                "zone_b": self.zone_b, "gpu_type_b": self.gpu_type_b, "num_gpus_b": self.num_gpus_b,
                "coeffs_gb_per_s": list(self.coeffs_gb_per_s), "max_bytes_per_s": self.max_bytes_per_s,
                "min_message_bytes": self.min_message_bytes}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "BandwidthCurve":
        return cls(str(d["gpu_type_a"]), int(d["num_gpus_a"]), str(d["gpu_type_b"]), int(d["num_gpus_b"]),
                   tuple(float(c) for c in d["coeffs_gb_per_s"]), float(d["max_bytes_per_s"]),
                   str(d.get("zone_a", "")), str(d.get("zone_b", "")),
                   float(d.get("min_message_bytes", DEFAULT_MIN_MESSAGE_BYTES)))


@dataclass(frozen=True)
class NetworkProfile:
    """Measured curves of one network, labelled with where they come from."""

    name: str
    kind: str  # "inter_node" (between nodes, per zone pair) | "intra_node" (inside one node)
    source: str
    curves: tuple[BandwidthCurve, ...]
    measured: bool = True

    def curve(self, gpu_type_a: str, num_gpus_a: int, gpu_type_b: str | None = None, num_gpus_b: int | None = None,
              zone_a: str = "", zone_b: str | None = None) -> BandwidthCurve:
        """The curve between two endpoints (b defaults to a; inside a node zones are "")."""
        key = (zone_a, gpu_type_a, num_gpus_a, zone_a if zone_b is None else zone_b,
               gpu_type_a if gpu_type_b is None else gpu_type_b, num_gpus_a if num_gpus_b is None else num_gpus_b)
        for c in self.curves:
            if (c.zone_a, c.gpu_type_a, c.num_gpus_a, c.zone_b, c.gpu_type_b, c.num_gpus_b) == key:
                return c
        raise ValueError(f"network profile {self.name!r} has no curve for {key[1]}x{key[2]} -> {key[4]}x{key[5]}"
                         + (f" ({key[0]} -> {key[3]})" if key[0] or key[3] else ""))

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "kind": self.kind, "source": self.source, "measured": self.measured,
                "curves": [c.to_dict() for c in self.curves]}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "NetworkProfile":
        return cls(str(d["name"]), str(d["kind"]), str(d["source"]),
                   tuple(BandwidthCurve.from_dict(c) for c in d["curves"]), bool(d.get("measured", True)))


def ring_time_s(op: str, buffer_bytes: float, num_gpus: int, curves: BandwidthCurve | Iterable[BandwidthCurve]) -> float:
    """Seconds of a ring `op` over a buffer of `buffer_bytes` on `num_gpus` GPUs: (k−1) chunk steps for an
    all-gather or a reduce-scatter, 2(k−1) for an all-reduce, each chunk (N/k bytes) at the bandwidth of
    the slowest of `curves` (the ring's links) for a message of that size."""
    if op not in OPS:
        raise ValueError(f"op must be one of {OPS}, got {op!r}")
    if num_gpus <= 1 or buffer_bytes <= 0:
        return 0.0
    links = [curves] if isinstance(curves, BandwidthCurve) else list(curves)
    if not links:
        raise ValueError("a ring needs at least one bandwidth curve")
    chunk = buffer_bytes / num_gpus
    steps = (2 if op == "all_reduce" else 1) * (num_gpus - 1)
    return steps * max(c.message_time_s(chunk) for c in links)


def all_reduce_time_s(buffer_bytes: float, num_gpus: int, curves: BandwidthCurve | Iterable[BandwidthCurve],
                      bucket_bytes: float | None = None) -> float:
    """A ring all-reduce, in buckets of `bucket_bytes` one after another when given (DeepSpeed's 500 MB)."""
    if bucket_bytes is None or buffer_bytes <= bucket_bytes:
        return ring_time_s("all_reduce", buffer_bytes, num_gpus, curves)
    full, rest = divmod(buffer_bytes, bucket_bytes)
    return (full * ring_time_s("all_reduce", bucket_bytes, num_gpus, curves)
            + ring_time_s("all_reduce", rest, num_gpus, curves))


def network_profile_path(name: str, store_dir: str | None = None) -> str:
    return os.path.join(store_root(store_dir), "network", _safe(name) + ".json")


def save_network_profile(profile: NetworkProfile, store_dir: str | None = None) -> str:
    return _write_json(network_profile_path(profile.name, store_dir), profile.to_dict())


def load_network_profile(name: str, store_dir: str | None = None) -> NetworkProfile | None:
    """A stored network profile by name, or None; a malformed file raises ValueError naming it."""
    path = network_profile_path(name, store_dir)
    d = _read_json(path)
    if d is None:
        return None
    try:
        return NetworkProfile.from_dict(d)
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"network profile {path} is malformed: {e}") from None


def list_network_profiles(store_dir: str | None = None) -> list[str]:
    folder = os.path.join(store_root(store_dir), "network")
    try:
        return sorted(n[:-5] for n in os.listdir(folder) if n.endswith(".json"))
    except OSError:
        return []


__all__ = ["BandwidthCurve", "NetworkProfile", "ring_time_s", "all_reduce_time_s", "save_network_profile",
           "load_network_profile", "list_network_profiles", "network_profile_path", "OPS"]
