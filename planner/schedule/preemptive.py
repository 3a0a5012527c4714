"""The preemptive baselines a practitioner would pick: `srtf`, `las` (Tiresias) and `gavel`.

Each has the same option set as `gpumix` (planner/schedule/sizing.py: one-pool options and mixed
gangs, the same MIN_SHARE floor) and the same checkpoint-and-resume mechanism and cost
(`Decision(suspend=True)`; the simulator charges planner.schedule.state.restart_s; at most
MAX_PREEMPTIONS per job), and none of gpumix's own search (expected-cost sizing, gain tests,
growth). Each decision walks the waiting jobs in the policy's priority order:

1. start the job where an option fits the free devices (`pick`) without delaying the reservation;
2. else preempt running jobs of lower priority (`may_preempt`) on one pool until one of its
   one-pool options fits, the fewest devices taken back;
3. else the first such job gets the one EASY reservation (as every sized baseline).

Orders:

* `srtf` — shortest remaining predicted time first; preempts a job with more than PREEMPT_RATIO
  times the starter's predicted time left (gpumix's margin against the prediction's error).
* `las` — Tiresias' discretised least attained service (Gu et al., NSDI '19), with no duration
  knowledge: queues by attained GPU-seconds (LAS_THRESHOLDS_GPU_S), first come first served
  inside a queue; a job in a higher queue preempts one demoted to a lower queue.
* `gavel` — in the spirit of Gavel (Narayanan et al., OSDI '20): throughput-normalised. Attained
  service counts progress in seconds *on the job's own request* (an hour on faster devices counts
  for more), queued as `las`; placement prices every device type by its average normalised
  throughput over the jobs seen (`type_prices`), so each job goes where its own speed-up beats
  the average job's (its comparative advantage), among its options down to the MIN_SHARE floor.

More: docs/models/scheduling.md ("The policies").
"""
from __future__ import annotations

import math
from dataclasses import replace
from typing import Sequence

from contracts.cluster import ClusterSpec
from contracts.jobs import JobSpec
from planner.schedule.backfill import start_job
from planner.schedule.options import Pool, ResourceOption
from planner.schedule.sizing import MIN_SHARE, Need, Reservation, Sizing
from planner.schedule.state import Decision, Running, take_victims

from planner.schedule.gpumix import MAX_PREEMPTIONS, PREEMPT_RATIO  # the same bounds on every policy

# Tiresias' queues by attained service (GPU-seconds): 1, 8 and 64 GPU-hours demote a job one queue
LAS_THRESHOLDS_GPU_S = (3600.0, 8 * 3600.0, 64 * 3600.0)


def las_queue(service: float, thresholds: Sequence[float] = LAS_THRESHOLDS_GPU_S) -> int:
    """0 for the highest-priority queue; one more per threshold reached."""
    return sum(service >= t for t in thresholds)


class PreemptivePolicy:
    """Priority order, preemption of lower-priority jobs, one EASY reservation (module docstring)."""

    name = "preemptive"

    def __init__(self, cluster: ClusterSpec, dtype: str = "bf16", mixed: bool = True,
                 max_preemptions: int = MAX_PREEMPTIONS, cheap_slack: float = 1.25) -> None:
        self.cluster, self.dtype = cluster, dtype
        self.max_preemptions = max_preemptions
        self.sizing = Sizing(cluster, dtype, cheap_slack=cheap_slack, mixed=mixed)
        self._jobs: dict[str, JobSpec] = {}
        self._left: dict[str, float] = {}  # share of steps left of each suspended job
        self._preempted: dict[str, int] = {}
        self._service: dict[str, float] = {}  # attained GPU-seconds
        self._seen: dict[str, tuple[float, int]] = {}  # running job -> (when last observed, its GPUs)

    def options(self, job: JobSpec) -> list[ResourceOption]:
        return self.sizing.options(job)

    def failed(self) -> dict[str, str]:
        return self.sizing.failed()

    # --- what each policy defines ---

    def key_waiting(self, now: float, job: JobSpec) -> tuple:
        raise NotImplementedError

    def key_running(self, now: float, r: Running) -> tuple:
        raise NotImplementedError

    def may_preempt(self, now: float, starter: tuple, victim: tuple, starter_s: float, r: Running) -> bool:
        """May a job of priority key `starter`, predicted to run `starter_s`, suspend `r` (key `victim`)?"""
        return victim > starter

    def pick(self, job: JobSpec, free_n: Sequence[int], blocked) -> tuple[Need, ResourceOption] | None:
        return self.sizing.choose(job, free_n, blocked)

    # --- the shared decision ---

    def service_s(self, job_id: str) -> float:
        """Attained GPU-seconds so far (as observed at decisions)."""
        return self._service.get(job_id, 0.0)

    def _observe(self, now: float, running: Sequence[Running]) -> None:
        for r in running:
            t, n = self._seen.get(r.job_id, (now, r.num_gpus))
            self._service[r.job_id] = self._service.get(r.job_id, 0.0) + max(0.0, now - t) * n
            self._seen[r.job_id] = (now, r.num_gpus)
        live = {r.job_id for r in running}
        for job_id in [j for j in self._seen if j not in live]:
            del self._seen[job_id]

    def decide(self, now: float, waiting: Sequence[JobSpec], free: dict[Pool, int],
               running: Sequence[Running]) -> list[Decision]:
        sizing = self.sizing
        sizing.new_decision()
        for j in waiting:
            self._jobs.setdefault(j.job_id, j)
        self._observe(now, running)
        free_n = [free.get(p, 0) for p in sizing.pools]
        todo = sorted((j for j in waiting if sizing.entries(j)), key=lambda j: self.key_waiting(now, j))
        rkeys = {r.job_id: self.key_running(now, r) for r in running
                 if r.option is not None and r.job_id in self._jobs}
        gone: set[str] = set()
        out: list[Decision] = []
        started: list[Running] = []
        res = Reservation()
        for job in todo:
            left = self._left.get(job.job_id, 1.0)
            pick = self.pick(job, free_n, lambda need, o: res.blocks(need, now + left * job.steps * o.iteration_s))
            if pick is None:
                pre = self._preempt(now, job, left, free_n, running, rkeys, gone)
                if pre is not None:
                    victims, need, o = pre
                    for r in victims:
                        gone.add(r.job_id)
                        self._left[r.job_id] = r.remaining
                        self._preempted[r.job_id] = self._preempted.get(r.job_id, 0) + 1
                        out.append(Decision(self._jobs[r.job_id], r.option, suspend=True))
                        for pool, n in r.parts:
                            free_n[sizing.index[pool.device]] += n
                    pick = need, o
            if pick is None:
                if res.job_id is None:
                    res = sizing.reserve(replace(job, steps=max(1, round(left * job.steps))), free_n,
                                         [*(r for r in running if r.job_id not in gone), *started], now)
                continue
            decision, view = start_job(sizing, res, free_n, job, pick[1], pick[0], now, left)
            out.append(decision)
            started.append(view)
            self._seen[job.job_id] = (now, decision.option.num_gpus)
            self._left.pop(job.job_id, None)
        return out

    def _preempt(self, now: float, job: JobSpec, left: float, free_n: list[int], running: Sequence[Running],
                 rkeys: dict[str, tuple], gone: set[str]) -> tuple[list[Running], Need, ResourceOption] | None:
        """(jobs to suspend, what the job takes, its option) taking back the fewest devices, or None."""
        key = self.key_waiting(now, job)
        best = None
        for k, o, _ in self.sizing.entries(job):
            pool = self.sizing.pools[k]
            d = left * job.steps * o.iteration_s
            victims = sorted((r for r in running if r.job_id in rkeys and r.job_id not in gone and r.count_on(pool)
                              and self._preempted.get(r.job_id, 0) < self.max_preemptions
                              and self.may_preempt(now, key, rkeys[r.job_id], d, r)),
                             key=lambda r: rkeys[r.job_id], reverse=True)  # the lowest priority first
            chosen = take_victims(victims, free_n[k], o.num_gpus, pool)
            if chosen is None:
                continue
            taken = sum(r.num_gpus for r in chosen)
            if best is None or (taken, o.iteration_s) < best[0]:
                best = ((taken, o.iteration_s), chosen, ((k, o.num_gpus),), o)
        return None if best is None else best[1:]


class SrtfPolicy(PreemptivePolicy):
    """Shortest remaining predicted time first, preemptive."""

    name = "srtf"

    def key_waiting(self, now: float, job: JobSpec) -> tuple:
        return (-job.priority, self._left.get(job.job_id, 1.0) * self.sizing.ref_s(job), job.submit_s, job.job_id)

    def key_running(self, now: float, r: Running) -> tuple:
        job = self._jobs[r.job_id]
        return (-job.priority, r.end_s - now, job.submit_s, job.job_id)

    def may_preempt(self, now: float, starter: tuple, victim: tuple, starter_s: float, r: Running) -> bool:
        return victim > starter and r.end_s - now > PREEMPT_RATIO * starter_s


class LasPolicy(PreemptivePolicy):
    """Tiresias' discretised least attained service (GPU-seconds), no duration knowledge."""

    name = "las"

    def __init__(self, cluster: ClusterSpec, dtype: str = "bf16", mixed: bool = True,
                 thresholds: Sequence[float] = LAS_THRESHOLDS_GPU_S, **kw) -> None:
        super().__init__(cluster, dtype, mixed, **kw)
        self.thresholds = tuple(thresholds)

    def attained(self, job_id: str) -> float:
        return self.service_s(job_id)

    def queue(self, job_id: str) -> int:
        return las_queue(self.attained(job_id), self.thresholds)

    def key_waiting(self, now: float, job: JobSpec) -> tuple:
        return (-job.priority, self.queue(job.job_id), job.submit_s, job.job_id)

    def key_running(self, now: float, r: Running) -> tuple:
        job = self._jobs[r.job_id]
        return (-job.priority, self.queue(r.job_id), job.submit_s, job.job_id)

    def may_preempt(self, now: float, starter: tuple, victim: tuple, starter_s: float, r: Running) -> bool:
        return victim[:2] > starter[:2]  # a strictly lower queue (or priority class), never inside one


class GavelPolicy(LasPolicy):
    """Throughput-normalised LAS and placement by comparative advantage across types (Gavel's spirit)."""

    name = "gavel"

    def __init__(self, cluster: ClusterSpec, dtype: str = "bf16", mixed: bool = True,
                 cheap_slack: float = 1.0 / MIN_SHARE, **kw) -> None:
        # any option down to the floor every policy has (MIN_SHARE): placement is by comparative advantage
        super().__init__(cluster, dtype, mixed, cheap_slack=cheap_slack, **kw)
        self._speed: dict[str, list[float]] = {}  # per job: per pool, its normalised per-device rate
        self._sum = [0.0] * len(self.sizing.pools)
        self._running_left: dict[str, float] = {}  # share of steps left of each running job, this decision

    def _progress(self, job_id: str) -> float:
        r = self._running_left.get(job_id)
        return 1.0 - (r if r is not None else self._left.get(job_id, 1.0))

    def attained(self, job_id: str) -> float:
        """Progress in GPU-seconds of the job's own request: the share of steps done × the request's
        predicted duration × its GPU count (the same hour is worth more on faster devices)."""
        job = self._jobs.get(job_id)
        if job is None:
            return 0.0
        rate = self.sizing.request_rate(job)
        if rate <= 0:
            return self.service_s(job_id)
        req_s = job.steps * job.global_batch / rate
        return self._progress(job_id) * req_s * (job.requested_gpus or 1)

    def decide(self, now: float, waiting: Sequence[JobSpec], free: dict[Pool, int],
               running: Sequence[Running]) -> list[Decision]:
        self._running_left = {r.job_id: r.remaining for r in running}
        for j in waiting:
            self._learn(j)
        return super().decide(now, waiting, free, running)

    def _learn(self, job: JobSpec) -> None:
        """The job's per-device rate on each pool, normalised by its best: added to the type prices."""
        if job.job_id in self._speed or not self.sizing.entries(job):
            return
        rate = [0.0] * len(self.sizing.pools)
        for k, o, _ in self.sizing.entries(job):
            rate[k] = max(rate[k], o.samples_per_s / o.num_gpus)
        top = max(rate)
        self._speed[job.job_id] = [r / top for r in rate]
        for k, r in enumerate(self._speed[job.job_id]):
            self._sum[k] += r

    def type_prices(self) -> list[float]:
        """Per pool: the average job's per-device rate there, normalised by its best pool's."""
        n = max(1, len(self._speed))
        return [max(s / n, 1e-9) for s in self._sum]

    def pick(self, job: JobSpec, free_n: Sequence[int], blocked) -> tuple[Need, ResourceOption] | None:
        """Among the options that fit (within cheap_slack of the fastest, that `blocked` allows): the
        most throughput per normalised price (its rate / Σ count × type price), ties to the faster."""
        cands = self.sizing.candidates(job, free_n)
        fastest_s = min((e[1].iteration_s for e, _ in cands), default=math.inf)
        prices = self.type_prices()
        best = None
        for (_, o, _), need in cands:
            if o.iteration_s > self.sizing.cheap_slack * fastest_s or blocked(need, o):
                continue
            value = o.samples_per_s / sum(n * prices[k] for k, n in need)
            if best is None or (value, -o.iteration_s) > (best[0], -best[2].iteration_s):
                best = (value, need, o)
        return None if best is None else (best[1], best[2])
