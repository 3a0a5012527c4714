"""AppTest of ui/launch.py: no plan -> a message; a plan -> its widgets; fabricated runs in
the store -> the live lines, the selector and the charts; a real launch and stop by click."""
from __future__ import annotations

import os
import time

import pytest
from streamlit.testing.v1 import AppTest

from executor.store import read_metrics
from tests.conftest import fabricate_run, processes_with_data_dir, two_cpu_plan

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAGE = os.path.join(ROOT, "ui", "launch.py")


def run_page(plan=None, run_dir=None) -> AppTest:
    at = AppTest.from_file(PAGE, default_timeout=60)
    if plan is not None:
        at.session_state["plan"] = plan
    if run_dir is not None:
        at.session_state["run_dir"] = run_dir
    at.run()
    assert not at.exception, at.exception
    return at


def texts(at: AppTest) -> str:
    return "\n".join(m.value for m in at.markdown)


def test_without_a_plan_the_page_says_so(data_dir):
    at = run_page()
    assert any("No plan" in i.value for i in at.info)
    assert not [b for b in at.button if b.key == "launch_button"]
    assert "Run status" not in texts(at)


def test_with_a_plan_the_widgets_are_there_and_a_finished_run_is_shown(data_dir):
    done = fabricate_run("run-done", 6, "done", slowdown=3.0)
    at = run_page(two_cpu_plan(3.0))
    assert at.number_input(key="launch_steps").value > 0
    assert at.button(key="launch_button")
    select = at.selectbox(key="launch_run_select")
    assert select.value == done  # the only run
    body = texts(at)
    assert "Run status: done" in body and "Steps recorded: 6" in body
    assert at.button(key="stop_button").disabled  # nothing to stop
    assert at.session_state["run_dir"] == done
    assert any("emulated" in c.value for c in at.caption)  # the slowdown-3 device is marked
    assert len(at.get("plotly_chart")) == 4
    assert not at.error


def test_a_reloaded_session_finds_the_running_run_in_the_store(data_dir):
    fabricate_run("run-old", 3, "failed")
    live = fabricate_run("run-live", 4, None)  # running: its 'launcher' is this test process
    at = run_page(two_cpu_plan())
    assert at.selectbox(key="launch_run_select").value == live
    assert "Run status: running" in texts(at) and "Steps recorded: 4" in texts(at)
    assert not at.button(key="stop_button").disabled


@pytest.mark.slow
def test_launch_and_stop_by_click(data_dir):
    at = run_page(two_cpu_plan())
    at.number_input(key="launch_steps").set_value(100_000)
    at.button(key="launch_button").click().run()
    assert not at.exception, at.exception
    run_dir = at.session_state["run_dir"]
    assert os.path.dirname(run_dir) == os.path.join(data_dir, "runs")
    deadline = time.monotonic() + 120
    while not read_metrics(run_dir)["steps"]:
        assert time.monotonic() < deadline, "no step recorded within 120 s"
        time.sleep(0.5)
    at.run()
    assert "Run status: running" in texts(at)
    at.button(key="stop_button").click().run()
    assert not at.exception, at.exception
    assert "Run status: stopped" in texts(at)
    assert read_metrics(run_dir)["status"] == "stopped"
    deadline = time.monotonic() + 30
    while processes_with_data_dir(data_dir) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert processes_with_data_dir(data_dir) == []
