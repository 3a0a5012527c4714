"""The Runs page on fabricated run folders written through executor.store's own writer.

History (status, model, ranks, steps, emulated marker), a broken and a missing
database beside good runs, the comparison chart's data, the CSV export's bytes."""
from __future__ import annotations

import csv
import io
import json
import os

import pytest
import streamlit as st
from streamlit.testing.v1 import AppTest

from executor.store import MetricsStore
from planner.cluster import ClusterSpec, DeviceSpec, NodeSpec
from planner.paths import runs_dir
from planner.plan import Assignment, Plan

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAGE = os.path.join(ROOT, "ui", "runs.py")
GLOBAL_BATCH = 4
SEQ = 64
STEP_S = 0.25


def two_cpu_plan(slowdown: float = 1.0) -> Plan:
    dev = DeviceSpec("cpu", slowdown=slowdown)
    cluster = ClusterSpec("local", (NodeSpec("localhost", "local", (DeviceSpec("cpu"), dev)),))
    emulated = dev.emulated
    asg = (
        Assignment(0, "localhost", "cpu", 2, 1, 2, 0.5, 10**7, 0.1),
        Assignment(1, "localhost", "cpu", 1, 2, 2, 0.5, 10**7, 0.1, emulated=emulated, slowdown=slowdown),
    )
    return Plan(cluster, "tiny", GLOBAL_BATCH, SEQ, "fp32", "none", asg, 0.1, 40.0)


def losses(offset: float, n: int) -> list[float]:
    return [offset + 4.0 / (1 + i) for i in range(n)]


def make_run(name: str, n_steps: int, status: str | None, slowdown: float = 1.0, loss_offset: float = 0.0) -> str:
    """A run folder as the executor writes it: plan.json + metrics.sqlite through MetricsStore.
    status None leaves it running (its 'launcher' is this test process, which is alive)."""
    run_dir = os.path.join(runs_dir(), name)
    os.makedirs(run_dir)
    plan = two_cpu_plan(slowdown)
    plan.save(os.path.join(run_dir, "plan.json"))
    store = MetricsStore(run_dir)
    try:
        store.init_run(plan, steps_target=100, seed=0, backend="gloo")
        for step, loss in enumerate(losses(loss_offset, n_steps)):
            for rank in (0, 1):
                store.record_rank_step(rank, step, 0.2, 0.0, 0.01, 0.02, 5_000_000 + rank)
            store.record_step(step, loss, STEP_S, GLOBAL_BATCH, SEQ)
        if status is not None:
            store.finish(status)
    finally:
        store.close()
    return run_dir


@pytest.fixture
def runs(data_dir):
    a = make_run("run-a", 6, "done")
    b = make_run("run-b", 4, "stopped", slowdown=3.0, loss_offset=1.0)
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
    make_run("live", 3, None)
    at = open_page()
    df = at.dataframe[0].value
    assert list(df["status"]) == ["running"]


def test_compare_plots_both_runs_losses_per_step(runs):
    at = open_page()
    at.selectbox(key="runs_compare_a").select("run-a")
    at.selectbox(key="runs_compare_b").select("run-b").run()
    assert not at.exception
    spec = json.loads(at.get("plotly_chart")[0].proto.spec)
    traces = {t["name"].split()[0]: t for t in spec["data"]}
    assert traces["run-a"]["y"] == pytest.approx(losses(0.0, 6))
    assert traces["run-b"]["y"] == pytest.approx(losses(1.0, 4))
    assert traces["run-a"]["x"] == list(range(6))
    layout = spec["layout"]
    assert "nats" in layout["yaxis"]["title"]["text"] and layout["xaxis"]["title"]["text"] == "step"


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
