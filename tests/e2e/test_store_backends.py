"""One store behind GPUMIX_DB, on the real things: the embedded SQLite files and a PostgreSQL
server started by testkit/postgres.py. Schema versions (refused, upgraded on request), several
machines on one queue and one history, and check-then-write races between processes."""
from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
from contextlib import closing

import pytest

from executor import booking, db
from executor.queue import QUEUE, JobQueue
from executor.store import RUNS, MetricsStore, list_runs, read_metrics
from contracts.paths import queue_db_path
from testkit.postgres import init_store
from testkit.runs import small_plan

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# a run folder's metrics.sqlite as GPUMix wrote it before schema versions (version 0)
LEGACY_RUN_SCHEMA = """
CREATE TABLE run (
    id INTEGER PRIMARY KEY CHECK (id = 1),
    status TEXT NOT NULL, phase TEXT, reason TEXT, failed_rank INTEGER,
    started_s REAL, ended_s REAL, updated_s REAL,
    emulated INTEGER NOT NULL, model TEXT, global_batch INTEGER, seq INTEGER, dtype TEXT,
    world_size INTEGER, steps_target INTEGER, seed INTEGER, backend TEXT,
    predicted_iteration_s REAL, predicted_samples_per_s REAL,
    plan_summary TEXT, launcher_pid INTEGER, host TEXT, stop_requested INTEGER NOT NULL DEFAULT 0
);
CREATE TABLE ranks (
    rank INTEGER PRIMARY KEY, position INTEGER, device_index INTEGER, node TEXT, type TEXT,
    micro_batch INTEGER, accum_steps INTEGER, batch INTEGER, shard_fraction REAL, shard_numel INTEGER,
    slowdown REAL, memory_gb REAL, emulated INTEGER, predicted_memory_bytes INTEGER, predicted_step_s REAL,
    pid INTEGER, started_s REAL, memory_method TEXT
);
CREATE TABLE steps (
    step INTEGER PRIMARY KEY, loss REAL NOT NULL, val_loss REAL,
    samples_per_s REAL, tokens_per_s REAL, step_s REAL, time_s REAL
);
CREATE TABLE rank_steps (
    rank INTEGER NOT NULL, step INTEGER NOT NULL,
    compute_s REAL, emulated_delay_s REAL, optimizer_s REAL, wait_s REAL, peak_memory_bytes INTEGER,
    PRIMARY KEY (rank, step)
);
CREATE TABLE events (
    id INTEGER PRIMARY KEY AUTOINCREMENT, time_s REAL, rank INTEGER, kind TEXT, message TEXT
);
"""
LEGACY_QUEUE_SCHEMA = """
CREATE TABLE jobs (
    id INTEGER PRIMARY KEY AUTOINCREMENT, model TEXT NOT NULL, global_batch INTEGER NOT NULL, seq INTEGER NOT NULL,
    steps INTEGER NOT NULL, priority INTEGER NOT NULL DEFAULT 0, state TEXT NOT NULL,
    devices TEXT NOT NULL DEFAULT '[]', device_labels TEXT NOT NULL DEFAULT '[]', run_dir TEXT, pid INTEGER,
    reason TEXT, predicted_duration_s REAL, submitted_s REAL NOT NULL, started_s REAL, ended_s REAL
);
"""


def _executor(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "executor", *args], capture_output=True, text=True, timeout=120,
                          cwd=ROOT, env=dict(env or os.environ, PYTHONPATH=ROOT))


def _legacy_run(run_dir: str) -> None:
    os.makedirs(run_dir)
    with closing(sqlite3.connect(os.path.join(run_dir, "metrics.sqlite"))) as conn, conn:
        conn.executescript(LEGACY_RUN_SCHEMA)
        conn.execute("INSERT INTO run (id, status, phase, emulated, model, world_size, steps_target, started_s, host)"
                     " VALUES (1, 'done', 'ended', 0, 'tiny', 2, 2, 1.0, 'old-host')")
        conn.executemany("INSERT INTO steps (step, loss, step_s) VALUES (?, ?, 0.5)", [(1, 4.0), (2, 3.5)])
        conn.executemany("INSERT INTO rank_steps (rank, step, compute_s, peak_memory_bytes) VALUES (?, ?, 0.1, ?)",
                         [(r, s, 1000 + r) for r in (0, 1) for s in (1, 2)])
        conn.execute("INSERT INTO ranks (rank, position, type) VALUES (0, 0, 'cpu'), (1, 1, 'cpu')")
        conn.execute("INSERT INTO events (time_s, rank, kind, message) VALUES (1.0, 0, 'rank_done', 'bye')")


def test_old_sqlite_files_are_refused_naming_the_upgrade_then_upgraded_with_every_row(tmp_path, data_dir):
    from contracts.paths import runs_dir

    old = os.path.join(runs_dir(), "old")
    _legacy_run(old)
    with closing(sqlite3.connect(queue_db_path())) as conn, conn:
        conn.executescript(LEGACY_QUEUE_SCHEMA)
        conn.execute("INSERT INTO jobs (model, global_batch, seq, steps, state, submitted_s) "
                     "VALUES ('tiny', 8, 16, 3, 'queued', 1.0)")
    for refused in (lambda: read_metrics(old), lambda: MetricsStore(old), JobQueue):
        with pytest.raises(ValueError, match=r"schema version 0 .*run `python -m executor db upgrade`"):
            refused()
    assert list_runs() == []  # an unreadable folder is skipped, never half-read
    status = _executor("db", "status")
    assert status.returncode == 0 and "job queue" in status.stdout and "schema version 0" in status.stdout
    r = _executor("metrics", "--run-dir", old)
    assert r.returncode == 2 and "db upgrade" in r.stderr and "Traceback" not in r.stderr
    up = _executor("db", "upgrade")
    assert up.returncode == 0, up.stderr
    assert "schema version 0 -> 1" in up.stdout and old in up.stdout
    m = read_metrics(old)
    assert [s["loss"] for s in m["steps"]] == [4.0, 3.5] and m["status"] == "done"
    assert [r["peak_memory_bytes"] for r in m["ranks"]] == [1000, 1001] and len(m["rank_steps"]) == 4
    assert [e["kind"] for e in m["events"]] == ["rank_done"]
    [job] = JobQueue().list()
    assert (job.model, job.state, job.host) == ("tiny", "queued", None)  # version 1 added the host column
    # the upgraded file is written as any new one: a new event gets the next id
    s = MetricsStore(old)
    s.add_event("note", "after the upgrade")
    s.close()
    assert [e["message"] for e in read_metrics(old)["events"]] == ["bye", "after the upgrade"]
    again = _executor("db", "upgrade")
    assert again.returncode == 0 and "at schema version 1 already" in again.stdout


def _set_version(store: db.Database, part: str, version: int) -> None:
    store.execute("UPDATE gpumix_schema SET version = ? WHERE part = ?", (version, part))


def test_a_store_of_another_version_is_refused_and_never_altered(store_backend, tmp_path):
    JobQueue()  # the queue's schema exists (created, or initialised by the fixture)
    url = db.resolve(None, queue_db_path)
    with closing(db.Database(url, "test")) as store:
        _set_version(store, "queue", db.SCHEMA_VERSION + 1)
    db._checked.clear()  # as a new process would
    with pytest.raises(ValueError, match=r"newer than this GPUMix's 1: update GPUMix"):
        JobQueue()
    with closing(db.Database(url, "test")) as store:
        with pytest.raises(ValueError, match="newer"):
            db.upgrade(store, QUEUE)
        _set_version(store, "queue", 0)
    db._checked.clear()
    with pytest.raises(ValueError, match=r"schema version 0 \(queue\).*`python -m executor db upgrade`"):
        JobQueue()
    with closing(db.Database(url, "test")) as store:
        assert db.stored_version(store, QUEUE) == 0  # refused, not rewritten
        _set_version(store, "queue", db.SCHEMA_VERSION)  # (its tables are version 1's: the real 0 -> 1 is above)
    db._checked.clear()
    assert JobQueue().list() == []


def test_a_shared_postgresql_store_is_created_only_by_db_init(postgres_server, monkeypatch, tmp_path):
    url = postgres_server.create_database()
    monkeypatch.setenv(db.ENV_DB, url)
    for what, opener in (("job queue", JobQueue), ("booking ledger", booking.Ledger)):
        with pytest.raises(ValueError, match=rf"{what} .* has no GPUMix schema .*`python -m executor db init`"):
            opener()
    r = _executor("db", "init")
    assert r.returncode == 0, r.stderr
    assert r.stdout.count("created (schema version 1)") == 3
    assert _executor("db", "init").stdout.count("already") == 3
    assert JobQueue().list() == [] and booking.Ledger().live() == []
    with pytest.raises(ValueError, match="no run metrics"):
        read_metrics(str(tmp_path / "never-ran"))
    bad = _executor("queue", env=dict(os.environ, GPUMIX_DB="mysql://x@y/z"))
    assert bad.returncode == 2 and "expected sqlite:///<path> or postgresql://" in bad.stderr


def _machine_env(data_dir: str) -> dict:
    """Another user's machine: its own data folder (no shared filesystem), the same GPUMIX_DB."""
    os.makedirs(data_dir, exist_ok=True)
    return dict(os.environ, GPUMIX_DATA_DIR=data_dir, PYTHONPATH=ROOT)


SECOND_MACHINE = """
import json, sys
from executor.queue import QUEUE, JobQueue
from executor.store import MetricsStore, list_runs
from testkit.runs import small_plan
q = JobQueue()
seen = [(j.model, j.state) for j in q.list()]
job = q.submit("gpt2", 16, 4)
s = MetricsStore(sys.argv[1])
s.init_run(small_plan(), steps_target=2, seed=0, backend="gloo")
s.record_step(1, 2.5, 0.5, 4, 16)
s.close()
print(json.dumps({"seen": seen, "job": job, "runs": [r["name"] for r in list_runs()]}))
"""


@pytest.mark.parametrize("shared", ["postgresql", "sqlite-file"])
def test_two_machines_see_one_queue_and_one_history(shared, postgres_server, monkeypatch, tmp_path):
    url = postgres_server.create_database() if shared == "postgresql" else f"sqlite:///{tmp_path / 'shared.sqlite'}"
    monkeypatch.setenv(db.ENV_DB, url)
    init_store()
    first = JobQueue().submit("tiny", 8, 3)
    s = MetricsStore(str(tmp_path / "runs-a" / "run-1"))  # no folder needed: the store holds the run
    s.init_run(small_plan(), steps_target=2, seed=0, backend="gloo")
    s.close()
    other = subprocess.run([sys.executable, "-c", SECOND_MACHINE, str(tmp_path / "runs-b" / "run-2")], cwd=ROOT,
                           env=_machine_env(str(tmp_path / "machine-b")), capture_output=True, text=True, timeout=120)
    assert other.returncode == 0, other.stderr
    out = json.loads(other.stdout)
    assert out["seen"] == [["tiny", "queued"]] and sorted(out["runs"]) == ["run-1", "run-2"]
    assert [(j.id, j.model) for j in JobQueue().list()] == [(first, "tiny"), (out["job"], "gpt2")]
    assert [r["name"] for r in list_runs()] == ["run-2", "run-1"]  # newest first, from both machines
    assert [r["name"] for r in list_runs(str(tmp_path / "runs-a"))] == ["run-1"]
    m = read_metrics(str(tmp_path / "runs-b" / "run-2"))
    assert [st["loss"] for st in m["steps"]] == [2.5] and m["steps_target"] == 2
    assert not os.path.exists(tmp_path / "runs-b")  # nothing went through a filesystem
    s = MetricsStore(str(tmp_path / "runs-a" / "run-1"))
    try:
        with pytest.raises(ValueError, match="shared by every run"):
            s.conn  # raw one-run SQL would read every run's rows
    finally:
        s.close()


RACE = """
import sys, time
from executor import booking
from executor.queue import JobQueue
kind, name, start, holder = sys.argv[1], sys.argv[2], float(sys.argv[3]), int(sys.argv[4])
ledger, queue = booking.Ledger(), JobQueue()
time.sleep(max(0.0, start - time.time()))  # every racer at once
try:
    if kind == "book":
        ledger.book("/runs/" + name, ["local/0", "local/1"], holder)  # held by a live process
        print("won")
    else:
        print("won" if queue.mark_running(1, [0], ["cpu"], "/runs/" + name, None, None) else "lost")
except ValueError as e:
    print("lost" if "in use by run" in str(e) else "error: " + str(e))
"""


@pytest.mark.parametrize("kind", ["book", "start-job"])
def test_racing_processes_never_both_win_a_device_or_a_job(store_backend, kind, tmp_path):
    import time

    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])  # the winner's live holder
    try:
        JobQueue().submit("tiny", 8, 3)
        start = str(time.time() + 3.0)
        racers = [subprocess.Popen([sys.executable, "-c", RACE, kind, f"r{i}", start, str(holder.pid)], cwd=ROOT, text=True,
                                   stdout=subprocess.PIPE, env=dict(os.environ, PYTHONPATH=ROOT)) for i in range(4)]
        results = sorted(p.communicate(timeout=120)[0].strip() for p in racers)
        assert results == ["lost", "lost", "lost", "won"]
    finally:
        holder.kill()
        holder.wait()
    if kind == "start-job":
        assert JobQueue().get(1).state == "running"


def test_another_machines_local_devices_are_not_ours(store_backend, tmp_path):
    ledger = booking.Ledger()
    with closing(ledger._connect()) as store:  # a booking made on another host of the shared ledger
        store.execute("INSERT INTO bookings VALUES (?, ?, ?, ?, ?, ?)",
                      ("/runs/elsewhere", json.dumps(["local/0", "n7/1"]), 1, None, "other-host", 1.0))
    ledger.book(str(tmp_path / "mine"), ["local/0"])  # our local/0 is another device
    [(b, held)] = ledger.conflicts(["local/0", "n7/1", "n7/2"], str(tmp_path / "mine"))
    assert b.run_dir == "/runs/elsewhere" and held == ["n7/1"]  # a named node is the same node everywhere
    with pytest.raises(ValueError, match="devices n7/1 are in use by run /runs/elsewhere"):
        ledger.book(str(tmp_path / "other"), ["n7/1"])


def test_the_runs_schema_has_one_version_row_per_part(store_backend, tmp_path):
    os.makedirs(tmp_path / "r")
    s = MetricsStore(str(tmp_path / "r"))  # a fresh run folder (SQLite) or the shared store
    try:
        assert db.stored_version(s.db, RUNS) == db.SCHEMA_VERSION
        parts = {r[0] for r in s.db.all("SELECT part FROM gpumix_schema")}
        assert parts == ({"runs"} if store_backend == "sqlite" else {"runs", "queue", "bookings"})
    finally:
        s.close()


def test_a_launched_run_records_into_postgresql_and_stops_through_it(postgres_server, monkeypatch, tmp_path):
    """A real launch (2 CPU ranks) with GPUMIX_DB: the launcher, rank 0 and the readers meet in the
    shared store, no run-folder database; stop goes through it."""
    from executor.launch import launch_run, start_run, stop_run
    from testkit.runs import two_cpu_plan
    from testkit.wait import wait_until

    monkeypatch.setenv(db.ENV_DB, postgres_server.create_database())
    init_store()
    assert launch_run(two_cpu_plan(), 3, str(tmp_path / "done"), seed=0) == "done"
    m = read_metrics(str(tmp_path / "done"))
    assert [s["step"] for s in m["steps"]] == [1, 2, 3] and len(m["rank_steps"]) == 6
    assert all(r["peak_memory_bytes"] for r in m["ranks"]) and m["steps"][-1]["val_loss"] is not None
    assert not os.path.exists(tmp_path / "done" / "metrics.sqlite")
    h = start_run(two_cpu_plan(), 100_000, str(tmp_path / "long"), seed=0)
    try:
        wait_until(lambda: read_metrics(h.run_dir)["steps"], 150, "a step")
    finally:
        assert stop_run(h.run_dir) == "stopped"
    assert {r["name"]: r["status"] for r in list_runs()} == {"done": "done", "long": "stopped"}
