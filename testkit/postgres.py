"""A PostgreSQL server of our own, for the store tests and bench/store_latency.py.

`running_postgres()` starts Debian's own binaries (`/usr/lib/postgresql/<v>/bin`: initdb, pg_ctl)
on a free localhost port in a temporary data directory and stops it when the block ends. initdb
refuses root, so as root the server runs as the `postgres` system user (created if missing)
through `runuser -u postgres --`, every command an argument list (no shell). `create_database()`
gives each test a database of its own; `init_store()` creates the GPUMix schema in the store
GPUMIX_DB names, as `python -m executor db init` does. `unavailable()` says why this platform
cannot run the server (no binaries: `apt-get install -y postgresql`; no psycopg), or None.
The fixtures (`postgres_server`, `store_backend`) are in tests/conftest.py.
"""
from __future__ import annotations

import contextlib
import glob
import itertools
import os
import pwd
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from typing import Iterator

from testkit.processes import free_port
from testkit.wait import wait_until

PG_USER = "postgres"
START_TIMEOUT_S = 60
BACKENDS = ("sqlite", "postgresql")
_names = itertools.count()


@dataclass(frozen=True)
class PostgresServer:
    port: int
    bin_dir: str

    def url(self, database: str = "postgres") -> str:
        return f"postgresql://{PG_USER}@127.0.0.1:{self.port}/{database}"

    def create_database(self) -> str:
        """A new empty database; returns its URL."""
        import psycopg

        name = f"gpumix_test_{os.getpid()}_{next(_names)}"
        with psycopg.connect(self.url(), autocommit=True) as conn:
            conn.execute(f"CREATE DATABASE {name}")
        return self.url(name)


def _bin_dir() -> str | None:
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"), key=lambda p: int(p.split("/")[4]))
    return os.path.dirname(found[-1]) if found else None


def _as_server_user() -> list[str]:
    """The command prefix that runs a server binary as a non-root user."""
    if os.geteuid() != 0:
        return []
    try:
        pwd.getpwnam(PG_USER)
    except KeyError:
        subprocess.run(["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", PG_USER],
                       check=True)
    return ["runuser", "-u", PG_USER, "--"]


def unavailable() -> str | None:
    """Why this platform cannot run the server (None when it can)."""
    if _bin_dir() is None:
        return ("PostgreSQL server binaries not found under /usr/lib/postgresql/*/bin "
                "(apt-get install -y postgresql)")
    try:
        import psycopg  # noqa: F401
    except ImportError:
        return "psycopg 3 is not installed (pip install 'psycopg[binary]')"
    return None


@contextlib.contextmanager
def running_postgres(durable: bool = False) -> Iterator[PostgresServer]:
    """A PostgreSQL server of our own for the block. `durable` False (tests): fsync off, a
    server a crash may lose; True (bench/store_latency.py): PostgreSQL's defaults, every commit
    flushed, as a real deployment runs."""
    bin_dir = _bin_dir()
    if bin_dir is None:
        raise RuntimeError(unavailable())
    prefix = _as_server_user()
    root = tempfile.mkdtemp(prefix="gpumix-pg-")
    data, sock = os.path.join(root, "data"), os.path.join(root, "sock")
    os.makedirs(sock)
    if prefix:
        uid = pwd.getpwnam(PG_USER)
        for path in (root, sock):
            os.chown(path, uid.pw_uid, uid.pw_gid)
    port = free_port()
    log = os.path.join(root, "server.log")
    subprocess.run(prefix + [f"{bin_dir}/initdb", "-D", data, "-U", PG_USER, "-A", "trust", "--no-sync",
                             "-E", "UTF8", "--locale", "C"],
                   check=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, timeout=START_TIMEOUT_S)
    # the unix socket in our own folder, TCP on localhost only
    options = f"-p {port} -k {sock} -c listen_addresses=127.0.0.1"
    if not durable:
        options += " -c fsync=off -c full_page_writes=off"
    try:
        subprocess.run(prefix + [f"{bin_dir}/pg_ctl", "-D", data, "-l", log, "-o", options, "-w",
                                 "-t", str(START_TIMEOUT_S), "start"],
                       check=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, timeout=START_TIMEOUT_S + 10)
        yield PostgresServer(port, bin_dir)
    finally:
        subprocess.run(prefix + [f"{bin_dir}/pg_ctl", "-D", data, "-m", "immediate", "-w", "stop"],
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=START_TIMEOUT_S)
        with contextlib.suppress(TimeoutError):  # a server that outlives this is removed with its folder
            wait_until(lambda: not os.path.exists(os.path.join(data, "postmaster.pid")), 10, "PostgreSQL to stop",
                       interval_s=0.1)
        shutil.rmtree(root, ignore_errors=True)


def init_store() -> None:
    """Every part's schema in the store GPUMIX_DB names (what `python -m executor db init` does)."""
    from executor.commands.db import init_all

    init_all()
