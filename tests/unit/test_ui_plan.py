"""AppTest of the Plan page (ui/plan.py): default plan on first open, inputs, errors, download.

The solve runs in a background process (ui/background.py): `settle` reruns the page, as its
polling fragment does in a browser, until the answer is in."""
import json
import os

import pytest
from streamlit.testing.v1 import AppTest

from contracts.cluster import ClusterSpec
from contracts.plan import Plan
from ui.charts import drawn_figures
from testkit.apptest import settle as settle_until
from testkit.clusters import many_kinds_dict

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PAGE = os.path.join(ROOT, "ui", "plan.py")




def settle(at: AppTest) -> AppTest:
    """Until the page has no request in flight (the plan or the error is shown)."""
    return settle_until(at, lambda a: "plan_request" in a.session_state)


def _page() -> AppTest:
    at = AppTest.from_file(PAGE, default_timeout=120)
    at.run()
    assert not at.exception
    return settle(at)


def test_a_solve_in_flight_shows_progress_and_cancel_stops_it(monkeypatch):
    from ui import background

    at = _page()
    monkeypatch.setattr(background, "FIRST_WAIT_S", 0.0)  # answer Pending at once, however fast the solve
    # a solve of seconds: still running when Cancel is clicked, however loaded the machine
    at.session_state["cluster"] = ClusterSpec.from_dict(many_kinds_dict())
    at.number_input(key="plan_global_batch").set_value(123)
    at.button(key="plan_compute").click().run()
    assert not at.exception
    assert "plan_request" in at.session_state  # answered later, by the background process
    assert any("Solving the plan" in i.value for i in at.info)

    [job] = [j for (_, name), j in background._jobs.items() if name == "plan"]
    at.button(key="plan_cancel").click().run()
    assert not at.exception and "plan_request" not in at.session_state
    assert job.cancel_reason == "by the user" and job.proc.returncode is not None
    assert at.session_state["plan"].global_batch != 123  # the last plan stays shown


def test_first_open_computes_a_default_plan_for_this_machine():
    at = _page()
    assert not at.error
    plan = at.session_state["plan"]
    assert isinstance(plan, Plan)
    assert plan.model == "tiny" and sum(a.batch for a in plan.assignments) == plan.global_batch
    table = at.table[0].value  # a static table: a few rows (ui/common.show_table)
    assert len(table) == plan.cluster.num_devices
    assert any("predicted" in c for c in table.columns)
    # the memory chart: each device's predicted peak as a bar, its capacity as a marker over it
    memory, baselines = drawn_figures(at)
    peak, capacity = memory["data"][:2]
    devices = plan.cluster.devices()
    assert peak["type"] == "bar" and peak["y"] == pytest.approx([a.predicted_memory_bytes / 2**30 for a in plan.assignments])
    assert capacity["name"] == "capacity" and len(memory["layout"]["shapes"]) >= len(plan.assignments)  # across the bars
    assert capacity["y"] == pytest.approx([devices[a.device_index][1].memory_bytes / 2**30 for a in plan.assignments])
    assert memory["layout"]["yaxis"]["title"]["text"] == "memory (GiB)"
    # throughput: the plan first, then a bar per baseline, each labelled with its value over the bar
    bars = baselines["data"][0]
    assert bars["x"] == ["GPUMix plan", *(n.replace("_", " ") for n in plan.baselines)]
    assert bars["y"][0] == pytest.approx(plan.predicted_samples_per_s)
    assert bars["textposition"] == "outside" and len(bars["text"]) == len(bars["x"])


def test_example_cluster_and_inputs_give_a_plan_with_baselines():
    at = _page()
    at.selectbox(key="plan_cluster_source").set_value("local-2cpu-emulated.json")
    at.number_input(key="plan_global_batch").set_value(12)
    at.selectbox(key="plan_dtype").set_value("fp32")
    settle(at.button(key="plan_compute").click().run())
    assert not at.error
    plan = at.session_state["plan"]
    assert plan.cluster.name == "local-2cpu-emulated" and plan.global_batch == 12
    fast, slow = plan.assignments
    assert fast.batch > slow.batch  # the emulated 3x slower device gets less work
    assert {"even", "proportional"} <= set(plan.baselines)


def test_infeasible_inputs_show_the_solver_reason_not_a_traceback():
    at = _page()
    at.selectbox(key="plan_cluster_source").set_value("local-2cpu-emulated.json")
    at.selectbox(key="plan_model").set_value("llama2-13b")  # 13B does not fit 2 CPU workers
    assert "plan" in at.session_state  # the default plan of the first open
    settle(at.button(key="plan_compute").click().run())
    assert any("no feasible plan" in e.value for e in at.error)
    # the failed plan clears the previous one: no plan, no table, no download, no launch link
    assert "plan" not in at.session_state and not at.table and not at.get("download_button")
    at.run()  # a rerun keeps saying why there is no plan
    assert any("no feasible plan" in e.value for e in at.error) and "plan" not in at.session_state


def test_sequence_field_shows_the_models_default_and_refuses_out_of_range():
    at = _page()
    assert at.number_input(key="plan_seq:tiny").value == 128  # tiny's own context, not a magic 0
    assert at.session_state["plan"].seq == 128
    at.selectbox(key="plan_model").set_value("llama2-7b").run()
    assert at.number_input(key="plan_seq:llama2-7b").value == 2048  # 4,096 capped at the default 2,048
    at.number_input(key="plan_seq:llama2-7b").set_value(0).run()
    assert not at.exception
    assert [e.value for e in at.error] == ["Sequence length: 0 is out of range, 1–131,072 tokens"]
    assert at.button(key="plan_compute").disabled
    assert at.number_input(key="plan_seq:llama2-7b").value == 0  # the value typed stays, never replaced
    assert at.number_input(key="plan_global_batch").label == "Global batch (samples, 1–1,000,000)"


def test_download_button_carries_a_plan_file():
    at = _page()
    [button] = [b for b in at.get("download_button") if b.proto.id and "plan_download" in b.proto.id]
    assert button is not None
    plan = at.session_state["plan"]
    assert Plan.from_dict(json.loads(plan.to_json())) == plan


def test_first_plan_on_an_unprofiled_machine_says_estimated_and_offers_the_profile():
    at = _page()
    warnings = [w.value for w in at.warning]
    assert any("Estimated, not measured" in w and "cpu" in w for w in warnings), warnings
    assert at.button(key="plan_profile_now")
