"""The floor every sized policy shares (planner/schedule/sizing.py MIN_SHARE): no job starts on less
than half the throughput of what its user asked for (a long job is never started on 2 of its 8 GPUs)."""
import pytest

from contracts.cluster import ClusterSpec
from contracts.jobs import JobSpec
from planner.schedule.simulate import simulate_schedule
from planner.schedule.sizing import MIN_SHARE, Sizing
from planner.schedule.trace import generate_trace

A100x8 = ClusterSpec.from_dict({"name": "a8", "nodes": [{"name": "n", "gpus": {"A100-80GB": 8}}]})
MIX = ClusterSpec.from_dict({"name": "mix", "nodes": [
    {"name": "a0", "gpus": {"A100-80GB": 8}}, {"name": "v0", "gpus": {"V100-32GB": 8}}, {"name": "t0", "gpus": {"T4": 8}}]})
SIZED = ("gpumix", "frenzy", "fifo-backfill-sized", "sjf", "srtf", "las", "gavel")


def test_a_long_job_asked_for_8_gpus_is_not_started_on_2():
    long_job = JobSpec("long", "gpt2-large", 64, 1024, 10**6, 10.0, requested_type="A100-80GB", requested_gpus=8)
    assert Sizing(A100x8).choose(long_job, [2]) is None  # 2 free: it waits
    no_floor = Sizing(A100x8, min_share=0.0).choose(long_job, [2])  # what the sized baselines did before
    assert no_floor is not None and no_floor[1].num_gpus == 2
    need, o = Sizing(A100x8).choose(long_job, [8])
    assert o.samples_per_s >= MIN_SHARE * Sizing(A100x8).request_rate(long_job)


@pytest.mark.parametrize("policy", SIZED)
def test_every_placement_keeps_the_floor(policy):
    trace = generate_trace(9, 60, MIX, load=0.9)
    sizing = Sizing(MIX)
    for r in simulate_schedule(trace, MIX, policy).records:
        for o in (r.option, r.final_option):
            assert o.samples_per_s >= MIN_SHARE * sizing.request_rate(r.job) * (1 - 1e-9)
