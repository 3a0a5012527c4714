"""Frenzy's memory-aware sizing (MARP over planner/schedule/options.py), shared by every policy
that picks devices itself (`frenzy`, `fifo-backfill-sized`, `sjf`) and by the EASY reservation.

A job's options: per pool, the counts from the smallest that fits up to where adding GPUs
stops paying (GPU-seconds within 1/min_efficiency of the pool's smallest). A start takes,
among the options that fit the free devices, the cheapest (peak FLOP/s × count) of those
within `cheap_slack` of the fastest: among nearly-as-fast options the cheaper devices win,
keeping the big parts free for the jobs that need them. With `user_requests` a job has one
option: its user's request (planner/schedule/fifo.py), so the same queueing can be measured
over hand-sized jobs.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Callable, Sequence

from contracts.catalog import device_dtype, get_gpu_type
from contracts.cluster import ClusterSpec
from contracts.jobs import JobSpec
from planner.schedule.fifo import FifoPolicy
from planner.schedule.options import Pool, ResourceOption, cluster_pools, estimate_option, options_on_pools
from planner.schedule.state import Running

# (pool index, option of ONE step, price); a job's duration is steps × iteration_s
Entry = tuple[int, ResourceOption, float]
# per pool index: [(predicted end, devices it frees)] in increasing end
Releases = list[list[tuple[float, int]]]


@dataclass
class Reservation:
    """EASY's one reservation: the pool (index; -1 for none), when the reserved job starts there,
    and how many of that pool's devices it leaves spare then."""

    pool: int = -1
    start_s: float = math.inf
    spare: int = 0
    job_id: str | None = None

    def blocks(self, k: int, end_s: float, n: int) -> bool:
        """Would n devices of pool k held until end_s delay the reserved job?"""
        return k == self.pool and end_s > self.start_s and n > self.spare

    def take(self, k: int, end_s: float, n: int) -> None:
        """n devices of pool k start now, held until end_s (they did not block it)."""
        if k == self.pool and end_s > self.start_s:
            self.spare -= n


class Sizing:
    def __init__(self, cluster: ClusterSpec, dtype: str = "bf16", cheap_slack: float = 1.25,
                 min_efficiency: float = 0.7, user_requests: bool = False, whole_pools: bool = False) -> None:
        self.cluster, self.dtype = cluster, dtype
        # whole_pools: also offer every device of a pool whose size is not a power of two (24 V100s:
        # a job that needs more than 16 runs there at all, a 7B one 1.2x faster than on 16)
        self.whole_pools = whole_pools
        self.cheap_slack, self.min_efficiency = cheap_slack, min_efficiency
        self._requests = FifoPolicy(cluster, dtype) if user_requests else None
        self.pools = cluster_pools(cluster)
        self.index = {p.device: k for k, p in enumerate(self.pools)}
        self._entries: dict[str, list[Entry]] = {}
        self._by_shape: dict[tuple, list[Entry]] = {}
        self._ref_s: dict[str, float] = {}
        self._failed: dict[str, str] = {}

    def failed(self) -> dict[str, str]:
        return dict(self._failed)

    def options(self, job: JobSpec) -> list[ResourceOption]:
        """The job's usable options, durations for its steps."""
        return [replace(o, duration_s=o.iteration_s * job.steps) for _, o, _ in self.entries(job)]

    def ref_s(self, job: JobSpec) -> float:
        """The job's shortest predicted duration over its options (inf when it fits nowhere)."""
        self.entries(job)
        return self._ref_s[job.job_id]

    def entries(self, job: JobSpec) -> list[Entry]:
        entries = self._entries.get(job.job_id)
        if entries is not None:
            return entries
        if self._requests is not None:
            req = self._requests.request(job)[0]
            entries = [] if req is None else [self.entry(replace(req, duration_s=req.iteration_s))]
            self._failed.update(self._requests.failed())
        else:
            entries = self._shape_entries(job)
            if not entries:
                self._failed[job.job_id] = "does not fit in memory on any device pool of the cluster"
        self._entries[job.job_id] = entries
        self._ref_s[job.job_id] = job.steps * min((o.iteration_s for _, o, _ in entries), default=math.inf)
        return entries

    def entry(self, o: ResourceOption) -> Entry:
        return self.index[o.pool], o, o.num_gpus * get_gpu_type(o.pool.type).peak_tflops(o.dtype)

    def entry_price(self, pool: Pool, n: int) -> float:
        """What n devices of the pool cost in the option prices: peak FLOP/s × count."""
        from_dtype = device_dtype(pool.device.type, self.dtype)
        return n * get_gpu_type(pool.device.type).peak_tflops(from_dtype)

    def _shape_entries(self, job: JobSpec) -> list[Entry]:
        """Options of one step, shared by all jobs of the same (model, seq, global batch): sweeps
        and repeated submissions cost a dictionary look-up."""
        key = (job.model, job.seq, job.global_batch)
        if key not in self._by_shape:
            one_step = replace(job, steps=1)
            entries, floor = [], {}
            net = self.cluster.network.inter_node_gbps
            options = options_on_pools(one_step, self.pools, net, self.dtype)
            if self.whole_pools:
                options += self._whole_pool_options(one_step, options, net)
            for o in options:
                floor.setdefault(o.pool, o.gpu_seconds)  # per pool in increasing count; GPU-seconds grow
                if o.gpu_seconds * self.min_efficiency <= floor[o.pool]:
                    entries.append(self.entry(o))
            self._by_shape[key] = entries
        return self._by_shape[key]

    def _whole_pool_options(self, one_step: JobSpec, options: Sequence[ResourceOption],
                            net: float) -> list[ResourceOption]:
        """Per pool whose size is not a power of two: all its devices, where predicted faster
        than every power-of-two count (the Pareto front stays in increasing count)."""
        out = []
        for pool in self.pools:
            if pool.count & (pool.count - 1) == 0 or pool.count > one_step.global_batch:
                continue
            fastest = min((o.iteration_s for o in options if o.pool == pool.device), default=math.inf)
            o = estimate_option(one_step, pool, pool.count, self.dtype, net)
            if o is not None and o.iteration_s < fastest:
                out.append(o)
        return out

    def choose(self, job: JobSpec, free_n: Sequence[int],
               blocked: Callable[[int, ResourceOption], bool] | None = None) -> tuple[int, ResourceOption] | None:
        """Frenzy's pick among the options that fit the free devices (and that `blocked` allows):
        the cheapest within cheap_slack of the fastest, ties to the faster."""
        entries = self.entries(job)
        fastest_s = min((o.iteration_s for k, o, _ in entries if free_n[k] >= o.num_gpus), default=math.inf)
        best = None
        for k, o, price in entries:
            if free_n[k] < o.num_gpus or o.iteration_s > self.cheap_slack * fastest_s:
                continue
            if blocked is not None and blocked(k, o):
                continue
            if best is None or (price, o.iteration_s) < (best[2], best[1].iteration_s):
                best = (k, o, price)
        return None if best is None else (best[0], best[1])

    def releases(self, running: Sequence[Running]) -> Releases:
        out: Releases = [[] for _ in self.pools]
        for r in running:
            out[self.index[r.pool.device]].append((r.end_s, r.num_gpus))
        for ends in out:
            ends.sort()
        return out

    def reserve(self, job: JobSpec, free_n: Sequence[int], running: Sequence[Running], now: float) -> Reservation:
        """The reservation of `job` where it can start and finish earliest (none when it cannot)."""
        got = self.earliest(job, free_n, self.releases(running), now)
        return Reservation() if got is None else Reservation(got[0], got[2], got[3], job.job_id)

    def earliest(self, job: JobSpec, free_n: Sequence[int], releases: Releases,
                 now: float) -> tuple[int, ResourceOption, float, int] | None:
        """(pool index, option, start time, devices to spare then) of the option that can start —
        and so finish — earliest as running jobs end (predicted); None when none can."""
        best = None
        for k, o, _ in self.entries(job):
            have, t = free_n[k], now
            for end_s, n in releases[k]:
                if have >= o.num_gpus:
                    break
                have, t = have + n, end_s
            if have < o.num_gpus:
                continue
            end = t + job.steps * o.iteration_s
            if best is None or end < best[0]:
                best = (end, k, o, t, have - o.num_gpus)
        return None if best is None else best[1:]
