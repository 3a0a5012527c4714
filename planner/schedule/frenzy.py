"""`frenzy`: the reproduction of Frenzy's HAS (arXiv 2412.14479) over MARP's options.

Users give only model, batch and steps. Each decision: order the waiting jobs by highest
response ratio `(wait + d) / d` (short jobs first, and every waiting job's ratio grows, so
none starves); give each the option planner/schedule/sizing.py picks among those that fit the
free devices; the oldest waiting job is tried first and, if it cannot start, gets a
reservation on the pool where it can start earliest; the others only backfill around it
(EASY backfilling), so a large job is never overtaken forever.
"""
from __future__ import annotations

from typing import Sequence

from contracts.cluster import ClusterSpec
from contracts.jobs import JobSpec
from planner.schedule.options import Pool, ResourceOption
from planner.schedule.backfill import easy_pass
from planner.schedule.sizing import Sizing
from planner.schedule.state import Decision, Running

MAX_ITERATION_S = 86_400.0  # a job whose every step takes over a day on the whole pool is refused


class FrenzyPolicy:
    name = "frenzy"

    def __init__(self, cluster: ClusterSpec, dtype: str = "bf16", cheap_slack: float = 1.25,
                 min_efficiency: float = 0.7, reserve_after_s: float = 0.0, order: str = "hrrn",
                 user_requests: bool = False, mixed: bool = False) -> None:
        if order not in ("hrrn", "arrival"):
            raise ValueError(f"order must be 'hrrn' or 'arrival', got {order!r}")
        self.cluster, self.dtype = cluster, dtype
        self.reserve_after_s, self.order = reserve_after_s, order
        # user_requests: ablation, frenzy's queueing (order, reservation, backfill) over the users' own requests.
        # mixed: offer mixed-type gangs; off by default because executor/orchestrator.py (which builds this
        # policy) launches one pool per job; the simulator turns it on (simulate.POLICY_TABLE)
        self.sizing = Sizing(cluster, dtype, cheap_slack, min_efficiency, user_requests, mixed=mixed)

    def options(self, job: JobSpec) -> list[ResourceOption]:
        """The job's usable options (planner/schedule/sizing.py)."""
        return self.sizing.options(job)

    def failed(self) -> dict[str, str]:
        return self.sizing.failed()

    def _rank(self, now: float, job: JobSpec) -> tuple:
        if self.order == "arrival":  # ablation: GPUMix's sizing and backfilling, first-come order
            return (-job.priority, job.submit_s, job.job_id)
        ref = self.sizing.ref_s(job)
        return (-job.priority, -(now - job.submit_s + ref) / ref, job.submit_s)

    def decide(self, now: float, waiting: Sequence[JobSpec], free: dict[Pool, int],
               running: Sequence[Running]) -> list[Decision]:
        sizing = self.sizing
        sizing.new_decision()
        todo = [j for j in waiting if sizing.entries(j)]
        todo.sort(key=lambda j: self._rank(now, j))
        # The oldest job goes first; if it cannot start it holds the one reservation (EASY).
        head = min(todo, key=lambda j: (j.submit_s, j.job_id), default=None)
        if head is not None and now - head.submit_s >= self.reserve_after_s:
            todo.remove(head)
            todo.insert(0, head)
        else:
            head = None
        # the paper's reservation: from the running jobs only, for the oldest job only
        return easy_pass(sizing, now, todo, free, running, lambda job: job is head, count_started=False)[0]


def check_runnable(job: JobSpec, cluster: ClusterSpec, dtype: str = "fp32") -> ResourceOption:
    """The fastest option this policy would consider for `job` on `cluster` (MARP's options);
    ValueError with the reason when no device set of the pool can run it: it fits in memory nowhere,
    or even its fastest option takes more than MAX_ITERATION_S per optimizer step (a batch no pool of
    this size trains: no step, no checkpoint for a day). How the job queue refuses a job at submit."""
    options = FrenzyPolicy(cluster, dtype).options(job)
    if not options:
        raise ValueError(f"{job.model} at global batch {job.global_batch}, seq {job.seq} fits in memory on no "
                         f"device set of {cluster.name} ({cluster.num_devices} devices: "
                         f"{', '.join(sorted({d.label for _, d in cluster.devices()}))}): nothing queued")
    best = min(options, key=lambda o: o.iteration_s)
    if best.iteration_s > MAX_ITERATION_S:
        raise ValueError(f"{job.model} at global batch {job.global_batch}: one step takes {best.iteration_s:,.0f} s "
                         f"(predicted) even on {best.num_gpus} {best.pool.label} device(s) of {cluster.name}, "
                         f"over the {MAX_ITERATION_S:,.0f} s limit: use a smaller global batch; nothing queued")
    return best
