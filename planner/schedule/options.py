"""MARP: which devices, how many, and in which parallel configuration a job fits.

For a job and each *pool* of identical devices, list the device counts at which the job fits in
memory, each with the fastest configuration the sharded runtime can execute there (ZeRO stage,
recomputation, per device a micro-batch and accumulation steps, the state sharded evenly), every
figure from the one cost model (planner.costmodel.training.CostModel) on the option's own devices:
an option is a plan the runtime runs (`option_plan`). Configurations the memory model cannot
compute exactly are not offered; neither are tensor or pipeline parallelism. Everything expensive
is cached, so a scheduler decision costs dictionary look-ups.

More: docs/models/scheduling.md ("Options").
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Sequence

from contracts.catalog import device_dtype
from contracts.cluster import ClusterSpec, DeviceSpec, NetworkSpec, NodeSpec
from contracts.constants import MEMORY_HEADROOM, RECOMPUTE, ZERO_STAGES
from contracts.jobs import JobSpec
from contracts.specs import get_model, with_max_seq
from planner.costmodel.training import CostModel

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ResourceOption:
    """One way to run a job, data parallel: `num_gpus` devices of one pool or, for a *mixed gang*
    (`mix` not empty), devices of several pools at once, each part a (pool, count), the batch and
    the state split unevenly over them by the heterogeneous planner (planner/schedule/mixed.py)."""

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
    # every device's (micro_batch, accum_steps, shard_fraction), as option_plan lays them out
    per_device: tuple[tuple[int, int, float], ...] = ()
    headroom: float = MEMORY_HEADROOM
    inter_node_gbps: float | None = None  # the override it was priced with (None: the cluster file's)
    max_per_node: int = 0  # how many of the pool one node holds (0: all on one node)
    network: NetworkSpec = field(default_factory=NetworkSpec)
    # a mixed gang: every part (pool, count) in the order its devices are laid out (and `per_device`
    # listed); empty for an option of one pool. `pool` is then the first part's device kind.
    mix: tuple[tuple["Pool", int], ...] = ()
    # a mixed gang's Plan (contracts.plan.Plan: the heterogeneous planner's, on the gang's devices in
    # the parts' order): what a launcher runs. None for an option of one pool (option_plan builds it).
    gang_plan: object = field(default=None, compare=False, repr=False)

    @property
    def gpu_type(self) -> str:
        """The device type; a mixed gang's types joined by '+' (`parts` names each)."""
        if self.mix:
            return "+".join(p.device.type for p, _ in self.mix)
        return self.pool.type

    @property
    def is_mixed(self) -> bool:
        return bool(self.mix)

    @property
    def parts(self) -> tuple[tuple[DeviceSpec, int], ...]:
        """(device kind, count) of every part: one for an option of one pool."""
        if self.mix:
            return tuple((p.device, n) for p, n in self.mix)
        return ((self.pool, self.num_gpus),)

    @property
    def gpu_seconds(self) -> float:
        return self.num_gpus * self.duration_s

    def to_dict(self) -> dict:
        """One pool: `gpu_type, device, num_gpus`; a mixed gang: `pools` (per part `gpu_type, device,
        num_gpus`), `num_gpus` (all parts) and `per_device` (per device, in the parts' order: `gpu_type,
        micro_batch, accum_steps, shard_fraction`), what a launcher needs beside option_plan's Plan."""
        d = {"gpu_type": self.pool.type, "device": self.pool.label, "num_gpus": self.num_gpus}
        if self.mix:
            d = {"pools": [{"gpu_type": p.device.type, "device": p.device.label, "num_gpus": n} for p, n in self.mix],
                 "num_gpus": self.num_gpus,
                 "per_device": [{"gpu_type": t, "micro_batch": m, "accum_steps": a, "shard_fraction": f}
                                for t, (m, a, f) in zip((p.device.type for p, n in self.mix for _ in range(n)),
                                                        self.per_device)]}
        d.update({
            "zero": self.zero,
            "recompute": self.recompute, "micro_batch": self.micro_batch, "accum_steps": self.accum_steps,
            "dtype": self.dtype, "predicted_memory_bytes": self.peak_memory_bytes,
            "capacity_bytes": self.capacity_bytes, "predicted_iteration_s": self.iteration_s,
            "predicted_duration_s": self.duration_s, "predicted_samples_per_s": self.samples_per_s,
        })
        return d


@dataclass(frozen=True)
class Pool:
    """All devices of one DeviceSpec in a cluster."""

    device: DeviceSpec
    count: int
    max_per_node: int  # the largest group on one node: above it traffic crosses nodes
    network: NetworkSpec = field(default_factory=NetworkSpec)  # the cluster file's links


def cluster_pools(cluster: ClusterSpec) -> list[Pool]:
    total: dict[DeviceSpec, int] = {}
    per_node: dict[DeviceSpec, int] = {}
    for g in cluster.groups():
        total[g.device] = total.get(g.device, 0) + g.count
        per_node[g.device] = max(per_node.get(g.device, 0), g.count)
    return [Pool(d, total[d], per_node[d], cluster.network) for d in total]


# --- one count's best configuration, from the cost model ---

def pool_cluster(pool: Pool, n: int, inter_node_gbps: float | None = None) -> ClusterSpec:
    """n devices of `pool` as the pool holds them: full nodes of `max_per_node` devices, then the rest."""
    nodes, left = [], n
    while left > 0:
        here = min(left, pool.max_per_node)
        nodes.append(NodeSpec(f"n{len(nodes)}", "dc0", tuple([pool.device] * here)))
        left -= here
    inter = pool.network.inter_node_gbps if inter_node_gbps is None else inter_node_gbps
    return ClusterSpec(f"{pool.device.type}x{n}", tuple(nodes), NetworkSpec(pool.network.intra_node_gbps, inter))


def even_batches(global_batch: int, n: int) -> list[int]:
    """The global batch split over n devices: ⌈B/n⌉ on the first B mod n, ⌊B/n⌋ on the others."""
    q, r = divmod(global_batch, n)
    return [q + 1] * r + [q] * (n - r)


def _fastest_split(cost: CostModel, device: DeviceSpec, batch: int, share: float,
                   global_batch: int) -> tuple[int, int] | None:
    """The fastest (micro-batch, accumulation steps) with m·n = batch exactly that fits beside
    `share` of the state, m from the planner's candidates. Larger m is never slower (fewer
    micro-batches, n = 1 keeps the graph): the first that fits, scanning down, is the fastest."""
    c = cost.coeffs[device]
    for m in sorted(cost.micro_batch_candidates(global_batch, None), reverse=True):
        if batch % m:
            continue
        if c.memory_bytes(m, batch // m, share) <= c.capacity_bytes:
            return m, batch // m
    return None


# per (model, seq, profiles) the step-profile look-ups shared by every CostModel built here
_PROFILE_CACHES: dict[tuple, dict] = {}
# planner/schedule/mixed.py's priced gangs: (model, seq, batch, dtype, parts, inter-node Gb/s, headroom) -> Plan | None
GANG_PLANS: dict[tuple, object] = {}


@lru_cache(maxsize=None)
def _best_config(model: str, seq: int, global_batch: int, dtype: str, pool: Pool, n: int,
                 inter_node_gbps: float | None, headroom: float) -> tuple | None:
    """(iteration_s, zero, recompute, per-device (m, n, f), peak bytes) of the fastest configuration
    on n devices of the pool, or None where nothing fits."""
    if n > global_batch:
        return None  # a device with no sample to work on
    spec = with_max_seq(get_model(model), seq)
    sub = pool_cluster(pool, n, inter_node_gbps)
    batches = even_batches(global_batch, n)
    share = 1.0 / n
    profiles = _PROFILE_CACHES.setdefault((model, seq), {})
    best = None
    for zero in ZERO_STAGES:
        for recompute in RECOMPUTE:
            cost = CostModel.build(sub, spec, seq, dtype, recompute, headroom, zero=zero, profile_cache=profiles)
            try:
                splits = {b: _fastest_split(cost, pool.device, b, share, global_batch) for b in set(batches)}
            except ValueError as e:  # a memory the model cannot compute exactly: not offered
                log.debug("%s on %s at zero %d, recompute %s: %s", model, pool.device.label, zero, recompute, e)
                continue
            if any(v is None for v in splits.values()):
                continue
            per_device = tuple((*splits[b], share) for b in batches)
            it_s, _ = cost.estimate_iteration_s(per_device)
            if best is None or it_s < best[0]:
                peak = max(cost.estimate_memory_bytes(pool.device, m, a, f) for m, a, f in per_device)
                best = (it_s, zero, recompute, per_device, int(peak))
    return best


def estimate_option(job: JobSpec, pool: Pool, n: int, dtype: str = "bf16", inter_node_gbps: float | None = None,
                    headroom: float = MEMORY_HEADROOM) -> ResourceOption | None:
    """The fastest configuration of `job` on exactly n devices of `pool`; None if it does not fit.
    `inter_node_gbps` overrides the pool's cluster file figure."""
    best = _best_config(job.model, job.seq, job.global_batch, dtype, pool, n, inter_node_gbps, headroom)
    if best is None:
        return None
    it_s, zero, recompute, per_device, peak = best
    m, accum, _ = per_device[0]  # the busiest device (the first takes ⌈B/n⌉)
    return ResourceOption(pool.device, n, zero, recompute, m, accum, device_dtype(pool.device.type, dtype), peak,
                          pool.device.memory_bytes, it_s, it_s * job.steps, job.global_batch / it_s, per_device,
                          headroom, inter_node_gbps, pool.max_per_node, pool.network)


def option_plan(job: JobSpec, option: ResourceOption, dtype: str = "bf16"):
    """The option as the Plan the executor launches: its devices (`pool_cluster`), its stage and
    per-device (m, n, f), every prediction from the same cost model. A mixed gang's Plan is the
    heterogeneous planner's on its parts (planner/schedule/mixed.py)."""
    from planner.hetero.solve import build_plan, plan_notes

    if option.mix:
        if option.gang_plan is None:
            raise ValueError("a mixed gang's option carries its plan (planner/schedule/mixed.py); this one has none")
        return option.gang_plan

    pool = Pool(option.pool, option.num_gpus, option.max_per_node or option.num_gpus, option.network)
    sub = pool_cluster(pool, option.num_gpus, option.inter_node_gbps)
    spec = with_max_seq(get_model(job.model), job.seq)
    cost = CostModel.build(sub, spec, job.seq, dtype, option.recompute, option.headroom, zero=option.zero)
    return build_plan(cost, job.model, job.global_batch, job.seq, dtype, option.recompute, option.per_device,
                      plan_notes(cost, dtype))


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
    _best_config.cache_clear()
    _PROFILE_CACHES.clear()
    clear_gang_plans()


def clear_gang_plans() -> None:
    """Forget the priced mixed gangs only: a policy replayed next prices its gangs within its own
    budget (planner/schedule/sizing.py), not with the plans an earlier replay paid for."""
    GANG_PLANS.clear()
