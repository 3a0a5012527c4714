"""The Geo page on its own (streamlit AppTest): edit, plan, render, and bad input.

The simulation runs in a background process (ui/background.py): `settle` reruns the page, as
its polling fragment does in a browser, until the answer is in."""
import pytest
from streamlit.testing.v1 import AppTest

from testkit.apptest import settle as settle_until
from ui.charts import drawn_figures

TIMEOUT_S = 120


def settle(at: AppTest) -> AppTest:
    return settle_until(at, lambda a: "geo_request" in a.session_state)


@pytest.fixture
def app():
    at = AppTest.from_file("../../ui/geo.py", default_timeout=TIMEOUT_S)
    at.run()
    assert not at.exception
    return at


def test_plan_renders_summary_gantt_and_bars(app):
    app.selectbox(key="geo_example").set_value("three_dc_slow_link.json").run()
    app.button(key="geo_plan").click().run()
    assert not app.exception
    settle(app)
    assert not app.error
    labels = " ".join(m.label for m in app.metric)
    assert "simulated" in labels and "Iteration" in labels
    text = " ".join(md.value for md in app.markdown)
    assert "virginia" in text  # the plan summary names the datacenters
    charts = drawn_figures(app)
    assert len(charts) == 3  # Gantt, iteration bars, utilization bars
    gantt = charts[0]
    assert {"training forward", "training backward", "prefill (BubbleTea)"} <= {t["name"] for t in gantt["data"]}
    assert "simulated" in gantt["layout"]["xaxis"]["title"]["text"] and gantt["layout"]["barmode"] == "overlay"
    for t in gantt["data"]:  # horizontal bars from start to end, one row per GPU
        assert t["orientation"] == "h" and all(w >= 0 for w in t["x"]) and len(t["base"]) == len(t["y"])
    # each bar labelled with its value, horizontally over it; the plan first
    bars = charts[1]["data"][0]
    assert bars["x"][0] == "atlas (plan)" and charts[1]["layout"]["xaxis"]["tickangle"] == 0
    assert bars["textposition"] == "outside" and bars["text"][0]
    assert {t["name"] for t in charts[2]["data"]} == {"training only", "with prefill (BubbleTea)"}


def test_bad_input_shows_an_error_not_a_traceback(app):
    app.number_input(key="geo_micro_batch").set_value(3).run()  # 64 is not a multiple of 3
    assert not app.exception
    assert any("micro_batch 3" in e.value for e in app.error)
    app.text_input(key="geo_prompts").set_value("a lot").run()
    assert not app.exception
    assert any("prompt lengths" in e.value for e in app.error)


def test_cancel_stops_the_simulation_and_forgets_the_request(app, monkeypatch):
    from ui import background

    monkeypatch.setattr(background, "FIRST_WAIT_S", 0.0)  # answer Pending at once, however fast the call
    app.button(key="geo_plan").click().run()
    assert any("Planning and simulating" in i.value for i in app.info)  # in flight, with a Cancel button
    [job] = [j for (_, name), j in background._jobs.items() if name == "geo"]
    app.button(key="geo_cancel").click().run()
    assert not app.exception and "geo_request" not in app.session_state
    assert job.cancel_reason == "by the user" and job.proc.returncode is not None
    assert not drawn_figures(app)  # no report: the one asked for was cancelled


@pytest.mark.parametrize("example", ["paper_like.json", "two_dc_fast.json"])
def test_defaults_shown_as_values_give_the_examples_own_scenario(app, monkeypatch, example):
    import json
    import os

    from planner.geo.scenario import GeoScenario
    from ui import background

    monkeypatch.setattr(background, "FIRST_WAIT_S", 0.0)  # keep the request in the session
    app.selectbox(key="geo_example").set_value(example).run()
    app.button(key="geo_plan").click().run()
    asked = json.loads(app.session_state["geo_request"])
    app.button(key="geo_cancel").click().run()
    with open(os.path.join(os.path.dirname(__file__), "..", "..", "examples", "geo", example)) as fh:
        original = json.load(fh)
    # the editors show the intra-DC bandwidth and the TCP window as numbers, not None, and change nothing
    assert GeoScenario.from_dict(asked).to_dict() == GeoScenario.from_dict(original).to_dict()


def test_bubbletea_caption_reads_as_text(app):
    app.button(key="geo_plan").click().run()
    settle(app)
    [line] = [c.value for c in app.caption if c.value.startswith("BubbleTea")]
    assert "[" not in line and "True" not in line and "False" not in line, line
