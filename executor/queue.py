"""The persistent job queue of the local orchestrator: one SQLite file (WAL).

A job moves queued -> running -> done | failed, or queued -> cancelled (a running
job that is stopped on request also ends as cancelled). Every state change is one
conditional UPDATE, so two writers (the dashboard and `python -m executor orchestrate`)
never both start the same job. Rows keep the devices a running job holds, its run
folder and launcher pid (how a restarted orchestrator finds the run again), the reason
of a failure and the timestamps (Unix seconds). Nothing here imports torch.
"""
from __future__ import annotations

import json
import sqlite3
import time
from contextlib import closing
from dataclasses import asdict, dataclass
from typing import Any, Iterable, Sequence

from planner.core.jobs import JobSpec
from planner.core.paths import queue_db_path
from planner.core.specs import get_model

STATES = ("queued", "running", "done", "failed", "cancelled")
ACTIVE_STATES = ("queued", "running")
DEFAULT_MAX_SEQ = 2048  # as the planner: a model's own context, capped (planner.hetero.solve)
BUSY_TIMEOUT_S = 30.0

_SCHEMA = """
CREATE TABLE IF NOT EXISTS jobs (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    model TEXT NOT NULL,
    global_batch INTEGER NOT NULL,
    seq INTEGER NOT NULL,
    steps INTEGER NOT NULL,
    priority INTEGER NOT NULL DEFAULT 0,
    state TEXT NOT NULL CHECK (state IN ('queued', 'running', 'done', 'failed', 'cancelled')),
    devices TEXT NOT NULL DEFAULT '[]',        -- JSON: device indices of the local cluster
    device_labels TEXT NOT NULL DEFAULT '[]',  -- JSON: their labels (type, emulation)
    run_dir TEXT,
    pid INTEGER,                               -- the run's launcher
    reason TEXT,
    predicted_duration_s REAL,
    submitted_s REAL NOT NULL,
    started_s REAL,
    ended_s REAL
);
CREATE INDEX IF NOT EXISTS jobs_state ON jobs (state);
"""


@dataclass(frozen=True)
class QueuedJob:
    id: int
    model: str
    global_batch: int
    seq: int
    steps: int
    priority: int
    state: str
    devices: tuple[int, ...]
    device_labels: tuple[str, ...]
    run_dir: str | None
    pid: int | None
    reason: str | None
    predicted_duration_s: float | None
    submitted_s: float
    started_s: float | None
    ended_s: float | None

    @classmethod
    def from_row(cls, row: sqlite3.Row) -> "QueuedJob":
        d = dict(row)
        d["devices"] = tuple(json.loads(d["devices"] or "[]"))
        d["device_labels"] = tuple(json.loads(d["device_labels"] or "[]"))
        return cls(**d)

    def job_spec(self, origin_s: float = 0.0) -> JobSpec:
        """The scheduler's view; submit time relative to `origin_s`."""
        return JobSpec(str(self.id), self.model, self.global_batch, self.seq, self.steps,
                       max(0.0, self.submitted_s - origin_s), self.priority)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["devices"], d["device_labels"] = list(self.devices), list(self.device_labels)
        return d


def open_sqlite(path: str, what: str) -> sqlite3.Connection:
    """An autocommit WAL connection with rows by name that waits for other writers; a file that is
    not a database is a ValueError naming `what` (the queue, the booking ledger)."""
    try:
        conn = sqlite3.connect(path, timeout=BUSY_TIMEOUT_S, isolation_level=None)
        conn.row_factory = sqlite3.Row
        conn.execute("PRAGMA journal_mode=WAL")
    except sqlite3.DatabaseError as e:
        raise ValueError(f"{what} {path}: {e}") from None
    return conn


def _positive_int(v: Any, what: str) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
        raise ValueError(f"{what} must be a positive integer, got {v!r}")
    return v


def job_spec_of(model: str, global_batch: int, steps: int, seq: int | None = None, priority: int = 0) -> JobSpec:
    """The job as the scheduler sees it, every field checked (ValueError naming the field); seq
    defaults to the model's context, capped at DEFAULT_MAX_SEQ."""
    spec = get_model(model)  # unknown model -> ValueError
    _positive_int(global_batch, "global batch")
    _positive_int(steps, "steps")
    seq = min(spec.max_seq, DEFAULT_MAX_SEQ) if seq is None else _positive_int(seq, "seq")
    if seq > spec.max_seq:
        raise ValueError(f"seq {seq} > the model's max_seq {spec.max_seq}")
    if isinstance(priority, bool) or not isinstance(priority, int):
        raise ValueError(f"priority must be an integer, got {priority!r}")
    return JobSpec("new", model, global_batch, seq, steps, 0.0, priority)


class JobQueue:
    """The queue in `path` (default planner.core.paths.queue_db_path()); safe to open many times."""

    def __init__(self, path: str | None = None) -> None:
        self.path = path or queue_db_path()
        with closing(self._connect()) as conn, conn:
            conn.executescript(_SCHEMA)

    def _connect(self) -> sqlite3.Connection:
        return open_sqlite(self.path, "job queue")

    def _update(self, sql: str, args: Sequence[Any]) -> bool:
        with closing(self._connect()) as conn:
            return conn.execute(sql, args).rowcount == 1

    # --- adding and reading ---

    def submit(self, model: str, global_batch: int, steps: int, seq: int | None = None, priority: int = 0) -> int:
        """Queue a job; returns its id. Bad input raises ValueError naming the field."""
        job = job_spec_of(model, global_batch, steps, seq, priority)
        seq = job.seq
        with closing(self._connect()) as conn:
            cur = conn.execute(
                "INSERT INTO jobs (model, global_batch, seq, steps, priority, state, submitted_s) "
                "VALUES (?, ?, ?, ?, ?, 'queued', ?)", (model, global_batch, seq, steps, priority, time.time()))
            return int(cur.lastrowid)

    def get(self, job_id: int) -> QueuedJob:
        with closing(self._connect()) as conn:
            row = conn.execute("SELECT * FROM jobs WHERE id = ?", (job_id,)).fetchone()
        if row is None:
            raise ValueError(f"no job {job_id} in the queue")
        return QueuedJob.from_row(row)

    def list(self, states: Iterable[str] | None = None) -> list[QueuedJob]:
        """Jobs in submission order, optionally only those in `states`."""
        states = tuple(states) if states is not None else STATES
        bad = set(states) - set(STATES)
        if bad:
            raise ValueError(f"unknown job states {sorted(bad)}; known: {', '.join(STATES)}")
        marks = ",".join("?" * len(states))
        with closing(self._connect()) as conn:
            rows = conn.execute(f"SELECT * FROM jobs WHERE state IN ({marks}) ORDER BY id", states).fetchall()
        return [QueuedJob.from_row(r) for r in rows]

    # --- state changes (each conditional on the current state) ---

    def mark_running(self, job_id: int, devices: Sequence[int], device_labels: Sequence[str], run_dir: str,
                     pid: int | None, predicted_duration_s: float | None) -> bool:
        """queued -> running; False when the job was no longer queued (someone else took it)."""
        return self._update(
            "UPDATE jobs SET state = 'running', devices = ?, device_labels = ?, run_dir = ?, pid = ?, "
            "predicted_duration_s = ?, started_s = ? WHERE id = ? AND state = 'queued'",
            (json.dumps(list(devices)), json.dumps(list(device_labels)), run_dir, pid, predicted_duration_s,
             time.time(), job_id))

    def finish(self, job_id: int, state: str, reason: str | None = None) -> bool:
        """queued|running -> done|failed|cancelled; the job's devices are free again."""
        if state not in ("done", "failed", "cancelled"):
            raise ValueError(f"a job ends as done, failed or cancelled, not {state!r}")
        return self._update(
            "UPDATE jobs SET state = ?, reason = ?, ended_s = ? WHERE id = ? AND state IN ('queued', 'running')",
            (state, reason, time.time(), job_id))

    def cancel(self, job_id: int) -> bool:
        """Cancel a queued job (a running one is stopped by the orchestrator: Orchestrator.cancel)."""
        self.get(job_id)
        return self._update("UPDATE jobs SET state = 'cancelled', ended_s = ? WHERE id = ? AND state = 'queued'",
                            (time.time(), job_id))
