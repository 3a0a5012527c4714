"""The booking ledger: which run holds which device, one table for every launcher, in the store
(executor.db: `bookings.sqlite` under the data folder, or the store GPUMIX_DB names).

Every launch (the dashboard, the CLI, the local orchestrator) books its devices before a rank
starts; a device held by a live booking is refused to any other run with one line naming that run.
A device is `<node>/<index>`, "local" for this machine (so the dashboard's and the orchestrator's
plans name it alike); a booking keeps its host, so in a shared ledger another machine's "local/0" is
not ours. Before anything is read or booked the ledger is repaired from the processes alive: a
booking whose booker, launcher and torchrun are all gone is released, and its run, if the store
still reads it as running, is recorded failed ("launcher vanished"). Nothing here imports torch.
"""
from __future__ import annotations

import json
import logging
import os
import socket
import time
from contextlib import closing
from dataclasses import dataclass
from typing import Any, Iterable, Sequence

from executor import db
from contracts.cluster import ClusterSpec
from contracts.paths import data_dir
from contracts.plan import Plan

log = logging.getLogger(__name__)

DB_NAME = "bookings.sqlite"
LOCAL = "local"
LOCAL_NAMES = {"localhost", "127.0.0.1", "::1", LOCAL}
PID_START_TOLERANCE_S = 2.0  # psutil's create_time is rounded; a reused pid starts later than that

_SCHEMA = """
CREATE TABLE IF NOT EXISTS bookings (
    run_dir TEXT PRIMARY KEY,
    devices TEXT NOT NULL,      -- JSON list of "<node>/<index>"
    pid {int} NOT NULL,         -- the holder: the booker, then the run's launcher
    pid_start_s {real},         -- the holder's start time (a reused pid is not the holder)
    host TEXT NOT NULL,
    started_s {real} NOT NULL
);
"""
# version 0 (the file before versions were kept) has the same table
BOOKINGS = db.Part("bookings", _SCHEMA, ("bookings",), {0: db.only_record_version})


@dataclass(frozen=True)
class Booking:
    run_dir: str
    devices: tuple[str, ...]
    pid: int
    host: str
    started_s: float

    def describe(self) -> str:
        return f"run {self.run_dir} (started {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(self.started_s))})"


def ledger_path() -> str:
    return os.path.join(data_dir(), DB_NAME)


def is_local_node(name: str) -> bool:
    return name in LOCAL_NAMES or name in {socket.gethostname(), socket.getfqdn()}


def _node_key(name: str, single_node: bool) -> str:
    return LOCAL if single_node or is_local_node(name) else name


def cluster_device_keys(cluster: ClusterSpec, indices: Iterable[int] | None = None) -> list[str]:
    """The ledger's names of `cluster`'s devices `indices` (ClusterSpec.devices() order; all by default)."""
    single = len(cluster.nodes) == 1
    keys = []
    for node in cluster.nodes:
        keys += [f"{_node_key(node.name, single)}/{k}" for k in range(len(node.devices))]
    return keys if indices is None else [keys[i] for i in indices]


def plan_device_keys(plan: Plan) -> list[str]:
    """The devices `plan` uses, named as in the ledger."""
    nodes = {a.node for a in plan.used}
    single = len(nodes) <= 1
    per_node: dict[str, int] = {}
    index_in_node: list[tuple[str, int]] = []
    for node in plan.cluster.nodes:
        for _ in node.devices:
            index_in_node.append((node.name, per_node.get(node.name, 0)))
            per_node[node.name] = per_node.get(node.name, 0) + 1
    keys = []
    for a in plan.used:
        node, k = index_in_node[a.device_index] if a.device_index < len(index_in_node) else (a.node, a.device_index)
        keys.append(f"{_node_key(node, single)}/{k}")
    return keys


# ---- is a holder alive ---------------------------------------------------------------------------


def _start_s(pid: int) -> float | None:
    try:
        import psutil

        p = psutil.Process(pid)
        return None if p.status() == psutil.STATUS_ZOMBIE else p.create_time()
    except Exception:  # NoSuchProcess, AccessDenied
        return None


def _holder_alive(pid: int, start_s: float | None) -> bool:
    now = _start_s(pid)
    return now is not None and (start_s is None or abs(now - start_s) <= PID_START_TOLERANCE_S)


def _torchrun_alive(run_dir: str) -> bool:
    try:
        with open(os.path.join(run_dir, "torchrun.pid")) as fh:
            pid = int(fh.read().strip())
        import psutil

        p = psutil.Process(pid)
        return p.status() != psutil.STATUS_ZOMBIE and "torch.distributed.run" in " ".join(p.cmdline())
    except Exception:
        return False


def _alive(row: Any) -> bool:
    if row["host"] != socket.gethostname():
        return True  # another machine's processes: not ours to judge
    return _holder_alive(row["pid"], row["pid_start_s"]) or _torchrun_alive(row["run_dir"])


# ---- the ledger --------------------------------------------------------------------------------


def _on_host(devices: Iterable[str], host: str) -> set[str]:
    """Devices named so that two machines' "local" devices differ: `local/k` -> `<host>/k`."""
    return {f"{host}/{d.split('/', 1)[1]}" if d.split("/", 1)[0] == LOCAL else d for d in devices}


def _held(devices: Sequence[str], b: Booking) -> list[str]:
    """Which of our `devices` (named as on this machine) booking `b` holds."""
    theirs = _on_host(b.devices, b.host)
    here = socket.gethostname()
    return sorted(d for d in devices if _on_host([d], here) & theirs)


class Ledger:
    def __init__(self, path: str | None = None) -> None:
        self.url = db.resolve(path, ledger_path)
        self.path = self.url.url
        self._vanished: list[tuple[str, int, str]] = []  # (run_dir, pid, host) released by _repair
        self._connect().close()  # the schema is there (a fresh file gets it), or a ValueError says why

    def _connect(self) -> db.Database:
        return db.connect(self.url, BOOKINGS, "booking ledger")

    def _repair(self, conn: db.Database) -> list[Booking]:
        """Release dead bookings; return the live ones (inside the caller's transaction)."""
        live = []
        for row in conn.all("SELECT * FROM bookings ORDER BY started_s"):
            if _alive(row):
                live.append(Booking(row["run_dir"], tuple(json.loads(row["devices"])), row["pid"], row["host"],
                                    row["started_s"]))
            else:
                log.info("booking of %s released: its launcher and torchrun are gone", row["run_dir"])
                conn.execute("DELETE FROM bookings WHERE run_dir = ?", (row["run_dir"],))
                self._vanished.append((row["run_dir"], row["pid"], row["host"]))
        return live

    def _record_vanished(self) -> None:
        """The runs of the bookings just released, still "running" in their store: failed, saying the
        launcher vanished (after the ledger's transaction: a run's store is another database)."""
        from executor.store import MetricsStore, has_run
        from executor.supervise import record_vanished

        vanished, self._vanished = self._vanished, []
        for run_dir, pid, host in vanished:
            try:
                if has_run(run_dir):
                    store = MetricsStore(run_dir)
                    with closing(store):
                        record_vanished(store, pid, host)
            except (ValueError, OSError, *db.errors()) as e:
                log.warning("run %s: could not record its vanished launcher: %s", run_dir, e)

    def live(self) -> list[Booking]:
        """The live bookings, oldest first (dead ones are released on the way)."""
        with closing(self._connect()) as conn, conn.transaction(lock="bookings"):
            live = self._repair(conn)
        self._record_vanished()
        return live

    def conflicts(self, devices: Sequence[str], run_dir: str | None = None) -> list[tuple[Booking, list[str]]]:
        """(booking, the devices of `devices` it holds) for every other live run holding some."""
        run_dir = os.path.abspath(run_dir) if run_dir else None
        return [(b, held) for b in self.live() if b.run_dir != run_dir and (held := _held(devices, b))]

    def book(self, run_dir: str, devices: Sequence[str], pid: int | None = None) -> None:
        """Book `devices` for `run_dir`, held by `pid` (default this process). A run folder that
        holds a booking already keeps its devices and only changes holder (the orchestrator books
        with the full cluster's names, then start_run and the launcher take it over). ValueError
        naming the holding run if another live run holds one of them."""
        run_dir = os.path.abspath(run_dir)
        pid = os.getpid() if pid is None else pid
        try:
            self._book(run_dir, devices, pid)
        finally:
            self._record_vanished()

    def _book(self, run_dir: str, devices: Sequence[str], pid: int) -> None:
        # check and book in one transaction, the table locked: two launchers never both win
        with closing(self._connect()) as conn, conn.transaction(lock="bookings"):
            live = self._repair(conn)
            if any(b.run_dir == run_dir for b in live):
                conn.execute("UPDATE bookings SET pid = ?, pid_start_s = ? WHERE run_dir = ?",
                             (pid, _start_s(pid), run_dir))
                return
            for b in live:
                busy = _held(devices, b)
                if busy:
                    raise ValueError(f"devices {', '.join(busy)} are in use by {b.describe()}; "
                                     "stop it or wait for it to end")
            conn.execute(db.upsert("bookings", ("run_dir", "devices", "pid", "pid_start_s", "host", "started_s"),
                                   ("run_dir",)),
                         (run_dir, json.dumps(list(devices)), pid, _start_s(pid), socket.gethostname(), time.time()))

    def release(self, run_dir: str) -> None:
        with closing(self._connect()) as conn:
            conn.execute("DELETE FROM bookings WHERE run_dir = ?", (os.path.abspath(run_dir),))
