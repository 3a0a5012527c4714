"""Sustained overload: gpumix's bounded-slowdown order (planner/schedule/gpumix.py) keeps serving
short jobs first; no rule turns it into first come first served once jobs have waited long."""
import random

import pytest

from contracts.cluster import ClusterSpec
from contracts.jobs import JobSpec
from planner.schedule.gpumix import SLOWDOWN_BOUND, GpumixPolicy
from planner.schedule.simulate import percentile, simulate_schedule
from planner.schedule.sizing import Sizing

A100x8 = ClusterSpec.from_dict({"name": "a8", "nodes": [{"name": "n", "gpus": {"A100-80GB": 8}}]})
HOUR = 3600.0


def overload_trace():
    """Four days of arrivals at 2.5x what 8 GPUs serve: 10-minute 1-GPU jobs and 8-hour 4-GPU ones."""
    rng = random.Random(5)
    probe = Sizing(A100x8)
    short_it = probe.ref_s(JobSpec("p", "gpt2", 8, 512, 1, 0.0, requested_type="A100-80GB", requested_gpus=1))
    jobs, t = [], 0.0
    while t < 96 * HOUR:
        if rng.random() < 0.8:
            jobs.append(JobSpec(f"s{len(jobs)}", "gpt2", 8, 512, round(600 / short_it), t,
                                requested_type="A100-80GB", requested_gpus=1))
        else:
            job = JobSpec(f"l{len(jobs)}", "gpt2-large", 64, 1024, 1, t, requested_type="A100-80GB", requested_gpus=4)
            it = probe.request_rate(job)
            jobs.append(JobSpec(job.job_id, job.model, 64, 1024, round(8 * HOUR * it / 64), t,
                                requested_type="A100-80GB", requested_gpus=4))
        t += rng.expovariate(1.0 / (0.8 * 600 / 8 + 0.2 * 8 * HOUR * 4 / 8) * 2.5)
    return jobs


@pytest.fixture(scope="module")
def overload():
    return overload_trace()


def _short_slowdowns(result):
    return [r.jct_s / 600.0 for r in result.records if r.job.job_id.startswith("s")]


def test_short_jobs_keep_a_bounded_slowdown_under_sustained_overload(overload):
    g = simulate_schedule(overload, A100x8, "gpumix", error_sigma=0)
    fifo = simulate_schedule(overload, A100x8, "fifo-backfill-sized", error_sigma=0)
    assert g.num_failed == 0 and all(r.status == "done" for r in g.records)
    waits = [r.start_s - r.job.submit_s for r in fifo.records]
    assert max(waits) > 24 * HOUR  # the overload is real: arrival order leaves jobs waiting over a day
    sd, sd_fifo = _short_slowdowns(g), _short_slowdowns(fifo)
    assert percentile(sd, 99) < 0.1 * percentile(sd_fifo, 99)
    # the bound holds up to the wait for a device to come free (the long jobs hold them 8 h at most)
    assert max(sd) <= SLOWDOWN_BOUND + 8 * HOUR / 600
    assert max(r.start_s - r.job.submit_s for r in g.records if r.job.job_id.startswith("s")) < 24 * HOUR


def test_the_order_among_long_waiters_is_by_slowdown_not_by_age():
    pol = GpumixPolicy(A100x8)
    old_long = JobSpec("old", "gpt2", 8, 512, 10**6, 0.0)
    young_short = JobSpec("young", "gpt2", 8, 512, 1000, 20 * HOUR)
    now = 30 * HOUR  # both have waited past any fixed deadline
    assert pol.slowdown(now, young_short) > pol.slowdown(now, old_long)
    assert pol._key(now, young_short) < pol._key(now, old_long)  # the short one first, though younger
