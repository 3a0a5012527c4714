"""The run history's refresh (ui/runs.py's list_history, every 2 s while a run goes) reads each
run's step count from the steps' index: no statement it issues scans the steps or rank_steps, so
its cost does not grow with the runs' lengths."""
from __future__ import annotations

import os
import sqlite3

import pytest

from executor import db
from executor.store import MetricsStore, RankStep
from testkit.runs import GLOBAL_BATCH, SEQ, fabricate_run, two_cpu_plan


def _long_run(run_dir: str, steps: int, status: str | None) -> None:
    os.makedirs(run_dir)
    store = MetricsStore(run_dir)
    store.init_run(two_cpu_plan(), steps_target=steps, seed=0, backend="gloo")
    store.record_history([(s, [RankStep(r, 0.1, 0.0, 0.01, 0.0, None) for r in (0, 1)], 5.0, 0.5)
                          for s in range(1, steps + 1)], GLOBAL_BATCH, SEQ)
    if status:
        store.finish(status)
    store.close()


@pytest.fixture
def statements(monkeypatch):
    """Every (store file, SQL, parameters) the code under test runs through executor.db."""
    seen: list[tuple[str, str, tuple]] = []
    real = db.Database.execute

    def spy(self, text, params=()):
        if self.dialect == "sqlite":
            seen.append((self.url.target, self.sql(text), tuple(params)))
        return real(self, text, params)

    monkeypatch.setattr(db.Database, "execute", spy)
    return seen


def _plans(seen: list[tuple[str, str, tuple]]) -> list[tuple[str, str]]:
    out = []
    for path, sql, params in seen:
        if not sql.lstrip().upper().startswith("SELECT"):
            continue
        conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
        try:
            plan = " | ".join(r[-1] for r in conn.execute("EXPLAIN QUERY PLAN " + sql, params))
        finally:
            conn.close()
        out.append((sql, plan))
    return out


def _vm_steps(seen: list[tuple[str, str, tuple]]) -> int:
    """SQLite virtual-machine instructions the SELECTs of `seen` take, run again: a count that
    grows with the rows a statement visits, free of timing."""
    total = [0]

    def tick() -> int:
        total[0] += 1
        return 0

    for path, sql, params in seen:
        if sql.lstrip().upper().startswith("SELECT"):
            conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
            conn.set_progress_handler(tick, 1)
            try:
                conn.execute(sql, params).fetchall()
            finally:
                conn.close()
    return total[0]


def _assert_no_scan_of_steps(seen) -> None:
    plans = _plans(seen)
    assert any("steps" in sql for sql, _ in plans), plans  # the step count was read
    for sql, plan in plans:
        for table in ("steps", "rank_steps"):
            assert f"SCAN {table}" not in plan.replace("SCAN TABLE", "SCAN"), (sql, plan)


def test_the_history_refresh_reads_no_step_rows(data_dir, statements):
    from contracts.paths import runs_dir
    from ui import runs as page

    _long_run(os.path.join(runs_dir(), "long"), 3000, "done")
    fabricate_run("short", 5, None)
    statements.clear()
    listed, broken = page.list_history()
    assert not broken
    by_name = {r["name"]: r for r in listed}
    assert by_name["long"]["steps_recorded"] == 3000 and by_name["short"]["steps_recorded"] == 5
    assert by_name["short"]["status"] == "running"
    _assert_no_scan_of_steps(statements)


def test_a_shared_store_lists_by_index_too(data_dir, tmp_path, monkeypatch, statements):
    monkeypatch.setenv(db.ENV_DB, f"sqlite:///{tmp_path / 'shared.sqlite'}")
    from executor import store

    fresh = db.Database(db.configured(), "run store")
    db.init(fresh, store.RUNS)
    fresh.close()

    _long_run(str(tmp_path / "runs" / "a"), 2000, "done")
    _long_run(str(tmp_path / "runs" / "b"), 10, None)
    statements.clear()
    listed = {os.path.basename(r["run_dir"]): r for r in store.list_runs()}
    assert listed["a"]["steps_recorded"] == 2000 and listed["b"]["steps_recorded"] == 10
    _assert_no_scan_of_steps(statements)


def test_the_listing_costs_the_same_at_any_run_length(data_dir, tmp_path, statements):
    from executor import store

    cost = {}
    for steps in (50, 5000):
        root = str(tmp_path / f"runs{steps}")
        _long_run(os.path.join(root, "r"), steps, "done")
        statements.clear()
        [run] = store.list_runs(root)
        assert run["steps_recorded"] == steps
        cost[steps] = _vm_steps(list(statements))
    assert cost[5000] <= cost[50] * 1.2, cost


def test_a_run_without_steps_lists_zero(data_dir):
    from executor import store

    fabricate_run("empty", 0, None)
    [run] = store.list_runs()
    assert run["steps_recorded"] == 0
