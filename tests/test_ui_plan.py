"""AppTest of the Plan page (ui/plan.py): default plan on first open, inputs, errors, download."""
import json
import os

from streamlit.testing.v1 import AppTest

from planner.plan import Plan

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAGE = os.path.join(ROOT, "ui", "plan.py")


def _page() -> AppTest:
    at = AppTest.from_file(PAGE, default_timeout=120)
    at.run()
    assert not at.exception
    return at


def test_first_open_computes_a_default_plan_for_this_machine():
    at = _page()
    assert not at.error
    plan = at.session_state["plan"]
    assert isinstance(plan, Plan)
    assert plan.model == "tiny" and sum(a.batch for a in plan.assignments) == plan.global_batch
    table = at.dataframe[0].value
    assert len(table) == plan.cluster.num_devices
    assert any("predicted" in c for c in table.columns)


def test_example_cluster_and_inputs_give_a_plan_with_baselines():
    at = _page()
    at.selectbox(key="plan_cluster_source").set_value("local-2cpu-emulated.json")
    at.number_input(key="plan_global_batch").set_value(12)
    at.selectbox(key="plan_dtype").set_value("fp32")
    at.button(key="plan_compute").click().run()
    assert not at.exception and not at.error
    plan = at.session_state["plan"]
    assert plan.cluster.name == "local-2cpu-emulated" and plan.global_batch == 12
    fast, slow = plan.assignments
    assert fast.batch > slow.batch  # the emulated 3x slower device gets less work
    assert {"even", "proportional"} <= set(plan.baselines)


def test_infeasible_inputs_show_the_solver_reason_not_a_traceback():
    at = _page()
    at.selectbox(key="plan_cluster_source").set_value("local-2cpu-emulated.json")
    at.selectbox(key="plan_model").set_value("llama2-13b")  # 13B does not fit 2 CPU workers
    at.button(key="plan_compute").click().run()
    assert not at.exception
    assert any("no feasible plan" in e.value for e in at.error)


def test_download_button_carries_a_plan_file():
    at = _page()
    [button] = [b for b in at.get("download_button") if b.proto.id and "plan_download" in b.proto.id]
    assert button is not None
    plan = at.session_state["plan"]
    assert Plan.from_dict(json.loads(plan.to_json())) == plan
