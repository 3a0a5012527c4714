"""`gpumix`: GPUMix's own scheduling policy — shortest remaining predicted work first with
aging, moldable sizing by expected cost to the mean JCT, EASY backfilling, and elastic jobs:
preemption and growth through checkpoint and resume.

Each decision: (1) order the waiting jobs by predicted remaining work aged by their wait; a job
whose predicted slowdown so far reaches `slowdown_bound` goes ahead, the highest slowdown first
(bounded slowdown: under overload the short jobs, whose slowdown grows fastest, still go first —
never a first-come-first-served collapse); (2) start each on the option of the Pareto front
(planner/schedule/options.py), mixed gangs included (planner/schedule/mixed.py), of least
expected cost to the mean JCT (`_cost`); (3) give the first
job that cannot start the one EASY reservation; (4) preempt jobs with far more work left that hold
its devices when the wait saved exceeds their restart cost (at most `max_preemptions` times each);
(5) when nobody waits, grow the longest running jobs onto faster options. Every figure it decides on
is predicted; the simulator runs the perturbed durations.

Each step and its parameters: docs/models/scheduling.md ("GPUMix's policy").
"""
from __future__ import annotations

import math
from dataclasses import replace
from typing import Sequence

from contracts.cluster import ClusterSpec
from contracts.jobs import JobSpec
from planner.schedule.backfill import start_job
from planner.schedule.options import Pool, ResourceOption
from planner.schedule.sizing import Reservation, Sizing
from planner.schedule.state import ERROR_SIGMA, Decision, Running, checkpoint_save_s, restart_s, take_victims

AGING_S = 6 * 3600.0  # a job that waited this long ranks as if it had half its work left
# Bounded slowdown: a job whose predicted slowdown if it started now, (wait + work left) / its whole
# work (at least SLOWDOWN_FLOOR_S), reaches SLOWDOWN_BOUND goes ahead of the others, the highest
# slowdown first. Its wait is so bounded in proportion to its own length: a 10-minute job waits
# about an hour and a half at most for its turn, a 100-hour one ~30 days, not a fixed day for all
# (the rule it replaces, "a job waiting 24 h goes first, oldest first", became FIFO under overload).
SLOWDOWN_BOUND = 10.0
SLOWDOWN_FLOOR_S = 600.0  # the ITP traces' shortest job: shorter ones count as this long
# Preempt when the predicted sum of JCTs falls: the wait saved exceeds the delay put on the
# preempted jobs (PREEMPT_GAIN 1); only jobs with at least twice the starter's work left
# (shortest remaining work first, with a margin for the prediction's error), each at most
# MAX_PREEMPTIONS times (so a long job's delay stays bounded: p99 and makespan).
PREEMPT_GAIN = 1.0
PREEMPT_RATIO = 2.0
MAX_PREEMPTIONS = 4
GROW_TOP = 8  # the running jobs with the most predicted time left that may grow, per decision
GROW_GAIN = 3.0  # a growth must save this many restart costs ...
# ... and be predicted faster by one sigma of the ratio of two independent prediction errors
# (the job's error on the new option is a new draw): exp(0.25 × √2) = 1.42
GROW_SPEEDUP = math.exp(ERROR_SIGMA * math.sqrt(2.0))
MAX_GROWS = 2  # per job
RATE_WINDOW_S = 3600.0  # the arrival rate is never judged on less than an hour


class GpumixPolicy:
    name = "gpumix"

    def __init__(self, cluster: ClusterSpec, dtype: str = "bf16", aging_s: float = AGING_S,
                 preempt_gain: float = PREEMPT_GAIN, preempt_ratio: float = PREEMPT_RATIO,
                 max_preemptions: int = MAX_PREEMPTIONS, queue_weight: float = 1.0,
                 arrival_weight: float = 3.0, min_efficiency: float = 0.0,
                 slowdown_bound: float = SLOWDOWN_BOUND, whole_pools: bool = True, grow_top: int = GROW_TOP,
                 grow_gain: float = GROW_GAIN, max_grows: int = MAX_GROWS, mixed: bool = True) -> None:
        self.cluster, self.dtype = cluster, dtype
        self.aging_s, self.preempt_gain, self.preempt_ratio = aging_s, preempt_gain, preempt_ratio
        self.max_preemptions, self.slowdown_bound = max_preemptions, slowdown_bound
        self.grow_top, self.grow_gain, self.max_grows = grow_top, grow_gain, max_grows
        self._grown: dict[str, int] = {}
        self.queue_weight, self.arrival_weight = queue_weight, arrival_weight
        # every Pareto option (min_efficiency 0): the expected-cost rule of _choose sizes the jobs
        self.sizing = Sizing(cluster, dtype, min_efficiency=min_efficiency, whole_pools=whole_pools, mixed=mixed)
        self.total_price = sum(self.sizing.entry_price(p, p.count) for p in self.sizing.pools)
        self._first_s = math.inf
        self._left: dict[str, float] = {}  # share of steps left of each suspended job
        self._preempted: dict[str, int] = {}
        self._jobs: dict[str, JobSpec] = {}  # every job seen

    def options(self, job: JobSpec) -> list[ResourceOption]:
        return self.sizing.options(job)

    def failed(self) -> dict[str, str]:
        return self.sizing.failed()

    def _work_s(self, job: JobSpec) -> float:
        return self._left.get(job.job_id, 1.0) * self.sizing.ref_s(job)

    def slowdown(self, now: float, job: JobSpec) -> float:
        """Predicted slowdown if it started now: (wait so far + work left) / its whole work."""
        return (now - job.submit_s + self._work_s(job)) / max(self.sizing.ref_s(job), SLOWDOWN_FLOOR_S)

    def _key(self, now: float, job: JobSpec) -> tuple:
        slowdown = self.slowdown(now, job)
        if slowdown >= self.slowdown_bound:  # waited too long for its length: ahead, worst slowdown first
            return (-job.priority, 0, -slowdown, job.job_id)
        return (-job.priority, 1, self._work_s(job) / (1.0 + (now - job.submit_s) / self.aging_s), job.job_id)

    def decide(self, now: float, waiting: Sequence[JobSpec], free: dict[Pool, int],
               running: Sequence[Running]) -> list[Decision]:
        sizing = self.sizing
        sizing.new_decision()
        free_n = [free.get(p, 0) for p in sizing.pools]
        for j in waiting:
            if j.job_id not in self._jobs:
                self._jobs[j.job_id] = j
                self._first_s = min(self._first_s, j.submit_s)
        rate = len(self._jobs) / max(now - self._first_s, RATE_WINDOW_S)  # arrivals per second so far
        # an arrival is delayed only if it finds the cluster full: weigh arrivals by the share of the
        # cluster's peak FLOP/s held now (an idle cluster gives each job its fastest option)
        busy = sum(sizing.entry(r.option)[2] for r in running if r.option is not None) / self.total_price
        rate *= min(1.0, busy)
        todo = sorted((j for j in waiting if sizing.entries(j)), key=lambda j: self._key(now, j))
        out: list[Decision] = []
        started: list[Running] = []
        res, head = Reservation(), None
        for i, job in enumerate(todo):
            if not any(free_n) and head is not None:
                break
            left = self._left.get(job.job_id, 1.0)
            pick = self._choose(job, left, free_n, lambda need, o: res.blocks(need, now + left * job.steps * o.iteration_s),
                                len(todo) - i - 1, rate)
            if pick is not None:
                decision, view = start_job(sizing, res, free_n, job, pick[1], pick[0], now, left)
                out.append(decision)
                started.append(view)
                self._left.pop(job.job_id, None)
            elif head is None:
                head = job
                res = sizing.reserve(replace(job, steps=max(1, round(left * job.steps))), free_n,
                                     [*running, *started], now)
                preempt = self._preempt(now, job, free_n, running, res.start_s)
                if preempt is not None:
                    victims, k, o = preempt
                    for r in victims:
                        self._left[r.job_id] = r.remaining
                        self._preempted[r.job_id] = self._preempted.get(r.job_id, 0) + 1
                        out.append(Decision(self._jobs[r.job_id], r.option, suspend=True))
                        for pool, n in r.parts:
                            free_n[sizing.index[pool.device]] += n
                    o = replace(o, duration_s=o.iteration_s * job.steps)
                    free_n[k] -= o.num_gpus
                    out.append(Decision(job, o))
                    self._left.pop(job.job_id, None)
                    res = Reservation(job_id=job.job_id)  # the head started: nothing held back
        if self.grow_top and head is None and any(free_n):
            out += self._grow(now, free_n, running, rate)
        return out

    def _cost(self, t: float, price: float, queued: float, rate: float) -> float:
        """Expected cost to the mean JCT of holding `price` for t seconds: t itself plus the delay on
        the jobs queued behind and those expected to arrive meanwhile (`rate` × t: the arrival rate
        so far weighed by how busy the cluster is), each delayed in proportion to the share of the
        cluster's peak FLOP/s held."""
        behind = self.queue_weight * queued + self.arrival_weight * rate * t
        return t * (1.0 + behind * price / self.total_price)

    def _grow(self, now: float, free_n: list[int], running: Sequence[Running], rate: float) -> list[Decision]:
        """Nobody waits and devices idle: move the running jobs with the most predicted time left
        to a faster option, one pool or a mixed gang (checkpoint and resume), where its expected cost
        (`_cost`, the restart included) falls by more than `grow_gain` restarts."""
        out = []
        longest = sorted((r for r in running if r.option is not None and r.job_id in self._jobs
                          and self._grown.get(r.job_id, 0) < self.max_grows),
                         key=lambda r: r.end_s, reverse=True)[:self.grow_top]
        for r in longest:
            job = self._jobs[r.job_id]
            restart = restart_s(job)
            held = [(self.sizing.index[p.device], n) for p, n in r.parts]
            self.sizing.give(free_n, held)  # what it could move to: the free devices and its own
            now_cost = self._cost(r.end_s - now, self.sizing.entry(r.option)[2], 0, rate)
            best = None
            for (k, o, price), need in self.sizing.candidates(job, free_n):
                if o.iteration_s >= r.option.iteration_s or all(n <= dict(held).get(q, 0) for q, n in need):
                    continue  # a move must be predicted faster and take devices it does not hold
                new_s = r.remaining * job.steps * o.iteration_s
                if new_s * GROW_SPEEDUP > r.end_s - now:
                    continue  # not faster by more than the prediction's error
                new_cost = self._cost(new_s + restart, price, 0, rate)
                if now_cost - new_cost > self.grow_gain * restart and (best is None or new_cost < best[0]):
                    best = (new_cost, need, o)
            if best is None:
                self.sizing.take(free_n, held)
                continue
            _, need, o = best
            self.sizing.take(free_n, need)
            self._grown[r.job_id] = self._grown.get(r.job_id, 0) + 1
            out.append(Decision(job, replace(o, duration_s=o.iteration_s * job.steps), resize=True))
        return out

    def _choose(self, job: JobSpec, left: float, free_n: list[int], blocked, queued: int,
                rate: float) -> tuple[tuple, ResourceOption] | None:
        """The option that fits now (one pool or a mixed gang, and that `blocked` allows) with the least
        expected cost to the mean JCT (`_cost`): queued jobs behind it, arrivals while it runs.
        Returns (what it takes, the option of one step)."""
        best = None
        for (k, o, price), need in self.sizing.candidates(job, free_n):
            if blocked(need, o):
                continue
            cost = self._cost(left * job.steps * o.iteration_s, price, queued, rate)
            if best is None or cost < best[0]:
                best = (cost, need, o)
        return None if best is None else best[1:]

    def _preempt(self, now: float, job: JobSpec, free_n: list[int], running: Sequence[Running],
                 reserved_s: float) -> tuple[list[Running], int, ResourceOption] | None:
        """(jobs to suspend, pool index, option) that let `job` start now, or None."""
        left = self._left.get(job.job_id, 1.0)
        wait_s = reserved_s - now
        best = None
        for k, o, _ in self.sizing.entries(job):
            d = left * job.steps * o.iteration_s + restart_s(job) * (job.job_id in self._preempted)
            if wait_s <= self.preempt_gain * d:
                continue  # not worth the trouble even with no one delayed
            pool = self.sizing.pools[k]
            victims = sorted((r for r in running if r.option is not None and r.count_on(pool)
                              and self._preempted.get(r.job_id, 0) < self.max_preemptions
                              and r.job_id in self._jobs
                              and r.end_s - now > self.preempt_ratio * d),
                             key=lambda r: -(r.end_s - now))
            chosen = take_victims(victims, free_n[k], o.num_gpus, pool)
            if chosen is None:
                continue
            # the victims wait out the starter and their restarts; the starter, their checkpoints' save
            save_s = max(checkpoint_save_s(self._jobs[r.job_id]) for r in chosen)
            delay = sum(d + save_s + restart_s(self._jobs[r.job_id]) for r in chosen)
            gain = wait_s - save_s - self.preempt_gain * delay
            if gain > 0 and (best is None or gain > best[0]):
                best = (gain, chosen, k, o)
        return None if best is None else best[1:]

