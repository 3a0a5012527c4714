import math

import pytest

from contracts.cluster import ClusterSpec
from contracts.jobs import JobSpec
from planner.schedule.options import MEMORY_HEADROOM, cluster_pools, estimate_option, estimate_options

CLUSTER = ClusterSpec.from_dict({"name": "t", "nodes": [
    {"name": "a", "gpus": {"A100-80GB": 8}},
    {"name": "v", "gpus": {"V100-32GB": 8}},
    *({"name": f"t{k}", "gpus": {"T4": 8}} for k in range(4))]})


def _pool(t):
    return next(p for p in cluster_pools(CLUSTER) if p.device.type == t)


def test_pools_count_devices_and_largest_node_group():
    t4 = _pool("T4")
    assert (t4.count, t4.max_per_node) == (32, 8)


@pytest.mark.parametrize("model, seq, batch", [("gpt2", 1024, 64), ("llama2-7b", 4096, 64),
                                               ("llama2-13b", 4096, 32)])
def test_every_option_fits_and_the_smallest_count_is_minimal(model, seq, batch):
    job = JobSpec("j", model, batch, seq, 100, 0.0)
    opts = estimate_options(job, CLUSTER)
    assert opts, "a 64-GPU-class cluster fits every preset up to 13B"
    for o in opts:
        assert o.peak_memory_bytes <= o.capacity_bytes * MEMORY_HEADROOM
        assert o.num_gpus * o.micro_batch * o.accum_steps >= batch
        assert o.duration_s == pytest.approx(o.iteration_s * 100)
    by_type = {}
    for o in opts:
        by_type.setdefault(o.gpu_type, []).append(o)
    for t, front in by_type.items():
        smallest = front[0].num_gpus
        if smallest > 1:  # half as many devices of that type must not fit
            assert estimate_option(job, _pool(t), smallest // 2, inter_node_gbps=100.0) is None
        durations = [o.duration_s for o in front]
        assert durations == sorted(durations, reverse=True) and len(set(durations)) == len(durations)


def test_a_13b_model_needs_more_16gb_parts_than_80gb_ones():
    # 32 samples of 4,096 tokens: at zero 3 the runtime keeps every micro-batch's unit boundaries
    # (fp32 residual stream), so a batch of 128 fits on none of these pools at all
    job = JobSpec("j", "llama2-13b", 32, 4096, 10, 0.0)
    opts = estimate_options(job, CLUSTER)
    first = {o.gpu_type: o.num_gpus for o in reversed(opts)}
    assert estimate_option(job, _pool("T4"), 1) is None
    assert first.get("T4", math.inf) > first["A100-80GB"]  # more T4s than A100s, or none at all


def test_more_gpus_than_samples_is_not_an_option():
    job = JobSpec("j", "gpt2", 2, 128, 10, 0.0)
    assert estimate_option(job, _pool("T4"), 4) is None
    assert max(o.num_gpus for o in estimate_options(job, CLUSTER)) <= 2


def test_unknown_model_raises():
    with pytest.raises(ValueError, match="unknown model"):
        estimate_options(JobSpec("j", "nope", 8, 128, 10, 0.0), CLUSTER)
