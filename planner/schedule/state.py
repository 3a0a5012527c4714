"""What every scheduling policy shares: the orchestrator's device ledger and the decision types.

* `ClusterState` — which job holds each device. Allocating a held device raises (no double
  booking, ever).
* `Running` — a running job as a policy sees it (its pool or, for a mixed gang, its parts, its
  count, its *predicted* end).
* `Decision` — start (or resume) a waiting job on an option, move a running job to another
  option through checkpoint and resume (`resize`), or checkpoint it and put it back in the
  queue (`suspend`, preemption).
* `Policy` — what the simulator (planner/schedule/simulate.py) and the orchestrator ask.
* `ERROR_SIGMA`, `restart_s` — what every policy may know of the cost model's error and of a
  checkpoint-and-resume's cost (the simulator charges the same).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence

from contracts.cluster import ClusterSpec
from contracts.jobs import JobSpec
from planner.schedule.options import Pool, ResourceOption, cluster_pools


# The cost model's measured error on step time, as a lognormal sigma (log of measured/predicted).
# bench/profile_report.py --quick on this machine (2026-12-01): the estimate path for a model
# that was not profiled (calibrated on another) is off by 1.24-1.33x (ln 0.21-0.28); profiled
# fits are within 0.97-1.12x of the medians. Every GPU type of the simulated clusters is
# estimated from the catalog, never profiled here, so the estimate path's error applies:
# sigma = 0.25 (68 % of jobs within x/÷ 1.28, 5 % beyond x/÷ 1.65; the unprofiled A6000/L4
# ratio once measured off by 2.1x sits at three sigma).
ERROR_SIGMA = 0.25

# Checkpoint and resume of a resized job: the whole training state (16 bytes/parameter, mixed-
# precision Adam) written then read at CHECKPOINT_GBPS (a parallel file system's aggregate
# per job, GB/s), plus RESTART_FIXED_S for launch, rendezvous, NCCL set-up and the first slow
# steps. gpt2: ~31 s; llama2-13b: ~140 s.
RESTART_FIXED_S = 30.0
CHECKPOINT_GBPS = 4.0
STATE_BYTES_PER_PARAM = 16


def checkpoint_save_s(job: JobSpec) -> float:
    """Writing the job's whole training state (reading it back takes as long)."""
    return STATE_BYTES_PER_PARAM * job.spec.num_params / (CHECKPOINT_GBPS * 1e9)


def restart_s(job: JobSpec) -> float:
    """Checkpoint and resume: save + load + launch and warm-up."""
    return RESTART_FIXED_S + 2 * checkpoint_save_s(job)


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

    def held_by(self, job_id: str) -> tuple[int, ...]:
        return self._held.get(job_id, ())

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
    """A running job as a policy sees it: which pool, how many, predicted end (never before now:
    a job past its prediction is expected to end any moment)."""

    job_id: str
    pool: Pool
    num_gpus: int
    end_s: float
    option: ResourceOption | None = None  # what it runs (None where the caller does not know)
    remaining: float = 1.0  # share of its steps still to run, as observed
    mix: tuple[tuple[Pool, int], ...] = ()  # a mixed gang's parts (pool, count); empty: `num_gpus` of `pool`

    @property
    def parts(self) -> tuple[tuple[Pool, int], ...]:
        """(pool, count) of every part it holds."""
        return self.mix or ((self.pool, self.num_gpus),)

    def count_on(self, pool: Pool) -> int:
        """How many of `pool`'s devices it holds."""
        return sum(n for p, n in self.parts if p == pool)


def take_victims(victims: Sequence[Running], free: int, need: int, pool: Pool) -> list[Running] | None:
    """The running jobs to suspend, in `victims`' order, until `free` and what they hold on `pool`
    reach `need` devices; None where all of them would not, or where none is needed."""
    chosen, have = [], free
    for r in victims:
        if have >= need:
            break
        chosen.append(r)
        have += r.count_on(pool)
    return chosen if have >= need and chosen else None


@dataclass(frozen=True)
class Decision:
    job: JobSpec
    option: ResourceOption
    request_adjusted: bool = False
    resize: bool = False  # the job is running: checkpoint it, then resume on `option`
    suspend: bool = False  # the job is running: checkpoint it and put it back in the queue


class Policy(Protocol):
    name: str

    def decide(self, now: float, waiting: Sequence[JobSpec], free: dict[Pool, int],
               running: Sequence[Running]) -> list[Decision]: ...

    def failed(self) -> dict[str, str]: ...
