"""Runs: the history of training runs, two runs' curves side by side, a run's metrics as CSV.

Widgets -> executor.store (list_runs, read_metrics) -> render. Every figure here is
*measured* (read from the run's SQLite store). A run folder whose database is missing
or broken is still listed, with the reason; the other runs are unaffected."""
from __future__ import annotations

import datetime as dt
import logging
import os
from typing import Any

import pandas as pd
import streamlit as st

from contracts.paths import runs_dir
from ui import common

log = logging.getLogger(__name__)

LIVE_REFRESH_S = 2.0  # the history table refreshes itself this often while a run is going
STEP_COLUMNS = ["step", "loss", "val_loss", "samples_per_s", "tokens_per_s", "step_s", "time_s"]


def _store():
    from executor import store  # torch-free reader

    return store


def _stamp(run_dir: str) -> tuple:
    """Changes whenever rank 0 writes or the launcher ends: the cache key of a run's metrics (the
    run folder's file stats, or one query of a shared store: executor.store.change_stamp)."""
    return _store().change_stamp(run_dir)


@st.cache_data(show_spinner=False, max_entries=256)
def _read_metrics_cached(run_dir: str, stamp: tuple) -> dict[str, Any]:
    return _store().read_metrics(run_dir)


def read_metrics(run_dir: str) -> dict[str, Any]:
    """`executor.store.read_metrics`, cached until the run's database changes. Raises ValueError."""
    return _read_metrics_cached(run_dir, _stamp(run_dir))


def _started(ts: float | None) -> dt.datetime | None:
    return dt.datetime.fromtimestamp(ts) if ts else None


def list_history() -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(runs the store can read, newest first; run folders it cannot, each with the reason)."""
    runs = _store().list_runs()
    known = {r["run_dir"] for r in runs}
    root = runs_dir()
    broken = []
    for name in sorted(os.listdir(root)):
        path = os.path.abspath(os.path.join(root, name))
        if not os.path.isdir(path) or path in known:
            continue
        try:
            read_metrics(path)
            reason = "the store could not list it"
        except ValueError as e:
            reason = common.error_message(e)
        broken.append({"run_dir": path, "name": name, "reason": reason})
    return runs, broken


def history_frame(runs: list[dict[str, Any]]) -> pd.DataFrame:
    return pd.DataFrame(
        {
            "run": [r["name"] for r in runs],
            "status": [r["status"] for r in runs],
            "model": [r["model"] for r in runs],
            "ranks": [r["world_size"] for r in runs],
            "steps (measured)": [r["steps_recorded"] for r in runs],
            "steps asked": [common.fmt_cell(r["steps_target"], lambda n: f"{n:,}") for r in runs],
            "emulated": [common.emulated_marker(r["emulated"]) for r in runs],
            "started": [_started(r["started_s"]) for r in runs],
            "note": [r.get("reason") or "" for r in runs],
        }
    )


def steps_frame(metrics: dict[str, Any]) -> pd.DataFrame:
    """One row per optimizer step (units in the column names: *_s seconds, *_per_s rates, loss in nats/token)."""
    return pd.DataFrame(metrics.get("steps") or [], columns=STEP_COLUMNS)


def metrics_csv(metrics: dict[str, Any]) -> bytes:
    return steps_frame(metrics).to_csv(index=False).encode("utf-8")


def compare_figure(runs: dict[str, dict[str, Any]], column: str, y_title: str) -> Any:
    series = {}
    for name, m in runs.items():
        df = steps_frame(m)
        series[f"{name} ({m.get('model')}, {m.get('world_size')} ranks)"] = (df["step"].tolist(), df[column].tolist())
    return common.line_figure(series, "step", y_title)


def render_history(runs: list[dict[str, Any]], broken: list[dict[str, Any]]) -> None:
    if runs:
        st.dataframe(
            history_frame(runs),
            hide_index=True,
            key="runs_table",
            column_config={"started": st.column_config.DatetimeColumn(format="YYYY-MM-DD HH:mm:ss")},
        )
        st.caption(f"{len(runs)} runs; step counts {common.source_badge(common.MEASURED)} from each run's SQLite store.")
    for b in broken:
        st.warning(f"Run folder **{b['name']}** cannot be read: {b['reason']}. The other runs are unaffected.",
                   icon=":material/warning:")
    if any(r["emulated"] for r in runs):
        common.show_emulated_note(True)
    live = [r for r in runs if r["status"] == "running"]
    if live:
        common.page_link("ui/launch.py", f"Watch {live[0]['name']} live", ":material/monitoring:")


def _load_selected(name: str, by_name: dict[str, dict[str, Any]]) -> dict[str, Any] | None:
    with common.show_errors(f"Run {name}"):
        return read_metrics(by_name[name]["run_dir"])
    return None


def render_compare(runs: list[dict[str, Any]]) -> None:
    st.subheader("Compare two runs")
    names = [r["name"] for r in runs]
    by_name = {r["name"]: r for r in runs}
    col_a, col_b = st.columns(2)
    a = col_a.selectbox("Run A", names, index=0, key="runs_compare_a")
    b = col_b.selectbox("Run B", names, index=min(1, len(names) - 1), key="runs_compare_b")
    chosen = {}
    for name in dict.fromkeys([a, b]):  # the same run twice is one curve
        m = _load_selected(name, by_name)
        if m is not None:
            chosen[name] = m
    if not chosen:
        return
    st.caption(f"Per optimizer step, {common.source_badge(common.MEASURED)}")
    c1, c2 = st.columns(2)
    with c1:
        common.show_figure(compare_figure(chosen, "loss", "training loss (nats/token)"), key="runs_loss_chart")
    with c2:
        common.show_figure(compare_figure(chosen, "samples_per_s", "throughput (samples/s)"), key="runs_speed_chart")


def render_export(runs: list[dict[str, Any]]) -> None:
    st.subheader("Export a run's metrics")
    by_name = {r["name"]: r for r in runs}
    name = st.selectbox("Run", list(by_name), key="runs_export_run")
    m = _load_selected(name, by_name)
    if m is None:
        return
    n = len(m.get("steps") or [])
    st.download_button(
        f"Download {name} metrics (CSV, {n} steps)",
        data=metrics_csv(m),
        file_name=f"{name}-metrics.csv",
        mime="text/csv",
        key="runs_export",
        icon=":material/download:",
        on_click="ignore",
        disabled=n == 0,
    )
    ranks = m.get("ranks") or []
    if ranks:
        st.caption(f"Per rank of {name}: {common.source_badge(common.MEASURED)} beside "
                   f"{common.source_badge(common.PREDICTED)}")
        st.dataframe(common.ranks_table(ranks), hide_index=True, key="runs_ranks_table")


def render() -> None:
    common.page_header("Runs", "Every training run on this machine, read from its SQLite store: history, curves, export.")
    with common.show_errors("Cannot list the runs"):
        runs, broken = list_history()
        live = any(r["status"] == "running" for r in runs)

        @st.fragment(run_every=LIVE_REFRESH_S if live else None)
        def history() -> None:  # reruns alone while a run is going
            render_history(*list_history())

        history()
        if not runs:
            st.info("No runs yet: compute a plan on **Plan**, then launch it on **Launch & monitor**.")
            common.page_link("ui/launch.py", "Launch & monitor", ":material/rocket_launch:")
            return
        render_compare(runs)
        render_export(runs)


if __name__ == "__main__":  # Streamlit runs pages as __main__; tests import the helpers above
    render()
