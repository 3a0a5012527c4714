"""A Plotly figure dict (ui/charts.py) drawn in the browser by plotly.js's basic bundle.

`st.plotly_chart` draws with Streamlit's PlotlyChart chunk: the full plotly.js bundle, about
4.7 MB of JavaScript that every new browser tab fetches, parses and compiles before the first
chart is on screen (bench/dashboard_latency.py). Every trace the dashboard draws is a scatter or
a bar, which plotly.js's "basic" bundle (scatter, bar, pie; 1.2 MB) draws the same way, with the
same hover, zoom and mode bar. This module draws a figure dict with that bundle:

- the chart is a Streamlit component (`st.components.v2`, in the page itself, no iframe) whose
  JavaScript, frontend/chart.js, loads the bundle once per browser tab and draws every chart of
  the tab with it (`Plotly.react`: a rerun with a new figure updates the chart in place);
- the bundle is served by Streamlit's server from frontend/, a folder registered as a
  (`components.v1`) component's static files: no build step, no network;
- `draw(fig, config, key)` sends the figure as it is (JSON) and reserves the layout's height.

A chart's element is a `div.gpumix-chart` (CHART_CLASS) holding Plotly's SVG once drawn, which
the browser tests and bench/dashboard_latency.py look for (testkit/dashboard.py); in AppTest the
element is a `bidi_component` whose `json` carries the figure (ui/charts.drawn_figure).
"""
from __future__ import annotations

import functools
import os
from typing import Any

FRONTEND_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "frontend")
PLOTLY_JS = "plotly-basic.min.js"  # plotly.js v4.1.1, basic bundle (npm plotly.js-basic-dist-min)
COMPONENT_NAME = "gpumix_plotly_chart"  # a v2 component's name is used as given
CHART_CLASS = "gpumix-chart"
DEFAULT_HEIGHT_PX = 450  # plotly.js's own default, for a figure without a layout height


@functools.cache
def _bundle_url() -> str:
    """The URL path of plotly.js's bundle on this server: frontend/ registered (once per process,
    inside a script run) as the static folder of a components.v1 component."""
    import streamlit as st
    import streamlit.components.v1 as components

    served = components.declare_component("static", path=FRONTEND_DIR)
    base = st.get_option("server.baseUrlPath").strip("/")
    return f"{'/' + base if base else ''}/component/{served.name}/{PLOTLY_JS}"


@functools.cache
def _component() -> Any:
    import streamlit as st

    with open(os.path.join(FRONTEND_DIR, "chart.js"), encoding="utf-8") as fh:
        js = fh.read()
    # not isolated (no shadow root): plotly.js styles its mode bar and hover box from the page's head
    return st.components.v2.component(COMPONENT_NAME, html=f'<div class="{CHART_CLASS}"></div>', js=js,
                                      isolate_styles=False)


def draw(fig: dict[str, Any], config: dict[str, Any], key: str | None = None) -> None:
    """Draw figure dict `fig` (data, layout) full width with plotly.js `config`."""
    height = (fig.get("layout") or {}).get("height") or DEFAULT_HEIGHT_PX
    _component()(data={"figure": fig, "config": config, "plotly_url": _bundle_url()}, key=key, height=height)
