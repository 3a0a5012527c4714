"""`python -m planner geo --out P`: the plan file executor launch runs, and its prediction.

The plan file must be loadable, cover the model's layers in stages of at least one layer each, put
the d replicas of a stage on its datacenter's node with the per-pipeline micro-batch each, carry the
scenario's links, and predict exactly what planner/geo/emulated.py simulates for it. The prediction
itself is checked against hand arithmetic: the units' compute sums to the measured profile's
α + β·b, and a one-micro-batch pipeline's iteration is the sum of its steps.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace

import pytest

from contracts.plan import Plan, link_key
from planner.core.profiles import StepProfile, save_step_profile
from contracts.specs import get_model
from planner.geo.emulated import build_plan_job, predict_dp_plan, predict_plan
from planner.geo.plan_file import check_runnable
from planner.geo.scenario import GeoScenario

# two "datacenters" of one CPU rank each: a pipeline over them halves the compute of one rank
CPU_SCENARIO = {"name": "cpu2", "datacenters": [{"name": "dc-a", "gpus": {"cpu": 1}}, {"name": "dc-b", "gpus": {"cpu": 1}}],
                "wan": [{"a": "dc-a", "b": "dc-b", "gbps": 1.0, "rtt_ms": 1.0}],
                "model": "small", "global_batch": 8, "micro_batch": 1, "seq": 64, "dtype": "fp32"}


def run_geo(tmp_path, scenario: dict, *extra: str, env: dict | None = None):
    path = tmp_path / "scenario.json"
    path.write_text(json.dumps(scenario))
    out = tmp_path / "plan.json"
    proc = subprocess.run([sys.executable, "-m", "planner", "geo", "--scenario", str(path), "--out", str(out),
                           "--json", *extra], capture_output=True, text=True, timeout=120,
                          env={**os.environ, **(env or {})})
    return proc, out


def measured_cpu_profile(store: str, model: str = "small", seq: int = 64) -> StepProfile:
    """'Measured' cpu profiles in a private store (what `profiler profile` writes): without
    recomputation, and with it a third slower (its forward runs twice)."""
    spec = get_model(model)
    prof = StepProfile("cpu", model, seq, "fp32", "none", alpha_s=0.004, beta_s=0.011, optimizer_s_per_param=2e-8,
                       r2=0.99, measured=True, source="test: measured", flops_per_sample=1e9,
                       num_params=spec.num_params, num_layers=spec.num_layers, micro_batches=(1, 2, 4),
                       step_times_s=(0.015, 0.026, 0.048), num_matmul_params=spec.matmul_params())
    save_step_profile(prof, os.path.join(store, "profiles"))
    save_step_profile(replace(prof, recompute="full", alpha_s=prof.alpha_s * 4 / 3, beta_s=prof.beta_s * 4 / 3),
                      os.path.join(store, "profiles"))
    return prof


def test_geo_out_writes_a_pipeline_plan_the_runtime_can_run(tmp_path):
    proc, out = run_geo(tmp_path, CPU_SCENARIO, env={"GPUMIX_DATA_DIR": str(tmp_path / "data")})
    assert proc.returncode == 0, proc.stderr
    plan = Plan.load(str(out))
    printed = json.loads(proc.stdout)
    assert printed["plan_file"]["pipeline"] and printed["plan_file"]["path"] == str(out)
    p = plan.pipeline
    spec = get_model("small")
    # the stages cover every layer in order, each at least one
    assert [st.first_layer for st in p.stages] == [sum(s.num_layers for s in p.stages[:j]) for j in range(len(p.stages))]
    assert sum(st.num_layers for st in p.stages) == spec.num_layers and all(st.num_layers >= 1 for st in p.stages)
    # one node per datacenter used, named as it; the stage's devices are on it
    assert {n.name for n in plan.cluster.nodes} <= {"dc-a", "dc-b"}
    assert all(n.datacenter == n.name for n in plan.cluster.nodes)
    devices = plan.cluster.devices()
    for st in p.stages:
        assert {devices[i][0].name for i in st.devices} == {st.datacenter}
        assert len(set(st.rows)) == 1 and p.micro_batch == len(st.devices) * st.rows[0] == len(st.devices) * 1
    assert p.micro_batch * p.num_microbatches == plan.global_batch
    # links from the scenario, connections from the plan
    assert [(w.a, w.b, w.gbps, w.rtt_ms) for w in plan.wan] == [("dc-a", "dc-b", 1.0, 1.0)]
    if len({st.datacenter for st in p.stages}) > 1:
        assert plan.connections[link_key("dc-a", "dc-b")] >= 1
    # the predicted iteration is the simulation of this very file, and so is its timeline
    iteration, ops = predict_plan(plan, str(tmp_path / "data" / "profiles"))
    assert plan.predicted_iteration_s == pytest.approx(iteration, rel=1e-12)
    assert printed["plan_file"]["predicted_iteration_s"] == pytest.approx(iteration, rel=1e-12)
    assert max(o["end_s"] for o in p.simulated_ops) == pytest.approx(iteration, rel=1e-12)
    assert len(p.simulated_ops) == len(ops)
    assert {o["op"] for o in p.simulated_ops} >= {"forward", "backward", "send_fwd", "recv_fwd", "send_bwd",
                                                  "recv_bwd", "optimizer"}
    fwd = [o for o in p.simulated_ops if o["op"] == "forward"]
    assert len(fwd) == p.num_microbatches * sum(len(st.devices) for st in p.stages)
    assert max(a.predicted_step_s for a in plan.assignments) == pytest.approx(iteration, rel=1e-12)
    check_runnable(plan)


def test_a_measured_cpu_profile_prices_the_stages(tmp_path):
    """The stages' compute comes from the profile store: forward + backward of every stage sum to the
    measured α + β·b of the whole model, and a slower profile gives a slower prediction."""
    store = str(tmp_path / "data")
    prof = measured_cpu_profile(store)
    proc, out = run_geo(tmp_path, CPU_SCENARIO, env={"GPUMIX_DATA_DIR": store})
    assert proc.returncode == 0, proc.stderr
    plan = Plan.load(str(out))
    assert plan.recompute == "none"
    job, memory = build_plan_job(plan, os.path.join(store, "profiles"))
    rows = plan.pipeline.stages[0].rows[0]
    assert sum(s.forward_s + s.backward_s for s in job.stages) == pytest.approx(prof.step_time_s(rows), rel=1e-9)
    assert all(s.backward_s == pytest.approx(2 * s.forward_s, rel=0.05) for s in job.stages[:-1])
    assert set(memory) == {d for st in plan.pipeline.stages for d in st.devices} and min(memory.values()) > 0
    slow = replace(prof, alpha_s=2 * prof.alpha_s, beta_s=2 * prof.beta_s)
    save_step_profile(slow, os.path.join(store, "profiles"))
    t_slow, _ = predict_plan(plan, os.path.join(store, "profiles"))
    assert t_slow > 1.3 * plan.predicted_iteration_s


def _two_stage(sc: GeoScenario):
    """The scenario's pipeline over both datacenters (when the search preferred one)."""
    from planner.geo.atlas import plan_from
    from planner.geo.costs import GeoCosts
    from planner.geo.search import Search

    costs = GeoCosts(sc)
    cand = Search(sc, costs).evaluate((("dc-a", "cpu"), ("dc-b", "cpu")), 1, (1, 1), "none")
    return plan_from(sc, costs, cand, "atlas")


def test_one_datacenter_is_written_as_a_data_parallel_plan(tmp_path):
    """One stage is the sharded runtime's ordinary run: no pipeline section, predicted as such."""
    one = {**CPU_SCENARIO, "datacenters": [{"name": "dc-a", "gpus": {"cpu": 2}}], "wan": []}
    proc, out = run_geo(tmp_path, one, "--no-baselines")
    assert proc.returncode == 0, proc.stderr
    plan = Plan.load(str(out))
    assert plan.pipeline is None and not plan.wan
    assert sum(a.batch for a in plan.assignments) == plan.global_batch
    assert plan.predicted_iteration_s == pytest.approx(predict_dp_plan(plan)[0], rel=1e-12)


@pytest.mark.parametrize("bad, words", [
    ({"datacenters": []}, "datacenters"),
    ({"datacenters": [{"name": "dc-a", "gpus": {"B300-XL": 1}}]}, "unknown"),
    ({"wan": [{"a": "dc-a", "b": "dc-z", "gbps": 1, "rtt_ms": 1}]}, "dc-z"),
    ({"global_batch": 7, "micro_batch": 2}, "multiple"),
])
def test_bad_scenarios_give_one_clear_line_and_no_file(tmp_path, bad, words):
    proc, out = run_geo(tmp_path, {**CPU_SCENARIO, **bad})
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and words in lines[0] and "Traceback" not in proc.stderr
    assert not out.exists()


def test_the_readme_example_of_two_cpu_datacenters_plans_a_pipeline(tmp_path):
    """examples/emulated/cpu_two_dc.json (the README's `--emulate-wan` example), run from the repository
    root as the README does: its model path resolves and the plan file has a stage per datacenter."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    out = tmp_path / "plan.json"
    proc = subprocess.run([sys.executable, "-m", "planner", "geo", "--scenario", "examples/emulated/cpu_two_dc.json",
                           "--out", str(out), "--json"], capture_output=True, text=True, timeout=120, cwd=root,
                          env={**os.environ, "GPUMIX_DATA_DIR": str(tmp_path)})
    assert proc.returncode == 0, proc.stderr
    plan = Plan.load(str(out))
    assert plan.pipeline is not None and [st.datacenter for st in plan.pipeline.stages] in (["dc-a", "dc-b"],
                                                                                            ["dc-b", "dc-a"])
    assert plan.pipeline.num_layers == get_model(os.path.join(root, "examples/emulated/geo-8x256")).num_layers
    assert plan.wan and plan.wan[0].gbps == 0.1


def test_planner_evaluate_re_predicts_a_pipeline_plan_as_it_was_written(tmp_path):
    """`planner evaluate` on a pipeline plan file: the emulated model's figures, the same as the file's
    (it used to sum every stage's batches and refuse: "batches sum to 16, not the global batch 8")."""
    proc, out = run_geo(tmp_path, CPU_SCENARIO, env={"GPUMIX_DATA_DIR": str(tmp_path / "data")})
    assert proc.returncode == 0, proc.stderr
    plan = Plan.load(str(out))
    assert plan.pipeline is not None and len(plan.pipeline.stages) == 2
    ev = subprocess.run([sys.executable, "-m", "planner", "evaluate", "--plan", str(out), "--json"],
                        capture_output=True, text=True, timeout=120,
                        env={**os.environ, "GPUMIX_DATA_DIR": str(tmp_path / "data")})
    assert ev.returncode == 0, ev.stderr
    again = Plan.from_dict(json.loads(ev.stdout))
    assert again.predicted_iteration_s == pytest.approx(plan.predicted_iteration_s, rel=1e-12)
    assert again.pipeline.simulated_ops == plan.pipeline.simulated_ops
    for a, b in zip(plan.assignments, again.assignments):
        assert (b.predicted_memory_bytes, b.predicted_step_s) == (a.predicted_memory_bytes, pytest.approx(a.predicted_step_s))
    # a smaller memory share makes the same plan's devices over it: said, and the figures kept
    tight = subprocess.run([sys.executable, "-m", "planner", "evaluate", "--plan", str(out), "--headroom", "0.0001"],
                           capture_output=True, text=True, timeout=120,
                           env={**os.environ, "GPUMIX_DATA_DIR": str(tmp_path / "data")})
    assert tight.returncode == 0, tight.stderr
    assert "over its memory × headroom 0.0001" in tight.stdout
