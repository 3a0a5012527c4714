"""ui/charts.py: the Vega-Lite specs the dashboard's pages draw (values, encodings, rules)."""
from ui import charts, common


def _by_mark(chart):
    out = {}
    for layer in charts.spec_layers(chart):
        out.setdefault(layer["mark"], []).append(layer)
    return out


def test_line_chart_with_rolling_median_and_predicted_rule():
    ys = [10.0, 30.0, 11.0, None, 12.0]
    ch = charts.line_chart({"each step": ([1, 2, 3, 4, 5], ys)}, "step", "throughput (samples/s)",
                           "Throughput", smooth=3, hlines={"predicted": 20.0})
    m = _by_mark(ch)
    assert [r["y"] for r in m["point"][0]["rows"]] == ys  # the raw points, the gap kept
    med = m["line"][0]["rows"]
    assert {r["series"] for r in med} == {"median of 3"}
    assert [r["y"] for r in med] == common.rolling_median(ys, 3) == [10.0, 20.0, 11.0, 20.5, 11.5]
    assert m["rule"][0]["rows"] == [{"series": "predicted", "y": 20.0}]
    assert m["rule"][0]["encoding"]["color"]["field"] == "series"
    # the legend names every series in the caller's order
    assert ch.to_dict()["layer"][0]["encoding"]["color"]["scale"]["domain"] == ["each step", "median of 3",
                                                                                "predicted"]


def test_markers_only_up_to_the_limit():
    few = charts.line_chart({"a": ([0, 1], [1.0, 2.0])}, "step", "loss (nats/token)")
    many_x = list(range(charts.MAX_MARKER_POINTS + 1))
    many = charts.line_chart({"a": (many_x, [1.0] * len(many_x))}, "step", "loss (nats/token)")
    assert few.to_dict()["mark"] == {"type": "line", "point": True}
    assert many.to_dict()["mark"] == {"type": "line", "point": False}


def test_grouped_bars_with_horizontal_labels_and_stacked_bars_with_a_capacity_rule():
    ch = charts.bar_chart(["rank 0", "rank 1"], {"measured": [100.0, 120.0], "predicted": [90.0, None]},
                          "rank", "memory (MiB)", labels={"measured": ["100", "120"], "predicted": ["90", "—"]})
    m = _by_mark(ch)
    bars = m["bar"][0]
    assert [(r["x"], r["series"], r["y"]) for r in bars["rows"]] == [
        ("rank 0", "measured", 100.0), ("rank 1", "measured", 120.0), ("rank 0", "predicted", 90.0)]
    assert bars["encoding"]["xOffset"]["field"] == "series"  # side by side
    assert bars["encoding"]["x"]["axis"]["labelAngle"] == 0
    assert m["text"][0]["encoding"]["text"]["field"] == "label" and "angle" not in m["text"][0]["encoding"]
    assert bars["encoding"]["y"]["scale"]["domainMax"] > 120.0  # room for the labels

    st = charts.bar_chart(["peak"], {"weights": [2.0], "activations": [3.0]}, "", "memory (GiB)", stacked=True,
                          hlines={"H100 capacity": 80.0})
    m = _by_mark(st)
    assert m["bar"][0]["encoding"]["y"]["stack"] == "zero" and "xOffset" not in m["bar"][0]["encoding"]
    assert m["bar"][0]["encoding"]["order"]["field"] == "order"  # weights at the bottom: the order given
    assert [(r["series"], r["order"]) for r in m["bar"][0]["rows"]] == [("weights", 0), ("activations", 1)]
    assert m["rule"][0]["rows"] == [{"series": "H100 capacity", "y": 80.0}]


def test_capacity_chart_draws_the_bar_and_a_capacity_marker_with_decade_ticks_on_log():
    ch = charts.capacity_chart(["0 · A", "1 · B"], [0.05, 90.0], [80.0, 80.0], "device", "memory (GiB)",
                               value_labels=["51 MiB", "90 GiB"], marks={"capacity × 0.9": [72.0, 72.0]},
                               log_y=True)
    m = _by_mark(ch)
    assert [r["y"] for r in m["bar"][0]["rows"]] == [0.05, 90.0]
    assert [(r["series"], r["y"]) for r in m["tick"][0]["rows"]] == [("capacity", 80.0), ("capacity", 80.0)]
    assert [r["y"] for r in m["tick"][1]["rows"]] == [72.0, 72.0]
    axis = m["bar"][0]["encoding"]["y"]["axis"]
    assert axis["values"] == [0.01, 0.1, 1.0, 10.0, 100.0]  # powers of ten only: no labelled minor ticks
    assert m["bar"][0]["encoding"]["y2"] == {"datum": 0.01}  # bars rise from the axis' bottom (no zero on a log axis)
    assert [r["label"] for r in m["text"][0]["rows"]] == ["51 MiB", "90 GiB"]


def test_gantt_chart_bars_from_start_to_end_in_the_row_order_given():
    rows = [{"row": "gpu 1", "start": 0.5, "end": 2.0, "color": "job b"},
            {"row": "gpu 0", "start": 0.0, "end": 1.0, "color": "job a"}]
    ch = charts.gantt_chart(rows, "time (h)", "device", "Devices", row_order=["gpu 0", "gpu 1"])
    (bar,) = charts.spec_layers(ch)
    enc = bar["encoding"]
    assert enc["x"]["field"] == "start" and enc["x2"]["field"] == "end" and enc["y"]["sort"] == ["gpu 0", "gpu 1"]
    assert [(r["row"], r["start"], r["end"]) for r in bar["rows"]] == [("gpu 1", 0.5, 2.0), ("gpu 0", 0.0, 1.0)]
    assert ch.to_dict()["height"] == charts.GANTT_MIN_PX
