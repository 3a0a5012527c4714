"""Rendering helpers shared by every dashboard page.

House rules these helpers make cheap to follow (docs/TEAM.md):
- every number says whether it is *predicted*, *measured* or *estimated*
  (`source_badge`, `metric`);
- emulated devices are marked (`emulated_marker`, `device_label`);
- bad input shows `st.error` with one clear line, never a traceback, and never a password
  (`show_errors`, `call_or_error`; URLs masked by contracts/secrets.py);
- an uploaded file is parsed in a bounded child process, once per upload (`parse_upload`);
- every chart axis has a unit (ui/charts.py builds the Plotly figures, `show_figure` draws them);
- SQLite connections shared between reruns come from `sqlite_connection`
  (`st.cache_resource`).

Names here are stable: other pages import them.
"""
from __future__ import annotations

import contextlib
import gc
import logging
import math
import os
import sqlite3
import sys
from typing import Any, Callable, Iterator, TypeVar

import streamlit as st

from contracts.secrets import mask_secrets
from ui import plotly_component
from ui.background import ChildFailed, run_bounded
from ui.charts import CHART_HEIGHT_PX, MAX_MARKER_POINTS, rolling_median  # noqa: F401  (stable names of this module)

log = logging.getLogger(__name__)

T = TypeVar("T")

PREDICTED = "predicted"
MEASURED = "measured"
ESTIMATED = "estimated"
SIMULATED = "simulated"  # a cost-model simulation (Geo, Scheduler): a kind of prediction
EMULATED = "emulated"

# Streamlit markdown badge colours, one per kind of number
_BADGE_COLOR = {PREDICTED: "blue", SIMULATED: "blue", MEASURED: "green", ESTIMATED: "orange", EMULATED: "violet"}

# chart defaults live in ui/charts.py (imported above, kept here as stable names)

_KIB = 1024


# ---- predicted / measured / emulated labels ------------------------------------------


def source_badge(kind: str) -> str:
    """Markdown for a small coloured badge: `:blue-badge[predicted]`.

    Use inside `st.markdown`, `st.caption`, a metric label or a column header
    rendered as markdown."""
    color = _BADGE_COLOR.get(kind, "gray")
    return f":{color}-badge[{kind}]"


def show_source(kind: str) -> None:
    """Render the predicted/measured/estimated badge on its own line."""
    st.badge(kind, color=_BADGE_COLOR.get(kind, "gray"))


def labelled(label: str, kind: str) -> str:
    """`"Step time"`, `"measured"` -> `"Step time (measured)"`: for table columns and plain text."""
    return f"{label} ({kind})"


def metric(label: str, value: Any, kind: str, *, help: str | None = None, delta: Any = None) -> None:
    """`st.metric` whose label carries the kind of number, e.g. "Iteration time · predicted".

    `value` should already be formatted with its unit (see `fmt_bytes`, `fmt_seconds`)."""
    st.metric(f"{label} {source_badge(kind)}", value, delta=delta, help=help)


def emulated_marker(emulated: bool) -> str:
    """The marker text for tables: "emulated" or ""."""
    return EMULATED if emulated else ""


def device_label(device: Any) -> str:
    """A device's display name with its emulation spelled out (DeviceSpec.label when it has one)."""
    label = getattr(device, "label", None)
    if isinstance(label, str):
        return label
    t = getattr(device, "type", str(device))
    return f"{t} (emulated)" if getattr(device, "emulated", False) else t


def show_emulated_note(emulated: bool) -> None:
    """One caption line under a table/chart that contains emulated devices."""
    if emulated:
        st.caption(
            f"{source_badge(EMULATED)} Some devices are emulated on this machine "
            "(slowdown and/or memory limit from the cluster file); their figures are not those of real hardware."
        )


# ---- errors ----------------------------------------------------------------------------


def error_message(exc: BaseException) -> str:
    """The one line a user sees for a bad-input error (a store URL's password masked)."""
    return mask_secrets(str(exc).strip()) or type(exc).__name__


@contextlib.contextmanager
def show_errors(what: str | None = None) -> Iterator[None]:
    """Turn a ValueError (bad input: the library's contract) into `st.error`, no traceback.

        with show_errors("Cannot compute the plan"):
            plan = solve_plan(...)

    Code after the `with` block still runs; check your result for None. OSError,
    sqlite3.Error and a background computation that died (ui/background.ChildFailed)
    are logged and also shown as one line, because a dashboard user should never see
    a traceback."""
    try:
        yield
    except ValueError as e:
        st.error(f"{what}: {error_message(e)}" if what else error_message(e), icon=":material/error:")
    except (OSError, sqlite3.Error, ChildFailed) as e:
        log.warning("%s", e, exc_info=True)
        msg = f"{type(e).__name__}: {error_message(e)}"
        st.error(f"{what}: {msg}" if what else msg, icon=":material/error:")


def call_or_error(fn: Callable[..., T], *args: Any, what: str | None = None, **kwargs: Any) -> T | None:
    """`fn(*args, **kwargs)`, or None after showing the ValueError/OSError as `st.error`."""
    with show_errors(what):
        return fn(*args, **kwargs)
    return None


UPLOAD_TIMEOUT_S = 20.0  # a cluster file or config.json of the maximum upload size parses in well under a second
UPLOAD_MEMORY_BYTES = 1 << 30  # address space of the parsing child: an interpreter and a few JSON megabytes


def parse_upload(uploaded: Any, parse: Callable[[bytes, str], T], what: str) -> T | None:
    """`parse(data, name)` of an `st.file_uploader` file, run in a child process bounded in time and
    memory (ui/background.run_bounded): a huge or hostile file costs the server nothing but the
    wait. Once per upload: the answer, an error too, is kept in the session under the upload's id.
    None after showing the error as one line ("<what>: ...")."""
    slot = f"parsed_upload:{parse.__module__}.{parse.__qualname__}"
    kept = st.session_state.get(slot)
    if kept is None or kept[0] != uploaded.file_id:
        try:
            kept = (uploaded.file_id, run_bounded(parse, uploaded.getvalue(), uploaded.name,
                                                  timeout_s=UPLOAD_TIMEOUT_S, memory_bytes=UPLOAD_MEMORY_BYTES), None)
        except (ValueError, ChildFailed) as e:
            kept = (uploaded.file_id, None, error_message(e))
        st.session_state[slot] = kept
    _, value, error = kept
    if error is not None:
        st.error(f"{what}: {error}", icon=":material/error:")
    return value


# ---- number inputs -------------------------------------------------------------------------


def _fmt_bound(x: float) -> str:
    return f"{x:,}" if isinstance(x, int) else f"{x:g}"


def number_field(label: str, *, unit: str, min_value: int | float, max_value: int | float, value: int | float,
                 key: str, step: int | float | None = None, help: str | None = None, where: Any = None,
                 format: str | None = None) -> int | float | None:
    """A number input that says its unit and range in its label, "Steps (steps, 1–1,000,000)",
    and answers an out-of-range value with an error right under the field (None is returned),
    instead of the browser silently putting the previous value back (what a Streamlit
    number_input with min/max bounds does). `where`: the column to draw in (default: the page)."""
    where = where if where is not None else st
    integer = isinstance(value, int) and isinstance(min_value, int) and isinstance(step or 1, int)
    bounds = f"{_fmt_bound(min_value)}–{_fmt_bound(max_value)}"
    x = where.number_input(f"{label} ({unit}, {bounds})", value=value, step=step or (1 if integer else None),
                           key=key, help=help, format=format)
    if x is None:
        where.error(f"{label}: give a value ({bounds} {unit})", icon=":material/error:")
        return None
    if not min_value <= x <= max_value:
        where.error(f"{label}: {_fmt_bound(x)} is out of range, {bounds} {unit}", icon=":material/error:")
        return None
    return int(x) if integer else float(x)


# ---- number formatting -------------------------------------------------------------------


def fmt_bytes(n: float | int | None) -> str:
    """Bytes in binary units: 1536 -> "1.5 KiB"."""
    if n is None or (isinstance(n, float) and not math.isfinite(n)):
        return "—"
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < _KIB or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= _KIB
    return f"{value:.1f} TiB"


def fmt_seconds(s: float | None) -> str:
    """Seconds with a sensible unit: 0.0123 -> "12.3 ms", 95 -> "1 min 35 s"."""
    if s is None or not math.isfinite(s):
        return "—"
    if s < 1e-3:
        return f"{s * 1e6:.0f} µs"
    if s < 1:
        return f"{s * 1e3:.1f} ms"
    if s < 120:
        return f"{s:.2f} s"
    minutes, sec = divmod(int(round(s)), 60)
    if minutes < 120:
        return f"{minutes} min {sec} s"
    return f"{minutes // 60} h {minutes % 60} min"


def fmt_percent(x: float | None, digits: int = 1, signed: bool = False) -> str:
    """A percentage as a person writes it: 12.345 -> "12.3 %"; a value that rounds to zero is
    "0.0 %" (never "-0.0 %"); None -> "—"."""
    if x is None or not math.isfinite(x):
        return "—"
    r = round(x, digits)
    if r == 0:
        r = 0.0
    return f"{r:+.{digits}f} %" if signed and r != 0 else f"{r:.{digits}f} %"


def fmt_cell(x: Any, fmt: Callable[[Any], str] = str) -> str:
    """A table cell for a person: None -> "—", True/False -> "yes"/"no", else fmt(x)."""
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return "—"
    if isinstance(x, bool):
        return "yes" if x else "no"
    return fmt(x)


def fmt_rate(x: float | None, unit: str = "samples/s") -> str:
    if x is None or not math.isfinite(x):
        return "—"
    return f"{x:,.1f} {unit}" if x < 1000 else f"{x:,.0f} {unit}"


def ranks_table(ranks: list[dict[str, Any]]) -> Any:
    """A run's per-rank table (executor.store.read_metrics' "ranks"), every cell text a person
    reads: "—" for a figure not measured yet, units in the column names."""
    import pandas as pd

    def mib(b: float | None) -> str:
        return fmt_cell(b, lambda x: f"{x / _KIB**2:,.1f}")

    def secs(x: float | None) -> str:
        return fmt_cell(x, fmt_seconds)

    rows = []
    for r in ranks:
        compute = None
        if r.get("median_compute_s") is not None:
            compute = r["median_compute_s"] + (r.get("median_emulated_delay_s") or 0.0)
        rows.append({
            "rank": str(r["rank"]), "node": r["node"], "type": r["type"],
            "emulated": emulated_marker(bool(r["emulated"])),
            "slowdown": fmt_cell(r["slowdown"], lambda x: f"{x:g}×"),
            "micro-batch × accum": f"{r['micro_batch']} × {r['accum_steps']}",
            "state shard": fmt_cell(r["shard_fraction"], lambda x: fmt_percent(100.0 * x)),
            "peak memory (measured, MiB)": mib(r["peak_memory_bytes"]),
            "memory (predicted, MiB)": mib(r["predicted_memory_bytes"]),
            "compute/step (measured median)": secs(compute),
            "wait/step (measured median)": secs(r["median_wait_s"]),
            "step (predicted)": secs(r["predicted_step_s"]),
        })
    return pd.DataFrame(rows)


# ---- tables ------------------------------------------------------------------------------

SMALL_TABLE_ROWS = 12  # up to this many rows a table is static (st.table), past it interactive


def show_table(rows: Any, key: str | None = None, *, max_static_rows: int = SMALL_TABLE_ROWS) -> None:
    """A table of a few rows as a static `st.table` (no index): it draws in a new browser tab
    without loading the interactive grid's JavaScript (bench/dashboard_latency.py);
    a longer one as `st.dataframe`, which a person can sort and scroll."""
    n = len(rows)
    if n <= max_static_rows:
        st.table(rows, hide_index=True)
    else:
        st.dataframe(rows, hide_index=True, key=key)


# ---- charts ------------------------------------------------------------------------------
# Every chart is a Plotly figure built as a plain dict in ui/charts.py (validated by Plotly in its
# tests); line_figure stays for the pages that import it from here.


def line_figure(
    series: dict[str, tuple[list[float], list[float]]],
    x_title: str,
    y_title: str,
    title: str | None = None,
    height: int = CHART_HEIGHT_PX,
) -> dict[str, Any]:
    """A line chart from `{name: (xs, ys)}` with unit axis titles: ui/charts.line_chart."""
    from ui.charts import line_chart

    return line_chart(series, x_title, y_title, title, height=height)


def show_figure(fig: dict[str, Any], key: str | None = None) -> None:
    """The one place a page draws a chart (a figure dict from ui/charts.py): full width, hover and
    zoom on, an interactive Plotly chart drawn by plotly.js's basic bundle (ui/plotly_component;
    `st.plotly_chart` would load the full bundle in every new tab). A key puts it in a keyed
    container, whose CSS class `st-key-<key>` the browser tests and bench/dashboard_latency.py look
    for, and keeps the chart (updated in place) across reruns."""
    with st.container(key=key) if key is not None else contextlib.nullcontext():
        plotly_component.draw(fig, PLOTLY_CONFIG, key=f"{key}_figure" if key is not None else None)


# the mode bar keeps zoom, pan, reset and "download as PNG"; without plotly.js's "Share chart..."
# (an upload to Plotly's cloud)
PLOTLY_CONFIG = {"displaylogo": False, "showSendToCloud": False}


# ---- shared resources --------------------------------------------------------------------


@st.cache_resource(show_spinner=False)
def _connection(path: str, mtime_key: float) -> sqlite3.Connection:
    # read-only: the dashboard never writes a store it only watches (and never creates an
    # empty file where a run's database is missing)
    conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True, check_same_thread=False, timeout=5.0)
    conn.row_factory = sqlite3.Row
    return conn


def sqlite_connection(path: str) -> sqlite3.Connection:
    """A shared read-only connection to an SQLite file (one per file, reused across reruns).

    Raises ValueError when the file is missing. A file replaced on disk (new inode)
    gets a new connection."""
    try:
        st_ino = os.stat(path).st_ino
    except OSError:
        raise ValueError(f"no database at {path}") from None
    return _connection(os.path.abspath(path), float(st_ino))


def profiles_version() -> int:
    """Changes whenever the profile store changes (newest file time, ns): add it to the
    arguments of an `st.cache_data` planner call so that "Profile now" invalidates it."""
    from contracts import paths

    newest = 0
    for folder, _, files in os.walk(paths.profiles_dir()):
        for name in files:
            with contextlib.suppress(OSError):
                newest = max(newest, os.stat(os.path.join(folder, name)).st_mtime_ns)
    return newest


def page_link(page: str, label: str, icon: str | None = None) -> None:
    """`st.page_link` to another page ("ui/launch.py"); nothing when the page is not routed
    (a page file run on its own, as in a page's AppTest)."""
    from streamlit.errors import StreamlitAPIException

    try:
        st.page_link(page, label=label, icon=icon)
    except StreamlitAPIException as e:
        log.debug("no link to %s: %s", page, e)


_modules_frozen = 0  # len(sys.modules) at the last gc.freeze()


def freeze_long_lived() -> None:
    """Move every object alive now out of the cyclic garbage collector's reach (`gc.freeze`), once
    per batch of newly imported modules. Streamlit runs a full `gc.collect()` after every script
    run, a fragment's once a second included, holding the GIL (the server's event loop waits):
    with torch, pandas and Altair loaded it walks ~280k long-lived objects, 0.3 s a run here, and
    0.04 ms once they are frozen. What a page allocates afterwards is collected as before."""
    global _modules_frozen
    if len(sys.modules) > _modules_frozen:
        _modules_frozen = len(sys.modules)
        gc.freeze()


def page_header(title: str, caption: str | None = None) -> None:
    """Title and one-line explanation of what the page is for (and `freeze_long_lived`: the modules
    the previous runs imported)."""
    freeze_long_lived()
    st.title(title)
    if caption:
        st.caption(caption)
