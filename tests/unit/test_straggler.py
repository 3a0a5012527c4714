"""The straggler detector (executor/straggler.py) and how the store reports it (executor/store.py)."""
from __future__ import annotations

import pytest

from executor.straggler import (CLEAR_THRESHOLD, SLOWDOWN_THRESHOLD, WINDOW_STEPS, StragglerDetector, slowdowns,
                                straggler_cost_s)
from executor.store import _event, encode_step_event, straggler_of

DEVICES = ["cpu@share1 (device 0 on n0)", "cpu@share0.5 (device 1 on n0)", "cpu@share1 (device 2 on n0)"]
PREDICTED = [0.10, 0.20, 0.10]  # the profile's compute of each rank's micro-batches


def feed(det: StragglerDetector, first: int, last: int, factors: list[float], common: float = 1.0):
    """Steps first..last with measured compute = predicted × common × factor; the changes returned."""
    out = []
    for step in range(first, last + 1):
        change = det.observe(step, [p * common * f for p, f in zip(PREDICTED, factors)], PREDICTED)
        if change is not None:
            out.append((step, *change))
    return out


def test_slowdown_is_against_the_median_of_the_other_ranks():
    assert slowdowns([1.0, 3.0, 1.0]) == [pytest.approx(0.5), pytest.approx(3.0), pytest.approx(0.5)]
    assert slowdowns([2.0, 2.0]) == [1.0, 1.0]  # a profile off for every rank alike names no one
    assert slowdowns([5.0]) == [1.0]


def test_a_rank_slowed_three_times_is_named_within_the_window_with_its_cost():
    det = StragglerDetector(DEVICES)
    # the profiles are all 1.7x optimistic (a busy machine): no straggler
    assert feed(det, 1, 10, [1, 1, 1], common=1.7) == []
    changes = feed(det, 11, 20, [1, 3, 1], common=1.7)
    assert changes[0][:2] == (10 + WINDOW_STEPS - 1, "named"), changes  # named after 2 of 3 slow steps
    s = changes[0][2]
    assert (s.rank, s.device, s.since_step) == (1, DEVICES[1], 11)
    assert s.slowdown == pytest.approx(3.0)
    assert s.compute_vs_profile == pytest.approx(3 * 1.7)
    # its compute 0.2*1.7*3 = 1.02 s; at the others' pace 0.34 s; the slowest other 0.17 s: 0.68 s waited
    assert s.cost_s == pytest.approx(0.2 * 1.7 * 3 - 0.2 * 1.7)
    assert len(changes) == 1  # named once while it lasts
    cleared = feed(det, 21, 30, [1, 1, 1], common=1.7)
    assert [c[1] for c in cleared] == ["cleared"] and cleared[0][2].rank == 1


def test_below_the_threshold_or_a_single_slow_step_names_no_one():
    det = StragglerDetector(DEVICES)
    assert feed(det, 1, 10, [1, SLOWDOWN_THRESHOLD * 0.95, 1]) == []
    det = StragglerDetector(DEVICES)
    assert feed(det, 1, 3, [1, 1, 1]) + feed(det, 4, 4, [1, 5, 1]) + feed(det, 5, 10, [1, 1, 1]) == []


def test_hysteresis_keeps_the_straggler_between_the_thresholds():
    det = StragglerDetector(DEVICES)
    assert [c[1] for c in feed(det, 1, 5, [1, 2, 1])] == ["named"]
    assert feed(det, 6, 12, [1, (SLOWDOWN_THRESHOLD + CLEAR_THRESHOLD) / 2, 1]) == []
    assert det.current is not None and det.current.rank == 1


def test_a_named_straggler_that_gets_worse_by_the_threshold_is_named_again_from_then():
    det = StragglerDetector(DEVICES)
    first = feed(det, 1, 5, [1, 1.35, 1])  # a mild straggler (noise, or a slightly slow device)
    assert [c[1] for c in first] == ["named"] and first[0][2].slowdown == pytest.approx(1.35)
    assert feed(det, 6, 8, [1, 1.35 * SLOWDOWN_THRESHOLD * 0.95, 1]) == []  # not worse enough: no new event
    again = feed(det, 9, 14, [1, 3, 1])
    assert [(c[0], c[1]) for c in again] == [(10, "named")], again  # the window's median, after 2 of 3 steps
    s = again[0][2]
    assert (s.rank, s.since_step) == (1, 9) and s.slowdown == pytest.approx(3.0)
    assert feed(det, 15, 20, [1, 3, 1]) == []  # named once more, not on every step


def test_the_worse_rank_replaces_the_named_one():
    det = StragglerDetector(DEVICES)
    feed(det, 1, 5, [1.5, 1, 1])
    changes = feed(det, 6, 10, [1, 1, 4])
    assert changes and changes[-1][1] == "named" and changes[-1][2].rank == 2


def test_bad_input_is_refused_or_skipped():
    with pytest.raises(ValueError, match="threshold"):
        StragglerDetector(DEVICES, threshold=1.1, clear_threshold=1.2)
    det = StragglerDetector(DEVICES)
    with pytest.raises(ValueError, match="3 ranks"):
        det.observe(1, [0.1, 0.1], PREDICTED)
    assert det.observe(1, [0.1, None, 0.1], PREDICTED) is None and len(det.history) == 0  # skipped


def test_the_cost_is_never_negative_and_bounded_by_the_others():
    assert straggler_cost_s([1.0, 0.5], 0, 2.0) == 0.5  # twice its pace: what it exceeds its pace and the others
    assert straggler_cost_s([1.0, 0.5], 0, 1.0) == 0.0  # at its own pace it costs nothing
    assert straggler_cost_s([1.0, 2.0], 0, 3.0) == 0.0


def test_the_store_reads_step_events_back_and_the_named_straggler():
    named = _event({"kind": "straggler", "message": encode_step_event(12, {"rank": 1, "slowdown": 3.0}, "rank 1 ...")})
    assert (named["step"], named["detail"]["rank"], named["message"]) == (12, 1, "rank 1 ...")
    plain = _event({"kind": "note", "message": "{not json"})
    assert (plain["step"], plain["detail"], plain["message"]) == (None, "{not json", "{not json")
    end = _event({"kind": "straggler_end", "message": encode_step_event(20, {"rank": 1}, "cleared")})
    assert straggler_of([named]) == {"rank": 1, "slowdown": 3.0}
    assert straggler_of([named, end]) is None
    assert straggler_of([plain]) is None
