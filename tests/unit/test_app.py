"""The router: app.py opens, and every page it routes to renders without an exception.

The page list is read from app.py itself, so a page added there is tested here."""
from __future__ import annotations

import os
import re

import pytest
from streamlit.testing.v1 import AppTest

from testkit.runs import fabricate_run

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
APP = os.path.join(ROOT, "app.py")
# shared modules in ui/ that are not pages
NOT_PAGES = {"__init__.py", "state.py", "common.py", "background.py", "compute.py", "charts.py"}
# first render of a page may import torch or solve a small ILP on a loaded 2-core machine
TIMEOUT_S = 60


def routed_pages() -> list[str]:
    with open(APP, encoding="utf-8") as fh:
        return re.findall(r'st\.Page\(\s*"(ui/[a-z_]+\.py)"', fh.read())


def test_app_routes_every_page_file():
    pages = routed_pages()
    on_disk = {f"ui/{f}" for f in os.listdir(os.path.join(ROOT, "ui")) if f.endswith(".py") and f not in NOT_PAGES}
    assert len(pages) == len(set(pages)) >= 7
    assert set(pages) == on_disk


def test_app_opens_on_inventory():
    at = AppTest.from_file(APP, default_timeout=TIMEOUT_S).run()
    assert not at.exception
    # the landing page is the local machine's inventory
    assert any("nventory" in t.value for t in at.title), [t.value for t in at.title]


@pytest.mark.parametrize("page", routed_pages())
def test_every_page_renders_through_the_router(page):
    at = AppTest.from_file(APP, default_timeout=TIMEOUT_S).run()
    assert not at.exception
    at.switch_page(page).run()
    assert not at.exception, f"{page}: {at.exception}"
    assert not at.error or all("Traceback" not in e.value for e in at.error)


def test_sidebar_links_the_live_run_found_in_the_store(data_dir):
    fabricate_run("old", 3, "done")
    fabricate_run("live", 2, None)  # running: its launcher (this process) is alive
    at = AppTest.from_file(APP, default_timeout=TIMEOUT_S).run()
    assert not at.exception
    links = [e.proto.label for e in at.get("page_link") if e.proto.label.startswith("Running:")]
    assert links == ["Running: live"]


def test_no_live_run_no_sidebar_link(data_dir):
    fabricate_run("old", 3, "stopped")
    at = AppTest.from_file(APP, default_timeout=TIMEOUT_S).run()
    assert not at.exception
    assert not [e for e in at.get("page_link") if e.proto.label.startswith("Running:")]


def _state_probe() -> None:
    import streamlit as st

    from ui import state

    plan = state.get_or_default_plan()
    st.write(f"plan {plan.model} {plan.global_batch} {sum(a.batch for a in plan.assignments)} {len(plan.used)}")
    st.write(f"live {state.current_run_dir()}")


def test_a_new_user_gets_the_default_plan_and_finds_the_live_run(data_dir):
    from ui import state

    run = fabricate_run("live", 1, None)
    at = AppTest.from_function(_state_probe, default_timeout=TIMEOUT_S).run()
    assert not at.exception, at.exception
    lines = [m.value for m in at.markdown]
    batch = state.DEFAULT_GLOBAL_BATCH
    assert lines[0].startswith(f"plan {state.DEFAULT_MODEL} {batch} {batch} ")
    assert int(lines[0].split()[-1]) >= 1
    assert lines[1] == f"live {os.path.abspath(run)}"
    assert at.session_state["run_dir"] == os.path.abspath(run)


# ---- ui/common: the helpers every page uses ------------------------------------------------


def _errors_probe() -> None:
    import streamlit as st

    from ui import common

    with common.show_errors("Cannot plan"):
        raise ValueError("global batch 7 cannot be split over 2 devices")
    st.write(f"after {common.call_or_error(int, 'x', what='Steps')}")
    common.metric("Iteration time", common.fmt_seconds(0.0123), common.PREDICTED)


def test_bad_input_becomes_one_error_line_not_a_traceback():
    at = AppTest.from_function(_errors_probe, default_timeout=TIMEOUT_S).run()
    assert not at.exception
    assert [e.value for e in at.error] == [
        "Cannot plan: global batch 7 cannot be split over 2 devices",
        "Steps: invalid literal for int() with base 10: 'x'",
    ]
    assert at.markdown[0].value == "after None"  # the page went on
    assert at.metric[0].label == "Iteration time :blue-badge[predicted]" and at.metric[0].value == "12.3 ms"


def test_formatting_and_chart_defaults():
    from ui import charts, common

    assert common.fmt_bytes(1536) == "1.5 KiB" and common.fmt_bytes(3 * 2**30) == "3.0 GiB"
    assert common.fmt_seconds(2.5e-4) == "250 µs" and common.fmt_seconds(95) == "95.00 s"
    assert common.fmt_seconds(3 * 3600 + 60) == "3 h 1 min"
    fig = common.line_figure({"a": ([0, 1], [2.0, 1.5])}, "step", "loss (nats/token)", title="Loss")
    (line,) = fig["data"]
    assert line["type"] == "scatter" and line["mode"] == "lines+markers"
    lay = fig["layout"]
    assert lay["xaxis"]["title"]["text"] == "step" and lay["yaxis"]["title"]["text"] == "loss (nats/token)"
    assert line["y"] == [2.0, 1.5] and lay["title"]["text"] == "Loss" and lay["height"] == charts.CHART_HEIGHT_PX


def test_profiles_version_changes_when_a_profile_is_written(data_dir):
    from contracts import paths
    from ui import common

    before = common.profiles_version()
    os.makedirs(os.path.join(paths.profiles_dir(), "steps"), exist_ok=True)
    with open(os.path.join(paths.profiles_dir(), "steps", "cpu__tiny.json"), "w") as fh:
        fh.write("{}")
    assert common.profiles_version() > before


def test_config_listens_on_localhost_without_usage_stats_or_tracebacks():
    import tomllib

    with open(os.path.join(ROOT, ".streamlit", "config.toml"), "rb") as fh:
        cfg = tomllib.load(fh)
    assert cfg["server"]["address"] == "127.0.0.1"
    assert cfg["browser"]["gatherUsageStats"] is False
    assert cfg["client"]["showErrorDetails"] == "none"


def test_launch_opened_first_has_the_default_plan_to_launch(data_dir):
    from ui import state

    at = AppTest.from_file(APP, default_timeout=TIMEOUT_S).run()
    at.switch_page("ui/launch.py").run()
    assert not at.exception
    plan = at.session_state["plan"]
    assert plan.model == state.DEFAULT_MODEL and plan.global_batch == state.DEFAULT_GLOBAL_BATCH
    assert at.button(key="launch_button")  # one click away


def test_inventory_does_not_solve_a_plan(data_dir):
    at = AppTest.from_file(APP, default_timeout=TIMEOUT_S).run()
    assert not at.exception
    assert "plan" not in at.session_state


def test_after_stop_the_sidebar_link_goes_at_once(data_dir):
    from executor.store import read_metrics

    live = fabricate_run("live", 2, None)  # running: its 'launcher' is this process
    at = AppTest.from_file(APP, default_timeout=TIMEOUT_S).run()
    at.switch_page("ui/launch.py").run()
    assert not at.exception, at.exception
    assert [e.proto.label for e in at.get("page_link") if e.proto.label.startswith("Running:")] == ["Running: live"]
    at.button(key="stop_button").click().run()
    assert not at.exception, at.exception
    assert read_metrics(live)["status"] == "stopped"
    # one source of status: the store; no cached "Running" link after Stop
    assert not [e for e in at.get("page_link") if e.proto.label.startswith("Running:")]
    assert at.button(key="stop_button").disabled


def test_every_chart_is_drawn_by_one_plotly_call():
    """Pages build their charts in ui/charts.py and draw them through ui/common.show_figure, the one
    `plotly_component.draw` (plotly.js's basic bundle): no page draws a chart of another kind, or a Plotly chart of its own."""
    import glob

    drawers = ("st.plotly_chart(", "st.vega_lite_chart(", "st.altair_chart(", "st.line_chart(", "st.bar_chart(",
               "st.area_chart(", "st.scatter_chart(", "st.pyplot(", "import altair", "import plotly", "from plotly")
    found = {}
    for path in [os.path.join(ROOT, "app.py"), *glob.glob(os.path.join(ROOT, "ui", "*.py"))]:
        with open(path, encoding="utf-8") as fh:
            src = fh.read()
        src = src.replace("import plotly_component", "")  # the project's own component, not plotly.py
        found.update({(os.path.basename(path), d): src.count(d) for d in drawers if d in src})
    assert found == {}
    common = open(os.path.join(ROOT, "ui", "common.py"), encoding="utf-8").read()
    assert common.count("plotly_component.draw(") == 1
