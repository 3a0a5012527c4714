"""MARP: which devices, how many, and in which parallel configuration a job fits.

For a job and each *pool* of identical devices in a cluster (same DeviceSpec:
type, emulated slowdown and memory), list the GPU counts at which the job fits
in memory, each with the fastest configuration found — data-parallel degree =
GPU count, ZeRO stage, activation recomputation, micro-batch — and its
predicted iteration time and so its predicted duration (steps × iteration).

Memory is the memory model's (planner.core.memory.estimate_memory); step time is
the profile's `α + β·m` per micro-batch (planner.core.profiles.get_step_profile,
measured where this machine has profiled the device, else estimated from the
catalog's peak FLOP/s). Tensor and pipeline parallelism are not modelled: ZeRO-3
shards every training state across the data-parallel group, which is enough to
fit 13B-class models on 16 GB parts at a count a cluster has.

Everything expensive is cached per (model, seq, dtype, device) so that a
scheduler decision costs dictionary look-ups, not model evaluations.
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from functools import lru_cache
from typing import Sequence

from planner.core.catalog import device_dtype, get_gpu_type
from planner.core.cluster import ClusterSpec, DeviceSpec
from planner.core.jobs import JobSpec
from planner.core.profiles import StepProfile, get_step_profile
from planner.core.specs import ModelSpec, get_model
from planner.core.constants import BITS_PER_BYTE, MAX_MICRO_BATCH, MEMORY_HEADROOM, RECOMPUTE

log = logging.getLogger(__name__)

ZERO_CHOICES = (2, 3)  # ZeRO-1 is dominated by ZeRO-2 (same traffic, less memory); 3 shards parameters too
# Share of one micro-batch's step time (the backward pass, ~2/3 of it) behind which
# the gradient reduce-scatter / parameter all-gather of the last micro-batch can hide.
BACKWARD_OVERLAP = 2.0 / 3.0


@dataclass(frozen=True)
class ResourceOption:
    """One way to run a job: `num_gpus` devices of one pool, data parallel."""

    pool: DeviceSpec  # the device kind (type + emulation)
    num_gpus: int  # data-parallel degree
    zero: int  # ZeRO stage (0 when num_gpus == 1: nothing to shard across)
    recompute: str  # "none" | "full"
    micro_batch: int
    accum_steps: int  # micro-batches per optimizer step on the busiest device
    dtype: str  # training dtype actually used on this device type
    peak_memory_bytes: int  # predicted, per device
    capacity_bytes: int  # the device's memory
    iteration_s: float  # predicted optimizer-step time
    duration_s: float  # predicted: steps × iteration_s
    samples_per_s: float  # predicted throughput

    @property
    def gpu_type(self) -> str:
        return self.pool.type

    @property
    def gpu_seconds(self) -> float:
        return self.num_gpus * self.duration_s

    def to_dict(self) -> dict:
        return {
            "gpu_type": self.pool.type, "device": self.pool.label, "num_gpus": self.num_gpus, "zero": self.zero,
            "recompute": self.recompute, "micro_batch": self.micro_batch, "accum_steps": self.accum_steps,
            "dtype": self.dtype, "predicted_memory_bytes": self.peak_memory_bytes,
            "capacity_bytes": self.capacity_bytes, "predicted_iteration_s": self.iteration_s,
            "predicted_duration_s": self.duration_s, "predicted_samples_per_s": self.samples_per_s,
        }


@dataclass(frozen=True)
class Pool:
    """All devices of one DeviceSpec in a cluster."""

    device: DeviceSpec
    count: int
    max_per_node: int  # the largest group on one node: above it traffic crosses nodes


def cluster_pools(cluster: ClusterSpec) -> list[Pool]:
    total: dict[DeviceSpec, int] = {}
    per_node: dict[DeviceSpec, int] = {}
    for g in cluster.groups():
        total[g.device] = total.get(g.device, 0) + g.count
        per_node[g.device] = max(per_node.get(g.device, 0), g.count)
    return [Pool(d, total[d], per_node[d]) for d in total]


# --- the two models this module consumes (cached) ---

@lru_cache(maxsize=None)
def _peak_bytes(model: str, seq: int, dtype: str, dp: int, zero: int, recompute: str, micro_batch: int,
                device_type: str = "cpu") -> int:
    spec = get_model(model)
    try:
        from planner.core.memory import MemoryConfig, estimate_memory
    except ImportError:  # memory model not in this tree yet
        return _fallback_peak_bytes(spec, seq, dtype, dp, zero, recompute, micro_batch)
    cfg = MemoryConfig(micro_batch=micro_batch, seq=seq, dtype=dtype, recompute=recompute, dp=dp, zero=zero,
                       device_type=device_type)
    return int(estimate_memory(spec, cfg).peak_bytes)


def _fallback_peak_bytes(spec: ModelSpec, seq: int, dtype: str, dp: int, zero: int, recompute: str, m: int) -> int:
    # Model states 16 B/param (mixed-precision Adam), sharded by stage; activations per layer
    # s·b·h·(34 + 5·a·s/h) bytes in 16-bit (Korthikanti et al. 2022), 2·s·b·h with recomputation.
    p = spec.num_params
    width = 4 if dtype == "fp32" else 2
    params, grads, optim = p * (4 if dtype == "fp32" else 2), p * width, p * (16 - 2 * width)
    shard = max(dp, 1)
    optim /= shard if zero >= 1 else 1
    grads /= shard if zero >= 2 else 1
    params /= shard if zero >= 3 else 1
    sbh = seq * m * spec.hidden
    per_layer = 2 * sbh if recompute == "full" else sbh * (34 + 5 * spec.num_heads * seq / spec.hidden)
    acts = spec.num_layers * per_layer * (width / 2) + 4 * seq * m * spec.vocab_size
    return int(params + grads + optim + acts)


@lru_cache(maxsize=None)
def _profile(gpu_type: str, model: str, seq: int, dtype: str, recompute: str) -> StepProfile:
    # measured where the store has it, else the catalog estimate; cached: it reads the store
    return get_step_profile(gpu_type, get_model(model), seq, dtype, recompute=recompute)


# --- one configuration's iteration time ---

def _comm_s(spec: ModelSpec, dtype: str, n: int, zero: int, pool: Pool, inter_node_gbps: float) -> float:
    """Gradient reduce-scatter + parameter all-gather per step (ring: (n-1)/n of the bytes
    each); ZeRO-3 all-gathers the parameters once more for the backward pass."""
    if n <= 1:
        return 0.0
    width = 4 if dtype == "fp32" else 2
    volume_bytes = spec.num_params * width * (n - 1) / n * (3 if zero >= 3 else 2)
    link_gbps = get_gpu_type(pool.device.type).interconnect_gbps  # GB/s (catalog)
    if n > pool.max_per_node:
        link_gbps = min(link_gbps, inter_node_gbps / BITS_PER_BYTE)  # cluster file: Gbit/s
    return volume_bytes / (link_gbps * 1e9)


def _iteration_s(prof: StepProfile, slowdown: float, per_device_batch: int, m: int, opt_params: float,
                 comm_s: float) -> tuple[float, int]:
    accum = math.ceil(per_device_batch / m)
    last = per_device_batch - (accum - 1) * m  # the last micro-batch may be smaller
    micro_s = slowdown * (prof.alpha_s + prof.beta_s * m)
    last_s = slowdown * (prof.alpha_s + prof.beta_s * last)
    compute_s = (accum - 1) * micro_s + last_s
    exposed_comm_s = max(0.0, comm_s - BACKWARD_OVERLAP * last_s)
    return compute_s + slowdown * prof.optimizer_s_per_param * opt_params + exposed_comm_s, accum


@lru_cache(maxsize=None)
def _best_config(model: str, seq: int, global_batch: int, dtype: str, pool: Pool, n: int,
                 inter_node_gbps: float, headroom: float) -> tuple | None:
    """The fastest (zero, recompute, micro_batch) that fits on n devices of the pool, or None."""
    if n > global_batch:
        return None  # a device with no sample to work on
    spec = get_model(model)
    dt = device_dtype(pool.device.type, dtype)
    capacity = pool.device.memory_bytes
    budget = capacity * headroom
    b = math.ceil(global_batch / n)
    m_max = 1 << (min(b, MAX_MICRO_BATCH).bit_length() - 1)
    best = None
    for zero in ((0,) if n == 1 else ZERO_CHOICES):
        comm_s = _comm_s(spec, dt, n, zero, pool, inter_node_gbps)
        opt_params = spec.num_params / (n if zero >= 1 else 1)
        for recompute in RECOMPUTE:
            m = m_max  # the largest fitting micro-batch is the fastest: a·(α+βm) falls with m
            while m >= 1 and _peak_bytes(model, seq, dt, n, zero, recompute, m, pool.device.type) > budget:
                m //= 2
            if m < 1:
                continue
            prof = _profile(pool.device.type, model, seq, dt, recompute)
            it_s, accum = _iteration_s(prof, pool.device.slowdown, b, m, opt_params, comm_s)
            if best is None or it_s < best[0]:
                best = (it_s, zero, recompute, m, accum, _peak_bytes(model, seq, dt, n, zero, recompute, m, pool.device.type))
    return best


def estimate_option(job: JobSpec, pool: Pool, n: int, dtype: str = "bf16", inter_node_gbps: float = 100.0,
                    headroom: float = MEMORY_HEADROOM) -> ResourceOption | None:
    """The fastest configuration of `job` on exactly n devices of `pool`; None if it does not fit."""
    best = _best_config(job.model, job.seq, job.global_batch, dtype, pool, n, inter_node_gbps, headroom)
    if best is None:
        return None
    it_s, zero, recompute, m, accum, peak = best
    return ResourceOption(pool.device, n, zero, recompute, m, accum, device_dtype(pool.device.type, dtype), peak,
                          pool.device.memory_bytes, it_s, it_s * job.steps, job.global_batch / it_s)


def candidate_counts(limit: int) -> list[int]:
    """Powers of two up to `limit` (how jobs are sized in practice: divides batches, fills nodes)."""
    return [1 << k for k in range(limit.bit_length()) if (1 << k) <= limit]


def estimate_options(job: JobSpec, cluster: ClusterSpec, dtype: str = "bf16",
                     headroom: float = MEMORY_HEADROOM) -> list[ResourceOption]:
    """Per pool: the smallest count that fits, then each larger count that is predicted faster
    (a Pareto front of GPUs against duration). Empty when the job fits nowhere."""
    return options_on_pools(job, cluster_pools(cluster), cluster.network.inter_node_gbps, dtype, headroom)


def options_on_pools(job: JobSpec, pools: Sequence[Pool], inter_node_gbps: float, dtype: str = "bf16",
                     headroom: float = MEMORY_HEADROOM) -> list[ResourceOption]:
    """estimate_options over pools computed once (a scheduler reuses them for every job)."""
    get_model(job.model)  # unknown model -> ValueError naming it
    return list(_options(job, pools, inter_node_gbps, dtype, headroom))


def _options(job: JobSpec, pools: Sequence[Pool], inter_node_gbps: float, dtype: str, headroom: float):
    for pool in pools:
        best_s = math.inf
        for n in candidate_counts(pool.count):
            opt = estimate_option(job, pool, n, dtype, inter_node_gbps, headroom)
            if opt is not None and opt.duration_s < best_s:
                best_s = opt.duration_s
                yield opt


def clear_caches() -> None:
    """Forget cached memory and profile figures (after new profiles were measured)."""
    for f in (_peak_bytes, _profile, _best_config):
        f.cache_clear()
