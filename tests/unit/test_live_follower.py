"""executor.live.RunFollower: a live view of a run whose size does not grow with the run, exact where
it claims to be (counts, peaks, the newest steps, bucket means) and equal to read_metrics on a short run."""
from __future__ import annotations

import pytest

from executor.live import CHART_TAIL_STEPS, HISTORY_BUCKETS, WINDOW_STEPS, RunFollower
from executor.store import MetricsStore, RankStep, read_metrics
from testkit.runs import GLOBAL_BATCH, SEQ, fabricate_run, two_cpu_plan


def loss_of(step: int) -> float:  # linear: a bucket's mean point lies on the line exactly
    return 10.0 - 0.001 * step


def wait_of(rank: int, step: int) -> float:
    return 0.01 * (rank + 1) + 1e-6 * step


def write_steps(store: MetricsStore, first: int, last: int) -> None:
    store.record_history([(step, [RankStep(rank, 0.2, 0.0, 0.01, wait_of(rank, step), 1000 * step + rank)
                                  for rank in (0, 1)], loss_of(step), 0.5) for step in range(first, last + 1)],
                         GLOBAL_BATCH, SEQ)


@pytest.fixture
def long_run(data_dir, tmp_path):
    run_dir = str(tmp_path / "long")
    import os

    os.makedirs(run_dir)
    store = MetricsStore(run_dir)
    store.init_run(two_cpu_plan(), steps_target=10**6, seed=0, backend="gloo")
    yield run_dir, store
    store.close()


def on_the_lines(m) -> None:
    xs, ys = m["history"]["loss"]
    assert ys == pytest.approx([loss_of(x) for x in xs])
    for rank, (wx, wy) in m["history"]["wait_s"].items():
        assert wy == pytest.approx([wait_of(rank, x) for x in wx])


def test_a_short_run_reads_as_read_metrics_does(data_dir):
    run_dir = fabricate_run("short", 30, "done")
    full, view = read_metrics(run_dir), RunFollower(run_dir).refresh()
    assert view["steps"] == full["steps"] and view["steps_recorded"] == 30
    assert view["ranks"] == full["ranks"]
    assert view["history"]["loss"] == ([s["step"] for s in full["steps"]], [s["loss"] for s in full["steps"]])
    assert view["history"]["width"] == 1 and view["events"] == []


def test_a_long_run_is_bounded_and_exact_where_it_says(long_run):
    run_dir, store = long_run
    write_steps(store, 1, 20_000)
    follower = RunFollower(run_dir)
    m = follower.refresh()
    assert m["steps_recorded"] == 20_000
    assert [s["step"] for s in m["steps"]] == list(range(20_001 - WINDOW_STEPS, 20_001))
    assert len(m["rank_steps"]) == 2 * WINDOW_STEPS
    assert [(r["peak_memory_bytes"], r["steps_recorded"]) for r in m["ranks"]] == [(20_000_000, 20_000),
                                                                                 (20_000_001, 20_000)]
    xs, _ = m["history"]["loss"]
    assert len(xs) <= HISTORY_BUCKETS + CHART_TAIL_STEPS and xs[-CHART_TAIL_STEPS:] == list(range(19_951, 20_001))
    assert xs == sorted(xs) and xs[0] <= m["history"]["width"]  # the whole run, oldest first
    assert m["history"]["width"] > 1
    on_the_lines(m)
    # later refreshes take only the new rows, and keep every figure exact and bounded
    for last in (20_003, 20_700, 26_000):
        write_steps(store, follower.last_step + 1, last)
        m = follower.refresh()
        assert m["steps_recorded"] == last and m["steps"][-1]["step"] == last
        assert m["ranks"][1]["peak_memory_bytes"] == 1000 * last + 1 and m["ranks"][0]["steps_recorded"] == last
        assert len(m["history"]["loss"][0]) <= HISTORY_BUCKETS + CHART_TAIL_STEPS
        assert m["history"]["loss"][0][-1] == last
        on_the_lines(m)
    fresh = RunFollower(run_dir).refresh()  # one that read it all at once agrees
    assert fresh["steps"] == m["steps"] and fresh["ranks"] == m["ranks"] and fresh["steps_recorded"] == 26_000


def test_a_relaunch_into_the_folder_starts_the_view_over(long_run):
    run_dir, store = long_run
    write_steps(store, 1, 3_000)
    follower = RunFollower(run_dir)
    assert follower.refresh()["steps_recorded"] == 3_000
    store.init_run(two_cpu_plan(), steps_target=100, seed=1, backend="gloo")  # a new run: rows wiped
    write_steps(store, 1, 7)
    m = follower.refresh()
    assert m["steps_recorded"] == 7 and [s["step"] for s in m["steps"]] == list(range(1, 8))
    assert m["ranks"][0]["peak_memory_bytes"] == 7000
