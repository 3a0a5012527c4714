"""How much fragmentation across types a window holds: the selection rule computed from the trace
and the pools (trace.fragmentation_exposure), the queueing a gang could save in a replay
(simulate.fragmented_jobs, ScheduleResult.fragmented_wait_s), and the bench's windows picked by the
rule."""
import math

import pytest

from contracts.jobs import JobSpec
from planner.schedule.simulate import fragmented_jobs, simulate_schedule
from planner.schedule.trace import PublicJob, fragmentation_exposure, generate_trace
from tests.unit.test_schedule import CLUSTER

# pools of 2 and 4 devices (6 in all; the largest holds 4)
POOLS = (2, 4)
ROWS = [PublicJob("a", 0.0, 100.0, 4),  # arrives on an idle cluster: the largest pool holds it
        PublicJob("b", 10.0, 50.0, 2),  # 2 free of 6 (a runs): the largest pool's share is 4 x 2/6 < 2
        PublicJob("c", 200.0, 10.0, 4)]  # a and b ended: idle again


def test_exposure_counts_the_gpu_seconds_arriving_where_only_all_pools_together_hold_them():
    # requested GPU-seconds: a 400, b 100, c 40; only b is exposed
    assert fragmentation_exposure(ROWS, POOLS) == pytest.approx(100 / 540)
    # a window from t = 10: a counts as concurrency only
    assert fragmentation_exposure(ROWS, POOLS, start_s=10.0) == pytest.approx(100 / 140)
    assert fragmentation_exposure(ROWS, POOLS, start_s=0.0, end_s=10.0) == 0.0  # a alone
    assert fragmentation_exposure(ROWS, POOLS, start_s=300.0) == 0.0  # an empty window
    # one pool of 6: nothing can be fragmented across types
    assert fragmentation_exposure(ROWS, (6,)) == 0.0


def test_exposure_caps_counts_at_the_largest_pool_and_refuses_bad_pools():
    big = [PublicJob("a", 0.0, 100.0, 2), PublicJob("b", 1.0, 10.0, 64)]  # b asks past every pool: 4
    # at b: 4 free, the largest pool's share 4 x 4/6 = 2.7 < 4 <= 4
    assert fragmentation_exposure(big, POOLS) == pytest.approx(40 / 240)
    for bad in ((), (0, 4), (-1, 2)):
        with pytest.raises(ValueError, match="pool_counts"):
            fragmentation_exposure(ROWS, bad)


def test_fragmented_jobs_names_each_job_no_pool_alone_holds():
    from dataclasses import dataclass

    @dataclass(frozen=True)
    class Opt:  # what `fragmented_jobs` reads of an option
        pool: str
        num_gpus: int
        mix: tuple = ()

    jobs = [JobSpec(i, "tiny", 8, 32, 1, 0.0) for i in ("four", "two", "eight")]
    counts = {"four": [Opt("A", 4)], "two": [Opt("A", 2)], "eight": [Opt("B", 8)]}
    free = {"A": 1, "B": 3}
    # four: 4 free in all, A has 1; two: its pool A has 1, 4 free in all; eight: 4 free in all, no gang of 8
    assert fragmented_jobs(free, jobs, lambda j: counts[j.job_id]) == ["four", "two"]
    assert fragmented_jobs(free, jobs, lambda j: counts[j.job_id], first_only=True) == ["four"]
    assert fragmented_jobs({"A": 4, "B": 0}, jobs, lambda j: counts[j.job_id]) == []  # four and two fit in A


@pytest.fixture(scope="module")
def replay():
    jobs = generate_trace(seed=5, num_jobs=80, cluster=CLUSTER, load=1.2)
    return jobs, simulate_schedule(jobs, CLUSTER, "gpumix", mixed=False, fragmentation=True)


def test_fragmented_wait_lies_between_the_fragmented_span_and_all_the_waiting(replay):
    jobs, r = replay
    start0 = min(j.submit_s for j in jobs)
    span = max(r.makespan_s, max(x.end_s for x in r.records) - start0)
    total_jct = sum(x.jct_s for x in r.records)
    assert r.fragmented_share > 0  # the overloaded trace meets fragmented free devices
    # while fragmented at least one job waits for it; a job waits at most its JCT
    assert r.fragmented_share * span <= r.fragmented_wait_s + 1e-6
    assert r.fragmented_wait_s < total_jct
    d = r.to_dict(jobs=False)
    assert d["fragmented_wait_s"] == r.fragmented_wait_s
    assert simulate_schedule(jobs[:10], CLUSTER, "gpumix").fragmented_wait_s is None  # not measured


def test_the_bench_picks_its_fragmented_windows_by_the_rule_alone(tmp_path, monkeypatch):
    import bench.scheduler as bench

    rows = ["job_id,submission_time,duration,num_gpu"]
    day = bench.DAY_S
    # days 0-1: 60 one-GPU jobs on an idle cluster (no exposure); days 2-3: jobs of 96 GPUs, each
    # arriving while the one before runs (exposed: 160 free in all, the largest pool's share 60)
    rows += [f"a{i},{i * 60.0},{600.0},1" for i in range(60)]
    rows += [f"b{i},{2 * day + i * 60.0},{40.0},96" for i in range(60)]
    rows += [f"c{i},{2 * day + 30 + i * 60.0},{50.0},96" for i in range(60)]
    (tmp_path / "cluster99.csv").write_text("\n".join(rows) + "\n")
    (tmp_path / "README.md").write_text("not a trace")
    monkeypatch.setattr(bench, "TRACE_DIR", str(tmp_path))
    monkeypatch.setattr(bench, "_ROWS", {})
    picked = bench.fragmented_windows(2)
    assert [(n, d) for n, d, _ in picked] == [("cluster99", 2), ("cluster99", 0)]
    assert picked[0][2] > 0 and picked[1][2] == 0.0
    assert picked[0][2] == pytest.approx(bench.window_exposure("cluster99", 2))
    monkeypatch.setattr(bench, "MIN_WINDOW_JOBS", 100)  # day 0 has only 60 jobs
    assert [(n, d) for n, d, _ in bench.fragmented_windows(5)] == [("cluster99", 2)]
    assert not math.isnan(picked[0][2])


def test_idle_speedup_is_the_fastest_gang_over_the_fastest_pool():
    from planner.schedule import mixed
    from planner.schedule.options import cluster_pools
    from planner.schedule.sizing import Sizing
    from tests.unit.test_sched_mixed import HA, JOB

    pools = cluster_pools(HA)
    net = HA.network.inter_node_gbps
    s = mixed.idle_speedup(JOB, pools, inter_node_gbps=net)
    # the policy's own view on the idle cluster: its gangs and one-pool options that fit
    cands = Sizing(HA, min_efficiency=0.0, whole_pools=True).candidates(JOB, [p.count for p in pools])
    gang = max(e[1].samples_per_s for e, _ in cands if e[1].is_mixed)
    one = max(e[1].samples_per_s for e, _ in cands if not e[1].is_mixed)
    assert s == pytest.approx(gang / one) and s > 1 / mixed.MIXED_GAIN
    # one pool: nothing to mix
    assert mixed.idle_speedup(JOB, pools[:1], inter_node_gbps=net) == 1.0


def test_gang_speed_share_weighs_each_jobs_running_time_by_its_speedup(monkeypatch):
    from types import SimpleNamespace

    import bench.scheduler as bench

    def record(job_id, batch, submit, start, end):
        job = JobSpec(job_id, "gpt2", batch, 512, 10, submit)
        return SimpleNamespace(job=job, status="done", start_s=start, end_s=end, jct_s=end - submit)

    speed = {16: 2.0, 8: 1.0}  # per shape (the speed-up depends on the job's shape only)
    monkeypatch.setattr(bench, "idle_speedup", lambda job, pools, inter_node_gbps: speed[job.global_batch])
    result = SimpleNamespace(records=[record("fast", 16, 0.0, 100.0, 300.0), record("same", 8, 0.0, 0.0, 100.0),
                                      record("fast2", 16, 50.0, 50.0, 150.0)])
    # fast: 200 s running, half of it saved on a gang; fast2: 100 s, half saved; of 500 s of JCT in all
    assert bench.gang_speed_share(result, CLUSTER) == pytest.approx((100 + 50) / 500)
