"""Runs: the history of training runs, two runs' curves side by side, a run's metrics as CSV.

Widgets -> executor.store (list_runs, read_metrics) -> render. Every figure here is
*measured* (read from the run's SQLite store); the plan's predictions are labelled.
A run whose database is missing or broken is still listed, with the reason."""
from __future__ import annotations

import datetime as dt
import logging
import os
from dataclasses import dataclass, field
from typing import Any

import pandas as pd
import streamlit as st

from planner.paths import runs_dir
from planner.plan import Plan
from ui import common, state

log = logging.getLogger(__name__)

PLAN_FILE = "plan.json"
METRICS_FILE = "metrics.sqlite"
LIVE_REFRESH_S = 2.0  # history refresh period while a run is going


@dataclass
class RunInfo:
    run_dir: str
    name: str
    status: str  # running | done | failed | stopped | unreadable | no metrics
    model: str = "?"
    num_ranks: int = 0
    num_steps: int = 0
    last_loss: float | None = None
    emulated: bool = False
    started: dt.datetime | None = None
    error: str = ""
    metrics: dict[str, Any] = field(default_factory=dict)


def _store():
    from executor import store  # torch-free reader; imported here so a missing executor is one message

    return store


def _run_dirs() -> list[str]:
    """Run folders, newest first, from the executor's store; a folder scan if the store fails."""
    try:
        return state.list_run_dirs()
    except (ValueError, OSError) as e:
        log.warning("list_runs failed: %s", e)
        root = runs_dir()
        dirs = [os.path.join(root, d) for d in os.listdir(root) if os.path.isdir(os.path.join(root, d))]
        return sorted(dirs, key=state.run_started_ts, reverse=True)


def _stamp(run_dir: str) -> tuple:
    """Changes whenever a worker writes: the cache key of a run's metrics."""
    out = []
    for suffix in ("", "-wal"):
        try:
            s = os.stat(os.path.join(run_dir, METRICS_FILE + suffix))
            out.append((s.st_mtime_ns, s.st_size))
        except OSError:
            out.append(None)
    return tuple(out)


@st.cache_data(show_spinner=False, max_entries=512)
def _read_metrics(run_dir: str, stamp: tuple) -> dict[str, Any]:
    return _store().read_metrics(run_dir)


@st.cache_data(show_spinner=False, max_entries=512)
def _read_plan(path: str, mtime: float) -> Plan:
    return Plan.load(path)


def load_run(run_dir: str) -> RunInfo:
    """Everything the page shows about one run; never raises for a broken run folder."""
    info = RunInfo(run_dir=run_dir, name=os.path.basename(run_dir.rstrip("/")), status="unreadable")
    started = state.run_started_ts(run_dir)
    info.started = dt.datetime.fromtimestamp(started) if started else None
    plan_path = os.path.join(run_dir, PLAN_FILE)
    problems = []
    try:
        plan = _read_plan(plan_path, os.stat(plan_path).st_mtime)
        info.model = plan.model
        info.num_ranks = len(plan.used)
        info.emulated = any(a.emulated for a in plan.used)
    except OSError:
        problems.append(f"no {PLAN_FILE} in the run folder")
    except ValueError as e:
        problems.append(f"plan: {common.error_message(e)}")
    if not os.path.exists(os.path.join(run_dir, METRICS_FILE)):
        info.status = "no metrics"
        problems.append(f"no {METRICS_FILE} in the run folder")
    else:
        try:
            m = _read_metrics(run_dir, _stamp(run_dir))
            info.metrics = m
            info.status = str(m.get("status", "?"))
            steps = m.get("steps") or []
            info.num_steps = len(steps)
            info.last_loss = steps[-1].get("loss") if steps else None
            info.emulated = info.emulated or bool(m.get("emulated"))
            info.num_ranks = info.num_ranks or len(m.get("ranks") or [])
        except Exception as e:  # a broken database must not hide the other runs
            log.warning("run %s: %s", run_dir, e)
            problems.append(f"metrics: {type(e).__name__}: {common.error_message(e)}")
    info.error = "; ".join(problems)
    return info


def history_frame(runs: list[RunInfo]) -> pd.DataFrame:
    return pd.DataFrame(
        {
            "run": [r.name for r in runs],
            "status": [r.status for r in runs],
            "model": [r.model for r in runs],
            "ranks": [r.num_ranks for r in runs],
            "steps (measured)": [r.num_steps for r in runs],
            "last loss (measured)": [r.last_loss for r in runs],
            "emulated": [common.emulated_marker(r.emulated) for r in runs],
            "started": [r.started for r in runs],
            "problem": [r.error for r in runs],
        }
    )


def steps_frame(info: RunInfo) -> pd.DataFrame:
    """One row per step, every column the store recorded (units are in the names: *_s, *_per_s)."""
    return pd.DataFrame(info.metrics.get("steps") or [])


def metrics_csv(info: RunInfo) -> bytes:
    return steps_frame(info).to_csv(index=False).encode("utf-8")


def compare_figure(a: RunInfo, b: RunInfo, column: str, y_title: str) -> Any:
    series = {}
    for r in (a, b) if a.run_dir != b.run_dir else (a,):
        df = steps_frame(r)
        if column in df and "step" in df:
            series[f"{r.name} ({r.model}, {r.num_ranks} ranks)"] = (df["step"].tolist(), df[column].tolist())
    return common.line_figure(series, "step", y_title)


def _render_history(runs: list[RunInfo]) -> None:
    df = history_frame(runs)
    st.dataframe(
        df,
        hide_index=True,
        key="runs_table",
        column_config={
            "last loss (measured)": st.column_config.NumberColumn(format="%.4f"),
            "started": st.column_config.DatetimeColumn(format="YYYY-MM-DD HH:mm:ss"),
        },
    )
    broken = [r for r in runs if r.error and r.status in ("unreadable", "no metrics")]
    for r in broken:
        st.warning(f"Run **{r.name}**: {r.error}. The other runs are unaffected.", icon=":material/warning:")
    if any(r.emulated for r in runs):
        common.show_emulated_note(True)
    live = [r for r in runs if r.status == "running"]
    if live:
        common.page_link("ui/launch.py", f"Watch {live[0].name} live", ":material/monitoring:")


def _render_compare(runs: list[RunInfo]) -> None:
    st.subheader("Compare two runs")
    names = [r.name for r in runs]
    by_name = {r.name: r for r in runs}
    col_a, col_b = st.columns(2)
    a = col_a.selectbox("Run A", names, index=0, key="runs_compare_a")
    b = col_b.selectbox("Run B", names, index=min(1, len(names) - 1), key="runs_compare_b")
    ra, rb = by_name.get(a), by_name.get(b)
    if ra is None or rb is None:
        return
    st.caption(f"Loss and throughput per step, {common.source_badge(common.MEASURED)}")
    c1, c2 = st.columns(2)
    with c1:
        common.show_figure(compare_figure(ra, rb, "loss", "training loss (nats/token)"), key="runs_loss_chart")
    with c2:
        common.show_figure(compare_figure(ra, rb, "samples_per_s", "throughput (samples/s)"), key="runs_speed_chart")


def _render_export(runs: list[RunInfo]) -> None:
    st.subheader("Export a run's metrics")
    names = [r.name for r in runs if r.metrics.get("steps")]
    if not names:
        st.info("No run has recorded steps yet.")
        return
    name = st.selectbox("Run", names, key="runs_export_run")
    info = next(r for r in runs if r.name == name)
    st.download_button(
        f"Download {name} metrics (CSV, {info.num_steps} steps)",
        data=metrics_csv(info),
        file_name=f"{name}-metrics.csv",
        mime="text/csv",
        key="runs_export",
        icon=":material/download:",
        on_click="ignore",
    )
    ranks = info.metrics.get("ranks") or []
    if ranks:
        st.caption(f"Per-rank figures of {name}, {common.source_badge(common.MEASURED)}")
        st.dataframe(pd.DataFrame(ranks), hide_index=True, key="runs_ranks_table")


def render() -> None:
    common.page_header("Runs", "Every training run on this machine, read from its SQLite store: history, curves, export.")
    try:
        dirs = _run_dirs()
    except ImportError as e:
        st.error(f"The executor is not available: {e}")
        return
    if not dirs:
        st.info("No runs yet. Compute a plan, then launch it on **Launch & monitor**.")
        common.page_link("ui/launch.py", "Launch & monitor", ":material/rocket_launch:")
        return
    runs = [load_run(d) for d in dirs]
    live = any(r.status == "running" for r in runs)

    def history() -> None:  # reruns alone every LIVE_REFRESH_S while a run is going
        _render_history([load_run(d) for d in dirs])

    st.fragment(run_every=LIVE_REFRESH_S if live else None)(history)()
    _render_compare(runs)
    _render_export(runs)


if __name__ == "__main__":  # Streamlit runs pages as __main__; tests import the helpers above
    render()
