"""Pipeline stages profiled as they run: `profiler profile --plan` of a two-stage CPU pipeline runs its
stages (on its emulated link where this machine can build it, else here without it), stores a stage
profile per stage, and the plan's simulation then prices each stage from it and names it; the stages'
run stays out of a shared store, and bad input is refused."""
import json
import os
import shutil
import subprocess
import sys

from contracts.plan import Plan
from planner.core.stage_profiles import HOW_ON_LINKS, HOW_STAGE_RUN, get_stage_profile
from planner.geo.emulated import build_plan_job, model_spec, simulate_plan, stage_sources
from planner.geo.plan_file import geo_plan_to_plan
from planner.geo.scenario import GeoScenario
from profiler.stage_run import can_emulate_links
from tests.e2e.test_geo_plan_file import CPU_SCENARIO, _two_stage

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _profile(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "profiler", "profile", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=400, env={**os.environ, **(env or {})})


def _plan_file(tmp_path) -> tuple[Plan, str]:
    sc = GeoScenario.from_dict(CPU_SCENARIO)
    plan = geo_plan_to_plan(sc, _two_stage(sc))
    path = str(tmp_path / "geo_plan.json")
    plan.save(path)
    return plan, path


def test_a_pipeline_plan_s_stages_are_profiled_as_they_run_and_price_its_stages(tmp_path, data_dir):
    plan, path = _plan_file(tmp_path)
    # a shared store named in the environment: the stages' run must not reach it (an unreachable URL
    # would fail the run if it were used)
    proc = _profile("--plan", path, "--micro-batches", "1,2,3,4", "--repeats", "2", "--no-collectives",
                    "--stage-steps", "6", "--json", env={"GPUMIX_DB": "postgresql://nobody@127.0.0.1:9/none"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout)
    # the plan has a WAN link: its stages run on it where this machine can emulate it (root), else here
    how = HOW_ON_LINKS if can_emulate_links() else HOW_STAGE_RUN
    stages = out["stages"]
    assert [(s["first_layer"], s["num_layers"], s["first"], s["last"]) for s in stages] == [
        (st.first_layer, st.num_layers, j == 0, j == 1) for j, st in enumerate(plan.pipeline.stages)]
    for s in stages:
        assert s["forward_s"] > 0 and s["backward_s"] > 0 and s["how"] == how
        assert s["steps"] == 4 and s["together_with"] == ["cpu", "cpu"] and s["optimizer_s_per_param"] > 0
        assert s["send_s"] is not None and s["send_s"] >= 0
    spec = model_spec(plan)
    job, _ = build_plan_job(plan)
    for j, st in enumerate(plan.pipeline.stages):
        stored = get_stage_profile("cpu", spec, plan.seq, "fp32", "none", st.first_layer, st.num_layers, j == 0,
                                   j == 1, 1)
        assert stored is not None and stored.forward_s == stages[j]["forward_s"]
        assert (job.stages[j].forward_s, job.stages[j].backward_s) == (stored.forward_s, stored.backward_s)
    lines = stage_sources(plan)
    assert all(f"{how} (2 ranks)" in line for line in lines), lines
    with_stages = simulate_plan(plan).iteration_s
    shutil.rmtree(os.path.join(data_dir, "profiles", "stages"))
    assert simulate_plan(plan).iteration_s != with_stages  # the step profile alone prices it otherwise
    assert not os.path.exists(os.path.join(data_dir, "runs")) or not os.listdir(os.path.join(data_dir, "runs"))


def test_without_the_links_the_stages_run_on_this_machine_alone(tmp_path):
    from profiler.stage_run import measure_stages

    plan, _ = _plan_file(tmp_path)
    stages = measure_stages(plan, model_spec(plan), steps=6, links=False)
    assert [s.how for s in stages] == [HOW_STAGE_RUN] * 2
    assert all(s.forward_s > 0 and s.backward_s > 0 and s.steps == 4 for s in stages)
    assert "stage run (2 ranks)" in stage_sources(plan)[0]


def test_stage_profiling_refuses_bad_input(tmp_path):
    _, path = _plan_file(tmp_path)
    proc = _profile("--plan", path, "--stage-steps", "2")
    assert proc.returncode == 2 and "--stage-steps" in proc.stderr
    proc = _profile("--plan", str(tmp_path / "missing.json"))
    assert proc.returncode == 2 and "missing.json" in proc.stderr

