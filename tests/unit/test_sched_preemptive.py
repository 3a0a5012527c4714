"""The preemptive baselines' defining behaviour (planner/schedule/preemptive.py): srtf preempts for a
shorter job, las demotes by attained service, gavel places by throughput normalised across types."""
from dataclasses import replace

import pytest

from contracts.cluster import ClusterSpec
from contracts.jobs import JobSpec
from planner.schedule.preemptive import LAS_THRESHOLDS_GPU_S, GavelPolicy, LasPolicy, las_queue
from planner.schedule.simulate import simulate_schedule
from planner.schedule.sizing import Sizing
from planner.schedule.state import checkpoint_save_s

A100x1 = ClusterSpec.from_dict({"name": "a1", "nodes": [{"name": "n", "gpus": {"A100-80GB": 1}}]})
A100_T4 = ClusterSpec.from_dict({"name": "at", "nodes": [{"name": "a", "gpus": {"A100-80GB": 1}},
                                                          {"name": "t", "gpus": {"T4": 1}}]})


def _job(job_id, submit_s, steps, model="gpt2", batch=8, seq=512):
    return JobSpec(job_id, model, batch, seq, steps, submit_s)


def _by_id(result):
    return {r.job.job_id: r for r in result.records}


def _steps_for(seconds, job_id="probe", cluster=A100x1):
    """Steps of the gpt2 probe job lasting `seconds` on the cluster's fastest option."""
    job = _job(job_id, 0.0, 1)
    return max(1, round(seconds / Sizing(cluster).ref_s(job)))


def test_srtf_preempts_a_long_job_for_a_much_shorter_one():
    long_job, short = _job("long", 0.0, _steps_for(10 * 3600)), _job("short", 60.0, _steps_for(600))
    s = _by_id(simulate_schedule([long_job, short], A100x1, "srtf", error_sigma=0))
    assert s["short"].start_s == 60.0 and s["long"].num_restarts == 1
    assert s["short"].end_s == pytest.approx(60.0 + checkpoint_save_s(long_job) + short.steps * s["short"].option.iteration_s)
    assert s["long"].end_s > s["short"].end_s
    # sjf, the same order without preemption, lets the short job wait the long one out
    j = _by_id(simulate_schedule([long_job, short], A100x1, "sjf", error_sigma=0))
    assert j["short"].start_s == pytest.approx(j["long"].end_s)


def test_srtf_does_not_preempt_for_a_job_that_is_not_much_shorter():
    first, second = _job("first", 0.0, _steps_for(3600)), _job("second", 60.0, _steps_for(2400))
    s = _by_id(simulate_schedule([first, second], A100x1, "srtf", error_sigma=0))
    assert s["first"].num_restarts == 0 and s["second"].start_s == pytest.approx(s["first"].end_s)


def test_las_queues_by_attained_gpu_seconds():
    assert [las_queue(x) for x in (0.0, 3599.0, 3600.0, 8 * 3600.0, 1e9)] == [0, 0, 1, 2, len(LAS_THRESHOLDS_GPU_S)]


def test_las_demotes_a_job_by_its_attained_service_not_its_length():
    # a has run 2 GPU-hours when b arrives: a is demoted to queue 1, b (queue 0) preempts it even though b
    # is the LONGER job (las knows no durations)
    a, b = _job("a", 0.0, _steps_for(3 * 3600)), _job("b", 2 * 3600.0, _steps_for(20 * 3600))
    las = _by_id(simulate_schedule([a, b], A100x1, "las", error_sigma=0))
    assert las["b"].start_s == 2 * 3600.0 and las["a"].num_restarts == 1 and las["a"].end_s > las["b"].end_s
    # b arriving while a is still in queue 0 waits its turn (first come first served inside a queue)
    early = _by_id(simulate_schedule([a, replace(b, submit_s=600.0)], A100x1, "las", error_sigma=0))
    assert early["a"].num_restarts == 0 and early["b"].start_s == pytest.approx(early["a"].end_s)
    # srtf on the same jobs keeps the shorter a running
    srtf = _by_id(simulate_schedule([a, b], A100x1, "srtf", error_sigma=0))
    assert srtf["a"].num_restarts == 0


def test_las_counts_attained_gpu_seconds_from_its_observations():
    pol = LasPolicy(A100x1)
    job = _job("a", 0.0, _steps_for(3 * 3600))
    pool = pol.sizing.pools[0]
    [start] = pol.decide(0.0, [job], {pool: 1}, [])
    from planner.schedule.state import Running
    view = Running("a", pool, 1, start.option.duration_s, start.option, 0.5)
    pol.decide(5000.0, [], {pool: 0}, [view])
    assert pol.attained("a") == pytest.approx(5000.0) and pol.queue("a") == 1


def test_gavel_places_each_job_where_its_normalised_throughput_is_highest():
    # tiny runs on a T4 at 2/3 of its A100 speed, gpt2 at 1/6: the T4 is worth more to tiny
    tiny, gpt2 = _job("tiny", 0.0, 20000, model="tiny", seq=128), _job("gpt2", 0.0, 20000)
    pol = GavelPolicy(A100_T4)
    g = _by_id(simulate_schedule([tiny, gpt2], A100_T4, pol, error_sigma=0))
    assert (g["tiny"].option.gpu_type, g["gpt2"].option.gpu_type) == ("T4", "A100-80GB")
    assert g["tiny"].start_s == g["gpt2"].start_s == 0.0  # both run at once
    prices = dict(zip((p.device.type for p in pol.sizing.pools), pol.type_prices()))
    assert prices["A100-80GB"] == pytest.approx(1.0) and prices["T4"] < 0.5  # the average job's T4 rate
    # sized by raw speed instead (frenzy's sizing): tiny takes the A100 and gpt2 waits for it
    s = _by_id(simulate_schedule([tiny, gpt2], A100_T4, "sjf", error_sigma=0))
    assert s["tiny"].option.gpu_type == "A100-80GB" and s["gpt2"].start_s > 0.0


def test_gavel_counts_service_in_seconds_of_the_request():
    pol = GavelPolicy(A100x1)
    job = JobSpec("a", "gpt2", 8, 512, 1000, 0.0, requested_type="A100-80GB", requested_gpus=1)
    pool = pol.sizing.pools[0]
    [start] = pol.decide(0.0, [job], {pool: 1}, [])
    from planner.schedule.state import Running
    pol.decide(10.0, [], {pool: 0}, [Running("a", pool, 1, start.option.duration_s, start.option, 0.25)])
    assert pol.attained("a") == pytest.approx(0.75 * start.option.duration_s)  # 3/4 of the steps done
