"""planner/geo/costs.py: a bucketed gradient all-reduce overlapped with the backward, hand-solved."""
import pytest

from planner.costmodel.collectives import Link, all_reduce_s
from planner.geo.costs import (estimate_best_bucketed_allreduce, estimate_overlapped_allreduce,
                               uniform_ready)

# 1 GB/s, 10 ms per call: a 2-rank ring all-reduce of b bytes takes b / 1e9 + 0.02 s
LINK = Link(1e9, call_latency_s=0.01)


def test_buckets_issued_as_ready_run_back_to_back():
    """Four 100 MB pieces ready at 0.1 .. 0.4 s, 100 MB buckets of 0.12 s each: the first starts at
    0.1 s, the others queue behind it, so the last ends at 0.1 + 4 × 0.12 = 0.58 s, 0.18 s after
    the backward."""
    ready = [(0.1 * (i + 1), 1e8) for i in range(4)]
    est = estimate_overlapped_allreduce(ready, 2, LINK, bucket_bytes=1e8)
    assert all_reduce_s(1e8, 2, LINK) == pytest.approx(0.12)
    assert est.num_buckets == 4
    assert est.end_s == pytest.approx(0.58)
    assert est.exposed_s == pytest.approx(0.18)
    assert est.total_comm_s == pytest.approx(0.48)
    assert est.hidden_s == pytest.approx(0.30)


def test_one_bucket_is_the_unoverlapped_all_reduce():
    ready = [(0.1 * (i + 1), 1e8) for i in range(4)]
    est = estimate_overlapped_allreduce(ready, 2, LINK, bucket_bytes=float("inf"))
    assert est.num_buckets == 1
    assert est.exposed_s == pytest.approx(all_reduce_s(4e8, 2, LINK))


def test_a_slow_backward_hides_all_but_the_last_bucket():
    """Pieces 1 s apart, each bucket 0.12 s: every bucket ends before the next is ready, so only the
    last one's 0.12 s is exposed."""
    ready = [(1.0 * (i + 1), 1e8) for i in range(4)]
    assert estimate_overlapped_allreduce(ready, 2, LINK, 1e8).exposed_s == pytest.approx(0.12)


def test_the_best_bucket_size_wins_and_is_never_above_no_overlap():
    """On a 1 s-per-call link small buckets pay the latency each time: the best choice is fewer,
    larger buckets, and never worse than one bucket (no overlap)."""
    slow = Link(1e9, call_latency_s=1.0)
    ready = uniform_ready(0.0, 1.0, 4e8, 40)
    best = estimate_best_bucketed_allreduce(ready, 2, slow, (1e7, 1e8, float("inf")))
    small = estimate_overlapped_allreduce(ready, 2, slow, 1e7)
    one = estimate_overlapped_allreduce(ready, 2, slow, float("inf"))
    assert best.end_s <= min(small.end_s, one.end_s)
    assert small.num_buckets == 40 and best.num_buckets < 40
    assert best.exposed_s <= one.exposed_s


def test_uniform_ready_spreads_the_bytes_over_the_backward():
    ready = uniform_ready(2.0, 4.0, 100.0, 4)
    assert ready == [(2.5, 25.0), (3.0, 25.0), (3.5, 25.0), (4.0, 25.0)]


@pytest.mark.parametrize("ready,world,bucket,match", [
    ([], 2, 1e8, "no gradient pieces"),
    ([(0.0, -1.0)], 2, 1e8, "piece of -1.0 bytes"),
    ([(0.0, 1.0)], 0, 1e8, "world_size must be >= 1"),
    ([(0.0, 1.0)], 2, 0, "bucket_bytes must be > 0"),
])
def test_bad_input_is_refused_with_its_reason(ready, world, bucket, match):
    with pytest.raises(ValueError, match=match):
        estimate_overlapped_allreduce(ready, world, LINK, bucket)
