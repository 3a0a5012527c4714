"""The planner's cost model: time and memory of one device, and the coefficient tables the ILP consumes.

What one optimizer step costs on the executor's runtime (models/runtime.py):
- compute: `n` micro-batches of `m` samples, each `α + β·m` seconds (the device type's
  StepProfile, planner/profiles.py), times the device's emulated `slowdown`;
- optimizer: AdamW over the device's slice of the flat state, `optimizer_s_per_param · N · f`
  (shard fraction `f`), times `slowdown`;
- collectives, none of them hidden behind compute: one ring all-reduce (SUM) of the full flat
  fp32 gradient buffer after the last micro-batch, `2·(k−1)/k · 4N` bytes per rank, then every
  rank broadcasts its slice of the fp32 parameters, `4N` bytes in all; each collective call also
  pays a latency per ring hop. `k` is the number of devices the plan uses; the bandwidth is the
  slowest link among them (the cluster's `intra_node_gbps` on one node, `inter_node_gbps`
  across nodes), or what `profiler bench` measured between local CPU workers.
An iteration ends when the slowest device ends: `T = max_i (compute_i + optimizer_i) + comm(k)`.

Memory is the memory model's (planner/memory.py), increasing in the shard fraction; the tables hold,
for every candidate micro-batch, the largest shard fraction that still fits (`Choice.max_share`).

Units: seconds and bytes everywhere inside; the cluster file's Gbit/s are converted once,
in `link_bandwidth_bytes_per_s`.
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Callable, Iterable, Sequence

from planner.cluster import ClusterSpec, DeviceSpec, NodeSpec
from planner.options import device_dtype
from planner.specs import ModelSpec

log = logging.getLogger(__name__)

BITS_PER_BYTE = 8
GBIT = 1e9  # the cluster file's *_gbps are Gbit/s (DESIGN.md)
FP32_BYTES = 4  # the runtime keeps flat fp32 params and grads (models/runtime.py)
# Per-hop latency of one collective step when nothing was measured: NCCL's ring step costs a few
# microseconds over NVLink/PCIe and tens over a datacenter network (NCCL tests, 8-byte all-reduce).
INTRA_NODE_HOP_LATENCY_S = 5e-6
INTER_NODE_HOP_LATENCY_S = 25e-6
# The largest micro-batch tried: beyond it α is fully amortized and only memory grows.
MAX_MICRO_BATCH = 64
# The runtime's sharding in ZeRO terms (planner/memory.py): only the AdamW state is sharded.
RUNTIME_ZERO_STAGE = 1
# The ILP prices the world size k exactly up to this count; above it k falls in buckets
# (9–11, 12–15, ...) priced at their largest k, a safe upper bound (comm grows with k).
EXACT_WORLD_SIZES = 8
WORLD_BUCKET_GROWTH = 1.4

MemoryFn = Callable[[int, float], float]  # (micro_batch, shard_fraction) -> peak bytes


@dataclass(frozen=True)
class DeviceCoeffs:
    """The cost figures of one kind of device (type + emulation) for one model, seq and dtype.
    Times include the emulated slowdown."""

    device: DeviceSpec
    dtype: str  # what this type trains in (bf16 falls back to fp16 where unsupported)
    alpha_s: float  # fixed cost of one micro-batch
    beta_s: float  # cost per sample of a micro-batch
    optimizer_s: float  # AdamW over the whole state (f = 1)
    capacity_bytes: float  # memory × headroom: what a plan may use
    memory_fn: MemoryFn = field(compare=False, repr=False)  # (m, f) -> bytes
    measured: bool = False  # the step profile was measured (else estimated)
    source: str = ""

    def compute_s(self, micro_batch: int, accum_steps: int) -> float:
        return accum_steps * (self.alpha_s + self.beta_s * micro_batch) if micro_batch > 0 else 0.0

    def step_s(self, micro_batch: int, accum_steps: int, shard_fraction: float) -> float:
        """Compute plus the optimizer step on the device's shard (collectives excluded)."""
        return self.compute_s(micro_batch, accum_steps) + self.optimizer_s * shard_fraction

    def memory_bytes(self, micro_batch: int, shard_fraction: float) -> float:
        return self.memory_fn(micro_batch, shard_fraction)

    @property
    def speed_samples_per_s(self) -> float:
        """Throughput at large micro-batches (α amortized): what `proportional` splits by."""
        return 1.0 / self.beta_s


@dataclass(frozen=True)
class CommModel:
    """Collective costs of one step for the devices of one scope (one node, or several)."""

    bandwidth_bytes_per_s: float  # ring bus bandwidth per rank
    hop_latency_s: float
    grad_bytes: float  # the flat fp32 gradient buffer
    param_bytes: float  # the flat fp32 parameter buffer (broadcast slice by slice)
    source: str = ""
    # a measured broadcast (profiler bench): bytes/s of one broadcast and its latency per call
    broadcast_bytes_per_s: float | None = None
    broadcast_call_latency_s: float | None = None

    def comm_s(self, world_size: int) -> float:
        """All-reduce of the gradients: ring bandwidth term 2·(k−1)/k·bytes/bw; then k broadcasts of
        the slices, together P bytes through each rank at bw. Each call pays its latency over a tree of
        ⌈log2 k⌉ hops (NCCL/gloo switch to trees for latency-bound sizes). 0 for one device."""
        k = world_size
        if k <= 1:
            return 0.0
        call_latency_s = math.ceil(math.log2(k)) * self.hop_latency_s
        all_reduce_s = 2 * (k - 1) / k * self.grad_bytes / self.bandwidth_bytes_per_s + 2 * call_latency_s
        bcast_bw = self.broadcast_bytes_per_s or self.bandwidth_bytes_per_s
        bcast_latency_s = call_latency_s if self.broadcast_call_latency_s is None else self.broadcast_call_latency_s
        broadcast_s = self.param_bytes / bcast_bw + k * bcast_latency_s
        return all_reduce_s + broadcast_s


@dataclass(frozen=True)
class Choice:
    """One (micro_batch, accum_steps) a device may take; (0, 0) holds state only."""

    micro_batch: int
    accum_steps: int
    compute_s: float
    memory_fixed_bytes: float  # at shard fraction 0
    memory_per_share_bytes: float  # memory at f = 1 minus at f = 0 (the slope where the peak is affine)
    max_share: float  # largest per-device shard fraction that fits (≤ 1)

    @property
    def batch(self) -> int:
        return self.micro_batch * self.accum_steps


@dataclass(frozen=True)
class ClassTable:
    """Identical devices of one scope (same DeviceSpec) and the choices each may take."""

    device: DeviceSpec
    device_indices: tuple[int, ...]  # ClusterSpec.devices() order
    coeffs: DeviceCoeffs
    choices: tuple[Choice, ...]

    @property
    def count(self) -> int:
        return len(self.device_indices)


@dataclass(frozen=True)
class ScopeTable:
    """The coefficient tables of one scope: the devices a plan may use with one link bandwidth."""

    name: str
    multi_node: bool
    classes: tuple[ClassTable, ...]
    comm: CommModel

    @property
    def num_devices(self) -> int:
        return sum(c.count for c in self.classes)

    def comm_s(self, world_size: int) -> float:
        return self.comm.comm_s(world_size)


# ---- edges: units and the two models this one consumes ----------------------------------------


def link_bandwidth_bytes_per_s(gbps: float) -> float:
    """Gbit/s (cluster file) -> bytes/s."""
    return gbps * GBIT / BITS_PER_BYTE


# The memory model takes shard fractions in (0, 1]; a device without a shard is asked at this one
# (round(f·P) = 0 parameters for any model below 10^12 parameters).
NO_SHARE = 1e-12
# max_share is found to this precision in the shard fraction (far below one parameter's worth
# that matters: the runtime rounds slices to whole parameters anyway).
SHARE_TOL = 1e-9


def cached_memory_fn(memory_at: Callable[[int, float], float]) -> MemoryFn:
    """The memory model as (m, f) -> bytes, cached; f = 0 asked at NO_SHARE; micro-batch 0 (state
    only) extrapolated from 1 and 2 if the model refuses it (each of its phases is affine in m)."""

    @lru_cache(maxsize=None)
    def fn(m: int, f: float) -> float:
        f = max(f, NO_SHARE)
        if m == 0:
            try:
                return float(memory_at(0, f))
            except ValueError:
                return 2.0 * fn(1, f) - fn(2, f)
        return float(memory_at(m, f))

    return fn


def max_share_fitting(memory_fn: MemoryFn, micro_batch: int, capacity_bytes: float) -> float:
    """The largest shard fraction f ≤ 1 with memory(m, f) ≤ capacity; −1 if even f = 0 does not fit.
    Memory grows with f and is piecewise affine (the peak is the largest of a few affine moments of the
    step): secant steps, exact on one affine piece, alternating with bisection, which always halves."""
    lo, hi = 0.0, 1.0
    mem_lo, mem_hi = memory_fn(micro_batch, lo), memory_fn(micro_batch, hi)
    if mem_hi <= capacity_bytes:
        return 1.0
    if mem_lo > capacity_bytes:
        return -1.0
    for step in range(200):
        if hi - lo <= SHARE_TOL:
            break
        x = 0.5 * (lo + hi) if step % 2 else lo + (capacity_bytes - mem_lo) * (hi - lo) / (mem_hi - mem_lo)
        x = min(max(x, lo + SHARE_TOL / 2), hi - SHARE_TOL / 2)
        mem_x = memory_fn(micro_batch, x)
        if mem_x <= capacity_bytes:
            lo, mem_lo = x, mem_x
        else:
            hi, mem_hi = x, mem_x
    return lo


def runtime_memory_fn(spec: ModelSpec, seq: int, dtype: str, recompute: str, world_size: int) -> MemoryFn:
    """The memory model of planner/memory.py for this runtime: ZeRO stage 1 in its terms (flat fp32
    params and grads in full on every device, AdamW state sharded by the shard fraction)."""
    from planner.memory import MemoryConfig, estimate_memory

    def memory_at(m: int, f: float) -> float:
        cfg = MemoryConfig(micro_batch=m, seq=seq, dtype=dtype, recompute=recompute, dp=max(world_size, 1),
                           zero=RUNTIME_ZERO_STAGE, shard_fraction=f)
        return estimate_memory(spec, cfg).peak_bytes

    return cached_memory_fn(memory_at)


def build_device_coeffs(device: DeviceSpec, spec: ModelSpec, seq: int, dtype: str, recompute: str,
                        headroom: float, world_size: int, profiles_dir: str | None = None) -> DeviceCoeffs:
    """One device kind's coefficients from its step profile (measured or estimated) and the memory model."""
    from planner.profiles import get_step_profile

    dt = device_dtype(device.type, dtype)
    prof = get_step_profile(device.type, spec, seq, dt, recompute=recompute, store_dir=profiles_dir)
    return DeviceCoeffs(
        device=device, dtype=dt,
        alpha_s=prof.alpha_s * device.slowdown,
        beta_s=prof.beta_s * device.slowdown,
        optimizer_s=prof.optimizer_s_per_param * spec.num_params * device.slowdown,
        capacity_bytes=device.memory_bytes * headroom,
        memory_fn=runtime_memory_fn(spec, seq, dt, recompute, world_size),
        measured=bool(prof.measured), source=prof.source,
    )


def build_comm_model(devices: Iterable[DeviceSpec], multi_node: bool, cluster: ClusterSpec, num_params: int,
                     profiles_dir: str | None = None) -> CommModel:
    """Link figures for a scope: measured gloo/NCCL fits for local CPU workers on one node when
    `profiler bench` has them, else the cluster file's bandwidth (slowest link among the devices)."""
    grad_bytes = param_bytes = float(FP32_BYTES * num_params)
    types = {d.type for d in devices}
    if not multi_node and types == {"cpu"}:
        from planner.profiles import get_collective_profile

        prof = get_collective_profile("cpu", profiles_dir)
        fit = prof.fit("all_reduce") if prof else None
        if fit is not None and fit.bandwidth_bytes_per_s > 0 and prof.world_size > 1:
            w = prof.world_size
            # the fit's bandwidth is size/time (algorithm bandwidth); a ring moves 2(w−1)/w of it per rank
            bus = fit.bandwidth_bytes_per_s * 2 * (w - 1) / w
            hop = max(fit.latency_s, 0.0) / (2 * math.ceil(math.log2(w)))  # comm_s: 2 calls' latency per all-reduce
            bcast = prof.fit("broadcast")
            bcast_bw = bcast.bandwidth_bytes_per_s if bcast and bcast.bandwidth_bytes_per_s > 0 else None
            bcast_lat = max(bcast.latency_s, 0.0) if bcast_bw else None
            return CommModel(bus, hop, grad_bytes, param_bytes, f"measured {prof.backend} collectives, {w} ranks",
                             bcast_bw, bcast_lat)
    net = cluster.network
    gbps = min(net.intra_node_gbps, net.inter_node_gbps) if multi_node else net.intra_node_gbps
    hop = INTER_NODE_HOP_LATENCY_S if multi_node else INTRA_NODE_HOP_LATENCY_S
    where = "inter_node_gbps" if multi_node else "intra_node_gbps"
    return CommModel(link_bandwidth_bytes_per_s(gbps), hop, grad_bytes, param_bytes, f"cluster file {where} {gbps:g}")


# ---- the cost model of one (cluster, model, seq, dtype) ----------------------------------------


class CostModel:
    """Per-device costs for one cluster and training setup; evaluates plans and builds ILP tables."""

    def __init__(self, cluster: ClusterSpec, num_params: int, coeffs: dict[DeviceSpec, DeviceCoeffs],
                 comm_for: Callable[[Sequence[DeviceSpec], bool], CommModel]):
        self.cluster = cluster
        self.num_params = num_params
        self.coeffs = coeffs
        self._comm_for = comm_for
        self._comm_cache: dict[tuple[frozenset, bool], CommModel] = {}

    @classmethod
    def build(cls, cluster: ClusterSpec, spec: ModelSpec, seq: int, dtype: str, recompute: str,
              headroom: float, profiles_dir: str | None = None) -> "CostModel":
        kinds = sorted({d for _, d in cluster.devices()}, key=lambda d: (d.type, d.slowdown, d.memory_gb or 0))
        coeffs = {d: build_device_coeffs(d, spec, seq, dtype, recompute, headroom, cluster.num_devices, profiles_dir)
                  for d in kinds}

        def comm_for(devices: Sequence[DeviceSpec], multi_node: bool) -> CommModel:
            return build_comm_model(devices, multi_node, cluster, spec.num_params, profiles_dir)

        return cls(cluster, spec.num_params, coeffs, comm_for)

    def comm_model(self, devices: Iterable[DeviceSpec], multi_node: bool) -> CommModel:
        key = (frozenset(devices), multi_node)
        if key not in self._comm_cache:
            self._comm_cache[key] = self._comm_for(sorted(key[0], key=lambda d: d.type), multi_node)
        return self._comm_cache[key]

    def estimate_iteration_s(self, per_device: Sequence[tuple[int, int, float]]) -> tuple[float, list[float]]:
        """Predicted iteration time of `(micro_batch, accum_steps, shard_fraction)` per device of
        the cluster (ClusterSpec.devices() order), and each used device's step time (0 if unused)."""
        devices = self.cluster.devices()
        used = [i for i, (m, n, f) in enumerate(per_device) if m * n > 0 or f > 0]
        if not used:
            raise ValueError("a plan must use at least one device")
        nodes = {devices[i][0].name for i in used}
        comm = self.comm_model({devices[i][1] for i in used}, len(nodes) > 1).comm_s(len(used))
        steps = [0.0] * len(devices)
        for i in used:
            m, n, f = per_device[i]
            steps[i] = self.coeffs[devices[i][1]].step_s(m, n, f) + comm
        return max(steps[i] for i in used), steps

    def estimate_memory_bytes(self, device: DeviceSpec, micro_batch: int, shard_fraction: float) -> float:
        return self.coeffs[device].memory_bytes(micro_batch, shard_fraction)

    # ---- coefficient tables -------------------------------------------------------------------

    def choices(self, device: DeviceSpec, global_batch: int, micro_batches: Sequence[int] | None = None,
                max_compute_s: float = math.inf) -> tuple[Choice, ...]:
        """The state-only choice, then every (m, n) with m from `micro_batches` (default: powers of
        two up to the global batch and MAX_MICRO_BATCH) whose memory at f = 0 fits, n from 1 while
        m·n ≤ the global batch and the compute time stays within `max_compute_s` (an upper bound
        on the optimum: a slower device would only finish later)."""
        c = self.coeffs[device]
        ms = sorted(set(micro_batches)) if micro_batches else [
            1 << i for i in range(min(global_batch, MAX_MICRO_BATCH).bit_length())]
        out = []
        for m in [0] + [m for m in ms if 0 < m <= global_batch]:
            max_share = max_share_fitting(c.memory_fn, m, c.capacity_bytes)
            if max_share < 0:
                continue
            fixed = c.memory_bytes(m, 0.0)
            per_share = c.memory_bytes(m, 1.0) - fixed
            for n in ([0] if m == 0 else range(1, global_batch // m + 1)):
                compute = c.compute_s(m, n)
                if compute > max_compute_s:
                    break
                out.append(Choice(m, n, compute, fixed, per_share, max_share))
        return tuple(out)

    def scopes(self) -> list[tuple[str, bool, list[tuple[NodeSpec, list[int]]]]]:
        """The device sets a plan's link bandwidth depends on: all nodes (when there are several),
        then each node on its own; nodes of identical composition are one scope."""
        by_node: dict[str, list[int]] = {}
        for i, (n, _) in enumerate(self.cluster.devices()):
            by_node.setdefault(n.name, []).append(i)
        out = []
        nodes = self.cluster.nodes
        if len(nodes) > 1:
            out.append(("all nodes", True, [(n, by_node[n.name]) for n in nodes]))
        seen = set()
        for n in nodes:
            comp = tuple(sorted((d.type, d.slowdown, d.memory_gb or 0.0) for d in n.devices))
            if comp in seen:
                continue
            seen.add(comp)
            out.append((f"node {n.name}", False, [(n, by_node[n.name])]))
        return out

    def scope_table(self, name: str, multi_node: bool, members: Sequence[int], global_batch: int,
                    micro_batches: Sequence[int] | None = None, max_compute_s: float = math.inf) -> ScopeTable:
        devices = self.cluster.devices()
        by_kind: dict[DeviceSpec, list[int]] = {}
        for i in sorted(members):
            by_kind.setdefault(devices[i][1], []).append(i)
        classes = tuple(
            ClassTable(d, tuple(ix), self.coeffs[d], self.choices(d, global_batch, micro_batches, max_compute_s))
            for d, ix in by_kind.items())
        return ScopeTable(name, multi_node, classes, self.comm_model(by_kind, multi_node))


def world_size_buckets(max_world_size: int) -> list[tuple[int, int]]:
    """[lo, hi] ranges of the number of used devices the ILP distinguishes: each k exactly up
    to EXACT_WORLD_SIZES, then ranges growing by WORLD_BUCKET_GROWTH (priced at hi: a few % of
    the collective time at most, and only where hundreds of devices share it)."""
    out = [(k, k) for k in range(1, min(max_world_size, EXACT_WORLD_SIZES) + 1)]
    lo = EXACT_WORLD_SIZES + 1
    while lo <= max_world_size:
        hi = min(max(lo, int((lo - 1) * WORLD_BUCKET_GROWTH)), max_world_size)
        out.append((lo, hi))
        lo = hi + 1
    return out
