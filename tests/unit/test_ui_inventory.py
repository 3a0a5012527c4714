"""AppTest of the Inventory page (the dashboard's landing page)."""
import json
import os

import pytest
from streamlit.testing.v1 import AppTest

from contracts.cluster import ClusterSpec

PAGE = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "ui", "inventory.py")


def _app() -> AppTest:
    at = AppTest.from_file(PAGE, default_timeout=120)
    at.run()
    assert not at.exception
    return at


def _texts(elements) -> list[str]:
    return [e.value for e in elements]


def test_fresh_machine_shows_its_devices_and_not_profiled_yet():
    at = _app()
    assert any("not profiled yet" in t for t in _texts(at.info))
    cluster = at.session_state["cluster"]
    assert cluster.device_types() == ["cpu"] and cluster.num_devices >= 2
    assert at.button(key="inv_profile_now") is not None
    assert at.download_button(key="inv_download") is not None


@pytest.mark.slow
def test_profile_now_measures_and_shows_labelled_figures():
    at = _app()
    at.selectbox(key="inv_profile_model").set_value("tiny")
    at.number_input(key="inv_profile_seq").set_value(64)
    at.button(key="inv_profile_now").click()
    at.run()
    assert not at.exception and not at.error
    assert len(at.get("progress")) == 1  # the progress bar the callback fed
    assert any("Measured tiny on cpu" in t for t in _texts(at.success))
    assert not any("not profiled yet" in t for t in _texts(at.info))
    labels = [m.label for m in at.metric]
    assert labels and all("measured" in label for label in labels)
    from planner.core.profiles import get_step_profile
    from contracts.specs import PRESETS

    assert get_step_profile("cpu", PRESETS["tiny"], 64, "fp32").measured


def test_add_nodes_from_the_catalog_and_an_emulated_cpu():
    at = _app()
    at.text_input(key="inv_node_name").set_value("gpu-box")
    at.text_input(key="inv_node_dc").set_value("dc-b")
    at.selectbox(key="inv_gpu_type").set_value("H200")
    at.number_input(key="inv_gpu_count").set_value(4)
    at.button(key="inv_add_node").click()
    at.run()
    assert not at.exception and not at.error
    c = at.session_state["cluster"]
    assert [(g.node, g.datacenter, g.device.type, g.count) for g in c.groups()][-1] == ("gpu-box", "dc-b", "H200", 4)
    last = at.table[-1].value.iloc[-1]  # the cluster table: a few rows, static
    assert (last["node"], last["device"], int(last["count"]), last["memory per device"]) == (
        "gpu-box", "H200", 4, f"{141e9 / 2**30:.1f} GiB")  # the H200's datasheet 141 GB
    at.text_input(key="inv_node_name").set_value("localhost")
    at.text_input(key="inv_node_dc").set_value("local")
    at.selectbox(key="inv_gpu_type").set_value("cpu")
    at.number_input(key="inv_gpu_count").set_value(1)
    at.number_input(key="inv_slowdown").set_value(3.0)
    at.button(key="inv_add_node").click()
    at.run()
    assert not at.exception and not at.error
    c = at.session_state["cluster"]
    assert c.emulated and any(d.slowdown == 3.0 for _, d in c.devices())
    assert any("emulated" in t for t in _texts(at.caption))  # the page says so
    # adding to an existing node in another datacenter is refused with a clear message
    at.text_input(key="inv_node_dc").set_value("elsewhere")
    at.button(key="inv_add_node").click()
    at.run()
    assert not at.exception and any("datacenter 'local'" in t for t in _texts(at.error))


def test_malformed_upload_names_the_problem_and_keeps_the_cluster():
    at = _app()
    before = at.session_state["cluster"]
    at.file_uploader(key="inv_upload").upload("lab.json", b'{"nodes": [{"name": "a", "gpus": {"B300": 1}}]}',
                                              "application/json")
    at.run()
    assert not at.exception
    assert any("unknown GPU type 'B300'" in t and "lab.json" in t for t in _texts(at.error))
    assert at.session_state["cluster"] == before
    at.file_uploader(key="inv_upload").set_value(("lab.json", b'{"nodes": [', "application/json"))
    at.run()
    assert not at.exception and any("malformed JSON" in t for t in _texts(at.error))


def test_good_upload_becomes_the_session_cluster_then_save_writes_a_cluster_file(data_dir):
    at = _app()
    doc = {"name": "lab", "nodes": [{"name": "n0", "datacenter": "dc-a", "gpus": {"A100-80GB": 2, "T4": 1}}]}
    at.file_uploader(key="inv_upload").upload("lab.json", json.dumps(doc).encode(), "application/json")
    at.run()
    assert not at.exception and not at.error
    assert at.session_state["cluster"] == ClusterSpec.from_dict(doc)
    at.text_input(key="inv_save_name").set_value("my lab")
    at.button(key="inv_save").click()
    at.run()
    assert not at.exception and not at.error
    path = os.path.join(data_dir, "clusters", "my_lab.json")
    saved = ClusterSpec.load(path)
    assert saved.name == "my lab" and saved.nodes == ClusterSpec.from_dict(doc).nodes
    # a later edit is not undone by the upload still sitting in the widget
    at.text_input(key="inv_node_name").set_value("n1")
    at.button(key="inv_add_node").click()
    at.run()
    assert at.session_state["cluster"].num_devices == 4


def test_number_fields_show_defaults_and_refuse_out_of_range_values():
    at = _app()
    at.number_input(key="inv_gpu_count").set_value(5000).run()
    assert not at.exception
    assert [e.value for e in at.error] == ["Count: 5,000 is out of range, 1–1,024 devices"]
    assert at.button(key="inv_add_node").disabled and at.number_input(key="inv_gpu_count").value == 5000
    at.number_input(key="inv_gpu_count").set_value(2)
    at.selectbox(key="inv_gpu_type").set_value("T4").run()
    at.checkbox(key="inv_limit_memory:T4").check().run()
    field = at.number_input(key="inv_memory_gb:T4")
    assert field.value == 16.0 and field.label.startswith("Emulated memory limit (GiB")  # the T4's own, not 0
    field.set_value(4.0)
    at.button(key="inv_add_node").click().run()
    assert not at.exception and not at.error
    assert [d.memory_gb for _, d in at.session_state["cluster"].devices() if d.type == "T4"] == [4.0, 4.0]


def test_one_click_emulated_mixed_cluster_is_kernel_limited_and_labelled():
    from profiler import cgroups

    at = _app()
    button = at.button(key="inv_emulated_mixed")
    if cgroups.unavailable_reason() is not None:
        assert button.disabled and any("unavailable here" in t for t in _texts(at.caption))
        return
    button.click().run()
    assert not at.exception and not at.error
    c = at.session_state["cluster"]
    assert [(d.type, d.cpu_share, d.memory_gb) for _, d in c.devices()] == [("cpu", 1.0, None), ("cpu", 0.333, 2.0)]
    assert c.emulated and any("emulated" in t for t in _texts(at.caption))
    assert list(at.table[-1].value["emulated"]) == ["emulated", "emulated"]  # the cluster table, static (2 rows)
