"""Mixed-type gangs (planner/schedule/mixed.py): offered where one pool cannot give a job as much,
planned by the heterogeneous planner (uneven batch and shards), used by every sized policy, switched
off by --no-mixed, reported by the simulator and `planner schedule --json`."""
import json

import pytest

from contracts.cluster import ClusterSpec
from contracts.jobs import JobSpec
from planner.schedule import mixed
from planner.schedule.options import clear_caches, cluster_pools, option_plan
from planner.schedule.simulate import gang_factor, simulate_schedule
from planner.schedule.sizing import Sizing
from planner.schedule.trace import save_trace

# 4 H100s and 4 A100s on two nodes: a 7B job asked for 4 H100s runs faster on all 8 together
HA = ClusterSpec.from_dict({"name": "ha", "nodes": [{"name": "h", "gpus": {"H100-SXM": 4}},
                                                    {"name": "a", "gpus": {"A100-80GB": 4}}],
                            "network": {"intra_node_gbps": 600, "inter_node_gbps": 200}})
JOB = JobSpec("x", "llama2-7b", 64, 2048, 100, 0.0, requested_type="H100-SXM", requested_gpus=4)
SIZED = ("gpumix", "frenzy", "fifo-backfill-sized", "sjf", "srtf", "las", "gavel")


def test_gang_parts_pairs_two_pools_in_powers_of_two():
    pools = cluster_pools(HA)
    assert mixed.gang_parts(pools, [4, 4], 8) == [((0, 4), (1, 4))]
    assert mixed.gang_parts(pools, [3, 4], 8) == [((0, 2), (1, 4))]  # H100 takes 2 (of 3), A100 the rest
    assert mixed.gang_parts(pools, [4, 4], 4) == []  # either pool alone holds the target
    assert mixed.gang_parts(pools, [0, 4], 8) == []  # one pool has nothing free


def test_a_gang_is_offered_and_planned_unevenly_by_the_hetero_planner():
    sizing = Sizing(HA)
    cands = sizing.candidates(JOB, [4, 4])
    gangs = [(e, need) for e, need in cands if e[1].is_mixed]
    assert len(gangs) == 1
    (k, o, price), need = gangs[0]
    assert need == ((0, 4), (1, 4)) and o.num_gpus == 8
    fastest_one_pool = min(e[1].iteration_s for e, _ in cands if not e[1].is_mixed)
    assert o.iteration_s * mixed.MIXED_GAIN < fastest_one_pool  # kept only where >= 10 % faster
    plan = option_plan(JOB, o)
    h = [a for a in plan.assignments if a.type == "H100-SXM"]
    a = [a for a in plan.assignments if a.type == "A100-80GB"]
    assert len(h) == len(a) == 4 and sum(x.batch for x in plan.assignments) == JOB.global_batch
    assert h[0].batch > a[0].batch  # uneven batch: the faster type takes more
    assert sum(x.shard_fraction for x in plan.assignments) == pytest.approx(1.0)
    assert plan.predicted_iteration_s == pytest.approx(o.iteration_s)
    d = o.to_dict()
    assert [p["gpu_type"] for p in d["pools"]] == ["H100-SXM", "A100-80GB"] and d["num_gpus"] == 8
    assert len(d["per_device"]) == 8 and "gpu_type" not in d
    # the gang is not offered when the free devices do not make one
    assert not [e for e, _ in sizing.candidates(JOB, [4, 0]) if e[1].is_mixed]


def test_gang_pricing_is_cached_and_bounded_per_decision(monkeypatch):
    clear_caches()
    solves = []
    real = mixed._solve
    monkeypatch.setattr(mixed, "_solve", lambda *a: solves.append(a) or real(*a))
    sizing = Sizing(HA)
    sizing.new_decision()
    sizing.candidates(JOB, [4, 4])
    sizing.candidates(JOB, [4, 4])
    other = JobSpec("y", JOB.model, JOB.global_batch, JOB.seq, 5000, 10.0, requested_type="H100-SXM", requested_gpus=4)
    sizing.candidates(other, [4, 4])  # the same shape: the same gang's plan
    assert len(solves) == 1
    clear_caches()  # the decision's budget spent: a gang not priced yet waits for a later decision
    fresh = Sizing(HA)
    fresh._solves_left = 0
    assert not [e for e, _ in fresh.candidates(JOB, [4, 4]) if e[1].is_mixed]


@pytest.mark.parametrize("policy", SIZED)
def test_every_sized_policy_runs_a_gang_and_no_mixed_keeps_one_pool(policy):
    with_gang = simulate_schedule([JOB], HA, policy, error_sigma=0)
    one_pool = simulate_schedule([JOB], HA, policy, error_sigma=0, mixed=False)
    assert with_gang.num_mixed_gang_jobs == 1 and with_gang.records[0].option.is_mixed
    assert one_pool.num_mixed_gang_jobs == 0 and not one_pool.records[0].option.is_mixed
    assert with_gang.avg_jct_s < 0.9 * one_pool.avg_jct_s
    types = {d.type for _, d in HA.devices()}
    assert {[*HA.devices()][i][1].type for i in with_gang.records[0].devices} == types  # devices of both pools


def test_a_gang_runs_at_its_slowest_types_error():
    o = simulate_schedule([JOB], HA, "gpumix", error_sigma=0).records[0].option
    factors = {("x", "H100-SXM"): 1.3, ("x", "A100-80GB"): 0.9}
    assert gang_factor(lambda j, t: factors[(j, t)], "x", o) == 1.3
    r = simulate_schedule([JOB], HA, "gpumix", error_seed=4).records[0]
    from planner.schedule.simulate import error_factor
    assert r.error_factor == max(error_factor(4, "x", t) for t in ("H100-SXM", "A100-80GB"))


def test_cli_reports_mixed_gangs_and_no_mixed_turns_them_off(tmp_path, capsys):
    from contracts.cli import main as cli_main
    from planner.__main__ import COMMANDS

    def main(argv):
        return cli_main("python -m planner", COMMANDS, argv)

    cluster_path, trace_path = str(tmp_path / "c.json"), str(tmp_path / "t.csv")
    HA.save(cluster_path)
    save_trace([JOB, JobSpec("y", "gpt2", 8, 512, 100, 5.0)], trace_path)
    argv = ["schedule", "--cluster", cluster_path, "--trace", trace_path, "--json"]
    assert main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["num_mixed_gang_jobs"] == 1 and out["mixed_allowed"] is True
    row = next(r for r in out["jobs"] if r["job_id"] == "x")
    assert row["mixed_gang"] and {p["gpu_type"] for p in row["option"]["pools"]} == {"H100-SXM", "A100-80GB"}
    assert main(argv + ["--no-mixed"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["num_mixed_gang_jobs"] == 0 and out["mixed_allowed"] is False
    assert all("gpu_type" in r["option"] and "pools" not in r["option"] for r in out["jobs"])
    assert main(["schedule", "--cluster", cluster_path, "--trace", trace_path]) == 0
    assert "num_mixed_gang_jobs" in capsys.readouterr().out  # the table names the count too
