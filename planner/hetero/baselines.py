"""What a plan is compared against, priced by the same cost model (planner/costmodel/training.py).

- `even`: every device the same batch (±1 where the global batch does not divide) and the same
  shard, as DDP/FSDP would run; out of memory where a device cannot hold its part.
- `proportional`: batch proportional to each device's speed (1/β), shards even.
- `best_homogeneous`: the best single-type subset of the cluster, run evenly.
Each device runs its batch as the largest power-of-two micro-batch that divides it and fits
(fewer, larger micro-batches amortize α). All are priced at the cost model's ZeRO stage (the
plan's). `planner.hetero.solve.evaluate_plan`
re-prices a given plan at its own stage.
"""
from __future__ import annotations

import logging
import math
from dataclasses import replace
from typing import Sequence

from contracts.cluster import DeviceSpec
from planner.costmodel.training import MAX_MICRO_BATCH, CostModel
from contracts.plan import BaselineResult, Plan

log = logging.getLogger(__name__)


def fastest_fitting_split(cost: CostModel, device: DeviceSpec, batch: int, share: float) -> tuple[int, int] | None:
    """(micro_batch, accum_steps) for `batch` samples with the largest power-of-two micro-batch
    dividing it that fits with `share` of the state; (0, 0) for no batch; None if nothing fits."""
    c = cost.coeffs[device]
    if batch == 0:
        return (0, 0) if c.memory_bytes(0, 0, share) <= c.capacity_bytes else None
    m = 1 << (min(batch, MAX_MICRO_BATCH).bit_length() - 1)
    while m >= 1:
        if batch % m == 0 and c.memory_bytes(m, batch // m, share) <= c.capacity_bytes:
            return m, batch // m
        m //= 2
    return None


def split_by_weights(total: int, weights: Sequence[float]) -> list[int]:
    """Integers proportional to `weights` summing to `total` (largest remainder)."""
    wsum = sum(weights)
    raw = [total * w / wsum for w in weights]
    out = [math.floor(r) for r in raw]
    order = sorted(range(len(raw)), key=lambda i: (out[i] - raw[i], i))
    for i in order[: total - sum(out)]:
        out[i] += 1
    return out


# a baseline priced, with the per-device (micro-batch, accumulation steps, shard) it runs (None when out of memory)
Priced = tuple[BaselineResult, tuple[tuple[int, int, float], ...] | None]


def estimate_split(cost: CostModel, batches: Sequence[int], shares: Sequence[float], name: str) -> Priced:
    """Price per-device batches and shares; OOM when a device cannot hold its part."""
    devices = cost.cluster.devices()
    per_device = []
    for (node, dev), b, f in zip(devices, batches, shares):
        if b == 0 and f == 0:
            per_device.append((0, 0, 0.0))
            continue
        split = fastest_fitting_split(cost, dev, b, f)
        if split is None:
            return BaselineResult(None, True, f"{name}: {dev.label} on {node.name} cannot hold batch {b} "
                                              f"with shard {f:.3g}"), None
        per_device.append((split[0], split[1], f))
    t_s, _ = cost.estimate_iteration_s(per_device)
    return BaselineResult(t_s, False, name), tuple(per_device)


def estimate_even(cost: CostModel, global_batch: int, members: Sequence[int] | None = None) -> Priced:
    num = cost.cluster.num_devices
    members = list(range(num)) if members is None else list(members)
    batches, shares = [0] * num, [0.0] * num
    for i, b in zip(members, split_by_weights(global_batch, [1.0] * len(members))):
        batches[i], shares[i] = b, 1.0 / len(members)
    return estimate_split(cost, batches, shares, "even batch, even shards")


def estimate_proportional(cost: CostModel, global_batch: int) -> Priced:
    devices = cost.cluster.devices()
    speeds = [cost.coeffs[d].speed_samples_per_s for _, d in devices]
    shares = [1.0 / len(devices)] * len(devices)
    return estimate_split(cost, split_by_weights(global_batch, speeds), shares, "batch ∝ speed, even shards")


def estimate_best_homogeneous(cost: CostModel, global_batch: int) -> Priced:
    by_type: dict[str, list[int]] = {}
    for i, (_, d) in enumerate(cost.cluster.devices()):
        by_type.setdefault(d.label, []).append(i)
    best: Priced | None = None
    for label, members in sorted(by_type.items()):
        r, per_device = estimate_even(cost, global_batch, members)
        if r.predicted_iteration_s is not None and (best is None or r.predicted_iteration_s < best[0].predicted_iteration_s):
            best = BaselineResult(r.predicted_iteration_s, False, f"{len(members)}× {label} only, even"), per_device
    return best or (BaselineResult(None, True, "no single device type holds the job"), None)


def estimate_memory_aware(cost: CostModel, global_batch: int) -> Priced:
    """A quick feasible plan (the ILP's starting upper bound): shards ∝ the room each device has
    left beside a micro-batch of 1, batch ∝ speed over the devices that can still compute."""
    devices = cost.cluster.devices()
    rooms = []
    for _, d in devices:
        room = cost.max_share(d, 1, 1)
        rooms.append(max(room if room >= 0 else cost.max_share(d, 0, 0), 0.0))
    if sum(rooms) < 1.0:
        return BaselineResult(None, True, "memory-aware: the state does not fit"), None
    shares = [r / sum(rooms) for r in rooms]
    speeds = [cost.coeffs[d].speed_samples_per_s if cost.coeffs[d].memory_bytes(1, 1, f) <= cost.coeffs[d].capacity_bytes
              else 0.0 for (_, d), f in zip(devices, shares)]
    if sum(speeds) <= 0:
        return BaselineResult(None, True, "memory-aware: no device holds a micro-batch of 1"), None
    return estimate_split(cost, split_by_weights(global_batch, speeds), shares, "memory-aware proportional")


def baseline_plans(cost: CostModel, global_batch: int) -> dict[str, Priced]:
    """Each baseline a plan reports, with the per-device split it prices."""
    return {
        "even": estimate_even(cost, global_batch),
        "proportional": estimate_proportional(cost, global_batch),
        "best_homogeneous": estimate_best_homogeneous(cost, global_batch),
    }


def estimate_baselines(cost: CostModel, global_batch: int) -> dict[str, BaselineResult]:
    return {name: r for name, (r, _) in baseline_plans(cost, global_batch).items()}
