"""`python -m executor db upgrade` is locked against running runs, on the embedded SQLite files
and on a PostgreSQL store (testkit/postgres.py; skipped where there is none): a store holding a
running run refuses with one line naming the run and changes nothing; once it ended, it upgrades."""
from __future__ import annotations

import os
import subprocess
import sys

from executor import db
from executor.store import RUNS, MetricsStore, read_metrics
from testkit.runs import small_plan

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _executor(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "executor", *args], capture_output=True, text=True, timeout=120,
                          cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT))


def test_a_running_run_refuses_db_upgrade_with_one_line(store_backend, data_dir, tmp_path):
    run_dir = str(tmp_path / "going")
    os.makedirs(run_dir)
    store = MetricsStore(run_dir)  # this process is the run's launcher: alive, so the run is running
    try:
        store.init_run(small_plan(), steps_target=10, seed=0, backend="gloo")
        store.record_step(1, 3.0, 0.5, 4, 16)
        r = _executor("db", "upgrade", "--run-dir", run_dir)
        assert r.returncode == 2, r.stdout + r.stderr
        lines = r.stderr.strip().splitlines()
        assert len(lines) == 1 and "is running" in lines[0] and "db upgrade" in lines[0], r.stderr
        assert "Traceback" not in r.stderr and "password" not in lines[0].lower()
        assert read_metrics(run_dir)["status"] == "running" and len(read_metrics(run_dir)["steps"]) == 1
        store.finish("done")
    finally:
        store.close()
    r = _executor("db", "upgrade", "--run-dir", run_dir)
    assert r.returncode == 0, r.stdout + r.stderr
    check = MetricsStore(run_dir)
    try:
        assert db.stored_version(check.db, RUNS) == db.SCHEMA_VERSION
    finally:
        check.close()
