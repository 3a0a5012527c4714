"""Mixed-type gangs: one job on devices of two pools at once, planned by the heterogeneous planner.

A mixed gang is a data-parallel job whose batch and training state are split *unevenly* over
devices of different types: the plan the heterogeneous planner (planner.entry.plan_job, the hetero
ILP, pure data parallelism) finds on exactly those devices, priced by the one cost model. The user
still names no GPU: a policy offers a job a mixed gang where the free devices are fragmented
across types and no single pool that fits now runs it as fast.

Keeping the option set small (a decision must stay in milliseconds):

* only pairs of pools, each part a power of two (`gang_parts`): for a target count T (the job's
  request, its fastest one-pool option's count, and twice that where that option takes a whole
  pool: the job could use more than one pool holds), part a takes the largest power of two of its free
  devices up to T, part b the largest power of two of its free devices up to what is left;
* a pair is priced only when an optimistic bound on its throughput (each part's own single-pool
  throughput, summed; `_part_rate`) beats the best single-pool option that fits now by
  MIXED_GAIN; and the plan it gets must beat it by MIXED_GAIN too;
* every pricing is cached per (model, seq, batch, dtype, parts), and a decision prices at most
  `MAX_NEW_SOLVES` gangs not seen before (the rest wait for a later decision).

A gang where the planner leaves a device idle is not offered (a smaller gang runs the same plan).
`idle_speedup` measures what the offered gangs add to a job's speed on an idle cluster (the bench's
bound on what gangs can gain).

More: docs/models/scheduling.md ("Mixed-type gangs").
"""
from __future__ import annotations

import logging
from dataclasses import replace
from typing import Sequence

from contracts.catalog import device_dtype
from contracts.cluster import ClusterSpec, NetworkSpec, NodeSpec
from contracts.constants import MEMORY_HEADROOM, RECOMPUTE
from contracts.jobs import JobSpec
from planner.schedule.options import GANG_PLANS as _PLANS, Pool, ResourceOption, estimate_option, options_on_pools

log = logging.getLogger(__name__)

MIXED_GAIN = 0.9  # a gang must be predicted >= 10 % faster than what one pool runs now (as planner.entry.MIXED_GAIN)
# Each new gang is one ILP solve: 10-50 ms mostly, up to ~1 s for 32+32 devices. A decision prices
# at most MAX_NEW_SOLVES new gangs, and all decisions together at most SOLVES_PER_JOB per job seen
# (a token bucket holding up to MAX_SOLVE_TOKENS): the decision time stays within milliseconds per job.
MAX_NEW_SOLVES = 2
SOLVES_PER_JOB = 0.1
MAX_SOLVE_TOKENS = 10.0
SOLVE_TIME_LIMIT_S = 2.0  # the ILP's limit per gang (a bound, not a target: past it the plan is unproven)
MIN_PART_SHARE = 0.1  # a part estimated to add under 10 % of the gang's rate: the planner would drop it


def pow2_floor(n: int) -> int:
    return 0 if n < 1 else 1 << (n.bit_length() - 1)


def gang_cluster(parts: Sequence[tuple[Pool, int]], inter_node_gbps: float | None = None) -> ClusterSpec:
    """The gang's devices as a cluster: per part, full nodes of the pool's `max_per_node`, then the rest
    (as options.pool_cluster lays out one pool); parts never share a node (pools are node-typed)."""
    nodes = []
    for i, (pool, n) in enumerate(parts):
        left = n
        while left > 0:
            here = min(left, pool.max_per_node)
            nodes.append(NodeSpec(f"p{i}n{len(nodes)}", "dc0", tuple([pool.device] * here)))
            left -= here
    net = parts[0][0].network
    inter = min(p.network.inter_node_gbps for p, _ in parts) if inter_node_gbps is None else inter_node_gbps
    name = "+".join(f"{p.device.type}x{n}" for p, n in parts)
    return ClusterSpec(name, tuple(nodes), NetworkSpec(net.intra_node_gbps, inter))


def _key(job: JobSpec, parts, dtype: str, inter_node_gbps, headroom: float) -> tuple:
    return (job.model, job.seq, job.global_batch, dtype, tuple(parts), inter_node_gbps, headroom)


def is_priced(job: JobSpec, parts, dtype: str, inter_node_gbps=None, headroom: float = MEMORY_HEADROOM) -> bool:
    return _key(job, parts, dtype, inter_node_gbps, headroom) in _PLANS


def _solve(job: JobSpec, parts, dtype: str, inter_node_gbps, headroom: float):
    """The heterogeneous planner's fastest data-parallel plan on the gang (recomputation off, then
    on where nothing fits without it); None where nothing fits or a device would idle."""
    from planner.entry import plan_job  # the one planning entry (above the scheduler's options)

    if sum(n for _, n in parts) > job.global_batch:
        return None
    cluster = gang_cluster(parts, inter_node_gbps)
    for recompute in RECOMPUTE:
        try:
            plan = plan_job(cluster, job.model, job.global_batch, seq=job.seq, dtype=dtype, recompute=recompute,
                            headroom=headroom, time_limit_s=SOLVE_TIME_LIMIT_S, pipeline=False).plan
        except ValueError as e:  # does not fit (or cannot be computed exactly) at this setting
            log.debug("mixed gang %s for %s: %s", cluster.name, job.model, e)
            continue
        if not all(a.used for a in plan.assignments):
            return None  # the planner drops a device: not a gang of these parts
        return plan
    return None


def plan_of(job: JobSpec, parts: Sequence[tuple[Pool, int]], dtype: str = "bf16", inter_node_gbps=None,
            headroom: float = MEMORY_HEADROOM):
    """The gang's Plan (cached), or None."""
    key = _key(job, parts, dtype, inter_node_gbps, headroom)
    if key not in _PLANS:
        _PLANS[key] = _solve(job, tuple(parts), dtype, inter_node_gbps, headroom)
    return _PLANS[key]


def estimate_mixed_option(job: JobSpec, parts: Sequence[tuple[Pool, int]], dtype: str = "bf16",
                          inter_node_gbps: float | None = None,
                          headroom: float = MEMORY_HEADROOM) -> ResourceOption | None:
    """`job` on the gang `parts` as an option (durations for its steps), or None where it does not fit."""
    plan = plan_of(job, parts, dtype, inter_node_gbps, headroom)
    if plan is None:
        return None
    a = plan.assignments
    busiest = max(a, key=lambda x: x.batch)
    it_s = plan.predicted_iteration_s
    first = parts[0][0]
    return ResourceOption(first.device, sum(n for _, n in parts), plan.zero, plan.recompute, busiest.micro_batch,
                          busiest.accum_steps, device_dtype(first.device.type, dtype),
                          max(x.predicted_memory_bytes for x in a), min(p.device.memory_bytes for p, _ in parts),
                          it_s, it_s * job.steps, job.global_batch / it_s,
                          tuple((x.micro_batch, x.accum_steps, x.shard_fraction) for x in a), headroom,
                          inter_node_gbps, first.max_per_node, first.network, mix=tuple(parts), gang_plan=plan)


def gang_parts(pools: Sequence[Pool], free_n: Sequence[int], target: int) -> list[tuple[tuple[int, int], ...]]:
    """Candidate gangs of two pools as ((pool index, count), (pool index, count)) in pool order: for
    each ordered pair (a, b), a takes the largest power of two of its free devices up to `target`
    (skipped when that is the whole target: one pool runs it), b the largest power of two of its
    free devices up to the rest."""
    out: list[tuple[tuple[int, int], ...]] = []
    seen = set()
    for a in range(len(pools)):
        na = pow2_floor(min(free_n[a], target))
        if na < 1 or na >= target:
            continue
        for b in range(len(pools)):
            if b == a:
                continue
            nb = pow2_floor(min(free_n[b], target - na))
            if nb < 1:
                continue
            parts = tuple(sorted(((a, na), (b, nb))))
            if parts not in seen:
                seen.add(parts)
                out.append(parts)
    return out


def part_rate(job: JobSpec, pool: Pool, n: int, dtype: str, inter_node_gbps) -> float:
    """An optimistic bound on n devices of `pool` in a gang, in samples/s: the single-pool option on n
    (without the gang's slower links), or, where n alone cannot hold the job, the smallest count
    that does scaled down linearly (its share of the state is then held by the other part)."""
    o = estimate_option(job, pool, n, dtype, inter_node_gbps)
    if o is not None:
        return o.samples_per_s
    m = n * 2
    while m <= min(pool.count * 8, job.global_batch):  # counts past the pool: the per-device rate only
        o = estimate_option(job, Pool(pool.device, m, pool.max_per_node, pool.network), m, dtype, inter_node_gbps)
        if o is not None:
            return o.samples_per_s * n / m
        m *= 2
    return 0.0


def gang_bound(job: JobSpec, parts: Sequence[tuple[Pool, int]], dtype: str, inter_node_gbps) -> float:
    """An optimistic estimate of the gang's samples/s, to skip pricing gangs that cannot pay: the sum
    of its parts' own rates (a gang adds slower links and never speeds a device up; only the larger
    micro-batch a thinner shard allows can beat it, by little). 0 where a part would add under
    MIN_PART_SHARE of it (the planner leaves such devices idle: not a gang)."""
    rates = [part_rate(job, p, n, dtype, inter_node_gbps) for p, n in parts]
    total = sum(rates)
    return 0.0 if total <= 0 or min(rates) < MIN_PART_SHARE * total else total


def idle_speedup(job: JobSpec, pools: Sequence[Pool], dtype: str = "bf16", inter_node_gbps=None) -> float:
    """How much faster the job's fastest mixed gang is than its fastest one-pool option on an idle
    cluster (every device of `pools` free): 1 where no gang is faster. The gangs are those a policy
    offers (`gang_parts` at the targets of Sizing.mixed_entries: the fastest one-pool option's
    count, twice it where that takes a whole pool, and the request), priced where `gang_bound`
    could beat the one-pool rate by MIXED_GAIN. What gangs can add to a job's speed, not counting
    waits: the speed half of the opportunity the bench reports."""
    one = replace(job, steps=1)
    options = options_on_pools(one, pools, inter_node_gbps, dtype)
    options += [o for p in pools if p.count <= job.global_batch
                for o in [estimate_option(one, p, p.count, dtype, inter_node_gbps)] if o is not None]
    if not options:
        return 1.0
    top = max(options, key=lambda o: o.samples_per_s)
    targets = {top.num_gpus} | ({job.requested_gpus} if job.requested_gpus else set())
    if any(p.device == top.pool and p.count == top.num_gpus for p in pools):
        targets.add(2 * top.num_gpus)
    free_n = [p.count for p in pools]
    best = top.samples_per_s
    for target in sorted(targets):
        for parts_ix in gang_parts(pools, free_n, target):
            parts = tuple((pools[k], n) for k, n in parts_ix)
            if gang_bound(one, parts, dtype, inter_node_gbps) * MIXED_GAIN <= best:
                continue
            o = estimate_mixed_option(one, parts, dtype, inter_node_gbps)
            if o is not None and o.samples_per_s > best:
                best = o.samples_per_s
    return best / top.samples_per_s
