"""The Runs page on fabricated run folders written through executor.store's own writer.

History (status, model, ranks, steps, emulated marker), a broken and a missing
database beside good runs, the comparison chart's data, the CSV export's bytes."""
from __future__ import annotations

import csv
import io
import os

import pytest
import streamlit as st
from streamlit.testing.v1 import AppTest

from contracts.paths import runs_dir
from testkit.runs import GLOBAL_BATCH, STEP_S, fabricate_run, losses
from ui.charts import drawn_figures, traces_by_name

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PAGE = os.path.join(ROOT, "ui", "runs.py")


@pytest.fixture
def runs(data_dir):
    a = fabricate_run("run-a", 6, "done")
    b = fabricate_run("run-b", 4, "stopped", slowdown=3.0, loss_offset=1.0)
    # a folder whose database is garbage, and one that never got a database
    bad = os.path.join(runs_dir(), "run-broken")
    os.makedirs(bad)
    with open(os.path.join(bad, "metrics.sqlite"), "wb") as fh:
        fh.write(b"this is not an SQLite file" * 100)
    os.makedirs(os.path.join(runs_dir(), "run-nodb"))
    # newest first: run-b started after run-a
    return a, b


def open_page() -> AppTest:
    at = AppTest.from_file(PAGE, default_timeout=30).run()
    assert not at.exception, at.exception
    return at


def test_history_lists_good_runs_and_names_the_broken_ones(runs):
    at = open_page()
    df = at.dataframe[0].value
    assert list(df["run"]) == ["run-b", "run-a"]  # newest first
    assert list(df["status"]) == ["stopped", "done"]
    assert list(df["model"]) == ["tiny", "tiny"]
    assert list(df["ranks"]) == [2, 2]
    assert list(df["steps (measured)"]) == [4, 6]
    assert list(df["emulated"]) == ["emulated", ""]  # run-b has a slowdown-3 device
    warnings = " ".join(w.value for w in at.warning)
    assert "run-broken" in warnings and "run-nodb" in warnings
    assert not at.error


def test_a_running_run_is_listed_as_running(data_dir):
    fabricate_run("live", 3, None)
    at = open_page()
    df = at.dataframe[0].value
    assert list(df["status"]) == ["running"]


def test_compare_plots_both_runs_losses_per_step(runs):
    at = open_page()
    at.selectbox(key="runs_compare_a").select("run-a")
    at.selectbox(key="runs_compare_b").select("run-b").run()
    assert not at.exception
    fig = drawn_figures(at)[0]
    traces = {name.split()[0]: t for name, t in traces_by_name(fig).items()}
    assert traces["run-a"]["y"] == pytest.approx(losses(0.0, 6))
    assert traces["run-b"]["y"] == pytest.approx(losses(1.0, 4))
    assert traces["run-a"]["x"] == list(range(6))
    lay = fig["layout"]
    assert "nats" in lay["yaxis"]["title"]["text"] and lay["xaxis"]["title"]["text"] == "step" and lay["showlegend"]


def test_csv_export_holds_every_recorded_step(runs, monkeypatch):
    offered = {}
    real = st.download_button

    def spy(label, data, *args, **kwargs):  # the bytes the page offers the browser
        offered[kwargs.get("key")] = (data, kwargs.get("file_name"))
        return real(label, data, *args, **kwargs)

    monkeypatch.setattr(st, "download_button", spy)
    at = open_page()
    at.selectbox(key="runs_export_run").select("run-a").run()
    assert not at.exception
    data, file_name = offered["runs_export"]
    assert file_name == "run-a-metrics.csv"
    rows = list(csv.DictReader(io.StringIO(data.decode("utf-8"))))
    assert [int(r["step"]) for r in rows] == list(range(6))
    assert [float(r["loss"]) for r in rows] == pytest.approx(losses(0.0, 6))
    assert [float(r["samples_per_s"]) for r in rows] == pytest.approx([GLOBAL_BATCH / STEP_S] * 6)
    assert [float(r["step_s"]) for r in rows] == pytest.approx([STEP_S] * 6)


def test_no_runs_says_how_to_get_one(data_dir):
    at = open_page()
    assert any("No runs yet" in i.value for i in at.info)
    assert not at.get("download_button")


def test_only_broken_folders_still_renders(data_dir):
    os.makedirs(os.path.join(runs_dir(), "half-written"))
    with open(os.path.join(runs_dir(), "half-written", "metrics.sqlite"), "wb") as fh:
        fh.write(b"\x00" * 10)
    at = open_page()
    assert any("half-written" in w.value for w in at.warning)


def test_per_rank_table_puts_measured_beside_predicted_in_mib(runs):
    at = open_page()
    at.selectbox(key="runs_export_run").select("run-b").run()
    df = at.dataframe[-1].value
    assert list(df["rank"]) == ["0", "1"]
    assert list(df["emulated"]) == ["", "emulated"]  # rank 1 of run-b has slowdown 3
    assert df["peak memory (measured, MiB)"].tolist() == [f"{5_000_000 / 2**20:,.1f}", f"{5_000_001 / 2**20:,.1f}"]
    assert df["memory (predicted, MiB)"].tolist() == [f"{10**7 / 2**20:,.1f}"] * 2
    cells = [str(c) for c in df.to_numpy().ravel()]
    assert not {"None", "nan", "True", "False"} & set(cells), cells  # text a person reads, no raw Python


def test_shared_sqlite_connection_is_reused_and_read_only(runs):
    import sqlite3

    from ui import common

    a, _ = runs
    path = os.path.join(a, "metrics.sqlite")
    conn = common.sqlite_connection(path)
    assert conn is common.sqlite_connection(path)
    assert conn.execute("SELECT COUNT(*) FROM steps").fetchone()[0] == 6
    with pytest.raises(sqlite3.OperationalError):
        conn.execute("DELETE FROM steps")
    with pytest.raises(ValueError):
        common.sqlite_connection(os.path.join(runs_dir(), "run-nodb", "metrics.sqlite"))
