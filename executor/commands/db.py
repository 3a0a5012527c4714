"""`python -m executor db init|upgrade|status [--run-dir R ...]`: the store's schema, on request.

The store is the one GPUMIX_DB names (a shared SQLite file or PostgreSQL database: queue,
ledger and every run), else the embedded SQLite files of this machine: the job queue, the
booking ledger and each run folder's metrics.sqlite (those under the runs folder, and any
`--run-dir`). `init` creates what is missing, `upgrade` brings older schemas to this GPUMix's
version (each store in one transaction), `status` prints each store's version. Nothing else
ever changes a schema: a store at another version is refused with the command to run.
"""
from __future__ import annotations

import argparse
import functools
import os

from executor import db

HELP = "create (init), upgrade or show (status) the schema of the store: queue, ledger, run history"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("action", choices=("init", "upgrade", "status"))
    p.add_argument("--run-dir", action="append", default=[],
                   help="also this run folder's own metrics.sqlite (embedded store; repeatable)")


def _stores(run_dirs: list[str], existing_only: bool) -> list[tuple[db.StoreURL, db.Part, str]]:
    """(store, part, what) for every store the command acts on."""
    from executor import booking, queue, store
    from contracts.paths import queue_db_path, runs_dir

    shared = db.configured()
    if shared is not None:
        return [(shared, queue.QUEUE, "job queue"), (shared, booking.BOOKINGS, "booking ledger"),
                (shared, store.RUNS, "run store")]
    files = [(queue_db_path(), queue.QUEUE, "job queue"), (booking.ledger_path(), booking.BOOKINGS, "booking ledger")]
    folders = sorted({os.path.abspath(d) for d in list(store._iter_run_dirs(runs_dir())) + run_dirs})
    for d in folders:
        if not os.path.exists(store.db_path(d)):
            raise ValueError(f"no run store in {d} (missing {store.DB_NAME})")
        files.append((store.db_path(d), store.RUNS, "run store"))
    return [(db.StoreURL("sqlite", path, False), part, what) for path, part, what in files
            if not existing_only or os.path.exists(path)]


def _on_each(run_dirs: list[str] | None, existing_only: bool, action, readonly: bool = False):
    """(url, part, what, action(connection, part)) for every store; a store that is not a
    database, or a lost server, is a ValueError naming it."""
    for url, part, what in _stores(run_dirs or [], existing_only):
        conn = db.Database(url, what, readonly=readonly and url.dialect == "sqlite")
        try:
            result = action(conn, part)
        except db.errors() as e:
            raise ValueError(f"{what} {url.describe()}: {db.error_line(e)}") from None
        finally:
            conn.close()
        yield url, what, result


def init_all(run_dirs: list[str] | None = None) -> list[str]:
    """Create every missing schema; one line per store."""
    lines = []
    for url, what, created in _on_each(run_dirs, False, db.init):
        lines.append(f"{what} {url.describe()}: " + (f"created (schema version {db.SCHEMA_VERSION})" if created
                                                      else f"at schema version {db.SCHEMA_VERSION} already"))
    return lines


def refuse_running(conn: db.Database) -> None:
    """The upgrade's lock: a running run holds its store open for its whole life, so no schema may
    change under it (ValueError naming the run)."""
    from executor.store import running_runs

    running = running_runs(conn)
    if running:
        raise ValueError(f"{conn.what} {conn.url.describe()}: run {running[0]} is running; `{db.UPGRADE_COMMAND}` "
                         "changes a schema only while no run is (stop it with `python -m executor stop` or wait)")


def upgrade_all(run_dirs: list[str] | None = None) -> list[str]:
    """Every store brought to this version, refused before any changes while a run is running (each
    store's own upgrade checks again, under its write lock, in the transaction that upgrades it)."""
    list(_on_each(run_dirs, True, lambda conn, part: refuse_running(conn), readonly=True))
    lines = []
    for url, what, (before, after) in _on_each(run_dirs, True, functools.partial(db.upgrade, guard=refuse_running)):
        was = "none" if before is None else str(before)
        lines.append(f"{what} {url.describe()}: schema version {was} -> {after}" if before != after
                     else f"{what} {url.describe()}: at schema version {after} already")
    return lines


def status_all(run_dirs: list[str] | None = None) -> list[str]:
    lines = []
    for url, what, version in _on_each(run_dirs, True, db.stored_version, readonly=True):
        state = "no schema" if version is None else f"schema version {version}"
        if version != db.SCHEMA_VERSION:
            state += f" (this GPUMix: {db.SCHEMA_VERSION}; run `{db.INIT_COMMAND if version is None else db.UPGRADE_COMMAND}`)"
        lines.append(f"{what} {url.describe()}: {state}")
    return lines


def run(args: argparse.Namespace) -> int:
    action = {"init": init_all, "upgrade": upgrade_all, "status": status_all}[args.action]
    for line in action(args.run_dir):
        print(line)
    return 0
