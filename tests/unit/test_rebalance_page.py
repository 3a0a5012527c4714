"""What the Launch page shows of a rebalanced run (ui/launch.py): the straggler's line, each rank's
measured compute and wait beside the predicted ones, the timeline of plans and the throughput
chart's marker at each change, from a run store written as a run writes it."""
from __future__ import annotations

import os

import pytest

from executor.live import RunFollower
from executor.store import MetricsStore, RankStep, read_events, read_metrics, straggler_of
from testkit.runs import GLOBAL_BATCH, SEQ, two_cpu_plan

STRAGGLER = {"rank": 1, "device": "cpu@share1 (device 1 on localhost)", "slowdown": 2.9, "since_step": 11,
             "cost_s": 0.21, "compute_vs_profile": 3.1, "step": 13}
REBALANCE = {"reason": "rank 1 on cpu@share1 (device 1 on localhost) measured 2.90x slower than its split assumed",
             "old_split": [{"rank": 0, "batch": 8, "micro_batch": 4, "accum_steps": 2},
                           {"rank": 1, "batch": 8, "micro_batch": 4, "accum_steps": 2}],
             "new_split": [{"rank": 0, "batch": 12, "micro_batch": 4, "accum_steps": 3},
                           {"rank": 1, "batch": 4, "micro_batch": 4, "accum_steps": 1}],
             "predicted_step_s_before": 0.6, "predicted_step_s": 0.35}


@pytest.fixture
def rebalanced_run(data_dir, tmp_path):
    run_dir = str(tmp_path / "run")
    os.makedirs(run_dir)
    plan = two_cpu_plan()
    plan.save(os.path.join(run_dir, "plan.json"))
    store = MetricsStore(run_dir)
    store.init_run(plan, steps_target=30, seed=0, backend="gloo")
    slow = lambda step: 3.0 if 11 <= step < 15 else 1.0  # noqa: E731
    store.record_history([(step, [RankStep(0, 0.1, 0.0, 0.01, 0.1 * (slow(step) - 1), None, None, None, 0.1, 0.0),
                                  RankStep(1, 0.1 * slow(step), 0.0, 0.01, 0.0, None, None, None, 0.1, 0.0)],
                           5.0, 0.1 * slow(step)) for step in range(1, 21)], GLOBAL_BATCH, SEQ)
    store.add_step_event("straggler", 13, STRAGGLER, "rank 1 ... is 2.90x slower", 1)
    store.add_step_event("rebalance", 15, REBALANCE, "rebalance from step 15: batches [8, 8] -> [12, 4]", 0)
    store.add_event("note", "a plain event")
    store.close()
    return run_dir


def test_the_store_gives_the_page_its_events_and_the_metrics_their_figures(rebalanced_run):
    events = read_events(rebalanced_run)
    assert [(e["kind"], e["step"]) for e in events] == [("straggler", 13), ("rebalance", 15)]
    assert straggler_of(events) == STRAGGLER
    m = read_metrics(rebalanced_run)
    assert m["straggler"] == STRAGGLER
    assert [e["detail"] for e in m["events"] if e["kind"] == "note"] == ["a plain event"]
    r1 = next(r for r in m["ranks"] if r["rank"] == 1)
    assert r1["median_predicted_compute_s"] == pytest.approx(0.1) and r1["compute_vs_profile"] == pytest.approx(1.0)


def test_the_page_names_the_straggler_and_draws_the_timeline(rebalanced_run):
    from ui import launch

    line = launch.straggler_line(STRAGGLER)
    assert "rank 1" in line and "cpu@share1 (device 1 on localhost)" in line and "2.90× slower" in line
    assert "since step 11" in line and "210.0 ms" in line
    rows = launch.timeline_rows(launch.run_plan(read_metrics(rebalanced_run)), read_events(rebalanced_run))
    assert [r["change"] for r in rows] == ["plan", "rebalance"]
    assert rows[1]["from step"] == "15" and "rank 0: 12 (4×3), rank 1: 4 (4×1)" == rows[1]["split"]
    assert "slower than its split assumed" in rows[1]["why"]
    m = RunFollower(rebalanced_run).refresh()
    frame = launch.prediction_frame(m)
    assert list(frame["compute (predicted)"]) == ["100.0 ms", "100.0 ms"]
    m["split_changes"] = [{"step": 15, "kind": "rebalance"}]
    _, speed, _, _ = launch.chart_figures(m)
    markers = [s for s in speed["layout"]["shapes"] if s.get("x0") == 15 and s.get("x1") == 15]
    assert len(markers) == 1 and "rebalance" in markers[0]["label"]["text"]
