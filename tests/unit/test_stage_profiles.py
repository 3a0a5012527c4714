"""Stage profiles (planner/core/stage_profiles.py) without a process: the store's key and round trip,
the simulator pricing a stage from its stage profile only where it is the newest measurement, the
plan's notes naming it, and the plan put on this machine for the stages' run (profiler/stage_run.py;
the run itself: tests/e2e/test_stage_profile_run.py)."""
from __future__ import annotations

import copy
import json
from dataclasses import replace

import pytest

from contracts.plan import Plan
from contracts.specs import PRESETS
from planner.core.profiles import StepProfile, get_step_profile, save_step_profile
from planner.core.stage_profiles import StageProfile, get_stage_profile, save_stage_profile, stage_profile_path
from planner.geo.emulated import build_plan_job, stage_sources
from planner.geo.plan_file import PRICED, evaluate_pipeline_plan, geo_plan_to_plan
from planner.geo.scenario import GeoScenario
from profiler.stage_run import LOCAL_NODE, local_stage_plan
from tests.e2e.test_geo_plan_file import CPU_SCENARIO, _two_stage

SMALL = PRESETS["small"]


def _step_profile(created: str) -> StepProfile:
    """A measured step profile of `small` on the CPU, at seq 64 (the scenario's)."""
    est = get_step_profile("cpu", SMALL, 64, "fp32")
    return replace(est, measured=True, source="measured (test)", created=created, r2=0.99)


def _stage(first_layer: int, num_layers: int, first: bool, last: bool, created: str, fwd: float = 0.011,
           bwd: float = 0.023, opt: float | None = 3e-9) -> StageProfile:
    return StageProfile("cpu", SMALL.name, SMALL.matmul_params(), 64, "fp32", "none", first_layer, num_layers,
                        first, last, 1, fwd, bwd, opt, 4e-4, 8, "1f1b", 10, 0.05, created, together_with=("cpu", "cpu"))


def _plan() -> Plan:
    sc = GeoScenario.from_dict(CPU_SCENARIO)
    return geo_plan_to_plan(sc, _two_stage(sc))


def test_a_stage_profile_round_trips_under_its_stage_s_key():
    sp = _stage(0, 2, True, False, "2026-12-05T10:00:00+00:00")
    path = save_stage_profile(sp)
    assert path == stage_profile_path("cpu", "small", 64, "fp32", "none", 0, 2, True, False, 1)
    assert path.endswith("cpu__small__s64__fp32__none__L0-2e__r1.json")
    assert get_stage_profile("cpu", SMALL, 64, "fp32", "none", 0, 2, True, False, 1) == sp
    # another stage, other rows, another architecture under the same name: none of them
    assert get_stage_profile("cpu", SMALL, 64, "fp32", "none", 0, 2, True, True, 1) is None
    assert get_stage_profile("cpu", SMALL, 64, "fp32", "none", 0, 2, True, False, 2) is None
    other = replace(SMALL, hidden=SMALL.hidden * 2)
    assert get_stage_profile("cpu", other, 64, "fp32", "none", 0, 2, True, False, 1) is None
    assert "stage run (2 ranks)" in sp.describe() and "L0-1 + embedding" in sp.describe()


def test_the_simulator_prices_a_stage_from_its_newer_stage_profile_and_says_so():
    save_step_profile(_step_profile("2026-12-05T10:00:00+00:00"))
    plan = _plan()
    before, _ = build_plan_job(plan)
    first, second = plan.pipeline.stages
    save_stage_profile(_stage(first.first_layer, first.num_layers, True, False, "2026-12-05T10:05:00+00:00",
                              fwd=0.0123, bwd=0.0456, opt=7e-9))
    job, _ = build_plan_job(plan)
    s0, s1 = job.stages
    assert (s0.forward_s, s0.backward_s) == (0.0123, 0.0456)
    assert (s1.forward_s, s1.backward_s) == (before.stages[1].forward_s, before.stages[1].backward_s)
    assert s0.forward_s != before.stages[0].forward_s
    # the optimizer: the measured seconds per parameter over the stage's state (the all-gather on top)
    ag = before.stages[0].optimizer_s - get_step_profile("cpu", SMALL, 64, "fp32").optimizer_time_s(
        _state_params(plan, 0))
    assert s0.optimizer_s == pytest.approx(7e-9 * _state_params(plan, 0) + ag)
    lines = stage_sources(plan)
    assert lines[0].startswith("stage 0: cpu stage L0-") and "stage run" in lines[0]
    assert lines[1].startswith("stage 1: step profile cpu: measured 2026-12-05T10:00:00") and "by FLOPs" in lines[1]
    notes = [n for n in evaluate_pipeline_plan(plan).notes if n.startswith(PRICED)]
    assert notes == [f"{PRICED} {line}" for line in lines]


def test_a_step_profile_newer_than_the_stage_profile_prices_the_stage():
    plan = _plan()
    first = plan.pipeline.stages[0]
    save_stage_profile(_stage(first.first_layer, first.num_layers, True, False, "2026-12-05T09:00:00+00:00",
                              fwd=0.0123, bwd=0.0456))
    save_step_profile(_step_profile("2026-12-05T10:00:00+00:00"))
    job, _ = build_plan_job(plan)
    assert job.stages[0].forward_s != 0.0123
    assert "step profile" in stage_sources(plan)[0]


def test_the_stages_run_here_in_the_plan_s_order_without_its_links():
    plan = _plan()
    local = local_stage_plan(plan)
    assert [n.name for n in local.cluster.nodes] == [LOCAL_NODE]
    assert [d for _, d in local.cluster.devices()] == [d for _, d in plan.cluster.devices()]
    assert {a.node for a in local.assignments} == {LOCAL_NODE}
    assert local.wan == () and local.connections == {} and local.cuts == () and local.diloco is None
    assert [(s.first_layer, s.num_layers, s.devices, s.rows) for s in local.pipeline.stages] == \
        [(s.first_layer, s.num_layers, s.devices, s.rows) for s in plan.pipeline.stages]
    assert Plan.from_dict(json.loads(local.to_json())).cluster.devices() == local.cluster.devices()


def test_a_plan_without_a_pipeline_has_no_stages_to_run():
    plan = copy.copy(_plan())
    object.__setattr__(plan, "pipeline", None)  # a data-parallel plan's shape, without re-validating its batches
    with pytest.raises(ValueError, match="not a pipeline plan"):
        local_stage_plan(plan)


def _state_params(plan: Plan, j: int) -> int:
    from planner.costmodel.pipeline import PipelineCostModel
    from planner.geo.emulated import model_spec

    st = plan.pipeline.stages[j]
    model = PipelineCostModel(model_spec(plan), plan.seq, 1, plan.dtype, "1f1b")
    return model.runtime_state(st.num_layers, j, len(plan.pipeline.stages))[2]



def test_only_a_plan_whose_ranks_run_here_has_its_stages_run_here():
    from profiler.stage_run import stages_run_here

    plan = _plan()
    assert stages_run_here(plan)  # CPU datacenters joined by a WAN link: emulated on this machine
    remote = copy.copy(plan)
    object.__setattr__(remote, "wan", ())  # the same nodes as real machines elsewhere
    assert not stages_run_here(remote)
    assert stages_run_here(local_stage_plan(plan))


def test_a_stage_across_nodes_of_two_kinds_is_priced_replica_by_replica_from_their_stage_profiles():
    from executor.compare import priced_from
    from tests.e2e.test_pipeline_span_nodes import MODEL, SEQ, span_plan

    plan = span_plan()
    devices = plan.cluster.devices()
    before, _ = build_plan_job(plan)  # stages across nodes: build_replica_job
    st = plan.pipeline.stages[1]
    spec = PRESETS[MODEL]
    kinds = [devices[i][1].profile_key for i in st.devices]
    assert len(set(kinds)) == 2 and st.rows == (2, 3)
    for kind, rows, fwd, bwd in zip(kinds, st.rows, (0.05, 0.07), (0.10, 0.09)):
        save_stage_profile(StageProfile(kind, spec.name, spec.matmul_params(), SEQ, "fp32", "none", st.first_layer,
                                        st.num_layers, False, True, rows, fwd, bwd, None, 4e-4, 10, "1f1b", 10, 0.05,
                                        "2026-12-05T10:05:00+00:00", together_with=tuple(kinds)))
    job, _ = build_plan_job(plan)
    # the stage runs at its slowest replica: the larger forward of one, the larger backward of the other
    assert (job.stages[1].forward_s, job.stages[1].backward_s) == (0.07, 0.10)
    assert (job.stages[0].forward_s, job.stages[0].backward_s) == (before.stages[0].forward_s,
                                                                    before.stages[0].backward_s)
    lines = stage_sources(plan)
    assert lines[0].startswith("stage 0: step profile")
    assert [line.split(":")[0] for line in lines[1:]] == [f"stage 1 ({k}, {r} row(s))" for k, r in zip(kinds, st.rows)]
    assert all("stage run" in line for line in lines[1:])
    noted = replace(plan, notes=(*plan.notes, *(f"{PRICED} {line}" for line in lines)))
    assert priced_from(noted, 1).count("stage run") == 2 and priced_from(noted, 0).startswith("step profile")


def test_the_plan_page_s_profile_now_runs_a_pipeline_s_stages_through_the_cli_s_one_step(monkeypatch):
    """ui/compute.profile_kinds (the Plan page's "Profile now") and `profiler profile --plan` both end in
    profiler.stage_run.profile_plan_stages: the kinds timed together, then a CPU pipeline whose ranks run
    here has its stages run; a plan without stages, or whose ranks run elsewhere, runs none."""
    import profiler.run_profile as run_profile
    import profiler.stage_run as stage_run
    from ui.compute import profile_kinds

    timed, ran = [], []
    monkeypatch.setattr(run_profile, "profile_devices", lambda model, seq, dtype, devices, **kw: timed.append(
        [d.profile_key for d in devices]))
    monkeypatch.setattr(stage_run, "measure_stages", lambda plan, spec, steps, save: ran.append(
        (plan.model, spec.name, steps, save)) or ["profiled"])
    plan = _plan()
    profile_kinds(plan, ["cpu"], lambda f, m: None)
    assert timed == [["cpu", "cpu"]] and ran == [(plan.model, plan.model, stage_run.DEFAULT_STEPS, True)]
    remote = copy.copy(plan)
    object.__setattr__(remote, "wan", ())  # the same nodes as real machines elsewhere
    assert stage_run.profile_plan_stages(remote) is None
    flat = copy.copy(plan)
    object.__setattr__(flat, "pipeline", None)
    profile_kinds(flat, ["cpu"], lambda f, m: None)
    assert len(timed) == 2 and len(ran) == 1
    assert stage_run.profile_plan_stages(plan, steps=7, save=False) == ["profiled"] and ran[-1][2:] == (7, False)


def test_a_geo_plan_file_names_the_step_profile_of_each_kind_once():
    """`planner geo --out` and its re-evaluation write the step-profile notes a `planner plan` file has
    (planner.core.profiles.profile_notes), so `executor metrics` names the profile a rank was priced by."""
    from executor.compare import profile_of_kind

    bare = _plan()
    assert [n for n in bare.notes if n.startswith("profile cpu:")] == [
        "profile cpu: none measured, priced by an estimate: profile the plan's devices (python -m profiler profile "
        "--plan PLAN_FILE), then plan again"]
    save_step_profile(replace(_step_profile("2026-12-05T10:00:00+00:00"), how="together", together_with=("cpu", "cpu"),
                              load_avg=None))
    plan = _plan()
    named = [n for n in plan.notes if n.startswith("profile cpu:")]
    assert len(named) == 1 and "measured 2026-12-05T10:00:00" in named[0] and "profile again" not in named[0]
    again = evaluate_pipeline_plan(bare)  # re-evaluated on the profile now stored: its note replaced, not added
    assert [n for n in again.notes if n.startswith("profile cpu:")] == named
    assert profile_of_kind(again, "cpu") == named[0][len("profile "):]


def test_a_failed_stages_run_on_the_plan_page_is_a_message_that_keeps_the_kinds_profiles(monkeypatch):
    import profiler.run_profile as run_profile
    import profiler.stage_run as stage_run
    from ui.compute import profile_kinds

    timed = []
    monkeypatch.setattr(run_profile, "profile_devices", lambda *a, **kw: timed.append(a))

    def fail(plan, spec, steps, save):
        raise RuntimeError("the stages' run failed (exit code 1): boom")

    monkeypatch.setattr(stage_run, "measure_stages", fail)
    with pytest.raises(ValueError, match="kinds were profiled and saved, but the plan's stages' run failed.*boom"):
        profile_kinds(_plan(), ["cpu"], lambda f, m: None)
    assert len(timed) == 1

