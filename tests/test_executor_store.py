import os
import sqlite3
import subprocess
import sys

import pytest

from executor.store import MetricsStore, list_runs, read_metrics
from planner.core.cluster import ClusterSpec, DeviceSpec, NodeSpec
from planner.core.plan import Assignment, Plan


def small_plan(slowdowns=(1.0, 3.0)) -> Plan:
    devs = tuple(DeviceSpec("cpu", slowdown=s) for s in slowdowns)
    cluster = ClusterSpec("t", (NodeSpec("localhost", "local", devs),))
    asg = tuple(Assignment(i, "localhost", "cpu", 2, 1, 2, 1 / len(devs), 1000 + i, 0.5, emulated=d.emulated,
                           slowdown=d.slowdown) for i, d in enumerate(devs))
    return Plan(cluster, "tiny", 2 * len(devs), 16, "fp32", "none", asg, 0.5, 8.0)


def test_store_records_as_it_goes_and_reads_the_design_contract(tmp_path):
    run = str(tmp_path / "r")
    os.makedirs(run)
    s = MetricsStore(run)
    s.init_run(small_plan(), steps_target=3, seed=0, backend="gloo")
    m = read_metrics(run)
    assert m["status"] == "running" and m["phase"] == "starting" and m["emulated"] is True
    assert m["steps"] == [] and [r["rank"] for r in m["ranks"]] == [0, 1]
    s.register_rank(1, 1, small_plan().used[1], os.getpid(), 100, "test")
    s.record_rank_step(0, 1, 0.1, 0.0, 0.01, 0.2, 5000)
    s.record_rank_step(1, 1, 0.1, 0.2, 0.01, 0.0, 7000)
    s.record_rank_step(1, 2, 0.1, 0.2, 0.01, 0.0, None)
    s.record_step(1, 5.5, 0.5, global_batch=4, seq=16)
    s.record_step(2, 5.0, 0.25, global_batch=4, seq=16, val_loss=4.9)
    m = read_metrics(run)
    assert [(x["step"], x["loss"]) for x in m["steps"]] == [(1, 5.5), (2, 5.0)]
    assert m["steps"][1]["samples_per_s"] == pytest.approx(16.0) and m["steps"][1]["tokens_per_s"] == 256.0
    assert m["steps"][1]["val_loss"] == 4.9 and m["steps"][0]["val_loss"] is None
    r0, r1 = m["ranks"]
    assert r0["peak_memory_bytes"] == 5000 and r1["peak_memory_bytes"] == 7000
    assert r1["emulated"] and r1["slowdown"] == 3.0 and r1["predicted_memory_bytes"] == 1001
    assert r1["median_emulated_delay_s"] == pytest.approx(0.2)
    s.finish("failed", "rank 1: boom", 1)
    m = read_metrics(run)
    assert (m["status"], m["reason"], m["failed_rank"]) == ("failed", "rank 1: boom", 1)
    with pytest.raises(ValueError):
        s.finish("exploded")
    s.close()


def test_rows_survive_a_writer_that_dies_and_concurrent_writers_queue(tmp_path):
    run = str(tmp_path / "r")
    os.makedirs(run)
    s = MetricsStore(run)
    s.init_run(small_plan(), steps_target=50, seed=0, backend="gloo")
    # two other processes write their rank rows at the same time, one dies without closing
    code = ("import os,sys; from executor.store import MetricsStore; s=MetricsStore(sys.argv[1]); r=int(sys.argv[2])\n"
            "for t in range(1, 51): s.record_rank_step(r, t, 0.1, 0.0, 0.0, 0.0, 10)\n"
            "if r == 1: os._exit(9)\n")
    env = dict(os.environ, PYTHONPATH=os.getcwd())
    procs = [subprocess.Popen([sys.executable, "-c", code, run, str(r)], env=env) for r in (0, 1)]
    for t in range(1, 51):
        s.record_step(t, 1.0, 0.1, 4, 16)
    assert sorted(p.wait(timeout=60) for p in procs) == [0, 9]
    m = read_metrics(run)
    assert len(m["steps"]) == 50 and len(m["rank_steps"]) == 100
    assert sqlite3.connect(os.path.join(run, "metrics.sqlite")).execute("PRAGMA journal_mode").fetchone()[0] == "wal"


def test_a_vanished_launcher_reads_as_failed_and_list_runs_finds_runs(tmp_path):
    root = tmp_path / "runs"
    for name in ("a", "b"):
        os.makedirs(root / name)
        s = MetricsStore(str(root / name))
        s.init_run(small_plan(), steps_target=3, seed=0, backend="gloo")
        s.close()
    (root / "not-a-run").mkdir()
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    sqlite3.connect(str(root / "a" / "metrics.sqlite")).execute(
        "UPDATE run SET launcher_pid = ?, started_s = started_s + 10", (dead.pid,)).connection.commit()
    runs = list_runs(str(root))
    assert [r["name"] for r in runs] == ["a", "b"]  # newest first
    assert runs[0]["status"] == "failed" and "launcher" in runs[0]["reason"]
    assert runs[1]["status"] == "running"  # its launcher (this process) is alive
    with pytest.raises(ValueError, match="no run metrics"):
        read_metrics(str(root / "not-a-run"))


def test_store_module_does_not_import_torch():
    code = "import sys, executor.store, executor.launch; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True, env=dict(os.environ, PYTHONPATH=os.getcwd()))
