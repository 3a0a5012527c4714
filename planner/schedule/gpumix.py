"""`gpumix`: GPUMix's own scheduling policy — shortest remaining predicted work first with
aging, moldable sizing by expected cost to the mean JCT, EASY backfilling, and elastic jobs:
preemption and growth through checkpoint and resume.

Each decision: (1) order the waiting jobs by predicted remaining work aged by their wait (a job
waiting `starve_after_s` goes first); (2) start each on the option of the Pareto front
(planner/schedule/options.py) of least expected cost to the mean JCT (`_cost`); (3) give the first
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
from planner.schedule.options import Pool, ResourceOption
from planner.schedule.sizing import Reservation, Sizing
from planner.schedule.state import ERROR_SIGMA, Decision, Running, checkpoint_save_s, restart_s

AGING_S = 6 * 3600.0  # a job that waited this long ranks as if it had half its work left
STARVE_AFTER_S = 24 * 3600.0  # a job that waited this long goes ahead of every other, oldest first
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
                 starve_after_s: float = STARVE_AFTER_S, whole_pools: bool = True, grow_top: int = GROW_TOP,
                 grow_gain: float = GROW_GAIN, max_grows: int = MAX_GROWS) -> None:
        self.cluster, self.dtype = cluster, dtype
        self.aging_s, self.preempt_gain, self.preempt_ratio = aging_s, preempt_gain, preempt_ratio
        self.max_preemptions, self.starve_after_s = max_preemptions, starve_after_s
        self.grow_top, self.grow_gain, self.max_grows = grow_top, grow_gain, max_grows
        self._grown: dict[str, int] = {}
        self.queue_weight, self.arrival_weight = queue_weight, arrival_weight
        # every Pareto option (min_efficiency 0): the expected-cost rule of _choose sizes the jobs
        self.sizing = Sizing(cluster, dtype, min_efficiency=min_efficiency, whole_pools=whole_pools)
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

    def _key(self, now: float, job: JobSpec) -> tuple:
        wait_s = now - job.submit_s
        if wait_s >= self.starve_after_s:  # waited too long: first come first served, ahead of the rest
            return (-job.priority, 0, job.submit_s, job.job_id)
        return (-job.priority, 1, self._work_s(job) / (1.0 + wait_s / self.aging_s), job.job_id)

    def decide(self, now: float, waiting: Sequence[JobSpec], free: dict[Pool, int],
               running: Sequence[Running]) -> list[Decision]:
        sizing = self.sizing
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
            pick = self._choose(job, left, free_n, lambda k, o: res.blocks(k, now + left * job.steps * o.iteration_s,
                                                                           o.num_gpus), len(todo) - i - 1, rate)
            if pick is not None:
                k, o = pick
                o = replace(o, duration_s=o.iteration_s * job.steps)
                free_n[k] -= o.num_gpus
                res.take(k, now + left * o.duration_s, o.num_gpus)
                out.append(Decision(job, o))
                started.append(Running(job.job_id, sizing.pools[k], o.num_gpus, now + left * o.duration_s, o, left))
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
                        free_n[k] += r.num_gpus
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
        to a faster option (checkpoint and resume) where its expected cost (`_cost`, the restart
        included) falls by more than `grow_gain` restarts."""
        out = []
        longest = sorted((r for r in running if r.option is not None and r.job_id in self._jobs
                          and self._grown.get(r.job_id, 0) < self.max_grows),
                         key=lambda r: r.end_s, reverse=True)[:self.grow_top]
        for r in longest:
            job = self._jobs[r.job_id]
            restart = restart_s(job)
            mine = self.sizing.index[r.pool.device]
            now_cost = self._cost(r.end_s - now, self.sizing.entry(r.option)[2], 0, rate)
            best = None
            for k, o, price in self.sizing.entries(job):
                have = free_n[k] + (r.num_gpus if k == mine else 0)
                if have < o.num_gpus or o.num_gpus <= (r.num_gpus if k == mine else 0) \
                        or o.iteration_s >= r.option.iteration_s:
                    continue  # a move must be predicted faster and, on its own pool, take more devices
                new_s = r.remaining * job.steps * o.iteration_s
                if new_s * GROW_SPEEDUP > r.end_s - now:
                    continue  # not faster by more than the prediction's error
                new_cost = self._cost(new_s + restart, price, 0, rate)
                if now_cost - new_cost > self.grow_gain * restart and (best is None or new_cost < best[0]):
                    best = (new_cost, k, o)
            if best is None:
                continue
            _, k, o = best
            free_n[mine] += r.num_gpus
            free_n[k] -= o.num_gpus
            self._grown[r.job_id] = self._grown.get(r.job_id, 0) + 1
            out.append(Decision(job, replace(o, duration_s=o.iteration_s * job.steps), resize=True))
        return out

    def _choose(self, job: JobSpec, left: float, free_n: list[int], blocked, queued: int,
                rate: float) -> tuple[int, ResourceOption] | None:
        """The option that fits now (and that `blocked` allows) with the least expected cost to the
        mean JCT (`_cost`): queued jobs behind it, arrivals while it runs."""
        best = None
        for k, o, price in self.sizing.entries(job):
            if free_n[k] < o.num_gpus or blocked(k, o):
                continue
            cost = self._cost(left * job.steps * o.iteration_s, price, queued, rate)
            if best is None or cost < best[0]:
                best = (cost, k, o)
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
            victims = sorted((r for r in running if r.pool == pool and r.option is not None
                              and self._preempted.get(r.job_id, 0) < self.max_preemptions
                              and r.job_id in self._jobs
                              and r.end_s - now > self.preempt_ratio * d),
                             key=lambda r: -(r.end_s - now))
            chosen, have = [], free_n[k]
            for r in victims:
                if have >= o.num_gpus:
                    break
                chosen.append(r)
                have += r.num_gpus
            if have < o.num_gpus or not chosen:
                continue
            # the victims wait out the starter and their restarts; the starter, their checkpoints' save
            save_s = max(checkpoint_save_s(self._jobs[r.job_id]) for r in chosen)
            delay = sum(d + save_s + restart_s(self._jobs[r.job_id]) for r in chosen)
            gain = wait_s - save_s - self.preempt_gain * delay
            if gain > 0 and (best is None or gain > best[0]):
                best = (gain, chosen, k, o)
        return None if best is None else best[1:]

