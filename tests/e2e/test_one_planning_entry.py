"""Every caller writes the same plan for the same inputs: the planner's one entry (planner/entry.py).

On a 1-, 2- and 4-node cluster of A100s the plan of one job is written through each caller: the
CLI (`python -m planner plan --json`, a subprocess), the dashboard's Plan page (AppTest), the
dashboard's default plan (ui/state.py, AppTest) and the queue's orchestrator (a queued job, one
pass, its `start` a stand-in that keeps the plan instead of running it). The jobs are sized so
that the scheduler gives the job every device of the cluster (tinyllama-1.1b does not train fast
enough on fewer), so each caller plans on the same devices; on 2 nodes behind a 10 Gbit/s link a
pipeline is chosen, on 4 nodes behind 100 Gbit/s pipelines are priced and data parallelism kept.
"""
from __future__ import annotations

import json
import pathlib
import subprocess
import sys
from dataclasses import dataclass

import pytest
from streamlit.testing.v1 import AppTest

from contracts.cluster import ClusterSpec
from contracts.plan import Plan
from executor.orchestrator import Orchestrator
from executor.queue import JobQueue
from planner.entry import default_seq
from testkit.wait import wait_until

MODEL = "tinyllama-1.1b"
ROOT = pathlib.Path(__file__).resolve().parents[2]  # the checkout under test
PLAN_PAGE = str(ROOT / "ui" / "plan.py")
TIMEOUT_S = 120


@dataclass(frozen=True)
class Case:
    nodes: int
    per_node: int
    inter_node_gbps: float
    global_batch: int
    chosen: str  # what the plan is expected to be: "data parallel" or "pipeline"

    def cluster(self) -> ClusterSpec:
        return ClusterSpec.from_dict({
            "name": f"a100-{self.nodes}-nodes",
            "nodes": [{"name": f"n{i}", "gpus": {"A100-80GB": self.per_node}} for i in range(self.nodes)],
            "network": {"intra_node_gbps": 300, "inter_node_gbps": self.inter_node_gbps}})


# 2 nodes: at batch 32 the scheduler, which prices its options by data parallelism, keeps the job on
# one device (its two-device option pays the 10 Gbit/s all-reduce); from 128 it takes both
CASES = [Case(1, 2, 100, 32, "data parallel"), Case(2, 1, 10, 128, "pipeline"), Case(4, 1, 100, 64, "data parallel")]


def comparable(plan: Plan) -> dict:
    """The plan file, less what is legitimately per run: `solve_s` (the wall time of that solve) and
    the cluster's name (the orchestrator names the devices it plans on after the job, `<name>-job<id>`;
    the devices, nodes and network themselves are compared)."""
    d = plan.to_dict()
    del d["solve_s"]
    del d["cluster"]["name"]
    return d


def through_cli(cluster: ClusterSpec, batch: int, tmp_path) -> Plan:
    path = tmp_path / "cluster.json"
    path.write_text(json.dumps(cluster.to_dict()))
    proc = subprocess.run([sys.executable, "-m", "planner", "plan", "--cluster", str(path), "--model", MODEL,
                           "--global-batch", str(batch), "--json"],
                          capture_output=True, text=True, timeout=TIMEOUT_S, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    return Plan.from_dict(json.loads(proc.stdout))


def through_plan_page(cluster: ClusterSpec, batch: int) -> Plan:
    at = AppTest.from_file(PLAN_PAGE, default_timeout=TIMEOUT_S)
    at.session_state["cluster"] = cluster  # the page's default source: the session's cluster
    at.session_state["plan_auto_started"] = True  # no default plan on this first open: only the one asked for
    at.run()
    at.selectbox(key="plan_model").set_value(MODEL).run()
    at.number_input(key="plan_global_batch").set_value(batch)
    assert at.number_input(key=f"plan_seq:{MODEL}").value == default_seq(MODEL)
    assert at.selectbox(key="plan_dtype").value == "fp32"
    at.button(key="plan_compute").click().run()

    def answered() -> bool:
        assert not at.exception and not at.error, (at.exception, at.error)
        if "plan_request" in at.session_state:
            at.run()
            return False
        return True

    wait_until(answered, TIMEOUT_S, "the Plan page's plan")
    return at.session_state["plan"]


def _default_plan_script() -> None:
    import streamlit as st

    from ui.state import get_or_default_plan

    st.session_state["default_plan"] = get_or_default_plan()


def through_default_plan(cluster: ClusterSpec, batch: int, monkeypatch) -> Plan:
    import ui.state

    monkeypatch.setattr(ui.state, "DEFAULT_GLOBAL_BATCH", batch)  # the default plan's one fixed input
    at = AppTest.from_function(_default_plan_script, default_timeout=TIMEOUT_S)
    at.session_state["cluster"] = cluster
    at.session_state["model"] = MODEL
    at.run()
    assert not at.exception, at.exception
    return at.session_state["default_plan"]


def through_orchestrator(cluster: ClusterSpec, batch: int) -> Plan:
    started = {}

    @dataclass(frozen=True)
    class Handle:
        run_dir: str
        pid: int | None = None

    def start(plan, steps, run_dir=None):
        started[run_dir] = plan
        return Handle(run_dir)

    queue = JobQueue()
    job_id = queue.submit(MODEL, batch, 5)  # seq: the queue's default, which is the planner's
    report = Orchestrator(queue, cluster, dtype="fp32", start=start,
                          read=lambda run_dir: {"status": "running"}).tick()
    assert report.started == [job_id], report.to_dict()
    [plan] = started.values()
    assert plan.cluster.name == f"{cluster.name}-job{job_id}"
    return plan


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c.nodes}-node")
def test_every_caller_writes_the_same_plan(case, tmp_path, monkeypatch):
    cluster = case.cluster()
    plans = {"cli": through_cli(cluster, case.global_batch, tmp_path),
             "plan page": through_plan_page(cluster, case.global_batch),
             "default plan": through_default_plan(cluster, case.global_batch, monkeypatch),
             "orchestrator": through_orchestrator(cluster, case.global_batch)}
    cli = plans["cli"]
    assert cli.cluster.num_devices == cluster.num_devices and all(a.used for a in cli.assignments)
    assert ("pipeline" if cli.pipeline is not None else "data parallel") == case.chosen
    if case.nodes > 1:  # the pipeline search ran and its verdict is in the notes
        assert any(n.startswith(("pipeline chosen", "data parallelism kept")) for n in cli.notes), cli.notes
    expected = comparable(cli)
    for caller, plan in plans.items():
        assert comparable(plan) == expected, f"{caller} wrote a different plan than the CLI"
