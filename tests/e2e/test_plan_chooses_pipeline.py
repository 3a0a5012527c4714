"""`python -m planner plan --cluster C` chooses pipeline stages when they beat data parallelism.

Two nodes of one A100 each training tinyllama-1.1b (untied, 22 layers) at seq 2048: across a
10 Gbit/s link the data-parallel all-reduce of 1.1 B gradients costs more than a node's compute,
so the ILP keeps one node; a 2-stage pipeline over both nodes sends only activations and wins.
At 400 Gbit/s the all-reduce is cheap and data parallelism over both nodes beats the pipeline's
bubble. The same comparison without --json prints both times; --no-pipeline keeps DP.
"""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from contracts.cluster import ClusterSpec
from contracts.plan import Plan
from planner.geo.cluster_plan import choose_plan, cluster_scenario, solve_cluster_pipeline, why_not
from planner.geo.emulated import predict_plan
from planner.entry import plan_job
from planner.hetero.solve import solve_plan

MODEL, BATCH, SEQ, DTYPE = "tinyllama-1.1b", 32, 2048, "bf16"


def cluster(gbps: float, per_node: int = 1) -> dict:
    return {"name": f"two-nodes-{gbps:g}",
            "nodes": [{"name": "n0", "gpus": {"A100-80GB": per_node}}, {"name": "n1", "gpus": {"A100-80GB": per_node}}],
            "network": {"intra_node_gbps": 300, "inter_node_gbps": gbps}}


def plan_cli(tmp_path, spec: dict, *extra: str) -> subprocess.CompletedProcess:
    path = tmp_path / "cluster.json"
    path.write_text(json.dumps(spec))
    return subprocess.run([sys.executable, "-m", "planner", "plan", "--cluster", str(path), "--model", MODEL,
                           "--global-batch", str(BATCH), "--seq", str(SEQ), "--dtype", DTYPE, *extra],
                          capture_output=True, text=True, timeout=120)


def test_a_slow_inter_node_link_chooses_a_pipeline_faster_than_data_parallelism(tmp_path):
    proc = plan_cli(tmp_path, cluster(10), "--json", "--out", str(tmp_path / "plan.json"))
    assert proc.returncode == 0, proc.stderr
    printed = json.loads(proc.stdout)
    assert "pipeline" in printed
    plan = Plan.load(str(tmp_path / "plan.json"))
    p = plan.pipeline
    assert p is not None and len(p.stages) >= 2 and sum(st.num_layers for st in p.stages) == 22
    assert {plan.cluster.devices()[st.devices[0]][0].name for st in p.stages} == {"n0", "n1"}
    dp = plan.baselines["data_parallel"]
    assert not dp.oom and plan.predicted_iteration_s < dp.predicted_iteration_s
    # the DP time is the ILP's own plan on the same cluster, the pipeline's its simulation
    ilp = solve_plan(ClusterSpec.from_dict(cluster(10)), MODEL, BATCH, seq=SEQ, dtype=DTYPE).plan
    assert dp.predicted_iteration_s == pytest.approx(ilp.predicted_iteration_s, rel=1e-9)
    assert plan.predicted_iteration_s == pytest.approx(predict_plan(plan)[0], rel=1e-12)
    assert any(n.startswith("pipeline chosen") and f"{dp.predicted_iteration_s:.4g}" in n for n in plan.notes)
    assert not plan.wan  # a real cluster's network: nothing to emulate


def test_a_fast_link_keeps_data_parallelism(tmp_path):
    proc = plan_cli(tmp_path, cluster(400), "--json")
    assert proc.returncode == 0, proc.stderr
    printed = json.loads(proc.stdout)
    assert "pipeline" not in printed
    plan = Plan.from_dict(printed)
    ilp = solve_plan(ClusterSpec.from_dict(cluster(400)), MODEL, BATCH, seq=SEQ, dtype=DTYPE).plan
    assert [a.to_dict() for a in plan.assignments] == [a.to_dict() for a in ilp.assignments]
    assert plan.predicted_iteration_s == ilp.predicted_iteration_s
    pp = plan.baselines["pipeline"]
    assert not pp.oom and pp.predicted_iteration_s > plan.predicted_iteration_s
    assert any(n.startswith("data parallelism kept") for n in plan.notes)


def test_the_table_says_both_times_and_no_pipeline_keeps_dp(tmp_path):
    proc = plan_cli(tmp_path, cluster(10))
    assert proc.returncode == 0, proc.stderr
    assert "pipeline chosen" in proc.stdout and "data_parallel:" in proc.stdout and "stage" in proc.stdout
    proc = plan_cli(tmp_path, cluster(10), "--json", "--no-pipeline")
    assert proc.returncode == 0, proc.stderr
    assert "pipeline" not in json.loads(proc.stdout)


def test_the_choice_follows_the_link_rate():
    """Below the link rate where DP's all-reduce outweighs the pipeline's bubble the pipeline wins,
    above it DP: the choice is the faster one each time."""
    gains = []
    for gbps in (5, 10, 400):
        c = ClusterSpec.from_dict(cluster(gbps))
        dp = solve_plan(c, MODEL, BATCH, seq=SEQ, dtype=DTYPE).plan
        option = solve_cluster_pipeline(c, MODEL, BATCH, SEQ, DTYPE)
        assert option.plan is not None, option.reason
        gains.append(dp.predicted_iteration_s / option.plan.predicted_iteration_s)
        chosen = plan_job(c, MODEL, BATCH, seq=SEQ, dtype=DTYPE).plan  # what every caller gets
        assert (chosen.pipeline is not None) == (gains[-1] > 1)
        expected = choose_plan(dp, option)
        # the same plan; plan_job ends its notes with one per device kind naming the profile it was priced
        # by, in place of any the pipeline plan carried
        assert chosen.to_dict() | {"solve_s": 0, "notes": []} == expected.to_dict() | {"solve_s": 0, "notes": []}
        kinds = list(dict.fromkeys(chosen.cluster.devices()[a.device_index][1].profile_key
                                   for a in chosen.assignments if a.used))
        named = tuple(f"profile {k}:" for k in kinds)
        assert [n for n in chosen.notes if not n.startswith(named)] == [n for n in expected.notes
                                                                         if not n.startswith(named)]
        assert [n.split(":")[0] for n in chosen.notes[-len(kinds):]] == [f"profile {k}" for k in kinds]
        assert sum(n.startswith(named) for n in chosen.notes) == len(kinds)
    assert gains[0] > 1 and gains[1] > 1 > gains[2]


def test_clusters_the_geo_search_cannot_price_keep_dp_and_say_why():
    one = ClusterSpec.from_dict({"name": "one", "nodes": [{"name": "n0", "gpus": {"A100-80GB": 2}}]})
    assert "one node" in why_not(one)
    emu = ClusterSpec.from_dict({"name": "emu", "nodes": [{"name": "n0", "gpus": [{"type": "cpu", "slowdown": 2}]},
                                                          {"name": "n1", "gpus": {"cpu": 1}}]})
    assert "emulated" in why_not(emu)
    kept = plan_job(emu, "tiny", 4).plan
    assert kept.pipeline is None and any("emulated" in n for n in kept.notes)
    sc = cluster_scenario(ClusterSpec.from_dict(cluster(10, 2)), MODEL, BATCH, SEQ, DTYPE, 1)
    assert [dc.name for dc in sc.datacenters] == ["n0", "n1"] and sc.wan[0].gbps == 10
