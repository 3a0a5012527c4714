"""Every dashboard chart, drawn with Vega-Lite through Altair.

Why Vega-Lite and not Plotly (issue 16, "Fast pages"): a page opened in a new browser tab must be
fully drawn within 2 s. Streamlit loads Plotly's JavaScript lazily, and that chunk alone put any
Plotly page over 2 s on the dashboard machine; moving the charts here drew Model & memory 0.9 s and
Plan 0.7 s sooner in a new tab, measured side by side against the Plotly pages
(bench/dashboard_latency.py measures the pages against a one-line app).

The builders return Altair charts (`chart.to_dict()` is the Vega-Lite spec a test can read); pages
render them with `show_chart` (or ui/common.show_figure, the same call). House rules they follow:
- every axis title carries its unit ("step", "loss (nats/token)", "memory (GiB)");
- a series' name says what kind of number it is (measured / predicted / simulated): the caller
  names it;
- values are written as horizontal labels over bars, never as vertical text inside them;
- a log axis is labelled at powers of ten only (no labelled minor ticks).

The API is stable: other pages import these names; add, do not rename.
"""
from __future__ import annotations

import math
from typing import Any, Iterable, Sequence

import streamlit as st

CHART_HEIGHT_PX = 320
MAX_MARKER_POINTS = 200  # line charts draw a marker per point up to this many points per series
GANTT_ROW_PX = 22  # a Gantt chart grows with its rows, within [GANTT_MIN_PX, GANTT_MAX_PX]
GANTT_MIN_PX, GANTT_MAX_PX = 260, 900
FRAME_PX = 190  # what a chart's height holds besides its plot: title, legend, x axis and its title
WRAP_LABEL_CHARS = 14  # a category label longer than this is written on several lines
RAW_OPACITY = 0.45  # the raw points under a rolling median

# the fields of the long-form tables the builders make (one row per point/bar)
X, Y, SERIES, LABEL, ORDER = "x", "y", "series", "label", "order"

# one colour per series, in the order the caller names them (Vega's category10)
PALETTE = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f",
           "#bcbd22", "#17becf")
RULE_COLOR = "crimson"


# ---- shared pieces ---------------------------------------------------------------------------------


def _alt():
    import altair as alt  # a Streamlit dependency; imported when a page draws its first chart

    return alt


def _frame(rows: list[dict[str, Any]], columns: Sequence[str]) -> dict[str, list[dict[str, Any]]]:
    """Inline Vega-Lite data, `columns` of each row as plain Python values (a NumPy scalar as its
    `.item()`): no DataFrame to build and convert on every draw."""
    return {"values": [{c: _plain(r.get(c)) for c in columns} for r in rows]}


def _plain(v: Any) -> Any:
    return v.item() if hasattr(v, "item") else v


def _finite(v: Any) -> float | None:
    """A plottable number or None (a gap in a line, no bar): None, NaN and inf are not drawn."""
    if v is None:
        return None
    v = float(v)
    return v if math.isfinite(v) else None


def color_scale(names: Iterable[str], colors: dict[str, str] | None = None):
    """One fixed colour per series name, legend in the order given (not alphabetical)."""
    names = list(dict.fromkeys(names))
    colors = colors or {}
    rng = [colors.get(n, PALETTE[k % len(PALETTE)]) for k, n in enumerate(names)]
    return _alt().Scale(domain=names, range=rng)


def _legend(show: bool = True):
    alt = _alt()
    return alt.Legend(orient="top", title=None, labelLimit=400) if show else None


def log_ticks(values: Iterable[float | None]) -> list[float]:
    """The powers of ten that span `values` (positive ones): a log axis's only labelled ticks."""
    pos = [v for v in values if v is not None and v > 0]
    if not pos:
        return [1.0]
    lo, hi = math.floor(math.log10(min(pos))), math.ceil(math.log10(max(pos)))
    return [10.0 ** e for e in range(lo, max(hi, lo + 1) + 1)]


def y_axis(title: str, values: Iterable[float | None] = (), *, log: bool = False, zero: bool = True,
           headroom: float = 1.0):
    """The y encoding's scale and axis: a linear axis from zero (with `headroom` × the largest
    value: room for labels over the bars), or a log axis labelled at powers of ten only."""
    alt = _alt()
    vals = [v for v in values if v is not None]
    if log:
        ticks = log_ticks(vals)
        scale = alt.Scale(type="log", domain=[ticks[0], ticks[-1]], nice=False)
        return scale, alt.Axis(title=title, values=ticks, format="~g", grid=True)
    scale = alt.Scale(zero=zero)
    if headroom > 1.0 and vals and max(vals) > 0:
        scale = alt.Scale(zero=zero, domainMax=headroom * max(vals))
    return scale, alt.Axis(title=title)


def category_axis(title: str | None, categories: Sequence[str]):
    """A bar chart's x axis: the categories in the order given, labels horizontal, a long one
    broken into lines at spaces ("best homogeneous"), so that long names are not dropped for
    overlapping."""
    alt = _alt()
    return alt.X(f"{X}:N", title=title or None, sort=list(dict.fromkeys(categories)),
                 axis=alt.Axis(labelAngle=0, labelLimit=240,
                               labelExpr=f"length(datum.label) > {WRAP_LABEL_CHARS} ? split(datum.label, ' ') : datum.label"))


def bar_floor(scale: Any) -> dict[str, Any]:
    """Where bars start: from zero on a linear axis (Vega-Lite's default); from the bottom of a log
    axis (zero is not on it, and a bar from zero is not drawn at all)."""
    if getattr(scale, "type", None) == "log":
        return {"y2": _alt().datum(scale.domain[0])}
    return {}


def finish(chart: Any, title: str | None = None, height: int = CHART_HEIGHT_PX) -> Any:
    """The dashboard's chart settings: full width, a fixed height, the title at the top left."""
    alt = _alt()
    props: dict[str, Any] = {"height": height, "width": "container"}
    if title:
        props["title"] = alt.TitleParams(title, anchor="start", fontSize=14)
    return chart.properties(**props)


def rules(values: dict[str, float]) -> Any | None:
    """Dashed horizontal lines, one per named value ("predicted", "H100 capacity"), in the legend
    with the chart's other series (the caller's colour scale must include their names)."""
    alt = _alt()
    rows = [{SERIES: name, Y: _finite(v)} for name, v in values.items() if _finite(v) is not None]
    if not rows:
        return None
    return alt.Chart(_frame(rows, (SERIES, Y))).mark_rule(strokeDash=[6, 4], strokeWidth=2).encode(
        y=alt.Y(f"{Y}:Q"), color=alt.Color(f"{SERIES}:N"),
        tooltip=[alt.Tooltip(f"{SERIES}:N", title="line"), alt.Tooltip(f"{Y}:Q", title="value", format=",.4~g")])


def _layer(layers: list[Any]) -> Any:
    alt = _alt()
    layers = [layer for layer in layers if layer is not None]
    return layers[0] if len(layers) == 1 else alt.layer(*layers)


# ---- line chart ------------------------------------------------------------------------------------


def line_chart(
    series: dict[str, tuple[Sequence[float], Sequence[float | None]]],
    x_title: str,
    y_title: str,
    title: str | None = None,
    *,
    height: int = CHART_HEIGHT_PX,
    smooth: int | None = None,
    hlines: dict[str, float] | None = None,
    log_y: bool = False,
    colors: dict[str, str] | None = None,
) -> Any:
    """Lines from `{name: (xs, ys)}`, one colour per name, markers up to MAX_MARKER_POINTS points.

    smooth=N: each series is drawn as faint raw points and its trailing rolling median of N points
    (ui/common.rolling_median) as the line to read, named "median of N" (one series) or
    "<name>, median of N". hlines: named dashed horizontal rules ("predicted": 41.5).
    A None / NaN y is a gap, not a zero."""
    from ui.common import rolling_median

    alt = _alt()
    raw, smoothed = [], []
    for name, (xs, ys) in series.items():
        ys = [_finite(y) for y in ys]
        raw += [{X: x, Y: y, SERIES: name} for x, y in zip(xs, ys)]
        if smooth:
            med_name = f"median of {smooth}" if len(series) == 1 else f"{name}, median of {smooth}"
            smoothed += [{X: x, Y: y, SERIES: med_name} for x, y in zip(xs, rolling_median(ys, smooth))]
    names = list(series) + list(dict.fromkeys(r[SERIES] for r in smoothed)) + list(hlines or {})
    scale, axis = y_axis(y_title, [r[Y] for r in raw] + list((hlines or {}).values()), log=log_y, zero=False)
    color = alt.Color(f"{SERIES}:N", scale=color_scale(names, colors), legend=_legend(len(names) > 1))
    # steps are whole numbers: no "0.5" tick between two of them
    whole = all(isinstance(r[X], int) or (isinstance(r[X], float) and r[X].is_integer()) for r in raw)
    x_axis = alt.Axis(title=x_title, tickMinStep=1, format="d") if whole and raw else alt.Axis(title=x_title)
    enc = dict(x=alt.X(f"{X}:Q", title=x_title, axis=x_axis), y=alt.Y(f"{Y}:Q", scale=scale, axis=axis), color=color,
               tooltip=[alt.Tooltip(f"{SERIES}:N", title="series"), alt.Tooltip(f"{X}:Q", title=x_title),
                        alt.Tooltip(f"{Y}:Q", title=y_title, format=",.4~g")])
    base = alt.Chart(_frame(raw, (X, Y, SERIES)))
    longest = max((len(xs) for xs, _ in series.values()), default=0)
    if smooth:
        layers = [base.mark_point(filled=True, size=18, opacity=RAW_OPACITY).encode(**enc),
                  alt.Chart(_frame(smoothed, (X, Y, SERIES))).mark_line(strokeWidth=3).encode(**enc)]
    else:
        # one SVG node per marker: past a few hundred points (a live run) the browser redraws too
        # slowly for a 1 s refresh, and a line reads as well
        layers = [base.mark_line(point=longest <= MAX_MARKER_POINTS).encode(**enc)]
    layers.append(rules(hlines or {}))
    return finish(_layer(layers), title, height)


# ---- bar charts --------------------------------------------------------------------------------------


def bar_chart(
    categories: Sequence[str],
    series: dict[str, Sequence[float | None]],
    x_title: str,
    y_title: str,
    title: str | None = None,
    *,
    labels: dict[str, Sequence[str]] | None = None,
    stacked: bool = False,
    hlines: dict[str, float] | None = None,
    log_y: bool = False,
    colors: dict[str, str] | None = None,
    height: int = CHART_HEIGHT_PX,
) -> Any:
    """Bars per category, one colour per series: side by side (grouped), or stacked.

    labels: `{series: [text per category]}` written horizontally over each bar (grouped bars only;
    the y axis gets room for them). hlines: named dashed horizontal rules (a capacity). A None
    value draws no bar. The category order is the order given."""
    alt = _alt()
    labels = labels or {}
    rows = []
    for k, (name, ys) in enumerate(series.items()):
        texts = list(labels.get(name, [""] * len(categories)))
        rows += [{X: c, Y: _finite(y), SERIES: name, LABEL: t, ORDER: k} for c, y, t in zip(categories, ys, texts)]
    rows = [r for r in rows if r[Y] is not None]
    names = list(series) + list(hlines or {})
    values = [r[Y] for r in rows] + list((hlines or {}).values())
    if stacked:
        totals: dict[str, float] = {}
        for r in rows:
            totals[r[X]] = totals.get(r[X], 0.0) + r[Y]
        values = list(totals.values()) + list((hlines or {}).values())
    scale, axis = y_axis(y_title, values, log=log_y, headroom=1.15 if labels and not log_y else 1.0)
    x = category_axis(x_title, categories)
    enc: dict[str, Any] = dict(
        x=x, y=alt.Y(f"{Y}:Q", scale=scale, axis=axis, stack="zero" if stacked else None),
        color=alt.Color(f"{SERIES}:N", scale=color_scale(names, colors), legend=_legend(len(names) > 1)),
        tooltip=[alt.Tooltip(f"{X}:N", title=x_title or "bar"), alt.Tooltip(f"{SERIES}:N", title="series"),
                 alt.Tooltip(f"{Y}:Q", title=y_title, format=",.4~g")])
    if not stacked and len(series) > 1:
        enc["xOffset"] = alt.XOffset(f"{SERIES}:N", sort=list(series))
    if stacked:
        enc["order"] = alt.Order(f"{ORDER}:Q")  # the first series at the bottom, as the legend reads
    base = alt.Chart(_frame(rows, (X, Y, SERIES, LABEL, ORDER)))
    layers = [base.mark_bar().encode(**enc, **bar_floor(scale))]
    if labels and not stacked:
        text_enc = {k: v for k, v in enc.items() if k not in ("color", "tooltip")}
        layers.append(base.mark_text(baseline="bottom", dy=-3, fontSize=11, color="#333").encode(
            text=alt.Text(f"{LABEL}:N"), **text_enc))
    layers.append(rules(hlines or {}))
    return finish(_layer(layers), title, height)


def capacity_chart(
    categories: Sequence[str],
    values: Sequence[float],
    capacity: Sequence[float],
    x_title: str,
    y_title: str,
    title: str | None = None,
    *,
    value_name: str = "predicted",
    capacity_name: str = "capacity",
    value_labels: Sequence[str] | None = None,
    capacity_labels: Sequence[str] | None = None,
    marks: dict[str, Sequence[float]] | None = None,
    log_y: bool = False,
    height: int = CHART_HEIGHT_PX,
) -> Any:
    """A bar per category (a predicted memory peak) with its limit (the device's capacity) drawn as a
    thick marker across the bar's band: a bar over its capacity stays visible above the marker.
    marks: more named markers per category (`{"capacity × 0.9": [...]}`), thinner. Labels are
    written over the bar (values, dark) and over the capacity marker (its colour)."""
    alt = _alt()
    cats = list(dict.fromkeys(categories))
    bars = [{X: c, Y: _finite(v), SERIES: value_name, LABEL: t}
            for c, v, t in zip(categories, values, value_labels or [""] * len(categories))]
    caps = [{X: c, Y: _finite(v), SERIES: capacity_name, LABEL: t}
            for c, v, t in zip(categories, capacity, capacity_labels or [""] * len(categories))]
    extra = [{X: c, Y: _finite(v), SERIES: name, LABEL: ""} for name, vs in (marks or {}).items()
             for c, v in zip(categories, vs)]
    names = [value_name, capacity_name, *(marks or {})]
    colors = {value_name: PALETTE[0], capacity_name: RULE_COLOR}
    all_values = [r[Y] for r in bars + caps + extra]
    scale, axis = y_axis(y_title, all_values, log=log_y, headroom=1.0 if log_y else 1.15)
    x = category_axis(x_title, cats)
    y = alt.Y(f"{Y}:Q", scale=scale, axis=axis)
    color = alt.Color(f"{SERIES}:N", scale=color_scale(names, colors), legend=_legend())
    tooltip = [alt.Tooltip(f"{X}:N", title=x_title), alt.Tooltip(f"{SERIES}:N", title="series"),
               alt.Tooltip(f"{Y}:Q", title=y_title, format=",.4~g")]
    cols = (X, Y, SERIES, LABEL)
    layers = [
        alt.Chart(_frame(bars, cols)).mark_bar().encode(x=x, y=y, color=color, tooltip=tooltip, **bar_floor(scale)),
        alt.Chart(_frame(caps, cols)).mark_tick(thickness=3).encode(x=x, y=y, color=color, tooltip=tooltip),
    ]
    if extra:
        layers.append(alt.Chart(_frame(extra, cols)).mark_tick(thickness=1.5, opacity=0.8).encode(
            x=x, y=y, color=color, tooltip=tooltip))
    if value_labels:
        layers.append(alt.Chart(_frame(bars, cols)).mark_text(baseline="bottom", dy=-3, fontSize=11, color="#333").encode(
            x=x, y=y, text=alt.Text(f"{LABEL}:N")))
    if capacity_labels:
        layers.append(alt.Chart(_frame(caps, cols)).mark_text(baseline="bottom", dy=-4, fontSize=11,
                                                            color=RULE_COLOR).encode(x=x, y=y, text=alt.Text(f"{LABEL}:N")))
    return finish(alt.layer(*layers), title, height)


# ---- Gantt chart -------------------------------------------------------------------------------------


def gantt_chart(
    rows: Sequence[dict[str, Any]],
    x_title: str,
    y_title: str,
    title: str | None = None,
    *,
    row_order: Sequence[str] | None = None,
    color_order: Sequence[str] | None = None,
    colors: dict[str, str] | None = None,
    legend: bool = True,
    color_title: str = "what",
    tooltip: Sequence[str] = (),
    height: int | None = None,
) -> Any:
    """Horizontal bars from `start` to `end` (x, x2), one row per `row`, coloured by `color`.

    rows: dicts with keys row, start, end, color (+ any names in `tooltip`). row_order: the rows from
    top to bottom (default: as first seen). The height grows with the number of rows."""
    alt = _alt()
    order = list(row_order) if row_order is not None else list(dict.fromkeys(r["row"] for r in rows))
    groups = list(color_order) if color_order is not None else list(dict.fromkeys(r["color"] for r in rows))
    cols = ("row", "start", "end", "color", *tooltip)
    data = _frame([{c: r.get(c) for c in cols} for r in rows], cols)
    chart = alt.Chart(data).mark_bar(cornerRadius=1).encode(
        x=alt.X("start:Q", title=x_title), x2=alt.X2("end:Q"),
        y=alt.Y("row:N", title=y_title, sort=order, axis=alt.Axis(labelLimit=300)),
        color=alt.Color("color:N", scale=color_scale(groups, colors), legend=_legend(legend)),
        tooltip=[alt.Tooltip("row:N", title=y_title), alt.Tooltip("color:N", title=color_title),
                 alt.Tooltip("start:Q", format=",.4~g"), alt.Tooltip("end:Q", format=",.4~g"),
                 *[alt.Tooltip(f"{t}:N") for t in tooltip]])
    if height is None:
        height = min(GANTT_MAX_PX, max(GANTT_MIN_PX, GANTT_ROW_PX * len(order) + FRAME_PX))
    return finish(chart, title, height)


# ---- rendering -----------------------------------------------------------------------------------------


def vega_lite_spec(chart: Any) -> dict[str, Any]:
    """A builder's chart as the Vega-Lite spec the browser draws, its data inline. Not validated
    against the schema here (that is half of Altair's cost per chart, paid again on every draw;
    tests/unit/test_ui_charts.py validates every builder's output), and without Altair's default theme
    (its 300 px view size: the dashboard sets its own), as `st.altair_chart` draws it."""
    spec = chart.to_dict(validate=False)
    spec.pop("config", None)  # the theme's only entry: no builder configures a chart
    return spec


def show_chart(chart: Any, key: str | None = None) -> None:
    """Draw a chart (a builder's Altair chart, or its `vega_lite_spec`, e.g. cached by a page) full
    width. A key puts it in a keyed container, whose CSS class `st-key-<key>` the browser tests
    and bench/dashboard_latency.py look for."""
    spec = chart if isinstance(chart, dict) else vega_lite_spec(chart)
    if key is None:
        st.vega_lite_chart(spec, width="stretch")
        return
    with st.container(key=key):
        st.vega_lite_chart(spec, width="stretch")


# ---- reading a chart back (tests, benchmarks) ----------------------------------------------------------


def spec_layers(chart: Any) -> list[dict[str, Any]]:
    """A chart's Vega-Lite spec as a flat list of its layers, each {"mark": "bar", "encoding":
    {...}, "rows": [the data rows it draws]}: what a test asserts on (the values, the encodings)
    without walking Altair's nesting of layers and named datasets."""
    spec = chart.to_dict()
    return _flatten(spec, spec.get("datasets", {}))


def element_layers(proto: Any) -> list[dict[str, Any]]:
    """The same flat layers from a drawn chart's Streamlit message (an AppTest element's
    `.proto`): its spec JSON and its Arrow datasets, as the browser receives them."""
    import json

    import pyarrow as pa

    datasets = {d.name: pa.ipc.open_stream(d.data.data).read_pandas().to_dict("records") for d in proto.datasets}
    return _flatten(json.loads(proto.spec), datasets)


def _flatten(node: dict[str, Any], datasets: dict[str, list[dict[str, Any]]], data: Any = None) -> list[dict[str, Any]]:
    data = node.get("data", data)
    if "layer" in node:
        return [x for child in node["layer"] for x in _flatten(child, datasets, data)]
    mark = node.get("mark")
    if isinstance(data, dict) and "name" in data:
        rows = datasets.get(data["name"], [])
    else:
        rows = (data or {}).get("values", [])
    return [{"mark": mark["type"] if isinstance(mark, dict) else mark, "encoding": node.get("encoding", {}),
             "rows": rows}]
