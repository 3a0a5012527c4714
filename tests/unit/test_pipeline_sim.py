"""The discrete-event pipeline simulator against hand-checked pipelines and link arithmetic."""
import pytest

from planner.geo.pipeline_sim import Channel, PipelineJob, Stage, simulate_pipeline, stage_order

FREE = Channel("free", 0.0, 1e9, 1e9)  # a zero-cost boundary


def job(p, m, schedule="1f1b", d=1, f=1.0, b=2.0, hops=None, channels=(FREE,), nbytes=0.0, order="fifo"):
    return PipelineJob(tuple(Stage(f, b) for _ in range(p)), tuple(hops or ["free"] * (p - 1)), channels,
                       d, m, nbytes, schedule, order)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("p,m", [(2, 1), (3, 5), (4, 8), (5, 16)])
def test_bubble_fraction_matches_formula(schedule, p, m):
    r = simulate_pipeline(job(p, m, schedule))
    assert r.bubble_fraction() == pytest.approx((p - 1) / (m + p - 1))
    assert r.iteration_s == pytest.approx((m + p - 1) * 3.0)  # (m + p - 1) slots of f + b


def test_1f1b_order_warmup_and_dependencies():
    p, m = 4, 6
    for j in range(p):
        order = stage_order("1f1b", j, p, m)
        assert sorted(order) == sorted([("F", i) for i in range(m)] + [("B", i) for i in range(m)])
        assert order[: p - j - 1] == [("F", i) for i in range(p - j - 1)]  # warm-up forwards
        for i in range(m):
            assert order.index(("F", i)) < order.index(("B", i))
    r = simulate_pipeline(job(p, m))
    ops = r.training_ops()
    for i in range(m):  # data dependencies hold in the timeline
        for j in range(1, p):
            assert ops[(0, j, "F", i)][0] >= ops[(0, j - 1, "F", i)][1] - 1e-12
            assert ops[(0, j - 1, "B", i)][0] >= ops[(0, j, "B", i)][1] - 1e-12


def wan(sharing, per_transfer, cap=1.0, latency=0.05):
    return Channel("wan", latency, per_transfer, cap, sharing)


def test_single_transfer_time_is_latency_plus_bytes_over_rate():
    # 2 stages of zero compute, one micro-batch: F crosses, B crosses back
    nbytes = 12.5e6  # 0.1 Gbit: 0.1 s at 1 Gbit/s
    r = simulate_pipeline(job(2, 1, f=0.0, b=0.0, hops=["wan"], channels=(wan("temporal", 1.0),), nbytes=nbytes))
    fwd = [t for t in r.transfers if t.direction == "fwd"][0]
    assert fwd.end_s - fwd.start_s == pytest.approx(0.05 + 0.1)
    assert r.iteration_s == pytest.approx(2 * (0.05 + 0.1))


def test_temporal_sharing_serialises_and_fair_sharing_splits():
    nbytes = 12.5e6  # 0.1 s alone at 1 Gbit/s
    kw = dict(p=2, m=1, d=2, f=0.0, b=0.0, hops=["wan"], nbytes=nbytes)
    temporal = simulate_pipeline(job(**kw, channels=(wan("temporal", 1.0),)))
    ends = sorted(t.end_s for t in temporal.transfers if t.direction == "fwd")
    assert ends == pytest.approx([0.15, 0.25])  # one after the other, each at the full rate
    fair = simulate_pipeline(job(**kw, channels=(wan("fair", 1.0),)))
    ends = sorted(t.end_s for t in fair.transfers if t.direction == "fwd")
    assert ends == pytest.approx([0.25, 0.25])  # both at half the rate, finishing together
    # fair sharing with one slow connection each: the per-connection cap binds, not the link
    capped = simulate_pipeline(job(**kw, channels=(wan("fair", 0.25),)))
    ends = sorted(t.end_s for t in capped.transfers if t.direction == "fwd")
    assert ends == pytest.approx([0.05 + 0.4, 0.05 + 0.4])


def test_link_order_pipeline_priority_lets_lower_pipeline_go_first():
    nbytes = 12.5e6
    kw = dict(p=2, m=2, d=2, f=0.01, b=0.02, hops=["wan"], nbytes=nbytes, channels=(wan("temporal", 1.0),))
    prio = simulate_pipeline(job(**kw, order="pipeline"))
    fwd = sorted((t.start_s, t.pipeline) for t in prio.transfers if t.direction == "fwd")
    assert [pl for _, pl in fwd][:2] == [0, 0]  # pipeline 0's two activations before pipeline 1's
    fifo = simulate_pipeline(job(**kw, order="fifo"))
    assert fifo.iteration_s > 0 and prio.iteration_s > 0


def test_wan_utilization_counts_bits_over_capacity_and_time():
    r = simulate_pipeline(job(2, 4, d=2, f=0.01, b=0.02, hops=["wan"], channels=(wan("temporal", 1.0),),
                              nbytes=12.5e6))
    util = r.channel_utilization()
    assert util["wan/fwd"] == pytest.approx(8 * 0.1 / r.iteration_s)
    assert 0 < util["wan/bwd"] <= 1


def test_reserved_interval_delays_an_overlapping_op_and_not_others():
    base = simulate_pipeline(job(2, 2))
    f0 = base.training_ops()[(0, 0, "F", 0)]
    moved = simulate_pipeline(job(2, 2), {(0, 0): [(0.0, 0.5)]})
    assert moved.training_ops()[(0, 0, "F", 0)][0] == pytest.approx(f0[0] + 0.5)
    far = simulate_pipeline(job(2, 2), {(0, 0): [(1e6, 1e6 + 1)]})
    assert far.training_ops() == base.training_ops()


def test_identical_pipelines_shortcut_equals_full_simulation():
    j = PipelineJob((Stage(0.1, 0.2, allreduce_s=0.05), Stage(0.15, 0.3, allreduce_s=0.05)), ("lan",),
                    (Channel("lan", 1e-5, 100, 100),), 3, 5, 1e6)
    short = simulate_pipeline(j)  # dedicated links: one pipeline simulated, copied
    full = simulate_pipeline(j, {(0, 0): [(1e6, 1e6 + 1)]})  # a reservation forces the full simulation
    assert short.iteration_s == pytest.approx(full.iteration_s)
    assert short.training_ops() == pytest.approx(full.training_ops())
    assert sum(1 for o in short.ops if o.kind == "AR") == 6


def test_bad_jobs_are_refused():
    with pytest.raises(ValueError, match="hops"):
        PipelineJob((Stage(1, 2), Stage(1, 2)), (), (FREE,), 1, 1, 0.0)
    with pytest.raises(ValueError, match="unknown channel"):
        PipelineJob((Stage(1, 2), Stage(1, 2)), ("nope",), (FREE,), 1, 1, 0.0)
    with pytest.raises(ValueError, match="sharing"):
        Channel("x", 0.0, 1.0, 1.0, "round-robin")


def test_collectives_then_optimizer_step_end_the_iteration():
    # 2 pipelines × 2 stages, one micro-batch, f = 1, b = 2: the backward ends at 4 s on stage 1, 6 s on stage 0
    j = PipelineJob((Stage(1.0, 2.0, 0.5, "s0", 0.25), Stage(1.0, 2.0, 0.5, "s1", 0.25)), ("free",), (FREE,),
                    2, 1, 0.0)
    r = simulate_pipeline(j)
    assert r.iteration_s == pytest.approx(6.0 + 0.5 + 0.25)
    steps = sorted((o.stage, o.pipeline, o.start_s, o.end_s) for o in r.step_ops)
    assert steps == [(0, 0, 6.5, 6.75), (0, 1, 6.5, 6.75), (1, 0, 4.5, 4.75), (1, 1, 4.5, 4.75)]
    assert all(o.kind == "OPT" for o in r.step_ops) and all(o.kind != "OPT" for o in r.ops)
    assert (0, 0, "OPT", -1) in r.training_ops()
    assert r.idle_intervals(0, 1)[-1] == (4.75, 6.75)  # the optimizer step is not idle time


def test_runtime_step_posts_each_receive_one_op_ahead():
    """models/pipeline.py's rule by hand: 2 stages, 1F1B, 2 micro-batches, f = 1, b = 2, a 0.5 s transfer
    that moves only once its receive is posted. Stage 1 posts micro-batch 1's input when its backward 0
    starts (t = 2.5, not when forward 1 starts at 4.5), so that transfer overlaps backward 0; stage 0
    posts gradient 0 at forward 1 (t = 1) and gradient 1 at backward 0 (t = 5). Iteration 10.0 s (posting
    at the op that needs the receive: 10.5 s, forward 1 of stage 1 at 5.0)."""
    lan = Channel("lan", 0.0, 8e-9 / 0.5, 1.0)  # 1 byte in 0.5 s
    r = simulate_pipeline(PipelineJob((Stage(1.0, 2.0), Stage(1.0, 2.0)), ("lan",), (lan,), 1, 2, 1.0, "1f1b",
                                      runtime_step=True))
    ops = r.training_ops()
    fwd1 = next(t for t in r.transfers if t.direction == "fwd" and t.microbatch == 1)
    assert (fwd1.ready_s, fwd1.start_s, fwd1.end_s) == pytest.approx((2.5, 2.5, 3.0))
    assert ops[(0, 1, "F", 1)] == pytest.approx((4.5, 5.5))
    assert ops[(0, 0, "B", 0)] == pytest.approx((5.0, 7.0)) and ops[(0, 0, "B", 1)] == pytest.approx((8.0, 10.0))
    assert r.iteration_s == pytest.approx(10.0)
    fwd0 = next(t for t in r.transfers if t.direction == "fwd" and t.microbatch == 0)
    assert fwd1.posted_s == pytest.approx(2.5) and fwd0.posted_s == 0.0  # stage 1's first op posts its own
