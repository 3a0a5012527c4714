"""The persistent job queue of the orchestrator: in the store (executor.db) — by default one
SQLite file (WAL) of this machine, with GPUMIX_DB the shared store every user's machine sees.

A job moves queued -> running -> done | failed, or queued -> cancelled (a running
job that is stopped on request also ends as cancelled). Every state change is one
conditional UPDATE, so two writers (the dashboard and `python -m executor orchestrate`)
never both start the same job. Rows keep the devices a running job holds, its run
folder and launcher pid (how a restarted orchestrator finds the run again), the reason
of a failure and the timestamps (Unix seconds). Nothing here imports torch.
"""
from __future__ import annotations

import json
import socket
import time
from contextlib import closing
from dataclasses import asdict, dataclass
from typing import Any, Iterable, Sequence

from executor import db
from contracts.jobs import JobSpec
from contracts.paths import queue_db_path
from contracts.specs import get_model
from planner.entry import default_seq

STATES = ("queued", "running", "done", "failed", "cancelled")
ACTIVE_STATES = ("queued", "running")

_SCHEMA = """
CREATE TABLE IF NOT EXISTS jobs (
    id {serial},
    model TEXT NOT NULL,
    global_batch {int} NOT NULL,
    seq {int} NOT NULL,
    steps {int} NOT NULL,
    priority {int} NOT NULL DEFAULT 0,
    state TEXT NOT NULL CHECK (state IN ('queued', 'running', 'done', 'failed', 'cancelled')),
    devices TEXT NOT NULL DEFAULT '[]',        -- JSON: device indices of the cluster of `host`
    device_labels TEXT NOT NULL DEFAULT '[]',  -- JSON: their labels (type, emulation)
    run_dir TEXT,
    pid {int},                                 -- the run's launcher (a process on `host`)
    reason TEXT,
    predicted_duration_s {real},
    submitted_s {real} NOT NULL,
    started_s {real},
    ended_s {real},
    host TEXT                                  -- the machine whose orchestrator started it
);
CREATE INDEX IF NOT EXISTS jobs_state ON jobs (state);
"""


def _upgrade_from_0(store: db.Database) -> None:
    """Version 0 (the file before versions were kept): no host column (every job was this machine's)."""
    store.execute("ALTER TABLE jobs ADD COLUMN host TEXT")


QUEUE = db.Part("queue", _SCHEMA, ("jobs",), {0: _upgrade_from_0})


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
    host: str | None = None  # the machine that started it (a shared queue holds every machine's jobs)

    @classmethod
    def from_row(cls, row: Any) -> "QueuedJob":
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


def _positive_int(v: Any, what: str) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
        raise ValueError(f"{what} must be a positive integer, got {v!r}")
    return v


def job_spec_of(model: str, global_batch: int, steps: int, seq: int | None = None, priority: int = 0) -> JobSpec:
    """The job as the scheduler sees it, every field checked (ValueError naming the field); seq
    defaults to the planner's (planner.entry.default_seq: the model's context, capped)."""
    spec = get_model(model)  # unknown model -> ValueError
    _positive_int(global_batch, "global batch")
    _positive_int(steps, "steps")
    seq = default_seq(model) if seq is None else _positive_int(seq, "seq")
    if seq > spec.max_seq:
        raise ValueError(f"seq {seq} > the model's max_seq {spec.max_seq}")
    if isinstance(priority, bool) or not isinstance(priority, int):
        raise ValueError(f"priority must be an integer, got {priority!r}")
    return JobSpec("new", model, global_batch, seq, steps, 0.0, priority)


class JobQueue:
    """The queue in `path` (a SQLite file or a store URL; default: GPUMIX_DB, else
    contracts.paths.queue_db_path()); safe to open many times, from many machines."""

    def __init__(self, path: str | None = None) -> None:
        self.url = db.resolve(path, queue_db_path)
        self.path = self.url.url
        self._connect().close()  # the schema is there (a fresh file gets it), or a ValueError says why

    def _connect(self) -> db.Database:
        return db.connect(self.url, QUEUE, "job queue")

    def _update(self, sql: str, args: Sequence[Any]) -> bool:
        with closing(self._connect()) as conn:
            return conn.execute(sql, args).rowcount == 1

    # --- adding and reading ---

    def submit(self, model: str, global_batch: int, steps: int, seq: int | None = None, priority: int = 0) -> int:
        """Queue a job; returns its id. Bad input raises ValueError naming the field."""
        job = job_spec_of(model, global_batch, steps, seq, priority)
        seq = job.seq
        with closing(self._connect()) as conn:
            [row] = conn.all(  # every row fetched: SQLite ends the INSERT's statement (and commits) then
                "INSERT INTO jobs (model, global_batch, seq, steps, priority, state, submitted_s) "
                "VALUES (?, ?, ?, ?, ?, 'queued', ?) RETURNING id",
                (model, global_batch, seq, steps, priority, time.time()))
            return int(row[0])

    def get(self, job_id: int) -> QueuedJob:
        with closing(self._connect()) as conn:
            row = conn.one("SELECT * FROM jobs WHERE id = ?", (job_id,))
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
            rows = conn.all(f"SELECT * FROM jobs WHERE state IN ({marks}) ORDER BY id", states)
        return [QueuedJob.from_row(r) for r in rows]

    # --- state changes (each conditional on the current state) ---

    def mark_running(self, job_id: int, devices: Sequence[int], device_labels: Sequence[str], run_dir: str,
                     pid: int | None, predicted_duration_s: float | None) -> bool:
        """queued -> running on this machine; False when the job was no longer queued (someone
        else took it, perhaps another machine's orchestrator on a shared queue)."""
        return self._update(
            "UPDATE jobs SET state = 'running', devices = ?, device_labels = ?, run_dir = ?, pid = ?, "
            "predicted_duration_s = ?, started_s = ?, host = ? WHERE id = ? AND state = 'queued'",
            (json.dumps(list(devices)), json.dumps(list(device_labels)), run_dir, pid, predicted_duration_s,
             time.time(), socket.gethostname(), job_id))

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
