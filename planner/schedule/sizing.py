"""Frenzy's memory-aware sizing (MARP over planner/schedule/options.py), shared by every policy
that picks devices itself (`frenzy`, `fifo-backfill-sized`, `sjf`, `srtf`, `las`, `gavel`,
`gpumix`) and by the EASY reservation.

A job's options: per pool, the counts from the smallest that fits up to where adding GPUs
stops paying (GPU-seconds within 1/min_efficiency of the pool's smallest), and, where the free
devices are fragmented across types, mixed gangs of two pools (planner/schedule/mixed.py;
`mixed=False` is the one-pool ablation). Every policy gets the same floor: no option runs a job
at less than MIN_SHARE of the throughput of what its user asked for (`admissible`): a 100-hour
job never starts on 2 of the 8 GPUs it asked for. A start takes, among the options that fit
the free devices, the cheapest (peak FLOP/s × count) of those within `cheap_slack` of the
fastest: among nearly-as-fast options the cheaper devices win, keeping the big parts free for
the jobs that need them. With `user_requests` a job has one option: its user's request
(planner/schedule/fifo.py), so the same queueing can be measured over hand-sized jobs.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Callable, Sequence

from contracts.catalog import device_dtype, get_gpu_type
from contracts.cluster import ClusterSpec
from contracts.jobs import JobSpec
from planner.schedule import mixed as gangs
from planner.schedule.fifo import FifoPolicy
from planner.schedule.options import Pool, ResourceOption, cluster_pools, estimate_option, options_on_pools
from planner.schedule.state import Running

# (pool index of the first part, option of ONE step, price); a job's duration is steps × iteration_s
Entry = tuple[int, ResourceOption, float]
# per pool index: [(predicted end, devices it frees)] in increasing end
Releases = list[list[tuple[float, int]]]
# what an option takes: (pool index, count) per part
Need = tuple[tuple[int, int], ...]

# No option may run a job at less than this share of the predicted throughput of its user's
# request (planner/schedule/fifo.py's reading of it; the most plentiful pool's smallest fitting
# count where there is none): twice the requested duration at most, the same for every policy.
MIN_SHARE = 0.5


@dataclass
class Reservation:
    """EASY's one reservation: the pool (index; -1 for none), when the reserved job starts there,
    and how many of that pool's devices it leaves spare then."""

    pool: int = -1
    start_s: float = math.inf
    spare: int = 0
    job_id: str | None = None

    def blocks(self, need: Need, end_s: float) -> bool:
        """Would the devices `need` held until end_s delay the reserved job?"""
        return end_s > self.start_s and any(k == self.pool and n > self.spare for k, n in need)

    def take(self, need: Need, end_s: float) -> None:
        """The devices `need` start now, held until end_s (they did not block it)."""
        if end_s > self.start_s:
            for k, n in need:
                if k == self.pool:
                    self.spare -= n


class Sizing:
    def __init__(self, cluster: ClusterSpec, dtype: str = "bf16", cheap_slack: float = 1.25,
                 min_efficiency: float = 0.7, user_requests: bool = False, whole_pools: bool = False,
                 mixed: bool = True, min_share: float = MIN_SHARE) -> None:
        self.cluster, self.dtype = cluster, dtype
        self.mixed = mixed and not user_requests  # users request one type
        self.min_share = min_share
        self._reference = FifoPolicy(cluster, dtype)  # what each user asked for: the MIN_SHARE floor
        self._solves_left = gangs.MAX_NEW_SOLVES  # this decision's
        self._tokens = float(gangs.MAX_NEW_SOLVES)  # all decisions': SOLVES_PER_JOB per job seen
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
        self._one_step: dict[str, JobSpec] = {}

    def new_decision(self) -> None:
        """A decision starts: it may price MAX_NEW_SOLVES mixed gangs not seen before, as far as the
        budget of SOLVES_PER_JOB per job seen lasts."""
        self._solves_left = min(gangs.MAX_NEW_SOLVES, int(self._tokens))  # this decision's

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
            else:
                floor = self.min_share * self.request_rate(job)
                kept = [e for e in entries if e[1].samples_per_s >= floor]
                if not kept:  # every efficient option is below the floor: the request itself (it fits)
                    req = self._reference.request(job)[0]
                    kept = [self.entry(replace(req, duration_s=req.iteration_s))] if req is not None else entries
                entries = kept
        self._entries[job.job_id] = entries
        self._tokens = min(gangs.MAX_SOLVE_TOKENS, self._tokens + gangs.SOLVES_PER_JOB)
        self._ref_s[job.job_id] = job.steps * min((o.iteration_s for _, o, _ in entries), default=math.inf)
        return entries

    def request_rate(self, job: JobSpec) -> float:
        """Predicted samples/s of the job on its user's request (0 where that fits nowhere)."""
        try:
            req = self._reference.request(job)[0]
        except ValueError:  # a request this cluster cannot hold: no floor
            return 0.0
        return 0.0 if req is None else req.samples_per_s

    def admissible(self, job: JobSpec, o: ResourceOption) -> bool:
        """At least MIN_SHARE of the request's predicted throughput (module docstring)."""
        return o.samples_per_s >= self.min_share * self.request_rate(job)

    def entry(self, o: ResourceOption) -> Entry:
        price = sum(n * get_gpu_type(d.type).peak_tflops(device_dtype(d.type, self.dtype)) for d, n in o.parts)
        return self.index[o.pool], o, price

    @staticmethod
    def take(free_n: list[int], need: Need) -> None:
        """Count the devices `need` as taken (per pool index)."""
        for k, n in need:
            free_n[k] -= n

    @staticmethod
    def give(free_n: list[int], need: Need) -> None:
        """Count the devices `need` as free again."""
        for k, n in need:
            free_n[k] += n

    def candidates(self, job: JobSpec, free_n: Sequence[int]) -> list[tuple[Entry, Need]]:
        """The job's options that fit the free devices now, each with what it takes: its one-pool
        entries and, where allowed, the mixed gangs the free devices offer (`mixed_entries`)."""
        out = []
        for e in self.entries(job):
            need = ((e[0], e[1].num_gpus),)
            if free_n[e[0]] >= e[1].num_gpus:
                out.append((e, need))
        if self.mixed and any(free_n):
            out += self.mixed_entries(job, free_n, max((e[1].samples_per_s for e, _ in out), default=0.0))
        return out

    def mixed_entries(self, job: JobSpec, free_n: Sequence[int], best_rate: float) -> list[tuple[Entry, Need]]:
        """Mixed gangs of two pools from the free devices (planner/schedule/mixed.py) predicted at least
        1/MIXED_GAIN times as fast as `best_rate` (the best one-pool option that fits now) and
        admissible; gangs not priced yet are priced only where their optimistic rate could pay and
        while the decision's budget lasts."""
        entries = self.entries(job)
        if not entries:
            return []
        one = self._one_step.get(job.job_id)
        if one is None:
            one = self._one_step[job.job_id] = replace(job, steps=1)
        k, top, _ = min(entries, key=lambda e: e[1].iteration_s)
        # gangs of the size asked for, of the fastest one-pool option's, and of twice that where that
        # option takes its whole pool (the job could use more than one pool holds)
        targets = {top.num_gpus}
        if top.num_gpus == self.pools[k].count:
            targets.add(2 * top.num_gpus)
        if job.requested_gpus:
            targets.add(job.requested_gpus)
        net = self.cluster.network.inter_node_gbps
        out = []
        for target in sorted(targets):
            for parts_ix in gangs.gang_parts(self.pools, free_n, target):
                parts = tuple((self.pools[k], n) for k, n in parts_ix)
                if not gangs.is_priced(one, parts, self.dtype, net):
                    if self._solves_left <= 0:
                        continue
                    if gangs.gang_bound(one, parts, self.dtype, net) * gangs.MIXED_GAIN <= best_rate:
                        continue
                    self._solves_left -= 1
                    self._tokens -= 1
                o = gangs.estimate_mixed_option(one, parts, self.dtype, net)
                if o is None or o.samples_per_s * gangs.MIXED_GAIN <= best_rate or not self.admissible(job, o):
                    continue
                out.append((self.entry(o), parts_ix))
        return out

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
               blocked: Callable[[Need, ResourceOption], bool] | None = None) -> tuple[Need, ResourceOption] | None:
        """Frenzy's pick among the options that fit the free devices (and that `blocked` allows):
        the cheapest within cheap_slack of the fastest, ties to the faster. Returns (what it takes,
        the option of one step)."""
        cands = self.candidates(job, free_n)
        fastest_s = min((e[1].iteration_s for e, _ in cands), default=math.inf)
        best = None
        for (k, o, price), need in cands:
            if o.iteration_s > self.cheap_slack * fastest_s:
                continue
            if blocked is not None and blocked(need, o):
                continue
            if best is None or (price, o.iteration_s) < (best[2], best[1].iteration_s):
                best = (need, o, price)
        return None if best is None else (best[0], best[1])

    def releases(self, running: Sequence[Running]) -> Releases:
        out: Releases = [[] for _ in self.pools]
        for r in running:
            for pool, n in r.parts:
                out[self.index[pool.device]].append((r.end_s, n))
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
