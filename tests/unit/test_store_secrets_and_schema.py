"""The store never prints a password, re-checks its schema at every connection of a long-lived
process, and `db upgrade` changes no schema under a running run (SQLite; PostgreSQL: tests/e2e)."""
from __future__ import annotations

import os
from contextlib import closing

import pytest

from executor import db
from executor.commands.db import status_all, upgrade_all
from executor.store import RUNS, MetricsStore, read_run_row
from testkit.runs import fabricate_run

SECRET = "s3cr3t-pw"


@pytest.mark.parametrize("url", [
    f"postgresql://alice:{SECRET}@127.0.0.1:1/gpumix",
    f"postgresql://alice@127.0.0.1:1/gpumix?password={SECRET}",
    f"postgresql://alice@127.0.0.1:1/gpumix?sslmode=disable&password={SECRET}",
    f"postgres://alice:{SECRET}@127.0.0.1:1/gpumix?password={SECRET}&connect_timeout=1",
])
def test_a_postgresql_password_is_never_in_a_message(url, monkeypatch, data_dir):
    described = db.parse_url(url).describe()
    assert SECRET not in described and "***" in described and "alice" in described
    monkeypatch.setenv(db.ENV_DB, url)
    with pytest.raises(ValueError) as e:  # nothing listens on port 1: `db status` fails naming the store
        status_all()
    assert SECRET not in str(e.value) and "127.0.0.1:1" in str(e.value)


def test_a_bad_store_url_is_refused_without_its_password(monkeypatch):
    for url in (f"mysql://bob:{SECRET}@host/db", f"mysql://bob@host/db?password={SECRET}"):
        with pytest.raises(ValueError, match="expected sqlite:///") as e:
            db.parse_url(url)
        assert SECRET not in str(e.value)


def test_a_driver_message_quoting_a_password_is_masked():
    err = RuntimeError(f"could not connect to postgresql://u:{SECRET}@h/db as password={SECRET} said\nmore")
    assert db.error_line(err) == "could not connect to postgresql://u:***@h/db as password=*** said"


def test_a_shared_store_changed_under_a_long_lived_process_is_refused_at_its_next_connection(
        tmp_path, monkeypatch, data_dir):
    monkeypatch.setenv(db.ENV_DB, f"sqlite:///{tmp_path / 'shared.sqlite'}")
    url = db.configured()
    with closing(db.Database(url, "setup")) as conn:
        db.init(conn, RUNS)
    db.connect(url, RUNS, "run store").close()  # this process has found it at its version
    with closing(db.Database(url, "another GPUMix")) as conn:  # upgraded by a newer GPUMix meanwhile
        conn.execute("UPDATE gpumix_schema SET version = ? WHERE part = 'runs'", (db.SCHEMA_VERSION + 1,))
    with pytest.raises(ValueError, match=r"run store .* has schema version 2 \(runs\), newer than this GPUMix's 1"):
        db.connect(url, RUNS, "run store")
    with closing(db.Database(url, "another GPUMix")) as conn:  # or taken back to an older one
        conn.execute("UPDATE gpumix_schema SET version = 0 WHERE part = 'runs'")
    with pytest.raises(ValueError, match="`python -m executor db upgrade`"):
        db.connect(url, RUNS, "run store", readonly=True)
    with closing(db.Database(url, "another GPUMix")) as conn:
        conn.execute("UPDATE gpumix_schema SET version = ? WHERE part = 'runs'", (db.SCHEMA_VERSION,))
    db.connect(url, RUNS, "run store").close()  # at this version again: accepted


def test_db_upgrade_is_refused_while_a_run_is_running_and_allowed_after(data_dir):
    live = fabricate_run("live", 2, None)  # running: its launcher is this process
    with pytest.raises(ValueError, match=r"run store .*metrics.sqlite: run .* is running; `python -m executor db "
                                         r"upgrade` changes a schema only while no run is"):
        upgrade_all()
    store = MetricsStore(live)
    store.finish("done")
    store.close()
    assert any("run store" in line and "at schema version 1 already" in line for line in upgrade_all())
    assert read_run_row(live)["status"] == "done"


def test_the_upgrade_checks_again_inside_its_own_transaction(data_dir):
    """A run that starts after the first look is still seen: the guard runs under the write lock."""
    live = fabricate_run("late", 1, None)
    conn = db.Database(db.StoreURL("sqlite", os.path.join(live, "metrics.sqlite"), False), "run store")
    seen = []

    def guard(c):
        seen.append(c.conn.in_transaction)
        from executor.commands.db import refuse_running
        refuse_running(c)

    with closing(conn), pytest.raises(ValueError, match="is running"):
        db.upgrade(conn, RUNS, guard)
    assert seen == [True]
