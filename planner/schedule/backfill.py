"""EASY backfilling (Lifka 1995; Mu'alem & Feitelson 2001), the baselines a practitioner runs.

* `fifo-backfill` — the users' own requests, arrival order.
* `fifo-backfill-sized` — arrival order, each job sized by the memory model exactly as
  `frenzy` sizes it (planner/schedule/sizing.py) instead of by its user.
* `sjf` — shortest predicted job first (its fastest option's predicted duration), the same
  sizing, the same backfilling.

Every sized policy's options include mixed gangs (planner/schedule/sizing.py) unless `mixed` is off.

Each decision walks the queue in order and starts every job that fits. The first job that
does not fit gets the one reservation: the option that can start (and so finish) earliest as
running jobs end at their predicted times, counting the jobs started in this same pass. A
later job starts on the reserved pool only if it is predicted to end before the reservation
or uses only devices the reserved job leaves spare; other pools are not held back.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Callable, Sequence

from contracts.cluster import ClusterSpec
from contracts.jobs import JobSpec
from planner.schedule.options import Pool
from planner.schedule.sizing import Reservation, Sizing
from planner.schedule.state import Decision, Running

ORDERS = ("arrival", "sjf")


class BackfillPolicy:
    def __init__(self, cluster: ClusterSpec, dtype: str = "bf16", order: str = "arrival",
                 user_requests: bool = False, name: str | None = None, mixed: bool = True) -> None:
        if order not in ORDERS:
            raise ValueError(f"order must be one of {', '.join(ORDERS)}, got {order!r}")
        self.order = order
        self.sizing = Sizing(cluster, dtype, user_requests=user_requests, mixed=mixed)
        self.name = name or ("sjf" if order == "sjf" else "fifo-backfill" if user_requests else "fifo-backfill-sized")
        self.reservation = Reservation()  # the last pass's

    def failed(self) -> dict[str, str]:
        return self.sizing.failed()

    def _key(self, job: JobSpec) -> tuple:
        if self.order == "sjf":
            return (-job.priority, self.sizing.ref_s(job), job.submit_s, job.job_id)
        return (-job.priority, job.submit_s, job.job_id)

    def decide(self, now: float, waiting: Sequence[JobSpec], free: dict[Pool, int],
               running: Sequence[Running]) -> list[Decision]:
        self.sizing.new_decision()
        todo = sorted((j for j in waiting if self.sizing.entries(j)), key=self._key)
        out, self.reservation = easy_pass(self.sizing, now, todo, free, running)
        return out


def running_view(sizing: Sizing, job_id: str, o, need, end_s: float, remaining: float = 1.0) -> Running:
    """A job started in this pass as the running jobs are seen (its parts by pool)."""
    mix = tuple((sizing.pools[k], n) for k, n in need) if o.mix else ()
    return Running(job_id, sizing.pools[need[0][0]], o.num_gpus, end_s, o, remaining, mix)


def start_job(sizing: Sizing, res: Reservation, free_n: list[int], job: JobSpec, o, need, now: float,
              left: float = 1.0) -> tuple[Decision, Running]:
    """Start `job` (`left` of its steps still to run) on option `o` taking `need`: the devices leave
    `free_n`, the reservation counts them until the job's predicted end; its decision and its view
    as a running job."""
    o = replace(o, duration_s=o.iteration_s * job.steps)
    end_s = now + left * o.duration_s
    sizing.take(free_n, need)
    res.take(need, end_s)
    return Decision(job, o), running_view(sizing, job.job_id, o, need, end_s, left)


def easy_pass(sizing: Sizing, now: float, todo: Sequence[JobSpec], free: dict[Pool, int],
              running: Sequence[Running], may_reserve: Callable[[JobSpec], bool] = lambda job: True,
              count_started: bool = True) -> tuple[list[Decision], Reservation]:
    """One EASY pass over `todo` in its order: start each job that fits without delaying the
    reservation; the first job that cannot start and `may_reserve` gets it, computed from the
    running jobs' predicted ends (and those started in this pass when `count_started`)."""
    free_n = [free.get(p, 0) for p in sizing.pools]  # by pool index: no hashing in the loop
    out: list[Decision] = []
    started: list[Running] = []
    res = Reservation()
    for job in todo:
        if not any(free_n):
            break
        pick = sizing.choose(job, free_n, lambda need, o: res.blocks(need, now + job.steps * o.iteration_s))
        if pick is not None:
            decision, view = start_job(sizing, res, free_n, job, pick[1], pick[0], now)
            out.append(decision)
            if count_started:
                started.append(view)
        elif res.job_id is None and may_reserve(job):
            res = sizing.reserve(job, free_n, [*running, *started], now)
    return out, res
