"""Every dashboard chart, as a Plotly figure (the design card's choice): hover, zoom, Gantt bars.

The builders return the figure as a plain dict ({"data": [traces], "layout": {...}}), what
`plotly.graph_objects.Figure(fig)` accepts and plotly.js draws (ui/common.show_figure).
A dict costs nothing to cache (st.cache_data pickles it) and nothing to build; Plotly's own
validation of the same dicts runs in tests/unit/test_ui_charts.py, not on every draw. This module
imports neither Streamlit nor Plotly. House rules the builders follow:
- every axis title carries its unit ("step", "loss (nats/token)", "memory (GiB)");
- a series' name says what kind of number it is (measured / predicted / simulated): the caller
  names it, and the hover box shows it;
- values are written as horizontal labels over bars, never as vertical text inside them;
- a log axis is labelled at powers of ten only.
Read the new-tab cost of these charts with bench/dashboard_latency.py.
"""
from __future__ import annotations

import json
import math
import statistics
from typing import Any, Iterable, Sequence

CHART_HEIGHT_PX = 320
MAX_MARKER_POINTS = 200  # line charts draw a marker per point up to this many points per series
GANTT_ROW_PX = 22  # a Gantt chart grows with its rows, within [GANTT_MIN_PX, GANTT_MAX_PX]
GANTT_MIN_PX, GANTT_MAX_PX = 260, 900
GANTT_MAX_LEFT_PX = 320  # a longer row label is Plotly's to fit (automargin)
FRAME_PX = 150  # what a chart's height holds besides its plot: title, legend, x axis and its title
WRAP_LABEL_CHARS = 14  # a category label longer than this is written on several lines
RAW_OPACITY = 0.45  # the raw points under a rolling median
LABEL_HEADROOM = 1.15  # a linear axis with labels over its bars reaches this × the tallest bar
LOG_LABEL_HEADROOM = 3.0  # on a log axis: room for a label over a value near the top power of ten
BAR_HALF_WIDTH = 0.4  # a lone bar's half width in category units (Plotly's default gap of 0.2)
NUMBER_FORMAT = ",.4~g"  # d3 format of a number in a hover box
# Margins (px) that already hold the axes' labels and titles: Plotly's automargin then has nothing to
# push, and a chart draws once instead of twice (35 -> 17 ms a line chart, 135 -> 55 ms a Gantt)
LEFT_PX, BOTTOM_PX, TITLE_PX, LEGEND_PX, LINE_PX, CHAR_PX = 70, 50, 30, 28, 14, 7

# one colour per series, in the order the caller names them (category10)
PALETTE = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f",
           "#bcbd22", "#17becf")
RULE_COLOR = "crimson"
LABEL_COLOR = "#333"


# ---- shared pieces ---------------------------------------------------------------------------------


def _finite(v: Any) -> float | None:
    """A plottable number or None (a gap in a line, no bar): None, NaN and inf are not drawn."""
    if v is None:
        return None
    v = float(v)
    return v if math.isfinite(v) else None


def _plain(v: Any) -> Any:
    """A NumPy scalar as its Python value (the figure is JSON)."""
    return v.item() if hasattr(v, "item") else v


def rolling_median(ys: Sequence[float | None], window: int) -> list[float | None]:
    """The median of each point's trailing window (at most `window` points, None skipped): a
    measured series smoothed without letting one slow step pull it, as a mean would."""
    out: list[float | None] = []
    for i in range(len(ys)):
        vals = [y for y in ys[max(0, i - window + 1):i + 1] if y is not None]
        out.append(statistics.median(vals) if vals else None)
    return out


def color_map(names: Iterable[str], colors: dict[str, str] | None = None) -> dict[str, str]:
    """One fixed colour per series name: the caller's, else the palette's in the order given."""
    colors = colors or {}
    return {n: colors.get(n, PALETTE[k % len(PALETTE)]) for k, n in enumerate(dict.fromkeys(names))}


def log_ticks(values: Iterable[float | None]) -> list[float]:
    """The powers of ten that span `values` (positive ones): a log axis's only labelled ticks."""
    pos = [v for v in values if v is not None and v > 0]
    if not pos:
        return [1.0]
    lo, hi = math.floor(math.log10(min(pos))), math.ceil(math.log10(max(pos)))
    return [10.0 ** e for e in range(lo, max(hi, lo + 1) + 1)]


def y_axis(title: str, values: Iterable[float | None] = (), *, log: bool = False, zero: bool = True,
           headroom: float = 1.0) -> dict[str, Any]:
    """A y axis: linear from zero, or log labelled at powers of ten only; either reaching `headroom`
    × the largest value (room for labels over the bars)."""
    vals = [v for v in values if v is not None]
    axis: dict[str, Any] = {"title": {"text": title}, "automargin": True}
    if log:
        ticks = log_ticks(vals)
        top = max(ticks[-1], headroom * max(vals, default=ticks[-1]))
        return {**axis, "type": "log", "range": [math.log10(ticks[0]), math.log10(top)],
                "tickmode": "array", "tickvals": ticks, "ticktext": [f"{t:g}" for t in ticks]}
    if headroom > 1.0 and vals and max(vals) > 0:
        return {**axis, "range": [min(0.0, min(vals)), headroom * max(vals)]}
    return {**axis, "rangemode": "tozero" if zero else "normal"}


def wrap_label(label: str) -> str:
    """A category label as the axis writes it: one longer than WRAP_LABEL_CHARS broken at spaces."""
    return label.replace(" ", "<br>") if len(label) > WRAP_LABEL_CHARS else label


def category_axis(title: str | None, categories: Sequence[str]) -> dict[str, Any]:
    """A bar chart's x axis: the categories in the order given, labels horizontal, a long one
    broken into lines ("best<br>homogeneous") so that long names are not dropped for overlapping."""
    cats = list(dict.fromkeys(categories))
    return {"title": {"text": title or ""}, "type": "category", "categoryorder": "array", "categoryarray": cats,
            "tickangle": 0, "tickmode": "array", "tickvals": cats, "ticktext": [wrap_label(c) for c in cats],
            "automargin": True}


def category_bottom(categories: Sequence[str]) -> int:
    """The bottom margin of a category axis: its title and its longest label's lines."""
    lines = max((wrap_label(c).count("<br>") + 1 for c in categories), default=1)
    return BOTTOM_PX + LINE_PX * (lines - 1)


def hover(x_title: str, y_title: str, *, x_format: str = "", extra: str = "") -> str:
    """A hover box: the series' name (what kind of number), then x and y with their titles."""
    return (f"<b>%{{fullData.name}}</b><br>{x_title or 'x'}: %{{x{x_format}}}<br>"
            f"{y_title}: %{{y:{NUMBER_FORMAT}}}{extra}<extra></extra>")


def figure(data: list[dict[str, Any]], title: str | None, x_axis: dict[str, Any], y_axis_: dict[str, Any], *,
           height: int = CHART_HEIGHT_PX, legend: bool = True, left: int = LEFT_PX, bottom: int = BOTTOM_PX,
           **layout: Any) -> dict[str, Any]:
    """The dashboard's figure: a fixed height (full width is the caller's), the title at the top
    left, the legend in one row above the plot, hover on the nearest point, zoom by dragging.
    left, bottom: the margins the y and x axes' labels need (automargin widens them if short)."""
    top = 10 + (TITLE_PX if title else 0) + (LEGEND_PX if legend else 0)
    lay: dict[str, Any] = {
        "height": height, "margin": {"l": left, "r": 10, "t": top, "b": bottom},
        "xaxis": x_axis, "yaxis": y_axis_, "showlegend": legend, "hovermode": "closest", "dragmode": "zoom",
        "legend": {"orientation": "h", "x": 0, "xanchor": "left", "y": 1.0, "yanchor": "bottom", "traceorder": "normal"},
        **layout,
    }
    if title:
        lay["title"] = {"text": title, "x": 0, "xref": "paper", "xanchor": "left", "font": {"size": 14}}
    return {"data": data, "layout": lay}


def rules(values: dict[str, float | None], colors: dict[str, str]) -> list[dict[str, Any]]:
    """Dashed horizontal lines across the plot, one per named value ("predicted", "H100 capacity"),
    each in the legend and labelled with its name and value at its right end."""
    out = []
    for name, v in values.items():
        y = _finite(v)
        if y is None:
            continue
        out.append({"type": "line", "xref": "x domain", "x0": 0, "x1": 1, "yref": "y", "y0": y, "y1": y,
                    "line": {"color": colors[name], "dash": "dash", "width": 2}, "name": name, "showlegend": True,
                    "label": {"text": f"{name}: {y:,.4g}", "textposition": "end", "yanchor": "top",
                              "font": {"size": 11, "color": colors[name]}}})
    return out


def _whole(xs: Iterable[Any]) -> bool:
    xs = [x for x in xs if x is not None]
    return bool(xs) and all(isinstance(x, int) or (isinstance(x, float) and x.is_integer()) for x in xs)


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
) -> dict[str, Any]:
    """Lines from `{name: (xs, ys)}`, one colour per name, markers up to MAX_MARKER_POINTS points.

    smooth=N: each series is drawn as faint raw points and its trailing rolling median of N points
    as the line to read, named "median of N" (one series) or "<name>, median of N".
    hlines: named dashed horizontal rules ("predicted": 41.5). A None / NaN y is a gap, not a zero."""
    raw, smoothed = [], []
    for name, (xs, ys) in series.items():
        xs, ys = [_plain(x) for x in xs], [_finite(y) for y in ys]
        raw.append((name, xs, ys))
        if smooth:
            med_name = f"median of {smooth}" if len(series) == 1 else f"{name}, median of {smooth}"
            smoothed.append((med_name, xs, rolling_median(ys, smooth)))
    hlines = hlines or {}
    palette = color_map([n for n, _, _ in raw + smoothed] + list(hlines), colors)
    all_x = [x for _, xs, _ in raw for x in xs]
    whole = _whole(all_x)
    tip = hover(x_title, y_title, x_format="" if whole else f":{NUMBER_FORMAT}")
    longest = max((len(xs) for _, xs, _ in raw), default=0)
    data = []
    for name, xs, ys in raw:
        trace = {"type": "scatter", "name": name, "x": xs, "y": ys, "hovertemplate": tip,
                 "line": {"color": palette[name], "width": 2}, "marker": {"color": palette[name], "size": 6}}
        if smooth:
            # one marker per point, faint: the median line is what a person reads
            trace.update(mode="markers", marker={"color": palette[name], "size": 5, "opacity": RAW_OPACITY})
        else:
            # past a few hundred markers a live chart redraws too slowly for a 1 s refresh
            trace["mode"] = "lines+markers" if longest <= MAX_MARKER_POINTS else "lines"
        data.append(trace)
    data += [{"type": "scatter", "mode": "lines", "name": name, "x": xs, "y": ys, "hovertemplate": tip,
              "line": {"color": palette[name], "width": 3}} for name, xs, ys in smoothed]
    x_axis: dict[str, Any] = {"title": {"text": x_title}, "automargin": True}
    if whole and max(all_x) - min(all_x) <= 10:
        x_axis.update(tick0=0, dtick=1)  # steps are whole numbers: no "0.5" tick between two of them
    y_values = [y for _, _, ys in raw for y in ys] + list(hlines.values())
    return figure(data, title, x_axis, y_axis(y_title, y_values, log=log_y, zero=False), height=height,
                  legend=len(palette) > 1, shapes=rules(hlines, palette))


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
) -> dict[str, Any]:
    """Bars per category, one colour per series: side by side (grouped), or stacked (the first
    series at the bottom).

    labels: `{series: [text per category]}` written horizontally over each bar (grouped bars only;
    the y axis gets room for them). hlines: named dashed horizontal rules (a capacity). A None
    value draws no bar. The category order is the order given."""
    labels, hlines = labels or {}, hlines or {}
    cats = list(categories)
    palette = color_map(list(series) + list(hlines), colors)
    tip = hover(x_title or "bar", y_title)
    data, values = [], []
    for name, ys in series.items():
        ys = [_finite(y) for y in ys]
        values += [y for y in ys if y is not None]
        trace = {"type": "bar", "name": name, "x": cats, "y": ys, "marker": {"color": palette[name]},
                 "hovertemplate": tip}
        if name in labels and not stacked:
            trace.update(text=[t if y is not None else "" for t, y in zip(labels[name], ys)], textposition="outside",
                         textangle=0, cliponaxis=False, textfont={"size": 11, "color": LABEL_COLOR})
        data.append(trace)
    if stacked:
        totals = [sum(_finite(ys[i]) or 0.0 for ys in series.values()) for i in range(len(cats))]
        values = totals
    headroom = LABEL_HEADROOM if labels and not stacked and not log_y else 1.0
    y_ax = y_axis(y_title, values + [_finite(v) for v in hlines.values()], log=log_y, headroom=headroom)
    return figure(data, title, category_axis(x_title, cats), y_ax, height=height, legend=len(palette) > 1,
                  bottom=category_bottom(cats),
                  barmode="stack" if stacked else "group", shapes=rules(hlines, palette))


def _band_markers(name: str, categories: Sequence[str], ys: Sequence[float | None], color: str, thickness: float,
                  tip: str, labels: Sequence[str] | None = None) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """A marker across each category's bar (a capacity): a line shape over the bar's width (a
    category axis places category k at k, so the band is k ± BAR_HALF_WIDTH), and a point trace at
    its centre for the hover box, the legend and the labels over it."""
    trace = {"type": "scatter", "name": name, "x": list(categories), "y": list(ys),
             "mode": "markers+text" if labels else "markers",
             "marker": {"symbol": "line-ew-open", "size": 16, "color": color, "line": {"color": color, "width": thickness}},
             "hovertemplate": tip, "cliponaxis": False}
    if labels:
        trace.update(text=list(labels), textposition="top center", textfont={"size": 11, "color": color})
    shapes = [{"type": "line", "xref": "x", "yref": "y", "x0": k - BAR_HALF_WIDTH, "x1": k + BAR_HALF_WIDTH,
               "y0": y, "y1": y, "line": {"color": color, "width": thickness}}
              for k, y in enumerate(ys) if y is not None]
    return trace, shapes


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
) -> dict[str, Any]:
    """A bar per category (a predicted memory peak) with its limit (the device's capacity) drawn as a
    thick marker across the bar's band: a bar over its capacity stays visible above the marker.
    marks: more named markers per category (`{"capacity × 0.9": [...]}`), thinner. Labels are
    written over the bar (values, dark) and over the capacity marker (its colour)."""
    marks = marks or {}
    cats = list(categories)
    palette = color_map([value_name, capacity_name, *marks], {value_name: PALETTE[0], capacity_name: RULE_COLOR})
    tip = hover(x_title, y_title)
    vals, caps = [_finite(v) for v in values], [_finite(v) for v in capacity]
    bar = {"type": "bar", "name": value_name, "x": cats, "y": vals, "marker": {"color": palette[value_name]},
           "hovertemplate": tip}
    if value_labels:
        bar.update(text=list(value_labels), textposition="outside", textangle=0, cliponaxis=False,
                   textfont={"size": 11, "color": LABEL_COLOR})
    markers = [_band_markers(capacity_name, cats, caps, palette[capacity_name], 3, tip, capacity_labels)]
    markers += [_band_markers(name, cats, [_finite(v) for v in vs], palette[name], 1.5, tip) for name, vs in marks.items()]
    all_values = vals + caps + [_finite(v) for vs in marks.values() for v in vs]
    y_ax = y_axis(y_title, all_values, log=log_y, headroom=LOG_LABEL_HEADROOM if log_y else LABEL_HEADROOM)
    return figure([bar, *(t for t, _ in markers)], title, category_axis(x_title, cats), y_ax, height=height,
                  bottom=category_bottom(cats),
                  shapes=[s for _, shapes in markers for s in shapes])


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
    x_range: tuple[float, float] | None = None,
    height: int | None = None,
) -> dict[str, Any]:
    """Horizontal bars from `start` to `end` on a time axis, one row per `row`, coloured by `color`.

    rows: dicts with keys row, start, end, color. row_order: the rows from top to bottom (default:
    as first seen). Bars overlap in the order given (a later one is drawn over an earlier one).
    legend=False (hundreds of jobs): one trace, each bar its colour, the hover box names it.
    x_range: the time axis's span (two charts drawn on the same scale). The height grows with the rows."""
    order = list(row_order) if row_order is not None else list(dict.fromkeys(str(r["row"]) for r in rows))
    groups = list(color_order) if color_order is not None else []
    groups += [g for g in dict.fromkeys(str(r["color"]) for r in rows) if g not in groups]
    palette = color_map(groups, colors)
    tip = (f"{y_title}: %{{y}}<br>{color_title}: %{{customdata[0]}}<br>start: %{{customdata[1]:{NUMBER_FORMAT}}}"
           f"<br>end: %{{customdata[2]:{NUMBER_FORMAT}}}<extra></extra>")

    def bars(name: str, chosen: list[dict[str, Any]]) -> dict[str, Any]:
        starts, ends = [_plain(r["start"]) for r in chosen], [_plain(r["end"]) for r in chosen]
        return {"type": "bar", "orientation": "h", "name": name, "y": [str(r["row"]) for r in chosen],
                "base": starts, "x": [e - s for s, e in zip(starts, ends)],
                "customdata": [[str(r["color"]), s, e] for r, s, e in zip(chosen, starts, ends)],
                "hovertemplate": tip, "marker": {"line": {"width": 0}}}

    if legend:
        # a trace per colour, drawn in the order the rows first name them, listed in the legend in `groups` order
        drawn = list(dict.fromkeys(str(r["color"]) for r in rows))
        data = []
        for name in drawn:
            trace = bars(name, [r for r in rows if str(r["color"]) == name])
            trace["marker"]["color"] = palette[name]
            trace["legendrank"] = 1000 + groups.index(name)
            data.append(trace)
    else:
        trace = bars(color_title, list(rows))
        trace["marker"]["color"] = [palette[str(r["color"])] for r in rows]
        data = [trace] if rows else []
    if height is None:
        height = min(GANTT_MAX_PX, max(GANTT_MIN_PX, GANTT_ROW_PX * len(order) + FRAME_PX))
    x_axis: dict[str, Any] = {"title": {"text": x_title}, "automargin": True, "zeroline": False}
    if x_range is not None:
        x_axis["range"] = [float(x_range[0]), float(x_range[1])]
    y_ax = {"title": {"text": y_title}, "type": "category", "categoryorder": "array", "categoryarray": order,
            "autorange": "reversed", "automargin": True}
    left = min(GANTT_MAX_LEFT_PX, LEFT_PX - 30 + CHAR_PX * max((len(r) for r in order), default=0))
    return figure(data, title, x_axis, y_ax, height=height, legend=legend, left=left, barmode="overlay", bargap=0.15)


# ---- reading a drawn chart back (tests, benchmarks) ----------------------------------------------------


CHART_ELEMENT = "bidi_component"  # an AppTest element of ui/plotly_component's kind


def drawn_figure(proto: Any) -> dict[str, Any]:
    """The figure a chart message carries (an AppTest `bidi_component` element's `.proto`, a chart
    of ui/plotly_component), as the browser receives it."""
    return json.loads(proto.json)["figure"]


def drawn_figures(at: Any) -> list[dict[str, Any]]:
    """The figures an AppTest page drew through ui/common.show_figure, in page order."""
    from ui.plotly_component import COMPONENT_NAME

    return [drawn_figure(e.proto) for e in at.get(CHART_ELEMENT) if e.proto.component_name == COMPONENT_NAME]


def traces_by_name(fig: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """A figure's traces by their names: what a test asserts on."""
    return {t.get("name", ""): t for t in fig["data"]}


def gantt_rows(fig: dict[str, Any]) -> list[dict[str, Any]]:
    """A Gantt figure's bars back as the rows it was built from: {row, start, end, color}."""
    return [{"row": y, "start": s, "end": e, "color": c}
            for t in fig["data"] for y, (c, s, e) in zip(t["y"], t["customdata"])]
