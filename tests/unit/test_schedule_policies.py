"""Each scheduling policy's defining behaviour on tiny hand-made traces, the seeded duration
error, gpumix's preemption and growth, the simulator's resize accounting
(planner/schedule/{fifo,backfill,gpumix,simulate}.py)."""
import math
import random
from dataclasses import replace

import pytest

from contracts.cluster import ClusterSpec
from contracts.jobs import JobSpec
from planner.schedule import simulate as sim
from planner.schedule.gpumix import GpumixPolicy
from planner.schedule.simulate import BASELINES, POLICIES, error_factor, simulate_schedule
from planner.schedule.sizing import Sizing
from planner.schedule.state import Decision, Running, checkpoint_save_s, restart_s
from planner.schedule.trace import generate_trace

A100x8 = ClusterSpec.from_dict({"name": "a8", "nodes": [{"name": "n", "gpus": {"A100-80GB": 8}}]})
A100x1 = ClusterSpec.from_dict({"name": "a1", "nodes": [{"name": "n", "gpus": {"A100-80GB": 1}}]})
MIX = ClusterSpec.from_dict({"name": "mix", "nodes": [
    {"name": "a0", "gpus": {"A100-80GB": 8}}, {"name": "v0", "gpus": {"V100-32GB": 8}},
    {"name": "t0", "gpus": {"T4": 8}}, {"name": "t1", "gpus": {"T4": 8}}]})


def _job(job_id, submit_s, steps, gpus=None, gpu_type="A100-80GB", model="gpt2", batch=8, seq=512):
    return JobSpec(job_id, model, batch, seq, steps, submit_s,
                   requested_type=gpu_type if gpus else None, requested_gpus=gpus)


def _by_id(result):
    return {r.job.job_id: r for r in result.records}


def test_strict_fifo_blocks_behind_the_head_and_easy_backfills_around_it():
    # a holds 4 of the 8 GPUs; b (8 GPUs) must wait for it; c (1 GPU, short) arrives last
    jobs = [_job("a", 0.0, 20000, 4), _job("b", 1.0, 20000, 8), _job("c", 2.0, 100, 1)]
    fifo = _by_id(simulate_schedule(jobs, A100x8, "fifo", error_sigma=0))
    easy = _by_id(simulate_schedule(jobs, A100x8, "fifo-backfill", error_sigma=0))
    assert fifo["c"].start_s >= fifo["b"].start_s == fifo["a"].end_s  # strict: c waits behind b
    assert easy["c"].start_s == 2.0 and easy["c"].end_s <= easy["b"].start_s  # backfilled: ends before b's slot
    assert easy["b"].start_s == pytest.approx(easy["a"].end_s)  # ... and b was not delayed


def test_easy_backfill_never_delays_the_heads_reservation():
    # c fits beside a but would not end before b's reservation: it must not start before b
    jobs = [_job("a", 0.0, 2000, 4), _job("b", 1.0, 2000, 8), _job("c", 2.0, 200000, 1)]
    easy = _by_id(simulate_schedule(jobs, A100x8, "fifo-backfill", error_sigma=0))
    assert easy["b"].start_s == pytest.approx(easy["a"].end_s)
    assert easy["c"].start_s >= easy["b"].start_s


def test_sized_backfill_ignores_the_request_and_uses_the_memory_aware_option():
    job = _job("x", 0.0, 500, 8, gpu_type="T4")  # the user asks for 8 T4s
    rec = _by_id(simulate_schedule([job], MIX, "fifo-backfill-sized", error_sigma=0))["x"]
    sizing = Sizing(MIX)
    k, want = sizing.choose(job, [p.count for p in sizing.pools])
    assert (rec.option.gpu_type, rec.option.num_gpus, rec.option.zero, rec.option.micro_batch) == \
        (want.gpu_type, want.num_gpus, want.zero, want.micro_batch)
    asked = _by_id(simulate_schedule([job], MIX, "fifo-backfill", error_sigma=0))["x"]
    assert (asked.option.gpu_type, asked.option.num_gpus) == ("T4", 8)


def test_sjf_runs_the_shortest_predicted_job_first_and_sized_fifo_in_arrival_order():
    # one GPU: everything is serial. A blocker runs; three jobs queue, longest first.
    jobs = [_job("block", 0.0, 1000), _job("long", 1.0, 3000), _job("mid", 2.0, 2000), _job("short", 3.0, 1000)]
    order = {}
    for policy in ("sjf", "fifo-backfill-sized"):
        recs = _by_id(simulate_schedule(jobs, A100x1, policy, error_sigma=0))
        order[policy] = [j for j in sorted(recs, key=lambda j: recs[j].start_s) if j != "block"]
    assert order["sjf"] == ["short", "mid", "long"]
    assert order["fifo-backfill-sized"] == ["long", "mid", "short"]


def test_error_factor_is_seeded_lognormal_and_paired_across_policies():
    assert error_factor(0, "j1", "T4") == error_factor(0, "j1", "T4")
    assert error_factor(0, "j1", "T4") != error_factor(1, "j1", "T4")
    assert error_factor(0, "j1", "T4", sigma=0) == 1.0
    logs = [math.log(error_factor(7, f"j{i}", "A100-80GB")) for i in range(4000)]
    mean = sum(logs) / len(logs)
    std = math.sqrt(sum((x - mean) ** 2 for x in logs) / len(logs))
    assert abs(mean) < 0.02 and std == pytest.approx(sim.ERROR_SIGMA, rel=0.06)
    trace = generate_trace(4, 40, MIX, load=0.7)
    seen: dict[tuple[str, str], float] = {}
    for policy in POLICIES:
        for r in simulate_schedule(trace, MIX, policy, error_seed=3).records:
            if r.status != "done":
                continue
            key = (r.job.job_id, r.option.gpu_type)
            assert r.error_factor == seen.setdefault(key, r.error_factor)  # same job, same type: same error
            if r.num_restarts == 0:  # the run lasts the prediction times the error ...
                run_s = r.option.duration_s * r.error_factor
                if policy in ("gpumix", "srtf", "las", "gavel"):  # ... after a preempted job's save, if any
                    assert run_s - 1e-6 <= r.end_s - r.start_s <= run_s + max(checkpoint_save_s(j) for j in trace) + 1e-6
                else:
                    assert r.end_s - r.start_s == pytest.approx(run_s)


def test_gpumix_preempts_a_long_job_for_a_short_one_and_resumes_it():
    long_job, short = _job("long", 0.0, 400000), _job("short", 60.0, 2000)
    g = _by_id(simulate_schedule([long_job, short], A100x1, "gpumix", error_sigma=0))
    s = _by_id(simulate_schedule([long_job, short], A100x1, "sjf", error_sigma=0))
    assert s["short"].start_s == pytest.approx(s["long"].end_s)  # non-preemptive: waits it out
    assert g["short"].start_s == 60.0 and g["long"].num_restarts == 1
    d_long, d_short = g["long"].option.duration_s, g["short"].option.duration_s
    save_s = checkpoint_save_s(long_job)
    assert g["short"].end_s == pytest.approx(60.0 + save_s + d_short)  # its GPU first wrote long's checkpoint
    # the long job lost nothing but the short job's time and one checkpoint-and-resume
    assert g["long"].end_s == pytest.approx(d_long + d_short + restart_s(long_job))
    assert g["long"].busy_gpu_s == pytest.approx(d_long + restart_s(long_job) - save_s)  # its save: on short's time


def test_gpumix_never_double_books_and_every_job_finishes(monkeypatch):
    events = []

    class Checked(sim.ClusterState):
        def assign(self, job_id, devices):
            events.append(("assign", job_id, tuple(devices)))
            super().assign(job_id, devices)  # raises on a device already held

    monkeypatch.setattr(sim, "ClusterState", Checked)
    trace = generate_trace(11, 150, MIX, load=0.9)
    r = simulate_schedule(trace, MIX, "gpumix")
    assert r.num_failed == 0 and all(x.status == "done" and x.end_s > x.start_s >= x.job.submit_s for x in r.records)
    assert len(events) == len(trace) + sum(x.num_restarts for x in r.records)
    with pytest.raises(RuntimeError, match="double booking"):
        state = Checked(MIX)
        state.assign("a", (0, 1))
        state.assign("b", (1,))


@pytest.mark.parametrize("policy", ["gpumix", "frenzy"])
def test_a_large_job_is_not_starved_by_a_stream_of_short_ones(policy):
    # more short work arrives than 8 GPUs can run: the queue never empties while the stream lasts
    cluster = ClusterSpec.from_dict({"nodes": [{"name": "n", "gpus": {"A100-80GB": 8}}]})
    big = JobSpec("big", "llama2-7b", 256, 4096, 20, 10.0)  # fits only on all 8 GPUs
    rng = random.Random(0)
    small = [JobSpec(f"s{i}", "gpt2", 8, 512, rng.randint(2000, 6000), 20.0 * i) for i in range(360)]
    pol = GpumixPolicy(cluster, slowdown_bound=3.0) if policy == "gpumix" else policy
    rec = _by_id(simulate_schedule([big, *small], cluster, pol))
    assert rec["big"].status == "done"
    last_small = max(j.submit_s for j in small)
    assert rec["big"].start_s < last_small  # it did not wait for the stream to dry up
    assert max(r.start_s for r in rec.values()) > last_small  # ... and the stream did outlast it


def test_bad_error_sigma_is_refused():
    with pytest.raises(ValueError, match="error_sigma"):
        simulate_schedule([_job("x", 0.0, 10)], A100x1, "gpumix", error_sigma=math.nan)


def test_quick_bench_gpumix_beats_the_strongest_baseline_on_a_small_trace():
    import bench.scheduler as bench

    r = bench.run_scenario(*bench.QUICK_SCENARIOS[0], error_seed=0, cold=False)
    assert set(r["policies"]) == {"gpumix", *BASELINES}
    strongest = r["policies"][r["strongest_baseline"]]
    assert r["policies"]["gpumix"]["avg_jct_s"] < strongest["avg_jct_s"]
    assert r["avg_jct_gain"] == pytest.approx(1 - r["policies"]["gpumix"]["avg_jct_s"] / strongest["avg_jct_s"])


def test_gpumix_grows_a_running_job_onto_idle_devices_only_when_nobody_waits():
    pol = GpumixPolicy(A100x8)
    job = _job("long", 0.0, 20000, batch=256, seq=1024)  # scales: 8 GPUs run it 7x faster than 1
    one = next(o for _, o, _ in pol.sizing.entries(job) if o.num_gpus == 1)
    one = replace(one, duration_s=one.iteration_s * job.steps)
    pool = pol.sizing.pools[0]
    assert pol.decide(0.0, [job], {pool: 1}, []) == [Decision(job, one)]  # one GPU free: it starts there
    view = Running("long", pool, 1, one.duration_s, one, 1.0)
    grown = pol.decide(10.0, [], {pool: 7}, [view])  # the other 7 come free, nobody waits
    assert len(grown) == 1 and grown[0].resize and grown[0].option.num_gpus > 1
    waiting = _job("next", 5.0, 400000, model="llama2-7b", batch=256, seq=4096)  # needs all 8: cannot start
    again = GpumixPolicy(A100x8)
    again.decide(0.0, [job], {pool: 1}, [])
    assert not any(d.resize for d in again.decide(10.0, [waiting], {pool: 7}, [view]))


class _ResizeOnce:
    """Starts every job on 1 GPU; at the first decision where job x runs, moves x to 2 GPUs
    (a probe of the simulator's resize accounting)."""

    name = "probe"

    def __init__(self, cluster):
        self.sizing = Sizing(cluster, min_efficiency=0.0)
        self.resized = False

    def failed(self):
        return {}

    def _on(self, job, n):
        o = next(o for _, o, _ in self.sizing.entries(job) if o.num_gpus == n)
        return replace(o, duration_s=o.iteration_s * job.steps)

    def decide(self, now, waiting, free, running):
        out = [Decision(j, self._on(j, 1)) for j in waiting]
        x = next((r for r in running if r.job_id == "x"), None)
        if x is not None and not self.resized:
            self.resized = True
            out.append(Decision(self.job, self._on(self.job, 2), resize=True))
        return out


def test_a_resize_keeps_the_work_done_and_charges_one_restart():
    job, other = _job("x", 0.0, 100000), _job("tick", 600.0, 10)  # tick's arrival is the next decision point
    probe = _ResizeOnce(A100x8)
    probe.job = job
    r = _by_id(simulate_schedule([job, other], A100x8, probe, error_sigma=0.2, error_seed=5))["x"]
    d1, d2 = r.option.duration_s, r.final_option.duration_s
    f = error_factor(5, "x", "A100-80GB", 0.2)
    done = 600.0 / (d1 * f)
    assert r.num_restarts == 1 and r.final_option.num_gpus == 2
    assert r.end_s == pytest.approx(600.0 + restart_s(job) + (1 - done) * d2 * f)
    assert r.busy_gpu_s == pytest.approx(600.0 + 2 * (r.end_s - 600.0))
