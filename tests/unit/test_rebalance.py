"""The live split's re-solve (executor/rebalance.py): exact on hand-solved instances, memory honoured,
the coarse unit, the decision's gates, and a plan's `rebalance` field."""
from __future__ import annotations

import itertools

import pytest

from contracts.cluster import ClusterSpec, DeviceSpec, NodeSpec
from contracts.plan import Assignment, Plan
from executor.rebalance import (MIN_GAIN, Rebalancer, best_pieces, kind_rates, solve_coarse_split, solve_split)

MBS = [1, 2, 4, 8]


def linear(scale: float, alpha: float = 0.0, beta: float = 1.0):
    """compute_s(m, n) = scale × n × (α + β m)."""
    return lambda m, n: scale * n * (alpha + beta * m)


def table(scale: float, batch: int, alpha: float = 0.0, fits=lambda m, n: True):
    return best_pieces(linear(scale, alpha), fits, batch, MBS)


def brute_force(batch: int, tables) -> float:
    """The least slowest-rank compute over every split (each rank >= 1 sample)."""
    best = float("inf")
    for bs in itertools.product(range(1, batch + 1), repeat=len(tables)):
        if sum(bs) == batch and all(t[b] is not None for t, b in zip(tables, bs)):
            best = min(best, max(t[b][0] for t, b in zip(tables, bs)))
    return best


def test_a_rank_three_times_slower_gets_a_quarter_of_the_batch():
    r = solve_split(16, [table(1.0, 16), table(3.0, 16)], current=[8, 8])
    assert r.batches == [12, 4] and r.makespan_s == pytest.approx(12.0)
    assert r.pieces == ((4, 3), (4, 1)) or r.pieces[0][0] * r.pieces[0][1] == 12


@pytest.mark.parametrize("scales,alpha", [((1.0, 2.0, 3.0), 0.0), ((1.0, 1.3, 0.7), 0.5), ((2.0, 1.0), 3.0)])
def test_the_split_is_exact_against_brute_force(scales, alpha):
    batch = 13
    tables = [table(s, batch, alpha) for s in scales]
    r = solve_split(batch, tables)
    assert sum(r.batches) == batch
    assert r.makespan_s == pytest.approx(brute_force(batch, tables))


def test_equal_rates_keep_the_current_split():
    r = solve_split(16, [table(1.0, 16), table(1.0, 16)], current=[8, 8])
    assert r.batches == [8, 8]


def test_memory_bounds_each_rank_even_when_it_is_fastest():
    """The fast rank fits at most 4 samples at a time and 2 micro-batches (its memory model)."""
    small = table(0.1, 16, fits=lambda m, n: m <= 4 and n <= 2)
    r = solve_split(16, [small, table(1.0, 16)])
    assert r.batches[0] <= 8 and sum(r.batches) == 16
    assert all(m <= 4 and n <= 2 for m, n in r.pieces[:1])
    with pytest.raises(ValueError, match="cannot take the global batch"):
        solve_split(16, [table(1.0, 16, fits=lambda m, n: m * n <= 4), table(1.0, 16, fits=lambda m, n: m * n <= 4)])
    with pytest.raises(ValueError, match="fits no batch"):
        solve_split(16, [table(1.0, 16, fits=lambda m, n: False), table(1.0, 16)])


def test_the_coarse_unit_keeps_micro_batches_large_when_nearly_as_fast():
    """Rates 1 : 2.8: the finest split is 21/11 (odd: micro-batches of 1 under a real α); in multiples
    of 8 the split 24/8 is within the tolerance, so it is taken."""
    tables = [table(1.0, 32, alpha=0.0), table(2.8, 32, alpha=0.0)]
    fine = solve_split(32, tables)
    coarse = solve_coarse_split(32, tables, [16, 16], max_unit=8)
    assert coarse.batches == [24, 8]
    assert coarse.makespan_s <= fine.makespan_s * 1.05 + 1e-12


def rebalancer(global_batch: int = 16, **kw) -> Rebalancer:
    kw.setdefault("window", 3)
    return Rebalancer(global_batch, [(4, 2), (4, 2)], ["a", "b"], compute_s=lambda i, m, n: n * (0.01 + 0.01 * m),
                      fits=lambda i, m, n: True, micro_batches=MBS, **kw)


def test_a_departure_for_the_window_gives_one_new_split_from_the_next_step():
    rb = rebalancer()
    pred = rb.predicted()
    assert pred == [pytest.approx(0.1), pytest.approx(0.1)]
    for step in (1, 2, 3):  # both ranks 2x their profile: no departure between them
        assert rb.observe(step, [0.2, 0.2], 0.25) is None
    decisions = [rb.observe(step, [0.2, 0.6], 0.65) for step in (4, 5, 6)]  # step: slowest compute + 0.05 s
    # the window's median departs at step 5 (2 of its 3 steps); the split is solved on 3 steps since
    assert decisions[:2] == [None, None] and decisions[2] is not None
    d = decisions[2]
    assert d.step == 7 and sum(m * n for m, n in d.pieces) == 16
    assert d.detail["new_split"][0]["batch"] > d.detail["new_split"][1]["batch"]
    assert [r["batch"] for r in d.detail["old_split"]] == [8, 8]
    assert "rank 1" in d.detail["reason"] and "slower" in d.detail["reason"]
    assert d.detail["predicted_step_s"] < (1 - MIN_GAIN) * d.detail["predicted_step_s_before"]
    assert rb.observe(7, [0.2, 0.6], 0.65) is None  # the new split's first step is skipped
    # the same rates on the new split (2x and 6x its profile): no departure from what it assumes
    pred = rb.predicted()
    computes = [2 * pred[0], 6 * pred[1]]
    # faster than the 0.65 s measured before it: kept with the rates measured on it, nothing moves again
    assert all(rb.observe(s, computes, max(computes) + 0.05) is None for s in range(8, 20))
    assert rb.changes == 1 and rb.trial is None and rb.assumed == pytest.approx([2.0, 6.0])


def test_a_new_split_not_worth_min_gain_is_not_applied():
    rb = rebalancer(global_batch=2, min_gain=0.5)
    rb.pieces = [(1, 1), (1, 1)]
    assert all(rb.observe(s, [0.02, 0.05], 0.06) is None for s in (1, 2, 3))  # 1/1 is the only split
    assert rb.pieces == [(1, 1), (1, 1)] and rb.changes == 0


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="threshold"):
        rebalancer(threshold=0.9)


def test_kind_rates_are_the_median_over_the_kinds_ranks():
    assert kind_rates(["a", "b", "a", "a"], [1.0, 2.0, 3.0, 5.0]) == {"a": 3.0, "b": 2.0}


def test_the_plan_carries_rebalance_auto_by_default_and_refuses_others():
    cluster = ClusterSpec("c", (NodeSpec("n0", "dc", (DeviceSpec("cpu"), DeviceSpec("cpu"))),))
    asg = tuple(Assignment(i, "n0", "cpu", 2, 1, 2, 0.5, 0, 0.0) for i in range(2))
    plan = Plan(cluster, "tiny", 4, 32, "fp32", "none", asg, 0.1, 40.0)
    assert plan.rebalance == "auto" and plan.to_dict()["rebalance"] == "auto"
    d = plan.to_dict()
    del d["rebalance"]  # a plan file written before the field
    assert Plan.from_dict(d).rebalance == "auto"
    assert Plan.from_dict(dict(d, rebalance="off")).rebalance == "off"
    with pytest.raises(ValueError, match="rebalance must be one of auto, off"):
        Plan.from_dict(dict(d, rebalance="sometimes"))


def _rank_0_at(rate: float, rb: Rebalancer, step: int):
    """One step with rank 0 at `rate` × its profile, rank 1 at 1x, the step the slower one + 0.05 s."""
    pred = rb.predicted()
    computes = [rate * pred[0], pred[1]]
    return rb.observe(step, computes, max(computes) + 0.05)


def _slow_rank_0(rb: Rebalancer, steps) -> list:
    """Rank 0 at 3x its profile over `steps` (`_rank_0_at`)."""
    return [_rank_0_at(3.0, rb, step) for step in steps]


def test_a_profile_error_at_the_new_shapes_is_measured_not_read_as_a_departure():
    """The new split's first window measures every rank's rate on its own shapes: rank 0 reading
    3.3x its profile there instead of 3x (the profile's error at the new micro-batches, not a change
    of speed) moves nothing once the trial measured faster."""
    rb = rebalancer()
    first = _slow_rank_0(rb, (1, 2, 3))
    assert first[-1] is not None and rb.changes == 1 and rb.trial is not None
    assert first[-1].detail["new_split"][0]["batch"] < 8
    rb.observe(4, [1.0, 1.0], 9.9)  # the new split's first step: skipped
    pred = rb.predicted()
    computes = [3.3 * pred[0], pred[1]]
    for step in range(5, 20):  # faster than the 0.35 s before it: kept at the rates measured on it
        assert rb.observe(step, computes, max(computes) + 0.05) is None
    assert rb.trial is None and rb.assumed[0] == pytest.approx(3.3) and rb.changes == 1


def test_a_trial_split_measured_slower_is_undone():
    rb = rebalancer()
    old = list(rb.pieces)
    d = _slow_rank_0(rb, (1, 2, 3))[-1]
    before = d.detail["measured_step_s_before"]
    assert before == pytest.approx(0.35)
    rb.observe(4, [1.0, 1.0], 9.9)
    pred = rb.predicted()
    back = [rb.observe(step, [pred[0], pred[1]], before * 1.2) for step in (5, 6, 7)]
    assert back[:2] == [None, None] and back[2] is not None
    assert list(back[2].pieces) == old and rb.pieces == old and rb.changes == 2
    assert back[2].detail["undone"] and "back to that split" in back[2].detail["reason"]
    assert rb.assumed == pytest.approx([3.0, 1.0])  # the rates measured on that split
    # the old split at the speeds that made it: no departure, nothing moves again
    assert all(x is None for x in _slow_rank_0(rb, range(8, 20)))
    assert rb.changes == 2


def test_a_trial_measured_slower_than_a_yardstick_taken_before_a_further_slowdown_is_kept():
    """The split before was measured while rank 0 was 3x its profile; during the trial it slowed to
    8x. The trial measures slower than that yardstick, but at the rates measured on it the split
    before prices MIN_GAIN slower still: kept and re-solved, not undone."""
    rb = rebalancer()
    old = list(rb.pieces)
    d = _slow_rank_0(rb, (1, 2, 3))[-1]
    before = d.detail["measured_step_s_before"]
    rb.observe(4, [1.0, 1.0], 9.9)
    pred = rb.predicted()
    computes = [8 * pred[0], pred[1]]
    assert max(computes) + 0.05 > before  # slower than the yardstick
    judged = [rb.observe(step, computes, max(computes) + 0.05) for step in (5, 6, 7)]
    assert judged[:2] == [None, None] and judged[2] is not None
    assert not judged[2].detail.get("undone") and "the speeds changed" in judged[2].detail["reason"]
    assert rb.pieces != old and rb.assumed[0] == pytest.approx(8.0)
    # re-solved for 8x: rank 0 takes fewer samples still (0.85 s priced for the split before, 0.45 s this one)
    assert judged[2].detail["new_split"][0]["batch"] < d.detail["new_split"][0]["batch"]


def test_a_kept_trial_is_re_solved_on_the_rates_measured_on_it():
    """The rates measured on the new split (rank 0 at 5x its profile there, the window before saw 3x:
    a slowdown still growing) re-solve the split once more, a trial of its own; the rates and the step
    the decision must beat are the steps since the rank departed (3 of them: the decision waits for
    the third)."""
    rb = rebalancer(window=4)
    for step in (1, 2):
        assert rb.observe(step, [0.1, 0.1], 0.15) is None
    slow = _slow_rank_0(rb, (3, 4, 5))
    assert slow[:2] == [None, None]  # at step 4 the window departs with 2 steps since: one more
    d = slow[2]
    assert d is not None and d.detail["rates_vs_profile"] == [3.0, 1.0]  # steps 3-5, not the window's 2x
    assert d.detail["measured_step_s_before"] == pytest.approx(0.35)
    first = d.detail["new_split"][0]["batch"]
    rb.observe(6, [1.0, 1.0], 9.9)
    pred = rb.predicted()
    computes = [5 * pred[0], pred[1]]
    again = [rb.observe(s, computes, max(computes) + 0.05) for s in (7, 8, 9, 10)]
    assert again[:3] == [None] * 3 and again[3] is not None  # 0.30 s measured, 0.35 s before: kept
    assert again[3].detail["rates_vs_profile"] == [5.0, 1.0] and again[3].detail["new_split"][0]["batch"] < first
    assert "re-solved with the rates measured on it" in again[3].detail["reason"] and rb.changes == 2


def test_no_new_split_is_tried_where_its_window_would_end_after_the_last_step():
    """The departure of the first test, decided at step 6: a split from step 7 is judged on steps 8-10
    (window 3, its first step skipped), so it is tried with a last step of 10 and not with 9."""
    def decisions(last_step: int | None) -> list:
        rb = rebalancer(last_step=last_step)
        for step in (1, 2, 3):
            assert rb.observe(step, [0.2, 0.2], 0.25) is None
        return [rb.observe(step, [0.2, 0.6], 0.65) for step in (4, 5, 6)]

    assert decisions(10)[2] is not None and decisions(None)[2] is not None
    assert decisions(9) == [None, None, None]
    rb = rebalancer(last_step=9)
    assert rb.judgeable_from(6) and not rb.judgeable_from(7)


def test_the_step_s_non_compute_time_is_the_same_for_every_rank():
    """The slowest rank's step time beyond its compute (0.65 - 0.6 s) is every rank's: the collectives
    are the ranks' together, so a rank slowed 3x is not charged them 3x, and the split balances compute."""
    rb = rebalancer()
    for step in (1, 2, 3):
        assert rb.observe(step, [0.2, 0.2], 0.25) is None
    d = [rb.observe(step, [0.2, 0.6], 0.65) for step in (4, 5, 6)][2]
    assert d.detail["overhead_s"] == [pytest.approx(0.05), pytest.approx(0.05)]
    assert d.detail["predicted_step_s"] == pytest.approx(max(d.detail["predicted_compute_s"]) + 0.05, abs=1e-5)


def test_a_slowdown_that_began_inside_the_window_is_solved_at_its_whole_speed():
    """Rank 0 slowed to 3x from the window's second step, read in part there (2x: the quota changed
    mid-step): the whole window's median (2.5x) says it departed, and the split is solved at the median
    of the steps since (3x), the split a window wholly after the change gives (solved at the straddled
    2.5x, it would be re-solved only after its own trial window); its trial is kept and nothing moves
    again."""
    rb = rebalancer(global_batch=32, window=4)
    rb.pieces = [(8, 2), (8, 2)]
    assert _rank_0_at(1.0, rb, 1) is None and _rank_0_at(2.0, rb, 2) is None and _rank_0_at(3.0, rb, 3) is None
    d = _rank_0_at(3.0, rb, 4)
    assert d is not None and d.detail["rates_vs_profile"] == [3.0, 1.0]
    whole = Rebalancer(32, [(8, 2), (8, 2)], ["a", "b"], compute_s=rb.compute_s, fits=rb.fits, micro_batches=MBS,
                       window=4)
    wd = [_rank_0_at(3.0, whole, s) for s in (1, 2, 3, 4)][-1]
    assert wd is not None and list(d.pieces) == list(wd.pieces)
    rb.observe(5, [1.0, 1.0], 9.9)  # the new split's first step: skipped
    assert all(_rank_0_at(3.0, rb, s) is None for s in range(6, 30))
    assert rb.changes == 1 and rb.trial is None


def test_one_disturbed_step_since_the_departure_does_not_set_the_rates():
    """Rank 0 slowed to 3x, and one step of the three since read 9x (a disturbance of a shared
    machine): the split is solved at their median, 3x, not at a mean the one step would pull to 5x."""
    rb = rebalancer(global_batch=32, window=4)
    rb.pieces = [(8, 2), (8, 2)]
    assert [_rank_0_at(r, rb, s) for s, r in ((1, 1.0), (2, 3.0), (3, 3.0))] == [None, None, None]
    d = _rank_0_at(9.0, rb, 4)
    assert d is not None and d.detail["rates_vs_profile"] == [3.0, 1.0]
