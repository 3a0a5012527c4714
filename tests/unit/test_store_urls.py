"""The store's URLs and schema reads without a server: a password never appears in a message, a schema
committed between the version reads is never read as version 0 (the backends:
tests/e2e/test_store_backends.py)."""
from __future__ import annotations

import pytest

from executor import booking, db


def test_a_password_never_appears_in_a_message():
    u = db.parse_url("postgresql://alice:s3cret@db.example:5432/gpumix")
    assert "s3cret" not in u.describe() and "alice:***@db.example" in u.describe()
    assert db.parse_url("sqlite:////tmp/x.sqlite").target == "/tmp/x.sqlite"
    with pytest.raises(ValueError, match="sqlite:///<path"):
        db.parse_url("sqlite://")


def test_a_schema_committed_between_the_version_reads_is_never_read_as_version_0(tmp_path):
    """CI once saw a racer refuse a fresh ledger as "schema version 0": it read "no version
    table", then another process committed the schema, then it read "the tables exist". Here
    that commit is made to land between the reads, deterministically."""
    url = db.StoreURL("sqlite", str(tmp_path / "bookings.sqlite"), False)
    reader, writer = db.Database(url, "booking ledger"), db.Database(url, "booking ledger")
    real, calls = reader.has_table, []

    def has_table(name):
        found = real(name)
        if not calls:  # right after the first read, the other process commits the fresh schema
            db.init(writer, booking.BOOKINGS)
        calls.append(name)
        return found

    reader.has_table = has_table
    try:
        assert db.stored_version(reader, booking.BOOKINGS) == db.SCHEMA_VERSION
        assert len(calls) >= 2  # the commit did land between two reads
    finally:
        reader.close()
        writer.close()
