"""`fifo`: the team without GPUMix — first come first served on each user's own request.

Each job gets exactly its user's request (type, count) when that many are free; the head of
the queue blocks everyone behind it. A request that does not fit in memory on the asked-for
count would crash with OOM; the user then asks for more of the same type — we charge nothing
for the failed attempt and run it at the smallest count of that type that fits
(`request_adjusted`), which favours the baseline. A request that cannot fit at any count of
its type fails (`status == "failed"`, left out of JCT). On its devices a fifo job gets the
same best configuration (ZeRO, recomputation, micro-batch) the memory model finds, so the
difference measured is the placement.
"""
from __future__ import annotations

from typing import Sequence

from contracts.cluster import ClusterSpec
from contracts.jobs import JobSpec
from planner.schedule.options import Pool, ResourceOption, candidate_counts, cluster_pools, estimate_option
from planner.schedule.state import Decision, Running


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
