"""Multi-job scheduling on a mixed pool: the orchestrator state, two policies, a trace simulator.

* `ClusterState` — the orchestrator's record of every device: which job holds it.
  Allocating a held device raises (no double booking, ever).
* `FrenzyPolicy` — GPUMix's heterogeneity- and memory-aware scheduler (Frenzy's HAS
  over MARP's options, planner/schedule/options.py). Users give only model, batch and steps.
  Each decision: order the waiting jobs by highest response ratio
  `(wait + d) / d` (short jobs first, and every waiting job's ratio grows, so none
  starves); give each the option that finishes it soonest among those that fit the
  free devices, preferring cheaper devices when they finish nearly as soon
  (`cheap_slack`), and counts whose GPUs are used efficiently (`min_efficiency`);
  the oldest waiting job is tried first and, if it cannot start, gets a reservation on
  the pool where it can start earliest; the others only backfill around it (EASY
  backfilling), so a large job is never overtaken forever.
* `FifoPolicy` — the team without GPUMix: first come first served, each job gets
  exactly its user's request (type, count) when that many are free; the head of the
  queue blocks everyone behind it. A request that does not fit in memory on the
  asked-for count would crash with OOM; the user then asks for more of the same type —
  we charge nothing for the failed attempt and run it at the smallest count of that
  type that fits (`request_adjusted`), which favours the baseline. A request that
  cannot fit at any count of its type fails (`status == "failed"`, left out of JCT).
  On its devices a fifo job gets the same best configuration (ZeRO, recomputation,
  micro-batch) the memory model finds, so the difference measured is the placement.
* `simulate_schedule` — replays a trace (arrivals, completions) under a policy. The
  cost model's predicted durations are the simulation's ground truth for both policies.
"""
from __future__ import annotations

import heapq
import logging
import math
import time
from dataclasses import dataclass, field, replace
from typing import Protocol, Sequence

from planner.core.catalog import get_gpu_type
from planner.core.cluster import ClusterSpec
from planner.core.jobs import JobSpec
from planner.schedule.options import Pool, ResourceOption, candidate_counts, cluster_pools, estimate_option, options_on_pools

log = logging.getLogger(__name__)

POLICIES = ("frenzy", "fifo")


class ClusterState:
    """Which job holds each device of a cluster (device indices as in ClusterSpec.devices())."""

    def __init__(self, cluster: ClusterSpec) -> None:
        self.cluster = cluster
        self.pools = cluster_pools(cluster)
        self.owner: list[str | None] = [None] * cluster.num_devices
        self._pool_of: list[Pool] = []
        self._node_of: list[str] = []
        by_device = {p.device: p for p in self.pools}
        for node, dev in cluster.devices():
            self._pool_of.append(by_device[dev])
            self._node_of.append(node.name)
        # free device indices per pool, per node (insertion order = cluster order)
        self._free: dict[Pool, dict[str, list[int]]] = {p: {} for p in self.pools}
        for i, pool in enumerate(self._pool_of):
            self._free[pool].setdefault(self._node_of[i], []).append(i)
        self._free_count = {p: p.count for p in self.pools}
        self._held: dict[str, tuple[int, ...]] = {}

    def free_count(self, pool: Pool) -> int:
        return self._free_count[pool]

    def free_counts(self) -> dict[Pool, int]:
        return dict(self._free_count)

    def pool_of(self, device_index: int) -> Pool:
        return self._pool_of[device_index]

    def pick(self, pool: Pool, n: int) -> tuple[int, ...]:
        """n free devices of the pool: all on one node when one has room (the node with the
        fewest free that suffices: keeps whole nodes for large jobs), else the emptiest nodes first."""
        if self._free_count[pool] < n:
            raise RuntimeError(f"only {self._free_count[pool]} free {pool.device.label} devices, {n} asked")
        nodes = self._free[pool]
        fitting = [(len(ix), name) for name, ix in nodes.items() if len(ix) >= n]
        if fitting:
            return tuple(nodes[min(fitting)[1]][:n])
        out: list[int] = []
        for name in sorted(nodes, key=lambda k: -len(nodes[k])):
            out.extend(nodes[name][: n - len(out)])
            if len(out) == n:
                break
        return tuple(out)

    def assign(self, job_id: str, devices: Sequence[int]) -> None:
        """Give `devices` to `job_id`; a device already held is a double booking and raises."""
        if job_id in self._held:
            raise RuntimeError(f"job {job_id} already holds devices {self._held[job_id]}")
        for i in devices:
            if self.owner[i] is not None:
                raise RuntimeError(f"double booking: device {i} is held by job {self.owner[i]}, wanted by {job_id}")
        for i in devices:
            self.owner[i] = job_id
            pool = self._pool_of[i]
            self._free[pool][self._node_of[i]].remove(i)
            self._free_count[pool] -= 1
        self._held[job_id] = tuple(devices)

    def release(self, job_id: str) -> tuple[int, ...]:
        devices = self._held.pop(job_id)
        for i in devices:
            assert self.owner[i] == job_id, f"device {i} is held by {self.owner[i]}, not {job_id}"
            self.owner[i] = None
            pool = self._pool_of[i]
            ix = self._free[pool][self._node_of[i]]
            ix.append(i)
            ix.sort()
            self._free_count[pool] += 1
        return devices


@dataclass(frozen=True)
class Running:
    """A running job as a policy sees it: which pool, how many, predicted end."""

    job_id: str
    pool: Pool
    num_gpus: int
    end_s: float


@dataclass(frozen=True)
class Decision:
    job: JobSpec
    option: ResourceOption
    request_adjusted: bool = False


class Policy(Protocol):
    name: str

    def decide(self, now: float, waiting: Sequence[JobSpec], free: dict[Pool, int],
               running: Sequence[Running]) -> list[Decision]: ...

    def failed(self) -> dict[str, str]: ...


class FrenzyPolicy:
    name = "frenzy"

    def __init__(self, cluster: ClusterSpec, dtype: str = "bf16", cheap_slack: float = 1.25,
                 min_efficiency: float = 0.7, reserve_after_s: float = 0.0, order: str = "hrrn",
                 user_requests: bool = False) -> None:
        if order not in ("hrrn", "arrival"):
            raise ValueError(f"order must be 'hrrn' or 'arrival', got {order!r}")
        self.cluster, self.dtype = cluster, dtype
        self.cheap_slack, self.min_efficiency = cheap_slack, min_efficiency
        self.reserve_after_s, self.order = reserve_after_s, order
        # ablation: frenzy's queueing (order, reservation, backfill) over the users' own requests
        self._requests = FifoPolicy(cluster, dtype) if user_requests else None
        self._pool_list = cluster_pools(cluster)
        self._pool_index = {p.device: k for k, p in enumerate(self._pool_list)}
        # per job: [(pool index, option of ONE step, price)]; a job's duration is steps × iteration_s
        self._options: dict[str, list[tuple[int, ResourceOption, float]]] = {}
        self._by_shape: dict[tuple, list[tuple[int, ResourceOption, float]]] = {}
        self._ref_s: dict[str, float] = {}
        self._failed: dict[str, str] = {}

    def options(self, job: JobSpec) -> list[ResourceOption]:
        """The job's usable options: per pool, counts from the smallest that fits up to where
        adding GPUs stops paying (GPU-seconds within 1/min_efficiency of the pool's smallest)."""
        return [replace(o, duration_s=o.iteration_s * job.steps) for _, o, _ in self._entries(job)]

    def _entries(self, job: JobSpec) -> list[tuple[int, ResourceOption, float]]:
        entries = self._options.get(job.job_id)
        if entries is not None:
            return entries
        if self._requests is not None:
            req = self._requests.request(job)[0]
            entries = [] if req is None else [self._entry(replace(req, duration_s=req.iteration_s))]
            self._failed.update(self._requests.failed())
        else:
            entries = self._shape_entries(job)
            if not entries:
                self._failed[job.job_id] = "does not fit in memory on any device pool of the cluster"
        self._options[job.job_id] = entries
        self._ref_s[job.job_id] = job.steps * min((o.iteration_s for _, o, _ in entries), default=math.inf)
        return entries

    def _entry(self, o: ResourceOption) -> tuple[int, ResourceOption, float]:
        # price: peak FLOP/s × count — among nearly-as-fast options the cheaper devices win,
        # keeping the big parts free for the jobs that need them
        return self._pool_index[o.pool], o, o.num_gpus * get_gpu_type(o.pool.type).peak_tflops(o.dtype)

    def _shape_entries(self, job: JobSpec) -> list[tuple[int, ResourceOption, float]]:
        """Options of one step, shared by all jobs of the same (model, seq, global batch): sweeps
        and repeated submissions cost a dictionary look-up."""
        key = (job.model, job.seq, job.global_batch)
        if key not in self._by_shape:
            one_step = replace(job, steps=1)
            entries, floor = [], {}
            for o in options_on_pools(one_step, self._pool_list, self.cluster.network.inter_node_gbps, self.dtype):
                floor.setdefault(o.pool, o.gpu_seconds)  # per pool in increasing count; GPU-seconds grow
                if o.gpu_seconds * self.min_efficiency <= floor[o.pool]:
                    entries.append(self._entry(o))
            self._by_shape[key] = entries
        return self._by_shape[key]

    def failed(self) -> dict[str, str]:
        return dict(self._failed)

    def _rank(self, now: float, job: JobSpec) -> tuple:
        if self.order == "arrival":  # ablation: GPUMix's sizing and backfilling, first-come order
            return (-job.priority, job.submit_s, job.job_id)
        ref = self._ref_s[job.job_id]
        return (-job.priority, -(now - job.submit_s + ref) / ref, job.submit_s)

    def decide(self, now: float, waiting: Sequence[JobSpec], free: dict[Pool, int],
               running: Sequence[Running]) -> list[Decision]:
        free_n = [free.get(p, 0) for p in self._pool_list]  # by pool index: no hashing in the loop
        todo = [j for j in waiting if self._entries(j)]
        todo.sort(key=lambda j: self._rank(now, j))
        # The oldest job goes first; if it cannot start it holds the one reservation (EASY).
        head = min(todo, key=lambda j: (j.submit_s, j.job_id), default=None)
        if head is not None and now - head.submit_s >= self.reserve_after_s:
            todo.remove(head)
            todo.insert(0, head)
        else:
            head = None
        out: list[Decision] = []
        reserved_pool, reserved_s = -1, math.inf  # the head's reservation: pool index, start time
        extra = 0  # devices of the reserved pool that stay free at the reservation time
        for job in todo:
            if not any(free_n):
                break
            entries = self._entries(job)
            fastest_s = min((o.iteration_s for k, o, _ in entries if free_n[k] >= o.num_gpus), default=math.inf)
            best = None
            for k, o, price in entries:
                if free_n[k] < o.num_gpus or o.iteration_s > self.cheap_slack * fastest_s:
                    continue
                if k == reserved_pool and now + job.steps * o.iteration_s > reserved_s and o.num_gpus > extra:
                    continue  # would delay the reserved job
                if best is None or (price, o.iteration_s) < (best[2], best[1].iteration_s):
                    best = (k, o, price)
            if best is not None:
                k, o, _ = best
                free_n[k] -= o.num_gpus
                if k == reserved_pool and now + job.steps * o.iteration_s > reserved_s:
                    extra -= o.num_gpus
                out.append(Decision(job, replace(o, duration_s=o.iteration_s * job.steps)))
            elif job is head:
                reserved_pool, reserved_s, extra = self._reserve(job, free_n, running, now)
        return out

    def _reserve(self, job: JobSpec, free_n: list[int], running: Sequence[Running],
                 now: float) -> tuple[int, float, int]:
        """(pool index, start time, devices to spare then) of the option that can start — and so
        finish — earliest as running jobs end; (-1, inf, 0) when none can."""
        best = None
        for k, o, _ in self._entries(job):
            pool = self._pool_list[k]
            have, t = free_n[k], now
            for r in sorted((r for r in running if r.pool == pool), key=lambda r: r.end_s):
                if have >= o.num_gpus:
                    break
                have, t = have + r.num_gpus, r.end_s
            end = t + job.steps * o.iteration_s
            if have >= o.num_gpus and (best is None or end < best[0]):
                best = (end, k, t, have - o.num_gpus)
        return (-1, math.inf, 0) if best is None else best[1:]


class FifoPolicy:
    name = "fifo"

    def __init__(self, cluster: ClusterSpec, dtype: str = "bf16") -> None:
        self.cluster, self.dtype = cluster, dtype
        self.pools = cluster_pools(cluster)
        self._request: dict[str, tuple[ResourceOption | None, bool]] = {}
        self._failed: dict[str, str] = {}

    def failed(self) -> dict[str, str]:
        return dict(self._failed)

    def request(self, job: JobSpec) -> tuple[ResourceOption | None, bool]:
        """(the option the user's request runs with, whether the count had to grow to fit)."""
        if job.job_id in self._request:
            return self._request[job.job_id]
        if job.requested_type is None:  # no request: the most plentiful type, smallest count that fits
            pools = sorted(self.pools, key=lambda p: -p.count)[:1]
            want = 1
        else:
            pools = sorted((p for p in self.pools if p.device.type == job.requested_type), key=lambda p: -p.count)[:1]
            if not pools:
                raise ValueError(f"job {job.job_id}: requested type {job.requested_type!r} is not in the cluster")
            want = job.requested_gpus
            if want > pools[0].count:
                raise ValueError(f"job {job.job_id}: requests {want} {job.requested_type} "
                                 f"but the cluster has {pools[0].count}")
        pool = pools[0]
        net = self.cluster.network.inter_node_gbps
        result: tuple[ResourceOption | None, bool] = (None, False)
        for n in [want] + [c for c in candidate_counts(pool.count) if c > want] + [pool.count]:
            opt = estimate_option(job, pool, n, self.dtype, net)
            if opt is not None:
                result = (opt, n != want)
                break
        if result[0] is None:
            self._failed[job.job_id] = f"out of memory on {pool.device.type} at every count up to {pool.count}"
        self._request[job.job_id] = result
        return result

    def decide(self, now: float, waiting: Sequence[JobSpec], free: dict[Pool, int],
               running: Sequence[Running]) -> list[Decision]:
        pools = {p.device: p for p in free}
        free = dict(free)
        out: list[Decision] = []
        for job in waiting:  # arrival order; the first that cannot start blocks the rest
            opt, adjusted = self.request(job)
            if opt is None:
                continue
            pool = pools[opt.pool]
            if free[pool] < opt.num_gpus:
                break
            free[pool] -= opt.num_gpus
            out.append(Decision(job, opt, adjusted))
        return out


def build_policy(name: str, cluster: ClusterSpec, dtype: str = "bf16") -> Policy:
    if name == "frenzy":
        return FrenzyPolicy(cluster, dtype)
    if name == "fifo":
        return FifoPolicy(cluster, dtype)
    raise ValueError(f"unknown policy {name!r}; choose one of {', '.join(POLICIES)}")


@dataclass(frozen=True)
class JobRecord:
    job: JobSpec
    status: str  # "done" | "failed"
    start_s: float | None = None
    end_s: float | None = None
    devices: tuple[int, ...] = ()
    option: ResourceOption | None = None
    request_adjusted: bool = False
    reason: str = ""

    @property
    def jct_s(self) -> float | None:
        return None if self.end_s is None else self.end_s - self.job.submit_s

    def to_dict(self) -> dict:
        return {"job_id": self.job.job_id, "model": self.job.model, "status": self.status,
                "submit_s": self.job.submit_s, "start_s": self.start_s, "end_s": self.end_s, "jct_s": self.jct_s,
                "devices": list(self.devices), "request_adjusted": self.request_adjusted, "reason": self.reason,
                **({"option": self.option.to_dict()} if self.option else {})}


@dataclass(frozen=True)
class ScheduleResult:
    policy: str
    num_devices: int
    records: tuple[JobRecord, ...]
    avg_jct_s: float
    p99_jct_s: float
    makespan_s: float
    gpu_utilization: float  # busy device-seconds / (devices × makespan), predicted
    scheduling_overhead_ms_per_job: float  # measured wall time of the policy's decisions / jobs
    num_decisions: int = 0

    @property
    def num_failed(self) -> int:
        return sum(r.status == "failed" for r in self.records)

    def to_dict(self, jobs: bool = True) -> dict:
        d = {"policy": self.policy, "num_jobs": len(self.records), "num_failed": self.num_failed,
             "num_devices": self.num_devices, "avg_jct_s": self.avg_jct_s, "p99_jct_s": self.p99_jct_s,
             "makespan_s": self.makespan_s, "gpu_utilization": self.gpu_utilization,
             "scheduling_overhead_ms_per_job": self.scheduling_overhead_ms_per_job,
             "num_decisions": self.num_decisions}
        if jobs:
            d["jobs"] = [r.to_dict() for r in self.records]
        return d


def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile (numpy's default), without numpy in the planner."""
    xs = sorted(values)
    if not xs:
        return math.nan
    k = (len(xs) - 1) * q / 100.0
    lo, hi = math.floor(k), math.ceil(k)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


@dataclass(order=True)
class _Event:
    time_s: float
    order: int  # completions (0) before arrivals (1) at the same instant, then FIFO
    seq: int
    job_id: str = field(compare=False)


def simulate_schedule(jobs: Sequence[JobSpec], cluster: ClusterSpec, policy: str | Policy = "frenzy",
                      dtype: str = "bf16") -> ScheduleResult:
    """Replay `jobs` on `cluster` under a policy; every arrival and completion is a decision point."""
    if not jobs:
        raise ValueError("the trace has no jobs")
    ids = [j.job_id for j in jobs]
    if len(set(ids)) != len(ids):
        raise ValueError("job ids in the trace are not unique")
    pol = build_policy(policy, cluster, dtype) if isinstance(policy, str) else policy
    state = ClusterState(cluster)
    by_id = {j.job_id: j for j in jobs}
    events: list[_Event] = []
    seq = 0
    for j in sorted(jobs, key=lambda j: (j.submit_s, j.job_id)):
        heapq.heappush(events, _Event(j.submit_s, 1, seq, j.job_id))
        seq += 1
    waiting: list[JobSpec] = []
    running: dict[str, Running] = {}
    records: dict[str, JobRecord] = {}
    decide_s, decisions = 0.0, 0
    while events:
        now = events[0].time_s
        while events and events[0].time_s == now:
            ev = heapq.heappop(events)
            if ev.order == 0:
                state.release(ev.job_id)
                del running[ev.job_id]
            else:
                waiting.append(by_id[ev.job_id])
        t0 = time.perf_counter()
        chosen = pol.decide(now, waiting, state.free_counts(), list(running.values()))
        decide_s += time.perf_counter() - t0
        decisions += 1
        started = set()
        for d in chosen:
            pool = next(p for p in state.pools if p.device == d.option.pool)
            devices = state.pick(pool, d.option.num_gpus)
            state.assign(d.job.job_id, devices)
            end = now + d.option.duration_s
            running[d.job.job_id] = Running(d.job.job_id, pool, d.option.num_gpus, end)
            records[d.job.job_id] = JobRecord(d.job, "done", now, end, devices, d.option, d.request_adjusted)
            heapq.heappush(events, _Event(end, 0, seq, d.job.job_id))
            seq += 1
            started.add(d.job.job_id)
        failed = pol.failed()
        waiting = [j for j in waiting if j.job_id not in started and j.job_id not in failed]
    for job_id, reason in pol.failed().items():
        records[job_id] = JobRecord(by_id[job_id], "failed", reason=reason)
    missing = [j.job_id for j in jobs if j.job_id not in records]
    if missing:  # cannot happen with an empty cluster at the end; guards the simulator itself
        raise RuntimeError(f"jobs never scheduled: {missing[:5]}")
    done = [records[j.job_id] for j in jobs if records[j.job_id].status == "done"]
    jcts = [r.jct_s for r in done]
    start0 = min(j.submit_s for j in jobs)
    makespan = max((r.end_s for r in done), default=start0) - start0
    busy = sum(r.option.num_gpus * (r.end_s - r.start_s) for r in done)
    return ScheduleResult(
        policy=pol.name, num_devices=cluster.num_devices, records=tuple(records[j.job_id] for j in jobs),
        avg_jct_s=sum(jcts) / len(jcts) if jcts else math.nan, p99_jct_s=percentile(jcts, 99),
        makespan_s=makespan, gpu_utilization=busy / (cluster.num_devices * makespan) if makespan > 0 else 0.0,
        scheduling_overhead_ms_per_job=1000.0 * decide_s / len(jobs), num_decisions=decisions,
    )
