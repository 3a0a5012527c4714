"""The geo scenario file: round trip, validation errors, and the TCP link model."""
import copy
import json

import pytest

from planner.geo.scenario import DEFAULT_TCP_WINDOW_BYTES, GeoScenario, WanLink

DESIGN_EXAMPLE = {  # DESIGN.md's geo scenario, verbatim
    "datacenters": [{"name": "dc-a", "gpus": {"A100-80GB": 64}}, {"name": "dc-b", "gpus": {"H100-SXM": 32}}],
    "wan": [{"a": "dc-a", "b": "dc-b", "gbps": 10, "rtt_ms": 60, "per_connection_gbps": 1.0}],
    "model": "llama2-7b", "global_batch": 512, "micro_batch": 1, "seq": 4096,
    "inference": {"model": "llama3-8b", "prompt_tokens": 2048, "requests_per_s": 50},
}


def test_design_example_round_trips(tmp_path):
    sc = GeoScenario.from_dict(DESIGN_EXAMPLE)
    assert sc.datacenter("dc-b").num_gpus == 32
    assert sc.inference.mean_prompt_tokens == 2048 and sc.inference.requests_per_s == 50
    again = GeoScenario.from_dict(json.loads(json.dumps(sc.to_dict())))
    assert again == sc
    path = tmp_path / "g.json"
    path.write_text(json.dumps(DESIGN_EXAMPLE))
    assert GeoScenario.load(str(path)).name == "g"  # named after its file


def test_prompt_distribution_and_backlog():
    d = copy.deepcopy(DESIGN_EXAMPLE)
    d["inference"] = {"model": "llama3-8b", "prompt_tokens": {"tokens": [100, 300], "weights": [3, 1]}, "backlog": True}
    inf = GeoScenario.from_dict(d).inference
    assert inf.backlog and inf.requests_per_s is None
    assert inf.prompt_tokens == ((100, 0.75), (300, 0.25)) and inf.mean_prompt_tokens == pytest.approx(150)


def mutate(path, value):
    d = copy.deepcopy(DESIGN_EXAMPLE)
    node = d
    for k in path[:-1]:
        node = node[k]
    if value is KeyError:
        del node[path[-1]]
    else:
        node[path[-1]] = value
    return d


@pytest.mark.parametrize("path,value,match", [
    (("wan", 0, "b"), "dc-z", "unknown datacenter 'dc-z'"),
    (("datacenters", 0, "gpus"), {"A100-81GB": 4}, "unknown GPU type 'A100-81GB'"),
    (("wan",), [], "no wan link connects datacenters \\['dc-b'\\]"),
    (("wan", 0, "gbps"), -1, "gbps must be a positive number"),
    (("wan", 0, "rtt_ms"), "60", "rtt_ms must be a positive number"),
    (("datacenters", 1, "gpus"), {"H100-SXM": 2.5}, "count of H100-SXM must be a positive integer"),
    (("global_batch",), 0, "global_batch must be a positive integer"),
    (("micro_batch",), 3, "not a multiple of micro_batch 3"),
    (("model",), "llama9-1t", "unknown model"),
    (("wan", 0, "speed"), 1, "unknown keys \\['speed'\\]"),
    (("inference", "backlog"), True, "either 'requests_per_s' or 'backlog'"),
    (("inference", "backlog"), 5, "'backlog' must be true or false"),
    (("inference", "requests_per_s"), KeyError, "give 'requests_per_s'"),
    (("datacenters", 1, "name"), "dc-a", "names repeat"),
])
def test_validation_errors_name_the_problem(path, value, match):
    with pytest.raises(ValueError, match=match):
        GeoScenario.from_dict(mutate(path, value))


def test_missing_link_between_datacenters_used_by_a_plan():
    sc = GeoScenario.from_dict(DESIGN_EXAMPLE)
    with pytest.raises(ValueError, match="no wan link between datacenters 'dc-a' and 'dc-x'"):
        sc.link("dc-a", "dc-x")


def test_one_connection_is_window_over_rtt_and_k_connections_scale_to_the_link():
    # 6 MiB window over 100 ms: 6·2^20·8 / 0.1 s = 0.503 Gbit/s
    link = WanLink("a", "b", gbps=2.0, rtt_ms=100)
    one = DEFAULT_TCP_WINDOW_BYTES * 8 / 0.1 / 1e9
    assert link.single_connection_gbps() == pytest.approx(one)
    assert link.throughput_gbps(3) == pytest.approx(3 * one)
    assert link.throughput_gbps(10) == pytest.approx(2.0)  # the link caps it
    assert link.connections_to_saturate() == 4
    # a measured per-connection rate replaces the window; it never exceeds the link
    assert WanLink("a", "b", 10.0, 60, per_connection_gbps=1.0).connections_to_saturate() == 10
    assert WanLink("a", "b", 0.05, 200, per_connection_gbps=1.0).single_connection_gbps() == pytest.approx(0.05)
    # 100 MB over one connection: 50 ms one way + 0.8 Gbit / 0.503 Gbit/s; over four: the 2 Gbit/s link
    assert link.transfer_time_s(100e6, 1) == pytest.approx(0.05 + 0.8 / one)
    assert link.transfer_time_s(100e6, 4) == pytest.approx(0.05 + 0.4)
    # twice the RTT halves one connection's rate (bandwidth-delay product)
    assert WanLink("a", "b", 100.0, 200).single_connection_gbps() == pytest.approx(one / 2)
    with pytest.raises(ValueError):
        link.throughput_gbps(0)


@pytest.mark.timeout(20)
@pytest.mark.parametrize("global_batch", [10**6, 10**9])
def test_a_huge_global_batch_is_refused_at_once_naming_the_limit(global_batch):
    """Issue 17: a global batch of 1e6 ran `planner geo` to 9.6 GB (one simulated op per
    micro-batch); the micro-batch count per iteration is bounded, and the refusal says how to fix it."""
    import time

    from planner.geo.scenario import MAX_MICROBATCHES

    d = {**copy.deepcopy(DESIGN_EXAMPLE), "global_batch": global_batch}
    t0 = time.perf_counter()
    with pytest.raises(ValueError, match=f"limit of {MAX_MICROBATCHES}.*raise micro_batch"):
        GeoScenario.from_dict(d)
    assert time.perf_counter() - t0 < 5.0  # a guard against a regression to simulating, not a benchmark
    d["micro_batch"] = global_batch // MAX_MICROBATCHES * 2  # within the limit: accepted
    d["global_batch"] = d["micro_batch"] * (MAX_MICROBATCHES // 2)
    assert GeoScenario.from_dict(d).global_batch == d["global_batch"]


@pytest.mark.parametrize("path, value, match", [
    (("seq",), 10**9, "seq"),
    (("datacenters", 0, "gpus", "A100-80GB"), 10**15, "over the limit"),
    (("wan", 0, "gbps"), float("inf"), "gbps"),
    (("wan", 0, "rtt_ms"), float("nan"), "rtt_ms"),
    (("dtype",), ["bf16"], "dtype"),
    (("global_batch",), 10**13, "global_batch"),
])
def test_absurd_numbers_and_wrong_types_are_refused(tmp_path, path, value, match):
    with pytest.raises(ValueError, match=match):
        GeoScenario.from_dict(mutate(path, value))


def test_the_pipeline_simulator_refuses_a_job_past_its_operation_limit():
    from planner.geo.pipeline_sim import MAX_SIMULATED_OPS, Channel, PipelineJob, Stage, simulate_pipeline

    job = PipelineJob((Stage(1.0, 2.0), Stage(1.0, 2.0)), ("lan",), (Channel("lan", 0.0, 100.0, 100.0),), 1,
                      MAX_SIMULATED_OPS, 1e6, "gpipe")
    with pytest.raises(ValueError, match="over the limit"):
        simulate_pipeline(job)
