"""The Geo page's cuts (streamlit AppTest): the chosen kind of every cut with the candidates' WAN
bytes per step, and a bench/geo_real.py output's measured loss curves; a bad file is an error line."""
import json

import pytest
from streamlit.testing.v1 import AppTest

from testkit.apptest import settle
from ui.charts import drawn_figures

TIMEOUT_S = 120


def pending(a: AppTest) -> bool:
    return "geo_request" in a.session_state or any("Choosing the cuts" in i.value for i in a.info)


@pytest.fixture
def app():
    at = AppTest.from_file("../../ui/geo.py", default_timeout=TIMEOUT_S)
    at.run()
    assert not at.exception
    return at


def table_text(at: AppTest) -> str:
    """Every table's text, static (st.table) or interactive (st.dataframe, for longer ones)."""
    return " ".join(t.value.to_string() for t in [*at.table, *at.dataframe])


def test_the_plan_shows_the_kind_of_every_cut_and_the_candidates(app):
    # not an example test_ui_geo.py needs uncached (st.cache_data is shared by the tests of one process)
    app.selectbox(key="geo_example").set_value("mixed_types.json").run()
    app.button(key="geo_plan").click().run()
    settle(app, pending)
    assert not app.error
    assert "Cuts between datacenters" in [s.value for s in app.subheader]
    text = table_text(app)
    assert "paris – frankfurt" in text and "pipeline" in text  # the chosen kind of the cut
    assert "WAN bytes per step" in text and "diloco H=" in text and "time to target" in text


def bench_output(tmp_path) -> str:
    curve = {"dp": [[8.0, 1, 5.4], [17.0, 2, 4.6]], "pipeline": [[0.8, 1, 5.4], [1.4, 2, 4.6], [2.0, 3, 4.3]],
             "diloco": [[0.5, 1, 5.4], [1.0, 2, 4.7], [1.5, 3, 4.2]]}
    link = {"mbit": 50, "chosen": "pipeline", "measured_best": "diloco",
            "loss_at_equal_time": {"dp": 4.6, "pipeline": 3.43, "diloco": 3.35},
            "wan_bytes_per_token": {"dp": 100382.1, "pipeline": 3364.3, "diloco": 2009.0}, "loss_curves": curve}
    path = tmp_path / "geo_real.json"
    path.write_text(json.dumps({"links": [link]}))
    return str(path)


def test_a_bench_output_draws_the_measured_loss_curves(app, tmp_path, monkeypatch):
    monkeypatch.setenv("GPUMIX_ALLOWED_ROOTS", str(tmp_path))
    app.text_input(key="geo_bench_json").set_value(bench_output(tmp_path)).run()
    assert not app.exception and not app.error
    text = table_text(app)
    assert "diloco" in text and "100,382" in text and "3.4300" in text
    [fig] = drawn_figures(app)
    assert {t["name"] for t in fig["data"]} == {"dp", "pipeline", "diloco"}
    diloco = next(t for t in fig["data"] if t["name"] == "diloco")
    assert diloco["x"] == [0.5, 1.0, 1.5] and diloco["y"] == [5.4, 4.7, 4.2]


@pytest.mark.parametrize("content,match", [("{not json", "not valid JSON"), ('{"links": []}', "no 'links' list"),
                                           ('{"links": [{"mbit": 1}]}', "every link needs")])
def test_a_bad_bench_file_is_one_error_line(app, tmp_path, monkeypatch, content, match):
    monkeypatch.setenv("GPUMIX_ALLOWED_ROOTS", str(tmp_path))
    path = tmp_path / "bad.json"
    path.write_text(content)
    app.text_input(key="geo_bench_json").set_value(str(path)).run()
    assert not app.exception
    assert any(match in e.value for e in app.error), [e.value for e in app.error]


def test_a_path_outside_the_allowed_folders_is_refused(app):
    app.text_input(key="geo_bench_json").set_value("/etc/passwd").run()
    assert not app.exception
    assert any("outside the folders" in e.value for e in app.error)
