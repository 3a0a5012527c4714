"""The local orchestrator: queued jobs -> devices of this machine -> real runs.

One pass (`tick`): poll every running job's run store (a run that ended marks its job done or
failed and frees its devices; the queue row holds the run folder and launcher pid, so a restarted
orchestrator re-attaches); rebuild the device ledger (planner.schedule.state.ClusterState); ask the
`frenzy` policy the simulator uses which queued jobs start on which devices (one pool, or a mixed
gang: devices of two kinds at once, planner/schedule/mixed.py); plan each on exactly those devices
through planner.entry.plan_on_devices (the same planning as `python -m planner plan`: a mixed
gang's plan is the uneven split and shards its option was priced with, `gang_mismatch` says where not) and
start it (executor.launch.start_run: each rank in its own device's cgroup kind). A launch that
fails marks the job failed with the reason.
`run_forever(poll_s)` repeats `tick`; a file lock beside the database lets one pass run at a time,
so the dashboard and the CLI can both drive it. The policies: docs/models/scheduling.md.
"""
from __future__ import annotations

import fcntl
import logging
import os
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable, Iterator

from contracts.cluster import ClusterSpec
from contracts.paths import runs_dir
from executor import booking
from executor.queue import JobQueue, QueuedJob
from planner.entry import plan_on_devices
from planner.schedule.frenzy import FrenzyPolicy
from planner.schedule.options import ResourceOption
from planner.schedule.state import ClusterState, Running

log = logging.getLogger(__name__)

LOCAL_DTYPE = "fp32"  # CPU workers train in fp32 (gloo); a GPU cluster file may ask for bf16
BOOKED_ELSEWHERE = "booked by another run"  # the ClusterState owner of devices the ledger gives to others
SHARD_TOLERANCE = 1e-6  # shard fractions that differ by less are the same split (the ILP's rounding)


@dataclass
class TickReport:
    """What one pass changed."""

    started: list[int] = field(default_factory=list)
    finished: list[tuple[int, str]] = field(default_factory=list)  # (job id, final state)
    skipped: bool = False  # another pass held the lock

    def to_dict(self) -> dict:
        return {"started": self.started, "finished": [{"id": i, "state": s} for i, s in self.finished],
                "skipped": self.skipped}


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
            views.append(running_view(state, str(job.id), held, max(end, now)))
        self._hold_booked_elsewhere(state, running)
        by_id = {str(j.id): j for j in queued}
        policy = FrenzyPolicy(self.cluster, self.dtype, mixed=True)
        decisions = policy.decide(now, [j.job_spec(origin) for j in queued], state.free_counts(), views)
        for job_id, reason in policy.failed().items():
            if self.queue.finish(int(job_id), "failed", f"does not fit: {reason}"):
                report.finished.append((int(job_id), "failed"))
        picked = []
        for d in decisions:  # reserve every decision's devices first: what is left is idle this pass
            devices = pick_devices(state, d.option)
            state.assign(d.job.job_id, devices)
            picked.append((d, devices))
        for d, devices in picked:
            job = by_id[d.job.job_id]
            try:
                self._launch(job, devices, state, d.option)
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
        keys = self._device_keys()
        taken = tuple(i for i, k in enumerate(keys) if k in held and state.owner[i] is None)
        if taken:
            state.assign(BOOKED_ELSEWHERE, taken)

    def _device_keys(self, devices: tuple[int, ...] | None = None) -> list[str]:
        """The ledger's names of the cluster's devices `devices` (all by default)."""
        return booking.cluster_device_keys(self.cluster, devices)

    def _launch(self, job: QueuedJob, devices: tuple[int, ...], state: ClusterState,
                option: ResourceOption | None = None) -> None:
        """Plan on the policy's devices. A mixed gang is planned on exactly its devices (a plan that
        differs from the split its option was priced with, `gang_mismatch`, is logged: the planner
        saw the devices' real links, the pricing a layout of its pools); an option of one pool is planned
        with the idle devices of other kinds this pass offered to the planner (it mixes types when
        that is clearly faster). The job then holds only the devices its plan uses."""
        mixed = option is not None and option.is_mixed
        pools = {state.pool_of(i) for i in devices}
        idle = () if mixed else tuple(i for i, owner in enumerate(state.owner)
                                      if owner is None and state.pool_of(i) not in pools)
        plan, used = plan_on_devices(self.cluster, devices, job.model, job.global_batch, seq=job.seq,
                                     dtype=self.dtype, name=f"{self.cluster.name}-job{job.id}", idle=idle)
        if mixed:
            problem = gang_mismatch(plan, option)
            if problem is not None:
                log.warning("mixed gang %s of job %d: %s", option.gpu_type, job.id, problem)
        if used != devices:
            state.release(str(job.id))
            state.assign(str(job.id), used)
        self._start_job(job, plan, used)

    def _start_job(self, job: QueuedJob, plan, devices: tuple[int, ...]) -> None:
        """Book the devices, start the run, mark the job running (stopping the run if the job was
        cancelled meanwhile)."""
        start = self._start
        if start is None:
            from executor.launch import start_run as start
        run_dir = os.path.join(runs_dir(), f"job-{job.id}-{time.strftime('%Y%m%d-%H%M%S')}")
        ledger = booking.Ledger()
        # booked by the cluster's names of the devices (the plan's sub-cluster renumbers them);
        # start_run and the launcher take the booking over
        ledger.book(run_dir, self._device_keys(devices))
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


def pick_devices(state: ClusterState, option: ResourceOption) -> tuple[int, ...]:
    """Free devices of the cluster for `option`: per part (one for an option of one pool), its
    count of that pool's devices (ClusterState.pick), in the parts' order."""
    out: list[int] = []
    for device, n in option.parts:
        pool = next(p for p in state.pools if p.device == device)
        out += state.pick(pool, n)
    return tuple(out)


def running_view(state: ClusterState, job_id: str, held: tuple[int, ...], end_s: float) -> Running:
    """A running job as the policy sees it: one pool, or a mixed gang's parts (pool, count)."""
    counts: dict = {}
    for i in held:
        counts[state.pool_of(i)] = counts.get(state.pool_of(i), 0) + 1
    mix = tuple(counts.items()) if len(counts) > 1 else ()
    return Running(job_id, state.pool_of(held[0]), len(held), end_s, mix=mix)


def gang_mismatch(plan, option: ResourceOption) -> str | None:
    """How a mixed gang's plan differs from the split its option was priced with (None: it does not):
    per device kind, the sorted (micro-batch, accumulation steps, shard fraction) of its devices;
    every device used, no pipeline."""
    if plan.pipeline is not None:
        return "the planner chose a pipeline; the option was priced as data parallelism"
    if not all(a.used for a in plan.assignments):
        return "the planner leaves a device of the gang idle"
    kinds = [d for d, n in option.parts for _ in range(n)]
    priced = sorted(zip((d.label for d in kinds), option.per_device))
    devices = plan.cluster.devices()
    planned = sorted((devices[a.device_index][1].label, (a.micro_batch, a.accum_steps, a.shard_fraction))
                     for a in plan.assignments)
    same = len(priced) == len(planned) and all(
        ka == kb and a[:2] == b[:2] and abs(a[2] - b[2]) <= SHARD_TOLERANCE
        for (ka, a), (kb, b) in zip(priced, planned))
    return None if same else f"planned on its devices as {planned}, priced as {priced}"


# ---- the orchestrator on SLURM -----------------------------------------------------------


def slurm_cluster(settings=None) -> ClusterSpec:
    """The SLURM cluster as the orchestrator's pool (profiler.slurm_inventory)."""
    from executor.slurm_job import SlurmSettings
    from profiler.slurm_inventory import build_slurm_cluster, cluster_name, read_nodes

    settings = settings or SlurmSettings()
    return build_slurm_cluster(read_nodes(settings.gres_name), cluster_name(), dict(settings.type_map))


class SlurmOrchestrator(Orchestrator):
    """The same passes, with SLURM as the truth:

    - a running job's state is its SLURM job's (`scontrol show job`): pending and running hold
      their devices even when the launcher is gone; completed, failed and cancelled end the job
      (the run store's reason when the launcher recorded one);
    - devices SLURM reports in use (`GresUsed`) that none of our running jobs holds, and every
      device of a node SLURM reports down or drained, are not offered;
    - a job is marked running (devices, run folder) before its launcher starts, so an
      orchestrator killed at any point never starts it twice; its launcher
      (executor.slurm.start_slurm_run) runs in its own session and outlives the orchestrator.
    """

    def __init__(self, queue: JobQueue | None = None, cluster: ClusterSpec | None = None,
                 dtype: str = LOCAL_DTYPE, settings=None) -> None:
        from executor.slurm_job import SlurmSettings

        self.settings = settings or SlurmSettings()
        super().__init__(queue, cluster or slurm_cluster(self.settings), dtype)

    def _device_keys(self, devices: tuple[int, ...] | None = None) -> list[str]:
        """`slurm:<node>/<index within the node>`, as executor.slurm books a launch from the CLI."""
        keys = []
        for node in self.cluster.nodes:
            keys += [f"slurm:{node.name}/{k}" for k in range(len(node.devices))]
        return keys if devices is None else [keys[i] for i in devices]

    def _run_status(self, job: QueuedJob) -> tuple[str, str | None]:
        from executor.slurm_job import job_state, read_job_file

        status, reason = super()._run_status(job)
        info = read_job_file(job.run_dir) if job.run_dir else None
        if info is None:  # not submitted yet: the launcher is starting, or died before sbatch
            return status, reason
        s = job_state(str(info["job_id"]))
        if s.active or s.completing:
            return "running", None  # SLURM runs it, whatever became of its launcher
        launcher_died = (reason or "").startswith("the launcher (pid")  # executor.store's verdict
        if status == "running" or not launcher_died or not s.known:
            return status, reason  # the launcher writes (or wrote) the end of the run with its reason
        status = {"COMPLETED": "done", "CANCELLED": "stopped"}.get(s.state, "failed")
        return status, f"SLURM job {s.job_id} {s.state}" + (f" ({s.reason})" if s.reason else "") + \
            " after its launcher died"

    def _hold_booked_elsewhere(self, state: ClusterState, running: list[QueuedJob]) -> None:
        super()._hold_booked_elsewhere(state, running)
        from profiler.slurm_inventory import catalog_type, read_nodes

        reported = {n.name: n for n in read_nodes(self.settings.gres_name, [n.name for n in self.cluster.nodes])}
        type_map = dict(self.settings.type_map)
        ours = {i for j in running for i in j.devices}
        taken: list[int] = []
        i = 0
        for node in self.cluster.nodes:
            idx = list(range(i, i + len(node.devices)))
            i += len(node.devices)
            n = reported.get(node.name)
            if n is None or not n.usable:
                taken += [k for k in idx if state.owner[k] is None]
                continue
            for gres_type, used in n.gres_used.items():
                t = catalog_type(gres_type, type_map)
                mine = sum(1 for k in idx if k in ours and node.devices[k - idx[0]].type == t)
                free = [k for k in idx if state.owner[k] is None and node.devices[k - idx[0]].type == t]
                taken += free[:max(0, used - mine)]
        if taken:
            state.assign(BOOKED_ELSEWHERE + " (SLURM)", tuple(taken))

    def _start_job(self, job: QueuedJob, plan, devices: tuple[int, ...]) -> None:
        from executor.slurm import start_slurm_run

        run_dir = os.path.join(runs_dir(), f"job-{job.id}-{time.strftime('%Y%m%d-%H%M%S')}")
        labels = [d.label for _, d in (self.cluster.devices()[i] for i in devices)]
        ledger = booking.Ledger()
        ledger.book(run_dir, self._device_keys(devices))
        if not self.queue.mark_running(job.id, devices, labels, run_dir, None,
                                       plan.predicted_iteration_s * job.steps):
            ledger.release(run_dir)  # cancelled meanwhile: nothing started
            return
        try:
            handle = start_slurm_run(plan, job.steps, run_dir, self.settings)
        except BaseException:
            ledger.release(run_dir)
            raise
        ledger.book(run_dir, (), handle.pid)  # the launcher holds the devices now

    def cancel(self, job_id: int) -> str:
        job = self.queue.get(job_id)
        state = super().cancel(job_id)
        if job.state == "running" and job.run_dir:
            from executor.slurm import cancel_slurm_run

            cancel_slurm_run(job.run_dir)  # the launcher scancels; this covers a launcher that is gone
        return state
