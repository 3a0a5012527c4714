"""ui/charts.py: every builder's figure is one Plotly accepts (its own validation) and holds the
values, traces and axes the pages promise (rolling median, labelled bars, capacity markers, Gantt bars)."""
import plotly.graph_objects as go
import pytest

from ui import charts, common


def _valid(fig):
    """The figure as Plotly reads it: go.Figure validates every property (raises ValueError on a
    wrong name or value), and the dict the builders made must come back unchanged in content."""
    checked = go.Figure(fig)
    assert len(checked.data) == len(fig["data"])
    return fig


def _axis_title(axis):
    return axis["title"]["text"]


def test_plotly_rejects_a_broken_figure():
    """The validation the tests rely on does fail: a misspelt property, a wrong mode."""
    fig = charts.line_chart({"a": ([0, 1], [1.0, 2.0])}, "step", "loss (nats/token)")
    fig["data"][0]["colour"] = "red"
    with pytest.raises(ValueError):
        go.Figure(fig)
    fig = charts.line_chart({"a": ([0, 1], [1.0, 2.0])}, "step", "loss (nats/token)")
    fig["data"][0]["mode"] = "dots"
    with pytest.raises(ValueError):
        go.Figure(fig)


def test_line_chart_with_rolling_median_and_predicted_rule():
    ys = [10.0, 30.0, 11.0, None, 12.0]
    fig = _valid(charts.line_chart({"each step": ([1, 2, 3, 4, 5], ys)}, "step", "throughput (samples/s)",
                                   "Throughput", smooth=3, hlines={"predicted": 20.0}))
    raw, med = fig["data"]
    assert raw["name"] == "each step" and raw["mode"] == "markers" and raw["y"] == ys  # the gap kept
    assert raw["marker"]["opacity"] == charts.RAW_OPACITY
    assert med["name"] == "median of 3" and med["mode"] == "lines"
    assert med["y"] == common.rolling_median(ys, 3) == [10.0, 20.0, 11.0, 20.5, 11.5]
    (rule,) = fig["layout"]["shapes"]
    assert (rule["y0"], rule["y1"], rule["name"], rule["line"]["dash"]) == (20.0, 20.0, "predicted", "dash")
    assert rule["showlegend"] and rule["xref"] == "x domain"  # across the plot, in the legend
    lay = fig["layout"]
    assert _axis_title(lay["xaxis"]) == "step" and _axis_title(lay["yaxis"]) == "throughput (samples/s)"
    assert lay["title"]["text"] == "Throughput" and lay["showlegend"]
    assert lay["xaxis"]["dtick"] == 1  # whole steps: no "0.5" tick
    assert "%{fullData.name}" in raw["hovertemplate"]  # the hover box says which series (measured, ...)
    # three distinct colours, in the order the series are named
    assert [raw["marker"]["color"], med["line"]["color"], rule["line"]["color"]] == list(charts.PALETTE[:3])


def test_markers_only_up_to_the_limit():
    few = _valid(charts.line_chart({"a": ([0, 1], [1.0, 2.0])}, "step", "loss (nats/token)"))
    many_x = list(range(charts.MAX_MARKER_POINTS + 1))
    many = _valid(charts.line_chart({"a": (many_x, [1.0] * len(many_x))}, "step", "loss (nats/token)"))
    assert few["data"][0]["mode"] == "lines+markers" and many["data"][0]["mode"] == "lines"
    assert not few["layout"]["showlegend"]  # one series: nothing to tell apart
    assert "dtick" not in many["layout"]["xaxis"]  # a long run: Plotly's own round ticks


def test_grouped_bars_with_horizontal_labels_and_stacked_bars_with_a_capacity_rule():
    fig = _valid(charts.bar_chart(["rank 0", "rank 1 (emulated)"], {"measured": [100.0, 120.0], "predicted": [90.0, None]},
                                  "rank", "memory (MiB)", labels={"measured": ["100", "120"], "predicted": ["90", "—"]}))
    measured, predicted = fig["data"]
    assert measured["type"] == "bar" and measured["y"] == [100.0, 120.0] and predicted["y"] == [90.0, None]
    assert predicted["text"] == ["90", ""]  # no bar, no label
    assert measured["textposition"] == "outside" and measured["textangle"] == 0  # over the bar, horizontal
    lay = fig["layout"]
    assert lay["barmode"] == "group"
    assert lay["xaxis"]["categoryarray"] == ["rank 0", "rank 1 (emulated)"] and lay["xaxis"]["tickangle"] == 0
    assert lay["xaxis"]["ticktext"] == ["rank 0", "rank<br>1<br>(emulated)"]  # a long label wraps
    assert lay["yaxis"]["range"][1] == pytest.approx(120.0 * charts.LABEL_HEADROOM)  # room for the labels

    st = _valid(charts.bar_chart(["peak"], {"weights": [2.0], "activations": [3.0]}, "", "memory (GiB)", stacked=True,
                                 hlines={"H100 capacity": 80.0}, colors={"H100 capacity": charts.RULE_COLOR}))
    assert st["layout"]["barmode"] == "stack"
    assert [t["name"] for t in st["data"]] == ["weights", "activations"]  # weights at the bottom: the order given
    (rule,) = st["layout"]["shapes"]
    assert (rule["name"], rule["y0"], rule["line"]["color"]) == ("H100 capacity", 80.0, charts.RULE_COLOR)


def test_capacity_chart_draws_the_bar_and_a_capacity_marker_with_decade_ticks_on_log():
    fig = _valid(charts.capacity_chart(["0 · A", "1 · B"], [0.05, 90.0], [80.0, 80.0], "device", "memory (GiB)",
                                       value_labels=["51 MiB", "90 GiB"], capacity_labels=["80 GiB", "80 GiB"],
                                       marks={"capacity × 0.9": [72.0, 72.0]}, log_y=True))
    bar, cap, mark = fig["data"]
    assert bar["type"] == "bar" and bar["y"] == [0.05, 90.0] and bar["text"] == ["51 MiB", "90 GiB"]
    assert cap["name"] == "capacity" and cap["y"] == [80.0, 80.0] and cap["text"] == ["80 GiB", "80 GiB"]
    assert cap["marker"]["color"] == charts.RULE_COLOR and mark["y"] == [72.0, 72.0]
    # each marker a line across its bar's band (category k spans k ± the bar's half width), capacity thicker
    lines = [(s["x0"], s["x1"], s["y0"], s["line"]["width"]) for s in fig["layout"]["shapes"]]
    w = charts.BAR_HALF_WIDTH
    assert lines == [(-w, w, 80.0, 3), (1 - w, 1 + w, 80.0, 3), (-w, w, 72.0, 1.5), (1 - w, 1 + w, 72.0, 1.5)]
    y = fig["layout"]["yaxis"]
    assert y["type"] == "log" and y["tickvals"] == [0.01, 0.1, 1.0, 10.0, 100.0]  # powers of ten only
    assert y["range"][0] == pytest.approx(-2.0) and 10 ** y["range"][1] > 90.0 * 2  # room for "90 GiB" over its bar


def test_gantt_chart_bars_from_start_to_end_in_the_row_order_given():
    rows = [{"row": "gpu 1", "start": 0.5, "end": 2.0, "color": "job b"},
            {"row": "gpu 0", "start": 0.0, "end": 1.0, "color": "job a"},
            {"row": "gpu 0", "start": 1.5, "end": 3.0, "color": "job b"}]
    fig = _valid(charts.gantt_chart(rows, "time (h)", "device", "Devices", row_order=["gpu 0", "gpu 1"],
                                    color_order=["job a", "job b"], x_range=(0.0, 4.0)))
    b, a = fig["data"]  # drawn in the order the rows name them (a later bar over an earlier one)
    assert (b["name"], b["orientation"], b["y"], b["base"], b["x"]) == ("job b", "h", ["gpu 1", "gpu 0"], [0.5, 1.5], [1.5, 1.5])
    assert (a["name"], a["base"], a["x"]) == ("job a", [0.0], [1.0])
    assert a["legendrank"] < b["legendrank"]  # listed in color_order
    assert a["customdata"] == [["job a", 0.0, 1.0]]  # the hover box names the job, its start and end
    lay = fig["layout"]
    assert lay["barmode"] == "overlay"  # bars of one row overlap, never side by side
    assert lay["yaxis"]["categoryarray"] == ["gpu 0", "gpu 1"] and lay["yaxis"]["autorange"] == "reversed"
    assert lay["xaxis"]["range"] == [0.0, 4.0] and _axis_title(lay["xaxis"]) == "time (h)"
    assert lay["height"] == charts.GANTT_MIN_PX


def test_margins_hold_the_labels_so_plotly_draws_once():
    """A margin wide enough for the row labels (Gantt) and the wrapped category labels (bars): Plotly's
    automargin has nothing to push, which would draw the chart a second time."""
    short = charts.gantt_chart([{"row": "d0", "start": 0, "end": 1, "color": "a"}], "time (h)", "device")
    long = charts.gantt_chart([{"row": "p0 s0 · eu-west A100-80GB", "start": 0, "end": 1, "color": "a"}], "time (h)", "device")
    assert long["layout"]["margin"]["l"] >= charts.CHAR_PX * len("p0 s0 · eu-west A100-80GB") > short["layout"]["margin"]["l"]
    one = charts.bar_chart(["even"], {"a": [1.0]}, "plan", "samples/s")
    three = charts.bar_chart(["pp single connection"], {"a": [1.0]}, "plan", "samples/s")
    assert three["layout"]["margin"]["b"] == one["layout"]["margin"]["b"] + 2 * charts.LINE_PX


def test_gantt_without_legend_is_one_trace_coloured_per_bar():
    rows = [{"row": str(i % 3), "start": i, "end": i + 1, "color": f"job {i}"} for i in range(30)]
    fig = _valid(charts.gantt_chart(rows, "time (h)", "device", legend=False, color_title="job"))
    (trace,) = fig["data"]
    assert len(trace["marker"]["color"]) == 30 and trace["marker"]["color"][0] != trace["marker"]["color"][1]
    assert not fig["layout"]["showlegend"] and "job: %{customdata[0]}" in trace["hovertemplate"]


def test_empty_charts_are_still_valid_figures():
    _valid(charts.line_chart({}, "step", "loss (nats/token)"))
    _valid(charts.gantt_chart([], "time (h)", "device", legend=False))
    _valid(charts.bar_chart([], {}, "rank", "memory (MiB)"))


def test_charts_do_not_import_the_frameworks():
    """The builders are data: the module reads neither Streamlit nor Plotly (pages draw through
    ui/common.show_figure), so building a figure costs no import and no validation."""
    import inspect

    src = inspect.getsource(charts)
    assert "import streamlit" not in src and "import plotly" not in src and "from plotly" not in src
