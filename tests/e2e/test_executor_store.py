import os
import sqlite3
import subprocess
import sys

import pytest

from executor.store import MetricsStore, RankStep, StepReader, list_runs, read_metrics
from testkit.runs import small_plan


def test_store_records_as_it_goes_and_reads_the_design_contract(store_backend, tmp_path):
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


def test_rows_survive_a_writer_that_dies_and_concurrent_writers_queue(store_backend, tmp_path):
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
    if store_backend == "sqlite":
        assert sqlite3.connect(os.path.join(run, "metrics.sqlite")).execute("PRAGMA journal_mode").fetchone()[0] == "wal"


def test_a_vanished_launcher_reads_as_failed_and_list_runs_finds_runs(store_backend, tmp_path):
    root = tmp_path / "runs"
    for name in ("a", "b"):
        os.makedirs(root / name)
        s = MetricsStore(str(root / name))
        s.init_run(small_plan(), steps_target=3, seed=0, backend="gloo")
        s.close()
    (root / "not-a-run").mkdir()
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    s = MetricsStore(str(root / "a"))  # as if run a's launcher had been that process, started later
    s.db.execute("UPDATE run SET launcher_pid = ?, started_s = started_s + 10 WHERE run_key = ?", (dead.pid, s.key))
    s.close()
    runs = list_runs(str(root))
    assert [r["name"] for r in runs] == ["a", "b"]  # newest first
    assert runs[0]["status"] == "failed" and "launcher" in runs[0]["reason"]
    assert runs[1]["status"] == "running"  # its launcher (this process) is alive
    with pytest.raises(ValueError, match="no run metrics"):
        read_metrics(str(root / "not-a-run"))


def test_rank_zero_writes_every_ranks_step_in_one_transaction_and_a_reader_follows(store_backend, tmp_path):
    run = str(tmp_path / "r")
    os.makedirs(run)
    s = MetricsStore(run)
    s.init_run(small_plan((1.0, 1.0, 2.0)), steps_target=2, seed=0, backend="gloo")
    reader = StepReader(run)
    try:
        assert reader.steps_after(0) == [] and reader.counts() == (0, 0)
        for step in (1, 2):
            s.record_steps_of_all_ranks(step, [RankStep(r, 0.1 * (r + 1), 0.0, 0.01, 0.02, 2**40 + r if step == 1
                                                        else None) for r in range(3)],
                                        loss=3.0 / step, step_s=0.5, global_batch=6, seq=16,
                                        val_loss=2.5 if step == 2 else None)
            assert [st for st, _ in reader.steps_after(step - 1)] == [step]
        assert reader.counts() == (2, 6)
    finally:
        reader.close()
        s.close()
    m = read_metrics(run)
    assert [(x["step"], x["loss"], x["val_loss"]) for x in m["steps"]] == [(1, 3.0, None), (2, 1.5, 2.5)]
    # peak bytes beyond 32 bits survive both dialects; the unmeasured step stays None
    assert [r["peak_memory_bytes"] for r in m["ranks"]] == [2**40, 2**40 + 1, 2**40 + 2]
    assert [r["median_compute_s"] for r in m["ranks"]] == pytest.approx([0.1, 0.2, 0.3])
    assert m["steps"][0]["samples_per_s"] == pytest.approx(12.0)


def test_store_module_does_not_import_torch():
    code = "import sys, executor.store, executor.launch; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True, env=dict(os.environ, PYTHONPATH=os.getcwd()))


def test_the_change_stamp_moves_with_every_write(store_backend, tmp_path):
    from executor.store import change_stamp

    run = str(tmp_path / "r")
    os.makedirs(run)
    s = MetricsStore(run)
    try:
        s.init_run(small_plan(), steps_target=3, seed=0, backend="gloo")
        stamps = [change_stamp(run)]
        s.record_step(1, 5.0, 0.5, 4, 16)
        stamps.append(change_stamp(run))
        s.add_event("note", "hello")
        stamps.append(change_stamp(run))
        assert len(set(stamps)) == 3 and change_stamp(run) == stamps[-1]  # unchanged rows: the same stamp
    finally:
        s.close()


def test_what_the_launcher_reads_back_is_this_runs_alone(store_backend, tmp_path):
    runs = []
    for name in ("a", "b"):
        os.makedirs(tmp_path / name)
        s = MetricsStore(str(tmp_path / name))
        s.init_run(small_plan(), steps_target=2, seed=0, backend="gloo")
        runs.append(s)
    a, b = runs
    try:
        a.register_rank(1, 1, small_plan().used[1], 4242, 10, "test")
        a.add_event("rank_done", "rank 1 done", 1)
        a.add_event("note", "hello")
        a.set_launcher_pid(777)  # while starting
        a.record_step(2, 1.0, 0.5, 4, 16)  # now training
        assert (a.worker_pids(), a.registered_ranks(), a.registered_ranks(node="elsewhere")) == ([4242], [1], [])
        assert [e["kind"] for e in a.events()] == ["rank_done", "note"] and len(a.events("note")) == 1
        assert (a.last_step(), a.status(), a.all_ranks_done()) == (2, "running", False)  # 1 of 2 ranks
        a.add_event("rank_done", "rank 0 done", 0)
        assert a.all_ranks_done()
        assert read_metrics(str(tmp_path / "a"))["launcher_pid"] == 777
        a.set_launcher_pid(1)  # no longer starting: the launcher that took the run over stays
        assert read_metrics(str(tmp_path / "a"))["launcher_pid"] == 777
        # run b, in the same store when it is shared, saw none of it
        assert (b.worker_pids(), b.events(), b.last_step(), b.all_ranks_done()) == ([], [], 0, False)
        b.finish("stopped")
        assert (a.status(), b.status()) == ("running", "stopped")
    finally:
        for s in runs:
            s.close()


def test_a_resume_on_fewer_ranks_keeps_no_dead_rank_of_the_earlier_launch(store_backend, tmp_path):
    """A launcher resuming a run on a plan with fewer ranks: the earlier launch's extra rank (its pid
    long dead) must not stay registered, or the launcher reads it as a rank that died and ends the run."""
    os.makedirs(tmp_path / "run")
    s = MetricsStore(str(tmp_path / "run"))
    try:
        s.init_run(small_plan((1.0, 1.0, 1.0)), steps_target=3, seed=0, backend="gloo")
        for r, a in enumerate(small_plan((1.0, 1.0, 1.0)).used):
            s.register_rank(r, r, a, 10_000_000 + r, 10, "test")  # pids no process has
        s.add_event("checkpoint", "checkpoint of step 3")
        s.init_run(small_plan(), steps_target=5, seed=0, backend="gloo", resume=True)
        assert s.worker_pids() == []
        assert [r["rank"] for r in read_metrics(str(tmp_path / "run"))["ranks"]] == [0, 1]
        assert any(e["kind"] == "checkpoint" for e in read_metrics(str(tmp_path / "run"))["events"])  # history kept
    finally:
        s.close()
