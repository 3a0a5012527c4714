"""The run's metrics store: one SQLite file per run directory (`metrics.sqlite`).

Writers: the launcher (the `run` row, events) and every rank (its own `rank_steps`
rows; rank 0 also the global `steps` rows) — one writer per process, each write a
short autocommit transaction, so a rank that dies loses nothing it has recorded.
Readers (the CLI, the dashboard) never write. WAL mode lets readers read while a
writer writes; `busy_timeout` makes concurrent writers queue instead of failing.

Status is one of "running" | "done" | "failed" | "stopped" (DESIGN.md). A reader that
finds "running" while the launcher process is gone reports "failed" (the launcher was
killed before it could write the end of the run).
"""
from __future__ import annotations

import json
import logging
import os
import socket
import sqlite3
import time
from typing import Any, Iterator

from planner.core.paths import runs_dir
from planner.core.plan import Plan

log = logging.getLogger(__name__)

DB_NAME = "metrics.sqlite"
STATUSES = ("running", "done", "failed", "stopped")
BUSY_TIMEOUT_MS = 30_000

_SCHEMA = """
CREATE TABLE IF NOT EXISTS run (
    id INTEGER PRIMARY KEY CHECK (id = 1),
    status TEXT NOT NULL, phase TEXT, reason TEXT, failed_rank INTEGER,
    started_s REAL, ended_s REAL, updated_s REAL,
    emulated INTEGER NOT NULL, model TEXT, global_batch INTEGER, seq INTEGER, dtype TEXT,
    world_size INTEGER, steps_target INTEGER, seed INTEGER, backend TEXT,
    predicted_iteration_s REAL, predicted_samples_per_s REAL,
    plan_summary TEXT, launcher_pid INTEGER, host TEXT, stop_requested INTEGER NOT NULL DEFAULT 0
);
CREATE TABLE IF NOT EXISTS ranks (
    rank INTEGER PRIMARY KEY, position INTEGER, device_index INTEGER, node TEXT, type TEXT,
    micro_batch INTEGER, accum_steps INTEGER, batch INTEGER, shard_fraction REAL, shard_numel INTEGER,
    slowdown REAL, memory_gb REAL, emulated INTEGER, predicted_memory_bytes INTEGER, predicted_step_s REAL,
    pid INTEGER, started_s REAL, memory_method TEXT
);
CREATE TABLE IF NOT EXISTS steps (
    step INTEGER PRIMARY KEY, loss REAL NOT NULL, val_loss REAL,
    samples_per_s REAL, tokens_per_s REAL, step_s REAL, time_s REAL
);
CREATE TABLE IF NOT EXISTS rank_steps (
    rank INTEGER NOT NULL, step INTEGER NOT NULL,
    compute_s REAL, emulated_delay_s REAL, optimizer_s REAL, wait_s REAL, peak_memory_bytes INTEGER,
    PRIMARY KEY (rank, step)
);
CREATE TABLE IF NOT EXISTS events (
    id INTEGER PRIMARY KEY AUTOINCREMENT, time_s REAL, rank INTEGER, kind TEXT, message TEXT
);
"""


def db_path(run_dir: str) -> str:
    return os.path.join(run_dir, DB_NAME)


def _connect(path: str, readonly: bool = False) -> sqlite3.Connection:
    uri = f"file:{path}?mode=ro" if readonly else f"file:{path}"
    conn = sqlite3.connect(uri, uri=True, timeout=BUSY_TIMEOUT_MS / 1000, isolation_level=None)
    conn.row_factory = sqlite3.Row
    conn.execute(f"PRAGMA busy_timeout={BUSY_TIMEOUT_MS}")
    return conn


def plan_summary(plan: Plan) -> dict[str, Any]:
    """What the run table keeps of the plan (the full plan is plan.json beside it)."""
    return {
        "model": plan.model, "global_batch": plan.global_batch, "seq": plan.seq, "dtype": plan.dtype,
        "cluster": plan.cluster.name, "devices": [
            {"node": a.node, "type": a.type, "micro_batch": a.micro_batch, "accum_steps": a.accum_steps,
             "shard_fraction": a.shard_fraction, "emulated": a.emulated, "slowdown": a.slowdown,
             "memory_gb": a.memory_gb}
            for a in plan.used],
    }


class MetricsStore:
    """Writer side. Every method is one short transaction."""

    def __init__(self, run_dir: str):
        self.run_dir = run_dir
        self.path = db_path(run_dir)
        self.conn = _connect(self.path)
        self.conn.execute("PRAGMA journal_mode=WAL")
        self.conn.execute("PRAGMA synchronous=NORMAL")  # WAL: durable against a process crash, fast commits
        self.conn.executescript(_SCHEMA)

    def close(self) -> None:
        self.conn.close()

    # ---- the launcher ------------------------------------------------------------------
    def init_run(self, plan: Plan, steps_target: int, seed: int, backend: str, resume: bool = False,
                 prefill_ranks: bool = True) -> None:
        now = time.time()
        used = plan.used
        emulated = any(a.emulated or a.slowdown != 1.0 or a.memory_gb is not None for a in used)
        with self.conn:
            self.conn.execute("BEGIN IMMEDIATE")
            if not resume:
                for table in ("steps", "rank_steps", "events", "ranks"):
                    self.conn.execute(f"DELETE FROM {table}")
            self.conn.execute(
                "INSERT OR REPLACE INTO run (id, status, phase, reason, failed_rank, started_s, ended_s, updated_s,"
                " emulated, model, global_batch, seq, dtype, world_size, steps_target, seed, backend,"
                " predicted_iteration_s, predicted_samples_per_s, plan_summary, launcher_pid, host, stop_requested)"
                " VALUES (1, 'running', 'starting', NULL, NULL, ?, NULL, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, 0)",
                (now, now, int(emulated), plan.model, plan.global_batch, plan.seq, plan.dtype, len(used), steps_target,
                 seed, backend, plan.predicted_iteration_s, plan.predicted_samples_per_s,
                 json.dumps(plan_summary(plan)), os.getpid(), socket.gethostname()),
            )
            for pos, a in enumerate(used if prefill_ranks else ()):  # local runs: rank = plan position
                self.conn.execute(
                    "INSERT OR REPLACE INTO ranks (rank, position, device_index, node, type, micro_batch, accum_steps,"
                    " batch, shard_fraction, slowdown, memory_gb, emulated, predicted_memory_bytes, predicted_step_s)"
                    " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                    (pos, pos, a.device_index, a.node, a.type, a.micro_batch, a.accum_steps, a.batch, a.shard_fraction,
                     a.slowdown, a.memory_gb, int(a.emulated or a.slowdown != 1.0 or a.memory_gb is not None),
                     a.predicted_memory_bytes, a.predicted_step_s),
                )

    def set_phase(self, phase: str) -> None:
        self.conn.execute("UPDATE run SET phase = ?, updated_s = ? WHERE id = 1", (phase, time.time()))

    def finish(self, status: str, reason: str | None = None, failed_rank: int | None = None) -> None:
        if status not in STATUSES:
            raise ValueError(f"unknown run status {status!r}")
        now = time.time()
        self.conn.execute(
            "UPDATE run SET status = ?, phase = 'ended', reason = ?, failed_rank = ?, ended_s = ?, updated_s = ?"
            " WHERE id = 1", (status, reason, failed_rank, now, now))

    def request_stop(self) -> None:
        self.conn.execute("UPDATE run SET stop_requested = 1, updated_s = ? WHERE id = 1", (time.time(),))

    def stop_requested(self) -> bool:
        row = self.conn.execute("SELECT stop_requested FROM run WHERE id = 1").fetchone()
        return bool(row and row[0])

    def add_event(self, kind: str, message: str, rank: int | None = None) -> None:
        self.conn.execute("INSERT INTO events (time_s, rank, kind, message) VALUES (?, ?, ?, ?)",
                          (time.time(), rank, kind, message))

    def truncate_after(self, step: int) -> None:
        """Resume: rows of steps after the checkpoint are recomputed, drop the old ones."""
        with self.conn:
            self.conn.execute("BEGIN IMMEDIATE")
            self.conn.execute("DELETE FROM steps WHERE step > ?", (step,))
            self.conn.execute("DELETE FROM rank_steps WHERE step > ?", (step,))

    # ---- the ranks ---------------------------------------------------------------------
    def register_rank(self, rank: int, position: int, a: Any, pid: int, shard_numel: int, memory_method: str) -> None:
        """A rank is up: its pid, and the plan device it trains (a multi-node rendezvous may order
        ranks differently from the plan, so the rank's own row is rewritten from its assignment)."""
        emulated = int(a.emulated or a.slowdown != 1.0 or a.memory_gb is not None)
        self.conn.execute(
            "INSERT OR REPLACE INTO ranks (rank, position, device_index, node, type, micro_batch, accum_steps,"
            " batch, shard_fraction, shard_numel, slowdown, memory_gb, emulated, predicted_memory_bytes,"
            " predicted_step_s, pid, started_s, memory_method) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
            (rank, position, a.device_index, a.node, a.type, a.micro_batch, a.accum_steps, a.batch, a.shard_fraction,
             shard_numel, a.slowdown, a.memory_gb, emulated, a.predicted_memory_bytes, a.predicted_step_s, pid,
             time.time(), memory_method))

    def record_rank_step(self, rank: int, step: int, compute_s: float, emulated_delay_s: float, optimizer_s: float,
                         wait_s: float, peak_memory_bytes: int | None) -> None:
        self.conn.execute(
            "INSERT OR REPLACE INTO rank_steps (rank, step, compute_s, emulated_delay_s, optimizer_s, wait_s,"
            " peak_memory_bytes) VALUES (?, ?, ?, ?, ?, ?, ?)",
            (rank, step, compute_s, emulated_delay_s, optimizer_s, wait_s, peak_memory_bytes))

    def record_step(self, step: int, loss: float, step_s: float, global_batch: int, seq: int,
                    val_loss: float | None = None) -> None:
        self.conn.execute(
            "INSERT OR REPLACE INTO steps (step, loss, val_loss, samples_per_s, tokens_per_s, step_s, time_s)"
            " VALUES (?, ?, ?, ?, ?, ?, ?)",
            (step, loss, val_loss, global_batch / step_s, global_batch * seq / step_s, step_s, time.time()))
        self.conn.execute("UPDATE run SET phase = 'training', updated_s = ? WHERE id = 1", (time.time(),))


# ---- readers -----------------------------------------------------------------------------


def _pid_alive(pid: int | None) -> bool:
    if not pid:
        return False
    try:
        import psutil

        p = psutil.Process(pid)
        return p.status() != psutil.STATUS_ZOMBIE
    except Exception:  # psutil.NoSuchProcess, AccessDenied, ImportError
        try:
            os.kill(pid, 0)
            return True
        except OSError:
            return False


def _effective_status(run: dict[str, Any]) -> tuple[str, str | None]:
    status, reason = run["status"], run["reason"]
    if status == "running" and run.get("host") == socket.gethostname() and not _pid_alive(run.get("launcher_pid")):
        return "failed", f"the launcher (pid {run.get('launcher_pid')}) ended without recording the end of the run"
    return status, reason


def _median(xs: list[float]) -> float | None:
    xs = sorted(x for x in xs if x is not None)
    if not xs:
        return None
    mid = len(xs) // 2
    return xs[mid] if len(xs) % 2 else 0.5 * (xs[mid - 1] + xs[mid])


def read_metrics(run_dir: str) -> dict[str, Any]:
    """The run's metrics as the DESIGN.md contract says, plus details:

    `{"status", "reason", "failed_rank", "run_dir", "emulated", "phase", "model", "global_batch",
    "seq", "world_size", "steps_target", "predicted_iteration_s", "started_s", "ended_s",
    "steps": [{"step", "loss", "val_loss", "samples_per_s", "tokens_per_s", "step_s"}],
    "ranks": [{"rank", "peak_memory_bytes", "predicted_memory_bytes", "median_compute_s",
    "median_wait_s", "predicted_step_s", "type", "node", "emulated", "slowdown", "memory_gb", ...}],
    "rank_steps": [...], "events": [...]}`. Raises ValueError when there is no run there."""
    path = db_path(run_dir)
    if not os.path.exists(path):
        raise ValueError(f"no run metrics at {run_dir} (missing {DB_NAME})")
    conn = _connect(path, readonly=True)
    try:
        row = conn.execute("SELECT * FROM run WHERE id = 1").fetchone()
        if row is None:
            raise ValueError(f"run store {path} has no run recorded yet")
        run = dict(row)
        steps = [dict(r) for r in conn.execute(
            "SELECT step, loss, val_loss, samples_per_s, tokens_per_s, step_s, time_s FROM steps ORDER BY step")]
        rank_steps = [dict(r) for r in conn.execute("SELECT * FROM rank_steps ORDER BY step, rank")]
        ranks = [dict(r) for r in conn.execute("SELECT * FROM ranks ORDER BY rank")]
        events = [dict(r) for r in conn.execute("SELECT time_s, rank, kind, message FROM events ORDER BY id")]
    except sqlite3.DatabaseError as e:
        raise ValueError(f"run store {path}: {e}") from None
    finally:
        conn.close()
    by_rank: dict[int, list[dict[str, Any]]] = {}
    for rs in rank_steps:
        by_rank.setdefault(rs["rank"], []).append(rs)
    for r in ranks:
        rows = by_rank.get(r["rank"], [])
        peaks = [x["peak_memory_bytes"] for x in rows if x["peak_memory_bytes"] is not None]
        r["peak_memory_bytes"] = max(peaks) if peaks else None
        r["median_compute_s"] = _median([x["compute_s"] for x in rows])
        r["median_emulated_delay_s"] = _median([x["emulated_delay_s"] for x in rows])
        r["median_wait_s"] = _median([x["wait_s"] for x in rows])
        r["emulated"] = bool(r["emulated"])
        r["steps_recorded"] = len(rows)
    status, reason = _effective_status(run)
    summary = json.loads(run["plan_summary"] or "{}")
    return {
        "status": status, "reason": reason, "failed_rank": run["failed_rank"], "run_dir": os.path.abspath(run_dir),
        "phase": run["phase"], "emulated": bool(run["emulated"]), "model": run["model"],
        "global_batch": run["global_batch"], "seq": run["seq"], "dtype": run["dtype"],
        "world_size": run["world_size"], "steps_target": run["steps_target"], "seed": run["seed"],
        "backend": run["backend"], "predicted_iteration_s": run["predicted_iteration_s"],
        "predicted_samples_per_s": run["predicted_samples_per_s"], "cluster": summary.get("cluster"),
        "started_s": run["started_s"], "ended_s": run["ended_s"], "launcher_pid": run["launcher_pid"],
        "median_step_s": _median([s["step_s"] for s in steps[1:]] or [s["step_s"] for s in steps]),
        "steps": steps, "ranks": ranks, "rank_steps": rank_steps, "events": events,
    }


def _iter_run_dirs(root: str) -> Iterator[str]:
    try:
        names = os.listdir(root)
    except OSError:
        return
    for name in names:
        d = os.path.join(root, name)
        if os.path.exists(db_path(d)):
            yield d


def list_runs(root: str | None = None) -> list[dict[str, Any]]:
    """Every run under `root` (default: planner.core.paths.runs_dir()), newest first:
    `[{"run_dir", "name", "status", "reason", "started_s", "ended_s", "steps_recorded",
    "steps_target", "model", "world_size", "emulated"}]`. Unreadable stores are skipped."""
    out = []
    for d in _iter_run_dirs(root or runs_dir()):
        try:
            conn = _connect(db_path(d), readonly=True)
            try:
                row = conn.execute("SELECT * FROM run WHERE id = 1").fetchone()
                n = conn.execute("SELECT COUNT(*) FROM steps").fetchone()[0]
            finally:
                conn.close()
        except sqlite3.DatabaseError as e:
            log.warning("skipping run %s: %s", d, e)
            continue
        if row is None:
            continue
        run = dict(row)
        status, reason = _effective_status(run)
        out.append({
            "run_dir": os.path.abspath(d), "name": os.path.basename(d), "status": status, "reason": reason,
            "started_s": run["started_s"], "ended_s": run["ended_s"], "steps_recorded": n,
            "steps_target": run["steps_target"], "model": run["model"], "world_size": run["world_size"],
            "emulated": bool(run["emulated"]),
        })
    out.sort(key=lambda r: r["started_s"] or 0.0, reverse=True)
    return out
