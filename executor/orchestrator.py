"""The local orchestrator: queued jobs -> devices of this machine -> real runs.

One pass (`tick`):
1. poll every running job's run store (executor.store.read_metrics by its run folder);
   a run that ended marks the job done or failed and frees its devices. The queue row
   holds the run folder and launcher pid, so a restarted orchestrator (or app) picks
   the runs up again: that is all re-attaching takes.
2. rebuild the orchestrator state (planner.schedule.simulate.ClusterState) from the running
   jobs — two jobs on one device raise at once;
3. ask the same `frenzy` policy the simulator uses (planner.schedule.simulate.FrenzyPolicy over
   MARP's options on the local cluster) which queued jobs start on which devices;
4. for each: the heterogeneous planner's plan on exactly those devices
   (planner.hetero.solve.solve_plan on the sub-cluster) — or, when devices of other types
   would otherwise idle this pass, a mixed-type plan over both if it is predicted
   clearly faster — then executor.launch.start_run.
A launch that fails marks the job failed with the reason and frees its devices.

`run_forever(poll_s)` repeats `tick`. Only one pass runs at a time per queue (a file
lock beside the database), so the dashboard and the CLI can both drive it.
"""
from __future__ import annotations

import fcntl
import logging
import os
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable, Iterator

from executor import booking
from executor.queue import JobQueue, QueuedJob
from planner.core.cluster import ClusterSpec, NodeSpec
from planner.core.jobs import JobSpec
from planner.schedule.options import ResourceOption
from planner.core.paths import runs_dir
from planner.schedule.simulate import ClusterState, FrenzyPolicy, Running

log = logging.getLogger(__name__)

LOCAL_DTYPE = "fp32"  # CPU workers train in fp32 (gloo); a GPU cluster file may ask for bf16
PLAN_TIME_LIMIT_S = 10.0
MIXED_GAIN = 0.9  # take idle devices of other types only for a predicted >= 10 % shorter iteration
BOOKED_ELSEWHERE = "booked by another run"  # the ClusterState owner of devices the ledger gives to others
MAX_ITERATION_S = 86_400.0  # a job whose every step takes over a day on the whole pool is refused at submit


@dataclass
class TickReport:
    """What one pass changed."""

    started: list[int] = field(default_factory=list)
    finished: list[tuple[int, str]] = field(default_factory=list)  # (job id, final state)
    skipped: bool = False  # another pass held the lock

    def to_dict(self) -> dict:
        return {"started": self.started, "finished": [{"id": i, "state": s} for i, s in self.finished],
                "skipped": self.skipped}


def sub_cluster(cluster: ClusterSpec, devices: tuple[int, ...], name: str) -> ClusterSpec:
    """The devices `devices` of `cluster` as a cluster of their own (same nodes, same order)."""
    chosen = set(devices)
    nodes, i = [], 0
    for node in cluster.nodes:
        keep = tuple(d for k, d in enumerate(node.devices, start=i) if k in chosen)
        i += len(node.devices)
        if keep:
            nodes.append(NodeSpec(node.name, node.datacenter, keep))
    return ClusterSpec(name, tuple(nodes), cluster.network)


def check_runnable(job: JobSpec, cluster: ClusterSpec, dtype: str = LOCAL_DTYPE) -> ResourceOption:
    """The fastest option the scheduler would consider for `job` on `cluster` (the `frenzy` policy's
    options over MARP's memory model); ValueError with the reason when no device set of the pool can
    run it: it fits in memory nowhere, or even its fastest option takes more than MAX_ITERATION_S
    per optimizer step (a batch no pool of this size trains: no step, no checkpoint for a day)."""
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


def local_cluster() -> ClusterSpec:
    """This machine as the orchestrator's pool (the profiler's inventory)."""
    from profiler.inventory import build_local_cluster

    return build_local_cluster()


class Orchestrator:
    def __init__(self, queue: JobQueue | None = None, cluster: ClusterSpec | None = None,
                 dtype: str = LOCAL_DTYPE, start: Callable | None = None, read: Callable | None = None) -> None:
        self.queue = queue or JobQueue()
        self.cluster = cluster or local_cluster()
        self.dtype = dtype
        self._start = start  # executor.launch.start_run unless given (tests)
        self._read = read  # executor.store.read_metrics unless given

    @contextmanager
    def _lock(self) -> Iterator[bool]:
        with open(self.queue.path + ".lock", "a") as fh:
            try:
                fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                yield False
                return
            try:
                yield True
            finally:
                fcntl.flock(fh, fcntl.LOCK_UN)

    def tick(self) -> TickReport:
        report = TickReport()
        with self._lock() as mine:
            if not mine:
                report.skipped = True
                return report
            running = self._poll_running(report)
            self._start_queued(running, report)
        return report

    def run_forever(self, poll_s: float = 2.0, max_ticks: int | None = None,
                    should_stop: Callable[[], bool] = lambda: False) -> None:
        n = 0
        while not should_stop() and (max_ticks is None or n < max_ticks):
            report = self.tick()
            if report.started or report.finished:
                log.info("orchestrator: %s", report.to_dict())
            n += 1
            time.sleep(poll_s)

    def cancel(self, job_id: int) -> str:
        """Cancel a queued job, or stop a running one and mark it cancelled."""
        job = self.queue.get(job_id)
        if job.state == "queued":
            self.queue.cancel(job_id)
        elif job.state == "running":
            from executor.launch import stop_run

            if job.run_dir:
                stop_run(job.run_dir)
            self.queue.finish(job_id, "cancelled", "stopped on request")
        return self.queue.get(job_id).state

    # --- the pass, step by step ---

    def _run_status(self, job: QueuedJob) -> tuple[str, str | None]:
        read = self._read
        if read is None:
            from executor.store import read_metrics as read
        try:
            m = read(job.run_dir)
        except ValueError as e:  # no run store: a launcher that died before writing it
            return "failed", f"run store unreadable: {e}"
        return m["status"], m.get("reason")

    def _poll_running(self, report: TickReport) -> list[QueuedJob]:
        still = []
        for job in self.queue.list(["running"]):
            status, reason = self._run_status(job)
            if status == "running":
                still.append(job)
                continue
            final = {"done": "done", "stopped": "cancelled"}.get(status, "failed")
            if job.run_dir:
                booking.Ledger().release(job.run_dir)
            if self.queue.finish(job.id, final, reason):
                report.finished.append((job.id, final))
        return still

    def _start_queued(self, running: list[QueuedJob], report: TickReport) -> None:
        queued = self.queue.list(["queued"])
        if not queued:
            return
        state = ClusterState(self.cluster)
        origin = min(j.submitted_s for j in queued)  # the policy's clock: seconds since the oldest submission
        now = time.time() - origin
        views = []
        for job in running:
            held = tuple(i for i in job.devices if i < self.cluster.num_devices)
            if len(held) != len(job.devices):  # the machine has fewer devices than when it started
                log.warning("job %d holds devices %s beyond this cluster's %d", job.id, job.devices,
                            self.cluster.num_devices)
            if not held:
                continue
            state.assign(str(job.id), held)  # raises on a double booking
            end = (job.started_s or origin) - origin + (job.predicted_duration_s or 0.0)
            views.append(Running(str(job.id), state.pool_of(held[0]), len(held), max(end, now)))
        self._hold_booked_elsewhere(state, running)
        by_id = {str(j.id): j for j in queued}
        policy = FrenzyPolicy(self.cluster, self.dtype)
        decisions = policy.decide(now, [j.job_spec(origin) for j in queued], state.free_counts(), views)
        for job_id, reason in policy.failed().items():
            if self.queue.finish(int(job_id), "failed", f"does not fit: {reason}"):
                report.finished.append((int(job_id), "failed"))
        picked = []
        for d in decisions:  # reserve every decision's devices first: what is left is idle this pass
            pool = next(p for p in state.pools if p.device == d.option.pool)
            devices = state.pick(pool, d.option.num_gpus)
            state.assign(d.job.job_id, devices)
            picked.append((d, devices))
        for d, devices in picked:
            job = by_id[d.job.job_id]
            try:
                self._launch(job, devices, state)
            except (ValueError, RuntimeError, OSError) as e:
                log.warning("job %d failed to launch: %s", job.id, e)
                state.release(d.job.job_id)
                if self.queue.finish(job.id, "failed", f"launch failed: {e}"):
                    report.finished.append((job.id, "failed"))
                continue
            report.started.append(job.id)

    def _hold_booked_elsewhere(self, state: ClusterState, running: list[QueuedJob]) -> None:
        """Devices that the ledger gives to runs other than our jobs' (a dashboard or CLI launch)
        are not offered this pass."""
        ours = {os.path.abspath(j.run_dir) for j in running if j.run_dir}
        held = {k for b in booking.Ledger().live() if b.run_dir not in ours for k in b.devices}
        keys = booking.cluster_device_keys(self.cluster)
        taken = tuple(i for i, k in enumerate(keys) if k in held and state.owner[i] is None)
        if taken:
            state.assign(BOOKED_ELSEWHERE, taken)

    def _plan(self, job: QueuedJob, devices: tuple[int, ...]):
        from planner.hetero.solve import solve_plan

        sub = sub_cluster(self.cluster, devices, f"{self.cluster.name}-job{job.id}")
        result = solve_plan(sub, job.model, job.global_batch, seq=job.seq, dtype=self.dtype,
                            time_limit_s=PLAN_TIME_LIMIT_S)
        if result.plan is None:
            raise ValueError(f"no plan on devices {list(devices)}: {result.reason or result.status}")
        return result.plan

    def _launch(self, job: QueuedJob, devices: tuple[int, ...], state: ClusterState) -> None:
        """Plan on the policy's devices; if other kinds of devices sit idle this pass, also plan on
        them together (the heterogeneous planner mixes types) and keep that when it is predicted
        clearly faster. The job then holds only the devices its plan uses."""
        plan = self._plan(job, devices)
        pools = {state.pool_of(i) for i in devices}
        idle = tuple(i for i, owner in enumerate(state.owner) if owner is None and state.pool_of(i) not in pools)
        if idle:
            both = tuple(sorted(devices + idle))
            mixed = self._plan(job, both)
            if mixed.predicted_iteration_s < MIXED_GAIN * plan.predicted_iteration_s:
                state.release(str(job.id))
                devices = tuple(both[a.device_index] for a in mixed.assignments if a.used)
                state.assign(str(job.id), devices)
                plan = self._plan(job, devices) if len(devices) < len(both) else mixed
        start = self._start
        if start is None:
            from executor.launch import start_run as start
        run_dir = os.path.join(runs_dir(), f"job-{job.id}-{time.strftime('%Y%m%d-%H%M%S')}")
        ledger = booking.Ledger()
        # booked by the cluster's names of the devices (the plan's sub-cluster renumbers them);
        # start_run and the launcher take the booking over
        ledger.book(run_dir, booking.cluster_device_keys(self.cluster, devices))
        try:
            handle = start(plan, job.steps, run_dir=run_dir)
        except BaseException:
            ledger.release(run_dir)
            raise
        if handle.pid:
            ledger.book(run_dir, (), handle.pid)
        labels = [d.label for _, d in (self.cluster.devices()[i] for i in devices)]
        predicted_s = plan.predicted_iteration_s * job.steps
        if not self.queue.mark_running(job.id, devices, labels, handle.run_dir, handle.pid, predicted_s):
            # cancelled between reading the queue and launching: stop what we started
            from executor.launch import stop_run

            stop_run(handle.run_dir)
