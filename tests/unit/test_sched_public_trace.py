"""The public-trace converter (planner/schedule/trace.py): the ITP CSV format (job_id,
submission_time, duration, num_gpu) to GPUMix jobs, seeded, each lasting its recorded duration on
its request; bad CSV gets a message naming the line."""
import math

import pytest

from planner.schedule.trace import (DEMO_CLUSTERS, MODELS_BY_GPUS, convert_public_trace, mixed_cluster,
                                    parse_public_trace, request_duration_s)

CLUSTER = mixed_cluster(DEMO_CLUSTERS[256])
HEADER = "job_id,submission_time,duration,num_gpu\n"
ROWS = [("a", 100, 3600, 1), ("b", 200, 7200, 8), ("c", 250, 900, 2), ("d", 5000, 36000, 64), ("e", 9000, 600, 4),
        ("f", 90000, 1800, 1)]
TEXT = HEADER + "".join(f"{j},{s},{d},{n}\n" for j, s, d, n in ROWS)


def test_parse_reads_every_row():
    rows = parse_public_trace(TEXT)
    assert [(r.job_id, r.submit_s, r.duration_s, r.num_gpus) for r in rows] == \
        [(j, float(s), float(d), n) for j, s, d, n in ROWS]


@pytest.mark.parametrize("text, words", [
    ("job,submit,duration,num_gpu\na,1,2,1\n", ["bad header", "job_id,submission_time,duration,num_gpu"]),
    (HEADER + "a,1,60,1\nb,2,-5,1\n", ["line 3", "'duration'", "-5"]),
    (HEADER + "a,1,60,1\nb,x,60,1\n", ["line 3", "'submission_time'"]),
    (HEADER + "a,1,60,1\nb,2,60,0\n", ["line 3", "'num_gpu'", "positive integer"]),
    (HEADER + "a,1,60,1\nb,2,60,2.5\n", ["line 3", "'num_gpu'"]),
    (HEADER + "a,1,60,1\na,2,60,1\n", ["line 3", "duplicate id"]),
    (HEADER + "a,1,60\n", ["line 2", "expected 4 columns"]),
    (HEADER + "a,1,nan,1\n", ["line 2", "'duration'"]),
    (HEADER, ["no jobs"]),
])
def test_bad_csv_is_refused_naming_the_line(text, words):
    with pytest.raises(ValueError) as e:
        parse_public_trace(text, source="t.csv")
    for w in words:
        assert w in str(e.value)
    assert str(e.value).startswith("t.csv")


def test_conversion_is_seeded_and_keeps_arrivals_counts_and_durations():
    rows = parse_public_trace(TEXT)
    jobs = convert_public_trace(rows, CLUSTER, seed=1, start_s=0, end_s=86400)
    assert [j.job_id for j in jobs] == ["a", "b", "c", "d", "e"]  # f is past the window
    assert jobs == convert_public_trace(rows, CLUSTER, seed=1, start_s=0, end_s=86400)
    other = convert_public_trace(rows, CLUSTER, seed=2, start_s=0, end_s=86400)
    assert [(j.model, j.requested_type) for j in other] != [(j.model, j.requested_type) for j in jobs]
    pools = {d.type for _, d in CLUSTER.devices()}
    by_id = {r.job_id: r for r in rows}
    for j in jobs:
        r = by_id[j.job_id]
        assert j.submit_s == r.submit_s and j.requested_gpus == r.num_gpus and j.requested_type in pools
        # steps such that the job on its request lasts its recorded duration (to one step)
        on_request = request_duration_s(j, CLUSTER)
        assert math.isfinite(on_request) and abs(on_request - r.duration_s) <= on_request / j.steps + 1e-6
        bucket = next(models for top, models in MODELS_BY_GPUS if top >= j.requested_gpus)
        assert j.model in {m for m, _ in bucket}
        assert j.global_batch >= j.requested_gpus


def test_window_shifts_arrivals_and_an_empty_window_is_refused():
    rows = parse_public_trace(TEXT)
    jobs = convert_public_trace(rows, CLUSTER, seed=0, start_s=200, end_s=10000)
    assert [(j.job_id, j.submit_s) for j in jobs] == [("b", 0.0), ("c", 50.0), ("d", 4800.0), ("e", 8800.0)]
    with pytest.raises(ValueError, match="no job submitted"):
        convert_public_trace(rows, CLUSTER, seed=0, start_s=10**6, end_s=10**6 + 10)
    with pytest.raises(ValueError, match="empty window"):
        convert_public_trace(rows, CLUSTER, seed=0, start_s=5, end_s=5)


def test_a_count_past_every_pool_is_capped_at_the_largest():
    rows = parse_public_trace(HEADER + "big,0,3600,512\n")
    [job] = convert_public_trace(rows, CLUSTER, seed=0)
    assert job.requested_gpus == max(DEMO_CLUSTERS[256].values())
