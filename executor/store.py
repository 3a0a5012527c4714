"""The run history: each run's status, ranks, steps, per-rank steps and events.

Where (executor.db): by default one SQLite file per run folder (`metrics.sqlite`, run key ''); with
GPUMIX_DB one shared store keyed by the run folder's absolute path, the name every writer and
reader gives the run on any machine. Writers: the launcher (the `run` row, events), every rank once
(its `ranks` row, its end; on several nodes rank 0 writes them for all), and rank 0 each step: the
step's row and every rank's figures in one transaction, so a reader never sees a step without its
ranks. Readers (the CLI, the dashboard) never write. Status is "running" | "done" | "failed" |
"stopped" (DESIGN.md); "running" with the launcher gone reads as "failed". A write refused for
want of space raises db.DiskFull, one line naming the store and its disk; what was written before
stays readable.
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import socket
import time
from dataclasses import dataclass
from typing import Any, Iterator, Sequence

from executor import db
from contracts.paths import runs_dir
from contracts.plan import Plan

log = logging.getLogger(__name__)

DB_NAME = "metrics.sqlite"
ROOM_FILE = ".store-room"  # MetricsStore.keep_room's reserve
ROOM_BYTES = 1 << 20
FULL_BELOW_BYTES = 1 << 20  # a SQLite store's disk with less left is full (a step's rows: a few KiB)
LINKS_FILE = "links.json"  # a run with emulated links: executor.links.LinksSetup
STATUSES = ("running", "done", "failed", "stopped")

_RUN_DDL = """
CREATE TABLE IF NOT EXISTS run (
    run_key TEXT PRIMARY KEY,                 -- '' in a run folder's own file, else the folder's absolute path
    id {int} NOT NULL DEFAULT 1,              -- always 1: what readers of the one-run file select
    status TEXT NOT NULL, phase TEXT, reason TEXT, failed_rank {int},
    started_s {real}, ended_s {real}, updated_s {real},
    emulated {int} NOT NULL, model TEXT, global_batch {int}, seq {int}, dtype TEXT,
    world_size {int}, steps_target {int}, seed {int}, backend TEXT,
    predicted_iteration_s {real}, predicted_samples_per_s {real},
    plan_summary TEXT, launcher_pid {int}, host TEXT, stop_requested {int} NOT NULL DEFAULT 0
)"""
_RANKS_DDL = """
CREATE TABLE IF NOT EXISTS ranks (
    run_key TEXT NOT NULL, rank {int} NOT NULL, position {int}, device_index {int}, node TEXT, type TEXT,
    micro_batch {int}, accum_steps {int}, batch {int}, shard_fraction {real}, shard_numel {int},
    slowdown {real}, memory_gb {real}, emulated {int}, predicted_memory_bytes {int}, predicted_step_s {real},
    pid {int}, started_s {real}, memory_method TEXT,
    PRIMARY KEY (run_key, rank)
)"""
_STEPS_DDL = """
CREATE TABLE IF NOT EXISTS steps (
    run_key TEXT NOT NULL, step {int} NOT NULL, loss {real} NOT NULL, val_loss {real},
    samples_per_s {real}, tokens_per_s {real}, step_s {real}, time_s {real},
    PRIMARY KEY (run_key, step)
)"""
_RANK_STEPS_DDL = """
CREATE TABLE IF NOT EXISTS rank_steps (
    run_key TEXT NOT NULL, rank {int} NOT NULL, step {int} NOT NULL,
    compute_s {real}, emulated_delay_s {real}, optimizer_s {real}, wait_s {real}, peak_memory_bytes {int},
    comm_wait_s {real}, link_tx_bytes {int}, predicted_compute_s {real}, predicted_wait_s {real},
    PRIMARY KEY (run_key, rank, step)
)"""
_EVENTS_DDL = """
CREATE TABLE IF NOT EXISTS events (
    id {serial}, run_key TEXT NOT NULL, time_s {real}, rank {int}, kind TEXT, message TEXT
)"""
_TABLES = {"run": _RUN_DDL, "ranks": _RANKS_DDL, "steps": _STEPS_DDL, "rank_steps": _RANK_STEPS_DDL,
           "events": _EVENTS_DDL}


def _upgrade_from_0(store: db.Database) -> None:
    """Version 0 (a run folder's file before versions were kept): the same tables without the
    run key; rebuilt with run_key '' (SQLite cannot add a column to a primary key)."""
    for table, ddl in _TABLES.items():
        db.rebuild_with_columns(table, ddl, {"run_key": "''"})(store)
    store.execute("CREATE INDEX IF NOT EXISTS events_run ON events (run_key, id)")


# rank_steps columns newer than schema version 1's tables: a store without them reads NULL
# (`db upgrade` adds them); comm_wait_s: the runtime's wall seconds waiting on communication;
# link_tx_bytes: TCP payload the rank sent on its emulated link (executor/links.py);
# predicted_compute_s / predicted_wait_s: the profile's compute of the rank's micro-batches that step
# and the wait the cost model gives it (executor/straggler.py)
OPTIONAL_RANK_STEP_COLUMNS = ("comm_wait_s", "link_tx_bytes", "predicted_compute_s", "predicted_wait_s")
RUNS = db.Part("runs", ";".join(_TABLES.values()) + ";CREATE INDEX IF NOT EXISTS events_run ON events (run_key, id)",
               tuple(_TABLES), {0: _upgrade_from_0},
               (("rank_steps", "comm_wait_s", "{real}"), ("rank_steps", "link_tx_bytes", "{int}"),
                ("rank_steps", "predicted_compute_s", "{real}"), ("rank_steps", "predicted_wait_s", "{real}")))
# events that carry a step and a structured detail (add_step_event): the run's timeline of plans
# (rebalance from executor/rebalance.py; replan, resume, node_lost, node_joined from the elastic
# launcher) and the straggler's naming and clearing (executor/straggler.py)
TIMELINE_KINDS = ("rebalance", "replan", "resume", "node_lost", "node_joined")
STRAGGLER_KINDS = ("straggler", "straggler_end")

_RANK_COLUMNS = ("run_key", "rank", "position", "device_index", "node", "type", "micro_batch", "accum_steps", "batch",
                 "shard_fraction", "shard_numel", "slowdown", "memory_gb", "emulated", "predicted_memory_bytes",
                 "predicted_step_s", "pid", "started_s", "memory_method")
_RUN_COLUMNS = ("run_key", "status", "phase", "reason", "failed_rank", "started_s", "ended_s", "updated_s",
                "emulated", "model", "global_batch", "seq", "dtype", "world_size", "steps_target", "seed", "backend",
                "predicted_iteration_s", "predicted_samples_per_s", "plan_summary", "launcher_pid", "host",
                "stop_requested")
_RANK_STEP_COLUMNS = ("run_key", "rank", "step", "compute_s", "emulated_delay_s", "optimizer_s", "wait_s",
                      "peak_memory_bytes")
_STEP_COLUMNS = ("run_key", "step", "loss", "val_loss", "samples_per_s", "tokens_per_s", "step_s", "time_s")
_UPSERT_RUN = db.upsert("run", _RUN_COLUMNS, ("run_key",))
_UPSERT_RANK = db.upsert("ranks", _RANK_COLUMNS, ("run_key", "rank"))
_UPSERT_STEP = db.upsert("steps", _STEP_COLUMNS, ("run_key", "step"))


def db_path(run_dir: str) -> str:
    """The run folder's own store (the embedded default)."""
    return os.path.join(run_dir, DB_NAME)


def store_of(run_dir: str) -> tuple[db.StoreURL, str]:
    """(the store holding `run_dir`'s run, the run's key in it)."""
    shared = db.configured()
    if shared is None:
        return db.StoreURL("sqlite", db_path(run_dir), False), ""
    return shared, os.path.abspath(run_dir)


def has_run(run_dir: str) -> bool:
    """Whether the store holds a run for `run_dir` (never raises: an unreadable store is no)."""
    try:
        read_run_row(run_dir)
        return True
    except ValueError:
        return False


@dataclass(frozen=True)
class RankStep:
    """One rank's figures of one step, as rank 0 gathers them."""
    rank: int
    compute_s: float
    emulated_delay_s: float
    optimizer_s: float
    wait_s: float
    peak_memory_bytes: int | None
    comm_wait_s: float | None = None  # wall seconds the compute waited on communication
    link_tx_bytes: int | None = None  # TCP payload sent on the rank's emulated link (executor/links.py)
    predicted_compute_s: float | None = None  # the profile's compute of this step's micro-batches
    predicted_wait_s: float | None = None  # the cost model's iteration less this rank's compute and optimizer

    def values(self, columns: Sequence[str]) -> list:
        return [getattr(self, c) for c in columns]


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
    """Writer side of one run. Every method is one short transaction."""

    def __init__(self, run_dir: str):
        self.run_dir = run_dir
        self.path = db_path(run_dir)
        self.url, self.key = store_of(run_dir)
        self.db = db.connect(self.url, RUNS, "run store")
        self._rank_step_columns: tuple[str, ...] | None = None
        self._room = False  # keep_room's reserve is this store's to give back

    @property
    def conn(self) -> Any:
        """The run folder's own SQLite connection (raw SQL over the one-run tables). A shared
        store holds every run in those tables: its callers use the methods below instead."""
        if self.url.shared:
            raise ValueError(f"the run store {self.url.describe()} is shared by every run: read the run "
                             "through MetricsStore's methods, not raw SQL on store.conn")
        return self.db.conn

    def close(self) -> None:
        self.db.close()
        self._free_room()

    def keep_room(self) -> None:
        """The launcher's room for the run's end: ROOM_BYTES taken beside the run folder's own
        store, given back when a write finds the disk full, so that the end is still recorded."""
        if self.url.shared:
            return
        path = os.path.join(self.run_dir, ROOM_FILE)
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            try:
                os.write(fd, b"\0" * ROOM_BYTES)  # written, not sparse: the blocks are really taken
            finally:
                os.close(fd)
            self._room = True
        except OSError:  # no room even for that: the end may go unrecorded, said by the launcher
            with contextlib.suppress(OSError):
                os.remove(path)

    def _free_room(self) -> bool:
        """Give back the room this store kept (keep_room); False when it kept none."""
        if not self._room:
            return False
        self._room = False
        try:
            os.remove(os.path.join(self.run_dir, ROOM_FILE))
            return True
        except OSError:
            return False

    def disk_full(self) -> db.DiskFull | None:
        """The store's disk as a run's failure reason: a SQLite store whose filesystem has less
        than FULL_BELOW_BYTES left (a rank that died writing it could not say so), else None (a
        PostgreSQL server's disk is its own: its writers' errors say so)."""
        if self.url.dialect != "sqlite":
            return None
        try:
            free = shutil.disk_usage(os.path.dirname(os.path.abspath(self.url.target))).free
        except OSError:
            return None
        return db.DiskFull(self.url, "no space left on device") if free < FULL_BELOW_BYTES else None

    # ---- the launcher ------------------------------------------------------------------
    def init_run(self, plan: Plan, steps_target: int, seed: int, backend: str, resume: bool = False,
                 prefill_ranks: bool = True) -> None:
        now = time.time()
        used = plan.used
        emulated = any(_emulated(a) for a in used)
        with self.db.transaction():
            # the ranks table is this launch's ranks: a launcher's resume (perhaps on a plan with fewer
            # ranks) must not keep an earlier launch's rank row, whose dead pid would read as a rank that
            # died. (Without a launcher, rank 0 calls this while the other ranks may be registering.)
            wipe = ("steps", "rank_steps", "events", "ranks") if not resume else ("ranks",) if prefill_ranks else ()
            for table in wipe:
                self.db.execute(f"DELETE FROM {table} WHERE run_key = ?", (self.key,))
            self.db.execute(_UPSERT_RUN, (
                self.key, "running", "starting", None, None, now, None, now, int(emulated), plan.model,
                plan.global_batch, plan.seq, plan.dtype, len(used), steps_target, seed, backend,
                plan.predicted_iteration_s, plan.predicted_samples_per_s, json.dumps(plan_summary(plan)),
                os.getpid(), socket.gethostname(), 0))
            for pos, a in enumerate(used if prefill_ranks else ()):  # local runs: rank = plan position
                self.db.execute(_UPSERT_RANK, self._rank_row(pos, pos, a, None, None, None, None))

    def _rank_row(self, rank: int, position: int, a: Any, shard_numel: int | None, pid: int | None,
                  started_s: float | None, memory_method: str | None) -> tuple:
        return (self.key, rank, position, a.device_index, a.node, a.type, a.micro_batch, a.accum_steps, a.batch,
                a.shard_fraction, shard_numel, a.slowdown, a.memory_gb, int(_emulated(a)), a.predicted_memory_bytes,
                a.predicted_step_s, pid, started_s, memory_method)

    def set_phase(self, phase: str) -> None:
        self.db.execute("UPDATE run SET phase = ?, updated_s = ? WHERE run_key = ?", (phase, time.time(), self.key))

    def set_launcher_pid(self, pid: int) -> None:
        """The launcher that took the run over (only while the run is still starting)."""
        self.db.execute("UPDATE run SET launcher_pid = ? WHERE run_key = ? AND phase = 'starting'", (pid, self.key))

    def finish(self, status: str, reason: str | None = None, failed_rank: int | None = None) -> None:
        if status not in STATUSES:
            raise ValueError(f"unknown run status {status!r}")
        now = time.time()
        end = ("UPDATE run SET status = ?, phase = 'ended', reason = ?, failed_rank = ?, ended_s = ?, updated_s = ?"
               " WHERE run_key = ?", (status, reason, failed_rank, now, now, self.key))
        try:
            self.db.execute(*end)
        except db.DiskFull:
            if not self._free_room():  # the launcher's room, kept for this write
                raise
            self.db.execute(*end)

    def request_stop(self) -> None:
        self.db.execute("UPDATE run SET stop_requested = 1, updated_s = ? WHERE run_key = ?", (time.time(), self.key))

    def stop_requested(self) -> bool:
        row = self.db.one("SELECT stop_requested FROM run WHERE run_key = ?", (self.key,))
        return bool(row and row[0])

    def add_event(self, kind: str, message: str, rank: int | None = None) -> None:
        self.db.execute("INSERT INTO events (run_key, time_s, rank, kind, message) VALUES (?, ?, ?, ?, ?)",
                        (self.key, time.time(), rank, kind, message))

    def add_step_event(self, kind: str, step: int | None, detail: Any, message: str, rank: int | None = None) -> None:
        """An event that belongs to a step, with a structured `detail` (JSON-able; a rebalance's old and
        new split and its reason): kept in the events table's message as one JSON object, which the
        readers (read_metrics, read_events) take apart again into `message`, `step` and `detail`."""
        self.add_event(kind, encode_step_event(step, detail, message), rank)

    def truncate_after(self, step: int) -> None:
        """Resume: rows of steps after the checkpoint are recomputed, drop the old ones."""
        with self.db.transaction():
            self.db.execute("DELETE FROM steps WHERE run_key = ? AND step > ?", (self.key, step))
            self.db.execute("DELETE FROM rank_steps WHERE run_key = ? AND step > ?", (self.key, step))

    # ---- what the launcher reads back --------------------------------------------------
    def status(self) -> str | None:
        row = self.db.one("SELECT status FROM run WHERE run_key = ?", (self.key,))
        return None if row is None else row[0]

    def worker_pids(self) -> list[int]:
        return [r[0] for r in self.db.all("SELECT pid FROM ranks WHERE run_key = ? AND pid IS NOT NULL ORDER BY rank",
                                          (self.key,))]

    def registered_ranks(self, node: str | None = None) -> list[int]:
        """Ranks that came up (wrote their pid), in order; only those of plan node `node` if given."""
        where, args = ("AND node = ?", (self.key, node)) if node is not None else ("", (self.key,))
        return [r[0] for r in self.db.all(
            f"SELECT rank FROM ranks WHERE run_key = ? AND pid IS NOT NULL {where} ORDER BY rank", args)]

    def events(self, kind: str | None = None) -> list[dict[str, Any]]:
        """[{"rank", "kind", "message"}] in the order written; only those of `kind` if given."""
        where, args = ("AND kind = ?", (self.key, kind)) if kind is not None else ("", (self.key,))
        return [_event({"rank": r[0], "kind": r[1], "message": r[2]}) for r in self.db.all(
            f"SELECT rank, kind, message FROM events WHERE run_key = ? {where} ORDER BY id", args)]

    def all_ranks_done(self) -> bool:
        """Every rank of this launch (not a resumed run's earlier ones) reported all steps done."""
        row = self.db.one("SELECT world_size, started_s FROM run WHERE run_key = ?", (self.key,))
        if row is None or not row[0]:
            return False
        done = self.db.one("SELECT COUNT(DISTINCT rank) FROM events WHERE run_key = ? AND kind = 'rank_done' "
                           "AND time_s >= ?", (self.key, row[1]))[0]
        return done >= row[0]

    def last_step(self) -> int:
        row = self.db.one("SELECT MAX(step) FROM steps WHERE run_key = ?", (self.key,))
        return int(row[0] or 0)

    # ---- the ranks ---------------------------------------------------------------------
    def register_rank(self, rank: int, position: int, a: Any, pid: int, shard_numel: int, memory_method: str) -> None:
        """A rank is up: its pid, and the plan device it trains (a multi-node rendezvous may order
        ranks differently from the plan, so the rank's own row is rewritten from its assignment)."""
        self.db.execute(_UPSERT_RANK, self._rank_row(rank, position, a, shard_numel, pid, time.time(), memory_method))

    def set_rank_split(self, pieces: dict[int, tuple[int, int]]) -> None:
        """A live rebalance (executor/rebalance.py): rank -> its new (micro_batch, accum_steps), the
        ranks rows rewritten in one transaction (their batch = the product)."""
        with self.db.transaction(writes_only=True):
            for rank, (m, n) in pieces.items():
                self.db.execute("UPDATE ranks SET micro_batch = ?, accum_steps = ?, batch = ? WHERE run_key = ? "
                                "AND rank = ?", (m, n, m * n, self.key, rank))

    def record_relayed(self, rows: Sequence[tuple[dict[str, Any], Any]],
                       events: Sequence[tuple[float, int | None, str, str]]) -> None:
        """Rank 0's write of other ranks' one-time rows (a multi-node run, executor/worker.py's
        Trainer.relay): `rows` (ranks row as RelayedStore keeps it, its plan assignment), `events`
        (time_s, rank, kind, message), one transaction."""
        with self.db.transaction(writes_only=True):
            for r, a in rows:
                self.db.execute(_UPSERT_RANK, self._rank_row(r["rank"], r["position"], a, r["shard_numel"], r["pid"],
                                                             r["started_s"], r["memory_method"]))
            for e in events:
                self.db.execute("INSERT INTO events (run_key, time_s, rank, kind, message) VALUES (?, ?, ?, ?, ?)",
                                (self.key, *e))

    def rank_step_columns(self) -> tuple[str, ...]:
        """The rank_steps columns this store has (an older store may lack the optional ones)."""
        if self._rank_step_columns is None:
            have = set(self.db.columns("rank_steps"))
            self._rank_step_columns = _RANK_STEP_COLUMNS + tuple(c for c in OPTIONAL_RANK_STEP_COLUMNS if c in have)
        return self._rank_step_columns

    def record_rank_step(self, rank: int, step: int, compute_s: float, emulated_delay_s: float, optimizer_s: float,
                         wait_s: float, peak_memory_bytes: int | None, comm_wait_s: float | None = None,
                         link_tx_bytes: int | None = None) -> None:
        self.record_rank_steps(step, [RankStep(rank, compute_s, emulated_delay_s, optimizer_s, wait_s,
                                               peak_memory_bytes, comm_wait_s, link_tx_bytes)])

    def record_rank_steps(self, step: int, ranks: Sequence[RankStep]) -> None:
        """Rows of `ranks` for `step`, one statement (the columns this store has)."""
        cols = self.rank_step_columns()
        self.db.execute(db.upsert("rank_steps", cols, ("run_key", "rank", "step"), len(ranks)),
                        [v for r in ranks for v in (self.key, r.rank, step, *r.values(cols[3:]))])

    def record_step(self, step: int, loss: float, step_s: float, global_batch: int, seq: int,
                    val_loss: float | None = None) -> None:
        with self.db.transaction(writes_only=True):
            self._write_step(step, loss, step_s, global_batch, seq, val_loss)

    def record_steps_of_all_ranks(self, step: int, ranks: Sequence[RankStep], loss: float, step_s: float,
                                  global_batch: int, seq: int, val_loss: float | None = None) -> None:
        """Rank 0's write of a step: every rank's figures (gathered) and the step row, one transaction."""
        self.rank_step_columns()  # read before the transaction (a pipelined one returns no rows)
        with self.db.transaction(writes_only=True):
            if ranks:  # one statement for every rank's row
                self.record_rank_steps(step, ranks)
            self._write_step(step, loss, step_s, global_batch, seq, val_loss)

    def record_history(self, steps: Sequence[tuple[int, Sequence[RankStep], float, float]], global_batch: int,
                       seq: int) -> None:
        """Many steps `(step, ranks, loss, step_s)` in one transaction, each as rank 0 records it
        (a benchmark's or a test's long run, written in seconds)."""
        self.rank_step_columns()
        with self.db.transaction(writes_only=True):
            for step, ranks, loss, step_s in steps:
                if ranks:
                    self.record_rank_steps(step, ranks)
                self._write_step(step, loss, step_s, global_batch, seq, None)

    def _write_step(self, step: int, loss: float, step_s: float, global_batch: int, seq: int,
                    val_loss: float | None) -> None:
        now = time.time()
        self.db.execute(_UPSERT_STEP, (self.key, step, loss, val_loss, global_batch / step_s,
                                       global_batch * seq / step_s, step_s, now))
        self.db.execute("UPDATE run SET phase = 'training', updated_s = ? WHERE run_key = ?", (now, self.key))


def _emulated(a: Any) -> bool:
    return bool(a.emulated or a.slowdown != 1.0 or a.memory_gb is not None)


_STEP_EVENT_TAG = "gpumix_step_event"  # marks a message written by add_step_event


def encode_step_event(step: int | None, detail: Any, message: str) -> str:
    """The events table's message of a step event: {"gpumix_step_event": 1, "step", "detail", "text"}."""
    return json.dumps({_STEP_EVENT_TAG: 1, "step": step, "detail": detail, "text": message}, separators=(",", ":"))


def _event(row: dict[str, Any]) -> dict[str, Any]:
    """An event row with `step` and `detail` added: those add_step_event wrote (its `message` back
    to the human line), else step None and the message as the detail."""
    msg = row.get("message")
    if isinstance(msg, str) and msg.startswith("{") and _STEP_EVENT_TAG in msg:
        try:
            d = json.loads(msg)
        except ValueError:
            d = None
        if isinstance(d, dict) and d.get(_STEP_EVENT_TAG) == 1:
            return {**row, "message": d.get("text", ""), "step": d.get("step"), "detail": d.get("detail")}
    return {**row, "step": None, "detail": msg}


def straggler_of(events: Sequence[dict[str, Any]]) -> dict[str, Any] | None:
    """The straggler named now: the detail of the last `straggler` event unless a `straggler_end`
    came after it (events in the order written, as _event returns them)."""
    for e in reversed(events):
        if e["kind"] == "straggler":
            return e["detail"] if isinstance(e["detail"], dict) else None
        if e["kind"] == "straggler_end":
            return None
    return None


# ---- readers -----------------------------------------------------------------------------


def pid_alive(pid: int | None) -> bool:
    """The process `pid` exists and is not a zombie."""
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
    if status == "running" and run.get("host") == socket.gethostname() and not pid_alive(run.get("launcher_pid")):
        return "failed", (f"launcher vanished: the launcher (pid {run.get('launcher_pid')} on {run.get('host')}) "
                          "ended without recording the end of the run")
    return status, reason


def running_runs(store: db.Database) -> list[str]:
    """The runs of `store` that are running (a launcher alive here, or on another host): their run
    folders, or the store itself for a run folder's own file. Reads any schema version's run table
    (`db upgrade` asks before it changes one)."""
    if not store.has_table("run"):
        return []
    out = []
    for row in store.all("SELECT * FROM run WHERE status = 'running'"):
        run = dict(row)
        if _effective_status(run)[0] == "running":
            out.append(run.get("run_key") or store.url.describe())
    return out


def _median(xs: list[float]) -> float | None:
    xs = sorted(x for x in xs if x is not None)
    if not xs:
        return None
    mid = len(xs) // 2
    return xs[mid] if len(xs) % 2 else 0.5 * (xs[mid - 1] + xs[mid])


def _open_reader(run_dir: str) -> tuple[db.Database, str]:
    url, key = store_of(run_dir)
    if not url.shared and not os.path.exists(url.target):
        raise ValueError(f"no run metrics at {run_dir} (missing {DB_NAME})")
    return db.connect(url, RUNS, "run store", readonly=True), key


def _no_run(run_dir: str, store: db.Database) -> ValueError:
    if store.url.shared:
        return ValueError(f"no run metrics at {run_dir} (the store {store.url.describe()} has no run of that folder)")
    return ValueError(f"run store {store.url.target} has no run recorded yet")


def _run_dict(row: Any) -> dict[str, Any]:
    run = dict(row)
    run.pop("run_key", None)
    return run


def read_run_row(run_dir: str) -> dict[str, Any]:
    """The run's `run` row alone (status as recorded). ValueError when there is no run there."""
    store, key = _open_reader(run_dir)
    try:
        row = store.one("SELECT * FROM run WHERE run_key = ?", (key,))
    except db.errors() as e:
        raise ValueError(f"run store {store.url.describe()}: {db.error_line(e)}") from None
    finally:
        store.close()
    if row is None:
        raise _no_run(run_dir, store)
    return _run_dict(row)


def run_status(run_dir: str) -> str:
    """The run's status as read_metrics gives it, from its run row alone (ValueError: no run)."""
    return _effective_status(read_run_row(run_dir))[0]


def read_metrics(run_dir: str) -> dict[str, Any]:
    """The run's metrics as the DESIGN.md contract says, plus details:

    `{"status", "reason", "failed_rank", "run_dir", "emulated", "phase", "model", "global_batch",
    "seq", "world_size", "steps_target", "predicted_iteration_s", "started_s", "ended_s",
    "steps": [{"step", "loss", "val_loss", "samples_per_s", "tokens_per_s", "step_s"}],
    "ranks": [{"rank", "peak_memory_bytes", "predicted_memory_bytes", "median_compute_s",
    "median_wait_s", "predicted_step_s", "type", "node", "emulated", "slowdown", "memory_gb", ...}],
    "rank_steps": [...], "events": [{"time_s", "rank", "kind", "message", "step", "detail"}],
    "straggler": null | {"rank", "device", "slowdown", "since_step", "cost_s", ...}, "steps_recorded"}`.
    Each rank also has its median predicted compute and wait beside the measured ones and
    `compute_vs_profile` (executor/straggler.py). Raises ValueError when there is no run there. Every
    row of a long run: a live view reads executor/live.py's RunFollower instead."""
    store, key = _open_reader(run_dir)
    try:
        run, ranks = read_run_and_ranks(store, key, run_dir)
        steps = [dict(r) for r in store.all(
            f"SELECT {', '.join(STEP_FIELDS)} FROM steps WHERE run_key = ? ORDER BY step", (key,))]
        rank_steps = read_rank_steps(store, key)
        events = [_event(dict(r)) for r in store.all(
            "SELECT time_s, rank, kind, message FROM events WHERE run_key = ? ORDER BY id", (key,))]
    except db.errors() as e:
        raise ValueError(f"run store {store.url.describe()}: {db.error_line(e)}") from None
    finally:
        store.close()
    return metrics_of(run_dir, run, steps, ranks, rank_steps, events, len(steps))


RECENT_STEPS = 5  # the newest steps a rank's compute_vs_profile is the median of
STEP_FIELDS = ("step", "loss", "val_loss", "samples_per_s", "tokens_per_s", "step_s", "time_s")


def read_run_and_ranks(store: db.Database, key: str, run_dir: str) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The run's row and its ranks' rows (ValueError when there is no run)."""
    row = store.one("SELECT * FROM run WHERE run_key = ?", (key,))
    if row is None:
        raise _no_run(run_dir, store)
    ranks = [dict(r) for r in store.all(
        f"SELECT {', '.join(_RANK_COLUMNS[1:])} FROM ranks WHERE run_key = ? ORDER BY rank", (key,))]
    return _run_dict(row), ranks


def read_rank_steps(store: db.Database, key: str, where: str = "", params: Sequence[Any] = ()) -> list[dict[str, Any]]:
    """The run's rank_steps rows (those matching `where`, SQL after "AND"), by step and rank; an
    optional column this store lacks reads None."""
    have = set(store.columns("rank_steps"))
    optional = [c for c in OPTIONAL_RANK_STEP_COLUMNS if c in have]
    return [{**dict.fromkeys(OPTIONAL_RANK_STEP_COLUMNS), **dict(r)} for r in store.all(
        f"SELECT {', '.join(_RANK_STEP_COLUMNS[1:] + tuple(optional))} FROM rank_steps WHERE run_key = ? "
        f"{'AND ' + where if where else ''} ORDER BY step, rank", (key, *params))]


def metrics_of(run_dir: str, run: dict[str, Any], steps: list[dict[str, Any]], ranks: list[dict[str, Any]],
               rank_steps: list[dict[str, Any]], events: list[dict[str, Any]], steps_recorded: int,
               totals: dict[int, tuple[int | None, int]] | None = None) -> dict[str, Any]:
    """read_metrics' dict from the rows read: each rank's medians over `rank_steps`, its peak and
    step count over them and `totals` {rank: (peak bytes, rows)} of rows read before (a live view,
    executor/live.py, holds only the newest rows)."""
    by_rank: dict[int, list[dict[str, Any]]] = {}
    for rs in rank_steps:
        by_rank.setdefault(rs["rank"], []).append(rs)
    for r in ranks:
        rows = by_rank.get(r["rank"], [])
        before_peak, before_n = (totals or {}).get(r["rank"], (None, 0))
        peaks = [x["peak_memory_bytes"] for x in rows if x["peak_memory_bytes"] is not None]
        peaks += [before_peak] if before_peak is not None else []
        r["peak_memory_bytes"] = max(peaks) if peaks else None
        r["median_compute_s"] = _median([x["compute_s"] for x in rows])
        r["median_emulated_delay_s"] = _median([x["emulated_delay_s"] for x in rows])
        r["median_wait_s"] = _median([x["wait_s"] for x in rows])
        r["comm_wait_s"] = _median([x["comm_wait_s"] for x in rows])
        r["median_predicted_compute_s"] = _median([x.get("predicted_compute_s") for x in rows])
        r["median_predicted_wait_s"] = _median([x.get("predicted_wait_s") for x in rows])
        recent = [x["compute_s"] / x["predicted_compute_s"] for x in rows[-RECENT_STEPS:]
                  if x.get("predicted_compute_s") and x["compute_s"] is not None]
        r["compute_vs_profile"] = _median(recent)  # measured / the profile's, over the newest steps
        r["emulated"] = bool(r["emulated"])
        r["steps_recorded"] = before_n + len(rows)
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
        "links": _links(run_dir, rank_steps), "steps_recorded": steps_recorded,
        "steps": steps, "ranks": ranks, "rank_steps": rank_steps, "events": events,
        "straggler": straggler_of(events),
    }


def read_events(run_dir: str, kinds: Sequence[str] = TIMELINE_KINDS + STRAGGLER_KINDS) -> list[dict[str, Any]]:
    """The run's events of `kinds` in the order written, each with `step` and `detail` (a live page
    reads these few beside executor/live.py's bounded rows). ValueError when there is no store."""
    store, key = _open_reader(run_dir)
    try:
        return [_event(dict(r)) for r in store.all(
            f"SELECT time_s, rank, kind, message FROM events WHERE run_key = ? AND kind IN "
            f"({', '.join('?' * len(kinds))}) ORDER BY id", (key, *kinds))]
    except db.errors() as e:
        raise ValueError(f"run store {store.url.describe()}: {db.error_line(e)}") from None
    finally:
        store.close()


def links_gbps(run_dir: str) -> float | None:
    """The emulated link rate of the run in `run_dir` (its LINKS_FILE, written by executor/links.py),
    None when it had none."""
    try:
        with open(os.path.join(run_dir, LINKS_FILE), encoding="utf-8") as fh:
            return float(json.load(fh)["gbps"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _links(run_dir: str, rank_steps: list[dict[str, Any]]) -> dict[str, Any] | None:
    """`{"gbps", "bytes_per_step"}` of a run with emulated links (None otherwise): the rate from
    links.json, and the median over steps of the TCP payload every rank together sent on its link
    during the step (a step counts when every rank of it has its figure)."""
    gbps = links_gbps(run_dir)
    by_step: dict[int, list[int | None]] = {}
    for rs in rank_steps:
        by_step.setdefault(rs["step"], []).append(rs["link_tx_bytes"])
    totals = [sum(v) for v in by_step.values() if v and None not in v]
    if gbps is None and not totals:
        return None
    return {"gbps": gbps, "bytes_per_step": _median(totals)}


def change_stamp(run_dir: str) -> tuple:
    """Changes whenever the run's rows change: a reader's cache key. The run folder's own file:
    its and its WAL's mtime and size (no query); a shared store: the run's last update, its
    step count and last event (one query)."""
    url, key = store_of(run_dir)
    if not url.shared:
        out = []
        for suffix in ("", "-wal"):
            try:
                st = os.stat(url.target + suffix)
                out.append((st.st_mtime_ns, st.st_size))
            except OSError:
                out.append(None)
        return tuple(out)
    try:
        store = db.connect(url, RUNS, "run store", readonly=True)
    except ValueError:
        return (None,)
    try:
        row = store.one("SELECT updated_s, (SELECT COUNT(*) FROM steps WHERE run_key = ?),"
                        " (SELECT MAX(id) FROM events WHERE run_key = ?) FROM run WHERE run_key = ?", (key, key, key))
    except db.errors():
        return (None,)
    finally:
        store.close()
    return tuple(row) if row is not None else (None,)


class StepReader:
    """A reader that follows a run as it goes, on one open connection: the steps recorded after
    the last one it saw (a live chart, bench/store_latency.py)."""

    def __init__(self, run_dir: str):
        self.store, self.key = _open_reader(run_dir)

    def steps_after(self, step: int) -> list[tuple[int, float]]:
        """(step, time_s written) of every step after `step`, in order."""
        return [(r[0], r[1]) for r in self.store.all(
            "SELECT step, time_s FROM steps WHERE run_key = ? AND step > ? ORDER BY step", (self.key, step))]

    def counts(self) -> tuple[int, int]:
        """(step rows, rank-step rows) recorded."""
        steps = self.store.one("SELECT COUNT(*) FROM steps WHERE run_key = ?", (self.key,))[0]
        rank_steps = self.store.one("SELECT COUNT(*) FROM rank_steps WHERE run_key = ?", (self.key,))[0]
        return int(steps), int(rank_steps)

    def close(self) -> None:
        self.store.close()


def _iter_run_dirs(root: str) -> Iterator[str]:
    try:
        names = os.listdir(root)
    except OSError:
        return
    for name in names:
        d = os.path.join(root, name)
        if os.path.exists(db_path(d)):
            yield d


def _summary(run_dir: str, run: dict[str, Any], steps_recorded: int) -> dict[str, Any]:
    status, reason = _effective_status(run)
    return {
        "run_dir": os.path.abspath(run_dir), "name": os.path.basename(run_dir), "status": status, "reason": reason,
        "started_s": run["started_s"], "ended_s": run["ended_s"], "steps_recorded": steps_recorded,
        "steps_target": run["steps_target"], "model": run["model"], "world_size": run["world_size"],
        "emulated": bool(run["emulated"]),
    }


# a list's step count: the run's last step less its first, plus one: two lookups in the steps'
# primary key (a COUNT would read every row of every run at each refresh of a history page);
# steps are recorded in order and a resume keeps those up to its checkpoint: none is missing
_STEP_SPAN = ("COALESCE((SELECT MAX(step) FROM steps WHERE run_key = {k}) - "
              "(SELECT MIN(step) FROM steps WHERE run_key = {k}) + 1, 0)")
_LAST_STEP = "SELECT " + _STEP_SPAN.format(k="?")


def _list_folder_runs(root: str) -> list[dict[str, Any]]:
    out = []
    for d in _iter_run_dirs(root):
        try:
            store = db.connect(db.StoreURL("sqlite", db_path(d), False), RUNS, "run store", readonly=True)
            try:
                row = store.one("SELECT * FROM run")
                n = store.one(_LAST_STEP, (row["run_key"],) * 2)[0] if row is not None else 0
            finally:
                store.close()
        except (ValueError, *db.errors()) as e:
            log.warning("skipping run %s: %s", d, e)
            continue
        if row is not None:
            out.append(_summary(d, _run_dict(row), n))
    return out


def _list_shared_runs(url: db.StoreURL, root: str | None) -> list[dict[str, Any]]:
    store = db.connect(url, RUNS, "run store", readonly=True)
    try:
        rows = store.all(f"SELECT run.*, {_STEP_SPAN.format(k='run.run_key')} AS n_steps FROM run")
    except db.errors() as e:
        raise ValueError(f"run store {url.describe()}: {db.error_line(e)}") from None
    finally:
        store.close()
    prefix = os.path.join(os.path.abspath(root), "") if root else ""
    out = []
    for row in rows:
        if row["run_key"].startswith(prefix):
            run = _run_dict(row)
            out.append(_summary(row["run_key"], run, int(run.pop("n_steps") or 0)))
    return out


def list_runs(root: str | None = None) -> list[dict[str, Any]]:
    """Every run under `root` (default: contracts.paths.runs_dir(); with a shared store
    GPUMIX_DB, default: every run the store holds, from any machine), newest first:
    `[{"run_dir", "name", "status", "reason", "started_s", "ended_s", "steps_recorded",
    "steps_target", "model", "world_size", "emulated"}]`. Unreadable per-folder stores are skipped.
    Its cost does not grow with the runs' lengths: "steps_recorded" is read from the steps' index
    (the span from the first step to the last)."""
    shared = db.configured()
    out = _list_shared_runs(shared, root) if shared else _list_folder_runs(root or runs_dir())
    out.sort(key=lambda r: r["started_s"] or 0.0, reverse=True)
    return out
