from dataclasses import dataclass

import pytest

from contracts.cluster import ClusterSpec
from executor.orchestrator import Orchestrator
from executor.queue import JobQueue
from planner.entry import sub_cluster
from testkit.wait import wait_until

TWO_CPUS = ClusterSpec.from_dict({"name": "local", "nodes": [{"name": "localhost", "gpus": {"cpu": 2}}]})


@dataclass(frozen=True)
class _Handle:
    run_dir: str
    pid: int | None = None


class FakeRuns:
    """start_run / read_metrics stand-ins: runs whose status the test sets."""

    def __init__(self):
        self.status = {}
        self.plans = {}

    def start(self, plan, steps, run_dir=None):
        self.status[run_dir] = "running"
        self.plans[run_dir] = plan
        return _Handle(run_dir)

    def read(self, run_dir):
        return {"status": self.status[run_dir], "reason": "rank 0 died" if self.status[run_dir] == "failed" else None}


def _orch(runs, queue=None):
    return Orchestrator(queue or JobQueue(), TWO_CPUS, start=runs.start, read=runs.read)


def test_a_failed_job_frees_its_devices_and_states_survive_a_restart():
    runs = FakeRuns()
    q = JobQueue()
    a, b = q.submit("tiny", 8, 5), q.submit("tiny", 8, 5)
    orch = _orch(runs, q)
    first = orch.tick()
    assert first.started == [a]  # both devices to the first job (it finishes twice as fast)
    ja = q.get(a)
    assert sorted(ja.devices) == [0, 1] and q.get(b).state == "queued"
    assert sum(x.batch for x in runs.plans[ja.run_dir].assignments) == 8  # a real plan on those devices
    # "restart": a new orchestrator over a reopened queue finds the running job by its run dir
    orch2 = _orch(runs, JobQueue(q.path))
    assert orch2.tick().started == [] and q.get(a).state == "running"
    runs.status[ja.run_dir] = "failed"
    report = orch2.tick()
    assert report.finished == [(a, "failed")] and report.started == [b]
    assert q.get(a).reason == "rank 0 died" and sorted(q.get(b).devices) == [0, 1]


def test_double_booking_in_the_queue_is_refused():
    runs = FakeRuns()
    q = JobQueue()
    a, b, c = (q.submit("tiny", 8, 5) for _ in range(3))
    for job, dev in ((a, [0]), (b, [0])):
        q.mark_running(job, dev, ["cpu"], f"/r{job}", None, 1.0)
        runs.status[f"/r{job}"] = "running"
    with pytest.raises(RuntimeError, match="double booking"):
        _orch(runs, q).tick()


def test_a_job_that_fits_nowhere_fails_with_the_reason():
    small = ClusterSpec.from_dict({"nodes": [{"name": "localhost", "gpus": [{"type": "cpu", "memory_gb": 0.5}]}]})
    q = JobQueue()
    j = q.submit("llama2-7b", 8, 1, seq=128)
    Orchestrator(q, small, start=FakeRuns().start).tick()
    assert q.get(j).state == "failed" and "fit" in q.get(j).reason


def test_sub_cluster_keeps_nodes_and_order():
    c = ClusterSpec.from_dict({"nodes": [{"name": "a", "gpus": {"T4": 2}}, {"name": "b", "gpus": {"V100-32GB": 2}}]})
    s = sub_cluster(c, (1, 2), "s")
    assert [(n.name, [d.type for d in n.devices]) for n in s.nodes] == [("a", ["T4"]), ("b", ["V100-32GB"])]


@pytest.mark.slow
def test_two_real_tiny_jobs_submitted_at_once_run_and_finish():
    pytest.importorskip("torch")
    from executor.store import read_metrics

    q = JobQueue()
    # global batch 1: a job cannot use two devices, so both start in the first pass, side by side
    ids = [q.submit("tiny", 1, 3, seq=32), q.submit("tiny", 1, 3, seq=32)]
    orch = Orchestrator(q, TWO_CPUS)
    assert sorted(orch.tick().started) == ids

    def ended() -> bool:
        if any(q.get(i).state in ("queued", "running") for i in ids):
            orch.tick()
            return False
        return True

    wait_until(ended, 150, "both jobs to end", interval_s=0.5, detail=lambda: [q.get(i).reason for i in ids])
    jobs = [q.get(i) for i in ids]
    assert [j.state for j in jobs] == ["done", "done"], [j.reason for j in jobs]
    for j in jobs:
        m = read_metrics(j.run_dir)
        assert m["status"] == "done" and len(m["steps"]) == 3 and m["world_size"] == 1
    assert {jobs[0].devices, jobs[1].devices} == {(0,), (1,)}  # one device each, never the same
    assert max(j.started_s for j in jobs) < min(j.ended_s for j in jobs)  # they ran at the same time


def test_devices_booked_by_another_launch_are_not_offered(tmp_path):
    import os
    import subprocess
    import sys

    from executor import booking

    runs = FakeRuns()
    q = JobQueue()
    a = q.submit("tiny", 8, 5)
    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:  # a dashboard launch holds device 1 of this machine
        booking.Ledger().book(str(tmp_path / "dashboard-run"), ["local/1"], holder.pid)
        assert _orch(runs, q).tick().started == [a]
        job = q.get(a)
        assert job.devices == (0,)  # only the free one
        held = {b.run_dir: b.devices for b in booking.Ledger().live()}
        assert held[os.path.abspath(job.run_dir)] == ("local/0",)  # the orchestrator's launch is booked too
        with __import__("pytest").raises(ValueError, match=f"in use by run {os.path.abspath(job.run_dir)}"):
            booking.Ledger().book(str(tmp_path / "another"), ["local/0"])
        runs.status[job.run_dir] = "done"
        _orch(runs, q).tick()
        assert os.path.abspath(job.run_dir) not in {b.run_dir for b in booking.Ledger().live()}  # released
    finally:
        holder.kill()
        holder.wait()
