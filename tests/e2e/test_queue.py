import socket
import sqlite3

import pytest

from executor.queue import JobQueue
from contracts.paths import queue_db_path


def test_jobs_and_their_states_survive_a_restart(store_backend):
    q = JobQueue()
    a = q.submit("tiny", 8, 5)
    b = q.submit("gpt2", 16, 10, seq=256, priority=1)
    c = q.submit("tiny", 4, 2)
    assert q.mark_running(a, [0, 1], ["cpu", "cpu"], "/runs/a", 4242, 12.5)
    assert q.finish(c, "failed", "boom")
    del q
    q2 = JobQueue()  # a new process would do exactly this
    ja, jb, jc = (q2.get(i) for i in (a, b, c))
    assert (ja.state, ja.devices, ja.run_dir, ja.pid, ja.predicted_duration_s) == ("running", (0, 1), "/runs/a",
                                                                                   4242, 12.5)
    assert ja.started_s >= ja.submitted_s and ja.host == socket.gethostname() and jb.host is None
    assert (jb.state, jb.seq, jb.priority) == ("queued", 256, 1)
    assert (jc.state, jc.reason) == ("failed", "boom") and jc.ended_s is not None
    assert [j.id for j in q2.list(["queued"])] == [b]
    assert q2.get(a).job_spec(origin_s=ja.submitted_s).submit_s == 0.0


def test_the_database_is_in_wal_mode():
    JobQueue()
    with sqlite3.connect(queue_db_path()) as conn:
        assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"


def test_state_changes_are_conditional(store_backend):
    q = JobQueue()
    a = q.submit("tiny", 8, 5)
    assert q.mark_running(a, [0], ["cpu"], "/r", None, None)
    assert not q.mark_running(a, [1], ["cpu"], "/r2", None, None)  # already taken: not twice
    assert not q.cancel(a)  # running: the orchestrator stops it, not the queue
    assert q.finish(a, "done")
    assert not q.finish(a, "failed")  # ended jobs stay ended
    b = q.submit("tiny", 8, 5)
    assert q.cancel(b) and q.get(b).state == "cancelled"


@pytest.mark.parametrize("kwargs, words", [
    (dict(model="nope", global_batch=8, steps=1), "unknown model"),
    (dict(model="tiny", global_batch=0, steps=1), "global batch"),
    (dict(model="tiny", global_batch=8, steps=-1), "steps"),
    (dict(model="tiny", global_batch=8, steps=1, seq=0), "seq"),
])
def test_bad_submissions_raise(store_backend, kwargs, words):
    with pytest.raises(ValueError, match=words):
        JobQueue().submit(**kwargs)


def test_unknown_job_and_state(store_backend):
    q = JobQueue()
    with pytest.raises(ValueError, match="no job 99"):
        q.get(99)
    with pytest.raises(ValueError, match="unknown job states"):
        q.list(["lost"])
    with pytest.raises(ValueError, match="done, failed or cancelled"):
        q.finish(1, "running")


def test_cli_submit_and_queue(store_backend, capsys):
    from executor.__main__ import COMMANDS
    from contracts.cli import main

    assert main("python -m executor", COMMANDS, ["submit", "--model", "tiny", "--global-batch", "8", "--steps",
                                                  "3"]) == 0
    job_id = int(capsys.readouterr().out.strip())
    assert main("python -m executor", COMMANDS, ["queue", "--json"]) == 0
    import json

    jobs = json.loads(capsys.readouterr().out)["jobs"]
    assert [(j["id"], j["state"], j["model"]) for j in jobs] == [(job_id, "queued", "tiny")]
    assert main("python -m executor", COMMANDS, ["submit", "--model", "nope", "--global-batch", "8", "--steps",
                                                  "3"]) == 2
    assert "unknown model" in capsys.readouterr().err
