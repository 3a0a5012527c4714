import math

import pytest

from contracts.cluster import ClusterSpec
from planner.schedule.options import cluster_pools, estimate_option
from contracts.specs import get_model
from planner.schedule.trace import COLUMNS, generate_trace, load_trace, parse_trace_csv, save_trace, write_trace_csv

CLUSTER = ClusterSpec.from_dict({"name": "mix", "nodes": [
    {"name": "a0", "gpus": {"A100-80GB": 8}}, {"name": "h0", "gpus": {"H100-SXM": 8}},
    {"name": "v0", "gpus": {"V100-32GB": 8}}, {"name": "t0", "gpus": {"T4": 8}}, {"name": "t1", "gpus": {"T4": 8}}]})
HEADER = ",".join(COLUMNS)


@pytest.fixture(scope="module")
def trace():
    return generate_trace(seed=11, num_jobs=300, cluster=CLUSTER)


def test_generator_is_seeded_and_round_trips_through_csv(trace, tmp_path):
    assert generate_trace(seed=11, num_jobs=300, cluster=CLUSTER) == trace
    assert generate_trace(seed=12, num_jobs=300, cluster=CLUSTER) != trace
    path = str(tmp_path / "t.csv")
    save_trace(trace, path)
    back = load_trace(path)
    assert [j.job_id for j in back] == [j.job_id for j in trace]
    assert all(a.submit_s == pytest.approx(b.submit_s) and a.steps == b.steps for a, b in zip(back, trace))


def test_generated_mix_is_realistic(trace):
    params = [get_model(j.model).num_params for j in trace]
    assert min(params) < 130e6 and max(params) > 12e9  # 125M to 13B
    submits = [j.submit_s for j in trace]
    assert submits == sorted(submits)
    gaps = sorted(b - a for a, b in zip(submits, submits[1:]))
    assert gaps[len(gaps) // 4] < 0.1 * gaps[len(gaps) // 2 + len(gaps) // 4]  # bursts: many near-zero gaps
    pools = {p.device.type: p for p in cluster_pools(CLUSTER)}
    durations, over, under = [], 0, 0
    for j in trace:
        pool = pools[j.requested_type]  # every request names a type the cluster has, at a count it has
        assert j.requested_gpus <= pool.count
        smallest = next(n for n in (1, 2, 4, 8, 16) if estimate_option(j, pool, n) is not None)
        over += j.requested_gpus > smallest
        under += j.requested_gpus < smallest
        durations.append(j.steps * estimate_option(j, pool, max(smallest, j.requested_gpus)).iteration_s)
    assert math.log10(max(durations) / min(durations)) >= 2  # orders of magnitude
    assert over > len(trace) * 0.2 and under > 0  # users over-size often, under-size sometimes


@pytest.mark.parametrize("text, words", [
    ("job,submit\n", "bad header"),
    ("", "bad header"),
    (HEADER + "\n", "no jobs"),
    (HEADER + "\na,0,gpt5,8,128,10,,\n", "line 2, column 'model'"),
    (HEADER + "\na,0,gpt2,8,128,10,,\nb,x,gpt2,8,128,10,,\n", "line 3, column 'submit_s'"),
    (HEADER + "\na,0,gpt2,0,128,10,,\n", "column 'global_batch'"),
    (HEADER + "\na,0,gpt2,8,12.5,10,,\n", "column 'seq'"),
    (HEADER + "\na,0,gpt2,8,128,-3,,\n", "column 'steps'"),
    (HEADER + "\na,0,gpt2,8,128,10,Z80,2\n", "column 'requested_type'"),
    (HEADER + "\na,0,gpt2,8,128,10,T4,\n", "column 'requested_gpus'"),
    (HEADER + "\na,0,gpt2,8,128,10,T4,two\n", "column 'requested_gpus'"),
    (HEADER + "\na,0,gpt2,8,128,10,,\na,1,gpt2,8,128,10,,\n", "duplicate"),
    (HEADER + "\na,0,gpt2,8,128\n", "columns"),
])
def test_parse_errors_name_line_and_column(text, words):
    with pytest.raises(ValueError, match=words):
        parse_trace_csv(text, source="t.csv")


def test_empty_request_is_allowed():
    jobs = parse_trace_csv(HEADER + "\na,0,gpt2,8,128,10,,\n")
    assert jobs[0].requested_type is None and jobs[0].requested_gpus is None
    assert write_trace_csv(jobs).splitlines()[1] == "a,0,gpt2,8,128,10,,"
