"""Replay a job trace on a mixed pool under a scheduling policy; every arrival and completion
is a decision point.

Policies (POLICIES, by name): `gpumix` (planner/schedule/gpumix.py), `frenzy`
(planner/schedule/frenzy.py), and the baselines `fifo`, `fifo-backfill`, `fifo-backfill-sized`,
`sjf` (planner/schedule/fifo.py, backfill.py), `srtf`, `las` and `gavel` (preemptive.py). A policy
decides on *predicted* durations; the simulated job runs for the prediction times a seeded
lognormal error per (job, GPU type) (`error_factor`), the same for every policy, so comparisons are
paired; a mixed gang runs at its slowest type's error (`gang_factor`: its devices step together), or,
with `rebalance`, where the errors differ enough for the run's live rebalancing to re-split it, at
its parts' summed rates. A
resized or suspended job keeps its steps done and pays planner.schedule.state.restart_s before it
computes again. `mixed=False` restricts every policy to one pool per job. The replay also measures
how long the free devices were fragmented across types (`fragmented`): the share of its span during
which a waiting job fitted on no pool's free devices, though all pools' free devices together
numbered one of its options' count.

The error model and the restart rules: docs/models/scheduling.md ("The simulator").
"""
from __future__ import annotations

import heapq
import logging
import math
import random
import time
from dataclasses import dataclass, field, replace
from typing import Sequence

from contracts.cluster import ClusterSpec
from contracts.jobs import JobSpec
from planner.schedule.backfill import BackfillPolicy
from planner.schedule.fifo import FifoPolicy
from planner.schedule.frenzy import FrenzyPolicy
from planner.schedule.gpumix import GpumixPolicy
from planner.schedule.options import ResourceOption
from planner.schedule.preemptive import GavelPolicy, LasPolicy, SrtfPolicy
from planner.schedule.state import ERROR_SIGMA, ClusterState, Policy, Running, checkpoint_save_s, restart_s

log = logging.getLogger(__name__)

# every policy by name, once: what it is (the CLI's help) and how it is built on a cluster at a dtype,
# with or without mixed gangs (`mixed`; the users' own requests are one type anyway)
POLICY_TABLE = {
    "gpumix": ("GPUMix's own", lambda c, d, m: GpumixPolicy(c, d, mixed=m)),
    "frenzy": ("the paper's", lambda c, d, m: FrenzyPolicy(c, d, mixed=m)),
    "fifo": ("baseline, strict first-come", lambda c, d, m: FifoPolicy(c, d)),
    "fifo-backfill": ("baseline, EASY over the users' requests",
                      lambda c, d, m: BackfillPolicy(c, d, order="arrival", user_requests=True)),
    "fifo-backfill-sized": ("baseline, EASY sized by GPUMix",
                            lambda c, d, m: BackfillPolicy(c, d, order="arrival", mixed=m)),
    "sjf": ("baseline, shortest job first", lambda c, d, m: BackfillPolicy(c, d, order="sjf", mixed=m)),
    "srtf": ("baseline, preemptive shortest remaining predicted time", lambda c, d, m: SrtfPolicy(c, d, mixed=m)),
    "las": ("baseline, Tiresias' least attained service (preemptive, no durations)",
            lambda c, d, m: LasPolicy(c, d, mixed=m)),
    "gavel": ("baseline, Gavel-style throughput-normalised LAS and placement",
              lambda c, d, m: GavelPolicy(c, d, mixed=m)),
}
POLICIES = tuple(POLICY_TABLE)
BASELINES = POLICIES[1:]  # every policy but GPUMix's own

MAX_ERROR_SIGMA = 2.0  # x/÷ 7.4 at one sigma: past this a "prediction" predicts nothing

def error_factor(seed: int, job_id: str, gpu_type: str, sigma: float = ERROR_SIGMA) -> float:
    """measured / predicted duration of `job_id` on `gpu_type`: lognormal, median 1 (the model is
    unbiased in log), the same for every policy and every count on that type."""
    if sigma == 0:
        return 1.0
    return math.exp(sigma * random.Random(f"{seed}:{job_id}:{gpu_type}").gauss(0.0, 1.0))


# executor/rebalance.py's DEPARTURE_THRESHOLD: a run re-splits its batch live once a rank's measured
# rate departs this much from what the split assumed (relative to the others)
REBALANCE_DEPARTURE = 1.25


def gang_factor(factor, job_id: str, option: ResourceOption, rebalance: bool = False) -> float:
    """measured / predicted duration of `job_id` on `option` (`factor(job_id, gpu_type)` per type). A
    mixed gang's devices step together: at the split it was planned with, its slowest type's error
    sets the pace. With `rebalance`, where its types' errors differ by more than REBALANCE_DEPARTURE,
    the run's live rebalancing (executor/rebalance.py, on by default in a launch) re-splits the batch
    by the measured rates, so the gang runs at its parts' summed measured rates: 1 / Σ share_i /
    factor_i, share_i the part's planned share of the global batch. Not modelled: the few steps
    before the re-split, and memory or the fixed shards capping how far a batch can move."""
    factors = [factor(job_id, d.type) for d, _ in option.parts]
    slowest = max(factors)
    if not rebalance or len(factors) < 2 or slowest <= REBALANCE_DEPARTURE * min(factors):
        return slowest
    batches, i = [], 0
    for _, n in option.parts:  # per_device lists the parts' devices in order
        batches.append(sum(m * a for m, a, _ in option.per_device[i:i + n]))
        i += n
    return 1.0 / sum(b / sum(batches) / f for b, f in zip(batches, factors))


def fragmented(free: dict, waiting: Sequence[JobSpec], options) -> bool:
    """Are the free devices fragmented across types for a waiting job: does one wait that none of
    its one-pool options (`options(job)`) fits on the free devices of its pool, while the free
    devices of all pools together number at least one option's count?"""
    return bool(fragmented_jobs(free, waiting, options, first_only=True))


def fragmented_jobs(free: dict, waiting: Sequence[JobSpec], options, first_only: bool = False) -> list[str]:
    """The waiting jobs for which the free devices are fragmented across types (`fragmented`): no
    pool's free devices hold one of their one-pool options, all pools' together would (a gang could
    at most start them now); the first only where `first_only`."""
    total = sum(free.values())
    out = []
    for job in waiting:
        counts = [(o.pool, o.num_gpus) for o in options(job) if not o.mix]
        if counts and all(free.get(d, 0) < n for d, n in counts) and any(n <= total for _, n in counts):
            out.append(job.job_id)
            if first_only:
                break
    return out


def build_policy(name: str, cluster: ClusterSpec, dtype: str = "bf16", mixed: bool = True) -> Policy:
    if name not in POLICY_TABLE:
        raise ValueError(f"unknown policy {name!r}; choose one of {', '.join(POLICIES)}")
    return POLICY_TABLE[name][1](cluster, dtype, mixed)


@dataclass(frozen=True)
class JobRecord:
    job: JobSpec
    status: str  # "done" | "failed"
    start_s: float | None = None
    end_s: float | None = None
    devices: tuple[int, ...] = ()  # the devices of its first placement
    option: ResourceOption | None = None  # its first placement (predicted figures)
    request_adjusted: bool = False
    reason: str = ""
    error_factor: float = 1.0  # measured / predicted duration of the first placement
    num_restarts: int = 0  # checkpoint-and-resume cycles (resizes, suspensions)
    final_option: ResourceOption | None = None
    busy_gpu_s: float = 0.0  # device-seconds it held (restarts included)

    @property
    def jct_s(self) -> float | None:
        return None if self.end_s is None else self.end_s - self.job.submit_s

    @property
    def mixed_gang(self) -> bool:
        """Did it run on a mixed gang (any placement)?"""
        return bool((self.option and self.option.mix) or (self.final_option and self.final_option.mix))

    def to_dict(self) -> dict:
        d = {"job_id": self.job.job_id, "model": self.job.model, "status": self.status,
             "submit_s": self.job.submit_s, "start_s": self.start_s, "end_s": self.end_s, "jct_s": self.jct_s,
             "devices": list(self.devices), "request_adjusted": self.request_adjusted, "reason": self.reason,
             "error_factor": self.error_factor, "num_restarts": self.num_restarts, "mixed_gang": self.mixed_gang}
        if self.option:
            d["option"] = self.option.to_dict()
        if self.num_restarts and self.final_option:
            d["final_option"] = self.final_option.to_dict()
        return d


@dataclass(frozen=True)
class ScheduleResult:
    policy: str
    num_devices: int
    records: tuple[JobRecord, ...]
    avg_jct_s: float
    p99_jct_s: float
    makespan_s: float
    gpu_utilization: float  # held device-seconds / (devices × makespan), simulated
    scheduling_overhead_ms_per_job: float  # measured CPU time of the policy's decisions (option estimates included) / jobs
    num_decisions: int = 0
    error_sigma: float = ERROR_SIGMA
    error_seed: int = 0
    mixed: bool = True  # mixed gangs allowed
    # share of the replay's span (first arrival to last event) with the free devices fragmented
    # across types for a waiting job (`fragmented`), after each decision's placements; None: not measured
    fragmented_share: float | None = None
    # the jobs' waiting seconds, summed, spent while the free devices were fragmented for them
    # (`fragmented_jobs`): all the queueing a gang could have saved; None: not measured
    fragmented_wait_s: float | None = None

    @property
    def num_failed(self) -> int:
        return sum(r.status == "failed" for r in self.records)

    @property
    def num_mixed_gang_jobs(self) -> int:
        return sum(r.mixed_gang for r in self.records)

    def to_dict(self, jobs: bool = True) -> dict:
        d = {"policy": self.policy, "num_jobs": len(self.records), "num_failed": self.num_failed,
             "num_devices": self.num_devices, "avg_jct_s": self.avg_jct_s, "p99_jct_s": self.p99_jct_s,
             "makespan_s": self.makespan_s, "gpu_utilization": self.gpu_utilization,
             "scheduling_overhead_ms_per_job": self.scheduling_overhead_ms_per_job,
             "num_decisions": self.num_decisions, "num_restarts": sum(r.num_restarts for r in self.records),
             "num_mixed_gang_jobs": self.num_mixed_gang_jobs, "mixed_allowed": self.mixed,
             "mixed_gang_job_ids": [r.job.job_id for r in self.records if r.mixed_gang],
             "error_sigma": self.error_sigma, "error_seed": self.error_seed}
        if self.fragmented_share is not None:
            d["fragmented_share"] = self.fragmented_share
            d["fragmented_wait_s"] = self.fragmented_wait_s
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
    version: int = field(default=0, compare=False)  # a completion made stale by a resize is skipped


@dataclass
class _Run:
    """A running job's simulated truth: what it runs, how far it got, when it really ends."""

    job: JobSpec
    option: ResourceOption  # duration_s: predicted for all the job's steps on this option
    factor: float
    done: float  # share of steps done when this segment's computing began
    compute_from_s: float  # this segment computes from here (after a restart)
    held_from_s: float  # ... and holds its devices from here
    version: int = 0

    @property
    def actual_s(self) -> float:
        return self.option.duration_s * self.factor

    @property
    def end_s(self) -> float:
        return self.compute_from_s + (1.0 - self.done) * self.actual_s

    def done_at(self, t: float) -> float:
        return min(1.0, self.done + max(0.0, t - self.compute_from_s) / self.actual_s)

    def view(self, pool_of: dict, now: float) -> Running:
        predicted_end = self.compute_from_s + (1.0 - self.done) * self.option.duration_s
        mix = tuple((pool_of[p.device], n) for p, n in self.option.mix)
        return Running(self.job.job_id, pool_of[self.option.pool], self.option.num_gpus, max(now, predicted_end),
                       self.option, 1.0 - self.done_at(now), mix)


def simulate_schedule(jobs: Sequence[JobSpec], cluster: ClusterSpec, policy: str | Policy = "frenzy",
                      dtype: str = "bf16", error_sigma: float = ERROR_SIGMA, error_seed: int = 0,
                      mixed: bool = True, fragmentation: bool = False, rebalance: bool = False) -> ScheduleResult:
    """Replay `jobs` on `cluster` under a policy (a name of POLICIES, built with or without mixed
    gangs, or an object). `fragmentation`: measure `fragmented_share` (a look at every waiting
    job's options after each decision; 0 when off or where the policy has no `options`).
    `rebalance`: gangs re-split their batch live as launched runs do (`gang_factor`)."""
    if not jobs:
        raise ValueError("the trace has no jobs")
    ids = [j.job_id for j in jobs]
    if len(set(ids)) != len(ids):
        raise ValueError("job ids in the trace are not unique")
    if not (math.isfinite(error_sigma) and 0 <= error_sigma <= MAX_ERROR_SIGMA):
        raise ValueError(f"error_sigma must be within [0, {MAX_ERROR_SIGMA:g}], got {error_sigma}")
    pol = build_policy(policy, cluster, dtype, mixed) if isinstance(policy, str) else policy
    state = ClusterState(cluster)
    pool_of = {p.device: p for p in state.pools}
    by_id = {j.job_id: j for j in jobs}
    factors: dict[tuple[str, str], float] = {}

    def factor(job_id: str, gpu_type: str) -> float:
        key = (job_id, gpu_type)
        if key not in factors:
            factors[key] = error_factor(error_seed, job_id, gpu_type, error_sigma)
        return factors[key]

    events: list[_Event] = []
    seq = 0
    for j in sorted(jobs, key=lambda j: (j.submit_s, j.job_id)):
        heapq.heappush(events, _Event(j.submit_s, 1, seq, j.job_id))
        seq += 1
    waiting: list[JobSpec] = []
    running: dict[str, _Run] = {}
    first: dict[str, tuple[float, tuple[int, ...], ResourceOption, bool]] = {}
    restarts: dict[str, int] = {}  # resizes and suspensions: each one a checkpoint and a resume
    suspended: dict[str, _Run] = {}
    busy: dict[str, float] = {}
    ended: dict[str, tuple[float, ResourceOption]] = {}
    decide_s, decisions = 0.0, 0
    frag_s, frag_since = 0.0, None  # fragmented seconds so far; since when it is now (None: it is not)
    frag_wait_s, frag_waiting = 0.0, 0  # job-seconds waited while fragmented; how many jobs are so now
    options = getattr(pol, "options", None) if fragmentation else None  # a job's options (none: not measured)
    while events:
        now = events[0].time_s
        if frag_since is not None:
            frag_s += now - frag_since
            frag_wait_s += frag_waiting * (now - frag_since)
        while events and events[0].time_s == now:
            ev = heapq.heappop(events)
            if ev.order == 0:
                run = running.get(ev.job_id)
                if run is None or run.version != ev.version:
                    continue  # resized since: a later completion event stands
                state.release(ev.job_id)
                busy[ev.job_id] = busy.get(ev.job_id, 0.0) + run.option.num_gpus * (now - run.held_from_s)
                ended[ev.job_id] = (now, run.option)
                del running[ev.job_id]
            else:
                waiting.append(by_id[ev.job_id])
        views = [r.view(pool_of, now) for r in running.values()]
        t0 = time.thread_time()  # CPU time of this thread: other processes on a shared machine do not count
        chosen = pol.decide(now, waiting, state.free_counts(), views)
        decide_s += time.thread_time() - t0
        decisions += 1
        # resized and suspended jobs give back their devices before anything is placed
        back: list[JobSpec] = []
        saving: dict = {}  # per pool: until when a suspended job's checkpoint is still being written there
        for d in chosen:
            if d.resize or d.suspend:
                run = running[d.job.job_id]
                state.release(d.job.job_id)
                busy[d.job.job_id] = busy.get(d.job.job_id, 0.0) + run.option.num_gpus * (now - run.held_from_s)
                if d.suspend:  # its devices write its checkpoint first: whoever takes them computes after
                    for pool, _ in run.option.parts:
                        saving[pool] = max(saving.get(pool, now), now + checkpoint_save_s(d.job))
                    suspended[d.job.job_id] = replace(run, done=run.done_at(now), version=run.version + 1)
                    del running[d.job.job_id]
                    restarts[d.job.job_id] = restarts.get(d.job.job_id, 0) + 1
                    back.append(d.job)
        started = set()
        for d in chosen:
            if d.suspend:
                continue
            job_id = d.job.job_id
            devices: tuple[int, ...] = ()
            for device, n in d.option.parts:  # a mixed gang: n devices of each part's pool
                devices += state.pick(pool_of[device], n)
            state.assign(job_id, devices)
            f = gang_factor(factor, job_id, d.option, rebalance)
            ready_s = max(saving.get(device, now) for device, _ in d.option.parts)
            if d.resize or job_id in suspended:
                if d.resize:
                    old, done = running[job_id], running[job_id].done_at(now)
                    restarts[job_id] = restarts.get(job_id, 0) + 1
                    pause_s = restart_s(d.job)  # save, load, warm-up
                else:  # resumed with the progress it had when suspended; its save was paid then
                    old = suspended.pop(job_id)
                    done = old.done
                    pause_s = restart_s(d.job) - checkpoint_save_s(d.job)
                run = _Run(d.job, d.option, f, done, max(ready_s, now) + pause_s, now, old.version + 1)
                started.add(job_id)
            else:
                if job_id in running or job_id in ended:
                    raise RuntimeError(f"policy {pol.name} started job {job_id} twice")
                run = _Run(d.job, d.option, f, 0.0, ready_s, now)
                first[job_id] = (now, devices, d.option, d.request_adjusted)
                started.add(job_id)
            running[job_id] = run
            heapq.heappush(events, _Event(run.end_s, 0, seq, job_id, run.version))
            seq += 1
        failed = pol.failed()
        waiting = [j for j in waiting if j.job_id not in started and j.job_id not in failed] + back
        if options is not None:
            free = {p.device: n for p, n in state.free_counts().items()}
            frag_waiting = len(fragmented_jobs(free, waiting, options))
            frag_since = now if frag_waiting else None
    if suspended:
        raise RuntimeError(f"policy {pol.name} never resumed suspended jobs {sorted(suspended)[:5]}")
    records: dict[str, JobRecord] = {}
    for job_id, (start, devices, option, adjusted) in first.items():
        end, final = ended[job_id]
        records[job_id] = JobRecord(by_id[job_id], "done", start, end, devices, option, adjusted,
                                    error_factor=gang_factor(factor, job_id, option, rebalance),
                                    num_restarts=restarts.get(job_id, 0), final_option=final,
                                    busy_gpu_s=busy[job_id])
    for job_id, reason in pol.failed().items():
        records[job_id] = JobRecord(by_id[job_id], "failed", reason=reason)
    missing = [j.job_id for j in jobs if j.job_id not in records]
    if missing:  # cannot happen with an empty cluster at the end; guards the simulator itself
        raise RuntimeError(f"jobs never scheduled: {missing[:5]}")
    done = [records[j.job_id] for j in jobs if records[j.job_id].status == "done"]
    jcts = [r.jct_s for r in done]
    start0 = min(j.submit_s for j in jobs)
    makespan = max((r.end_s for r in done), default=start0) - start0
    held = sum(r.busy_gpu_s for r in done)
    span = max(makespan, now - start0)
    return ScheduleResult(
        policy=pol.name, num_devices=cluster.num_devices, records=tuple(records[j.job_id] for j in jobs),
        avg_jct_s=sum(jcts) / len(jcts) if jcts else math.nan, p99_jct_s=percentile(jcts, 99),
        makespan_s=makespan, gpu_utilization=held / (cluster.num_devices * makespan) if makespan > 0 else 0.0,
        scheduling_overhead_ms_per_job=1000.0 * decide_s / len(jobs), num_decisions=decisions,
        error_sigma=error_sigma, error_seed=error_seed, mixed=mixed,
        fragmented_share=None if options is None else frag_s / span if span > 0 else 0.0,
        fragmented_wait_s=None if options is None else frag_wait_s,
    )
