"""BubbleTea: chunked prefill fills idle compute only, never moves training, respects memory."""
import re

import pytest

from planner.geo.bubbletea import (COMPUTE_KINDS, PrefillPlacement, PrefillResult, SPLIT_CHUNK, UnitTimes,
                                  _peak_tokens, _replica_windows, _simulate, _split_windows, _steady,
                                  compute_idle_gaps, prefill_memory_bytes, prefill_time_s, reservations,
                                  simulate_bubbletea, split_kv_tokens, split_layers, split_memory_bytes,
                                  split_reservations, steady_state_gaps, training_unchanged)
from planner.geo.evaluate import run_prefill
from planner.geo.scenario import GeoScenario, InferenceWorkload
from planner.geo.pipeline_sim import Channel, PipelineJob, Stage, simulate_pipeline
from contracts.specs import get_model
from tests.unit.test_geo import small_dict

GPT2 = get_model("gpt2")
WAN = Channel("wan", 0.03, 1.0, 1.0, "temporal")


def wan_job(d=2, m=6):
    """4 stages, a slow WAN hop in the middle: long bubbles."""
    return PipelineJob(tuple(Stage(0.05, 0.1, 0.01) for _ in range(4)), ("lan", "wan", "lan"),
                       (Channel("lan", 1e-5, 100, 100), WAN), d, m, 12.5e6)


def backlog(tokens=(128, 256, 512)):
    return InferenceWorkload("gpt2", tuple((t, 1 / len(tokens)) for t in tokens), None, True)


def test_prefill_never_moves_a_training_operation():
    sim = simulate_pipeline(wan_job())
    pre = simulate_bubbletea(sim, ["A100-80GB"] * 4, [40 * 2**30] * 4, backlog(), GPT2)
    assert len(pre.placements) > 10  # there is something to check
    reserved, during = split_reservations(pre, sim)
    assert during  # some prefill runs inside a gradient collective (idle compute)
    again = simulate_pipeline(sim.job, reserved)
    assert again.training_ops() == sim.training_ops()
    assert again.iteration_s == sim.iteration_s
    assert training_unchanged(sim, pre)
    assert pre.gpu_utilization_with_prefill() > sim.gpu_utilization()


def test_the_check_catches_prefill_over_a_compute_op():
    # negative controls: a piece over a forward (reserved: it moves) or over a collective and a forward
    sim = simulate_pipeline(wan_job())
    f = next(o for o in sim.ops if o.kind == "F" and o.stage == 2)
    ar = next(o for o in sim.ops if o.kind == "AR")
    bad = PrefillResult(sim.iteration_s, sim.job.num_gpus, 0.0, (2,),
                        [PrefillPlacement(0, 128, f.pipeline, 2, 0.0, f.start_s, f.end_s)])
    assert not training_unchanged(sim, bad)
    prev = max((o for o in sim.ops if (o.pipeline, o.stage) == (ar.pipeline, ar.stage)
                and o.kind in COMPUTE_KINDS and o.end_s <= ar.start_s + 1e-12), key=lambda o: o.end_s)
    over = PrefillResult(sim.iteration_s, sim.job.num_gpus, 0.0, (ar.stage,),
                         [PrefillPlacement(0, 128, ar.pipeline, ar.stage, 0.0, prev.end_s - 1e-3, ar.end_s)])
    assert not training_unchanged(sim, over)
    inside = PrefillResult(sim.iteration_s, sim.job.num_gpus, 0.0, (ar.stage,),
                           [PrefillPlacement(0, 128, ar.pipeline, ar.stage, 0.0, ar.start_s, ar.end_s)])
    assert training_unchanged(sim, inside)


def test_the_comparison_would_catch_a_moved_operation():
    # negative control: a reservation over a training op does change the timeline
    sim = simulate_pipeline(wan_job())
    op = next(o for o in sim.ops if o.kind == "F" and o.stage == 2)
    moved = simulate_pipeline(sim.job, {(op.pipeline, op.stage): [(op.start_s - 0.01, op.start_s + 0.01)]})
    assert moved.training_ops() != sim.training_ops()


def test_pieces_fit_idle_compute_and_never_overlap():
    sim = simulate_pipeline(wan_job())
    pre = simulate_bubbletea(sim, ["A100-80GB"] * 4, [40 * 2**30] * 4, backlog(), GPT2)
    T = sim.iteration_s
    for (r, j), taken in reservations(pre).items():
        taken = sorted(taken)
        for (s1, e1), (s2, e2) in zip(taken, taken[1:]):
            assert e1 <= s2 + 1e-12
        train = [(o.start_s, o.end_s) for o in sim.ops + sim.step_ops
                 if (o.pipeline, o.stage) == (r, j) and o.kind in COMPUTE_KINDS]
        for s, e in taken:
            assert 0 <= s < e <= T + 1e-12
            assert all(e <= ts + 1e-12 or s >= te - 1e-12 for ts, te in train)
    assert pre.prefill_tokens_per_s() == pytest.approx(sum(p.tokens for p in pre.served) / T)


def test_a_request_is_chunked_across_gaps_at_layer_granularity():
    sim = simulate_pipeline(wan_job())
    big, n = get_model("llama3-8b"), 2048
    whole = prefill_time_s(big, n, "A100-80GB")
    gaps = {(0, j): compute_idle_gaps(sim, 0, j) for j in range(4)}
    short = {k: [(s, e) for s, e in g if e - s < whole] for k, g in gaps.items()}
    assert any(short.values())  # the job has gaps shorter than one whole prefill
    units = UnitTimes(big, "A100-80GB", "bf16")
    assert units.unit_s(0, n) * big.num_layers == pytest.approx(whole)  # one chunk: the unchunked time
    assert units.unit_s(1024, 1024) >= units.unit_s(0, 1024)  # a later chunk attends to more cached keys
    pre = simulate_bubbletea(sim, ["A100-80GB"] * 4, [60 * 2**30] * 4, backlog((n,)), big)
    pieces: dict[int, list] = {}
    for p in pre.placements:
        pieces.setdefault(p.request, []).append(p)
        assert p.units >= 1
    split = [ps for ps in pieces.values() if len(ps) > 1 and ps[-1].done]
    assert split  # some request ran across gaps and finished
    for ps in split:
        assert [p.done for p in ps] == [False] * (len(ps) - 1) + [True]
        assert len({(p.pipeline, p.stage) for p in ps}) == 1  # its KV cache stays on one GPU
        # chunking never makes a prompt cheaper than its unchunked pass
        assert sum(p.end_s - p.start_s for p in ps) >= whole * (1 - 1e-9)
        assert sum(p.units for p in ps) >= big.num_layers
    # gaps shorter than a whole prefill are used too (a whole-request placement leaves them empty)
    in_short = [p for p in pre.placements if p.pipeline == 0 and any(
        s - 1e-12 <= p.start_s and p.end_s <= e + 1e-12 for s, e in short[(0, p.stage)])]
    assert in_short
    assert training_unchanged(sim, pre)


def test_memory_left_by_training_decides_which_stages_serve():
    sim = simulate_pipeline(wan_job())
    need = prefill_memory_bytes(GPT2, 512)
    free = [need - 1, need, 0, 10 * need]
    pre = simulate_bubbletea(sim, ["A100-80GB"] * 4, free, backlog((512,)), GPT2)
    grouped = {j for g in pre.split_groups for j in g["stages"]}
    assert 2 not in pre.eligible_stages and 2 not in grouped  # no memory free at all
    assert {1, 3} <= set(pre.eligible_stages)
    assert {p.stage for p in pre.placements} <= {1, 3} | grouped
    none = simulate_bubbletea(sim, ["A100-80GB"] * 4, [0] * 4, backlog(), GPT2)
    assert none.placements == [] and "free" in none.note
    # the weights alone: 124M params in 16-bit
    assert prefill_memory_bytes(GPT2, 1) > 2 * GPT2.num_params


def test_a_split_group_shares_one_copy_of_the_model():
    # no stage holds the whole model; stages 0 and 1 (one datacenter: a LAN hop) hold it between them
    sim = simulate_pipeline(wan_job())
    big, n = get_model("llama3-8b"), 512
    need = prefill_memory_bytes(big, n)
    free = [int(0.9 * need), int(0.9 * need), 0, 0]
    pre = simulate_bubbletea(sim, ["A100-80GB"] * 4, free, backlog((n,)), big)
    assert pre.split_groups and pre.split_groups[0]["stages"] == [0, 1]
    layers = pre.split_groups[0]["layers"]
    assert sum(layers) == big.num_layers and all(k >= 1 for k in layers)
    for j, k in enumerate(layers):  # each GPU's share fits the memory training leaves it
        assert split_memory_bytes(big, k, n, True) <= free[j]
    assert {p.stage for p in pre.placements} == {0, 1}
    done = [p for p in pre.placements if p.done]
    assert done and all(p.stage == 1 for p in done)  # the last layer (and the head) is on stage 1
    units: dict[int, int] = {}
    for p in pre.placements:
        units[p.request] = units.get(p.request, 0) + p.units
    for p in done:  # every layer of every chunk ran once
        assert units[p.request] == big.num_layers * -(-n // SPLIT_CHUNK)
    assert training_unchanged(sim, pre)
    assert pre.gpu_utilization_with_prefill() > sim.gpu_utilization()
    # one GPU's share alone cannot hold the model: without the split nothing would run
    assert split_layers(big, [free[0]], [1.0], n, "bf16") is None


def lan_job(d=2, m=6):
    """4 stages in one datacenter (every hop a LAN hop)."""
    return PipelineJob(tuple(Stage(0.05, 0.1, 0.01) for _ in range(4)), ("lan", "lan", "lan"),
                       (Channel("lan", 1e-5, 100, 100),), d, m, 12.5e6)


def test_a_minimal_group_takes_only_the_stages_it_needs():
    # stage 0 cannot hold the model; with stage 1 it can; stages 2 and 3 hold whole copies
    runs, whole, free = [[0, 1, 2, 3]], {2, 3}, [1, 5, 9, 9]
    assert _split_windows(runs, whole, free, lambda w: len(w) >= 2, "minimal") == [[0, 1]]
    assert _split_windows(runs, whole, free, lambda w: len(w) >= 2, "run") == [[0, 1, 2, 3]]
    # it grows toward more free memory, and past a neighbour that does not suffice
    assert _split_windows([[0, 1, 2, 3]], {0}, [9, 2, 1, 5], lambda w: 2 in w and 3 in w, "minimal") == [[1, 2, 3]]
    assert _split_windows([[0, 1], [2, 3]], {1, 3}, [1, 5, 1, 5], lambda w: len(w) >= 2, "minimal") == [[0, 1], [2, 3]]
    assert _split_windows(runs, {1, 2, 3}, free, lambda w: False, "minimal") == []  # nothing holds it


def test_the_variant_serving_most_is_kept_and_the_others_named():
    sim = simulate_pipeline(lan_job())
    big, n = get_model("llama3-8b"), 512
    need = prefill_memory_bytes(big, n)
    free = [int(0.5 * need), int(0.9 * need), 2 * need, 2 * need]
    pre = simulate_bubbletea(sim, ["A100-80GB"] * 4, free, backlog((n,)), big)
    assert pre.split_groups
    others = re.findall(r"(whole copies only|split groups \((?:run|minimal|replicas|replicas_rich_ends)\)): "
                        r"([0-9.e+]+) prefill tokens/s \(not kept\)", pre.note)
    assert "whole copies only" in {k for k, _ in others} and len(others) >= 2
    assert len({k for k, _ in others}) == len(others)  # each variant named once
    assert all(float(v) <= pre.prefill_tokens_per_s() * (1 + 1e-4) for _, v in others)
    assert training_unchanged(sim, pre)


def test_replica_windows_cut_just_large_enough_and_rich_ends():
    members = [(0, 0), (1, 0), (0, 1), (1, 1), (0, 2)]
    holds_three = lambda w: len(w) >= 3  # noqa: E731
    assert _replica_windows(members, holds_three, None) == [[(0, 0), (1, 0), (0, 1), (1, 1), (0, 2)]]  # leftovers join
    assert _replica_windows(members[:4], lambda w: len(w) >= 2, None) == [[(0, 0), (1, 0)], [(0, 1), (1, 1)]]
    # the two GPUs with the most free memory (stage 2's, then the first of stage 1's) take the ends
    free = [1, 5, 9]
    assert _replica_windows(members, lambda w: len(w) >= 5, free) == [[(0, 1), (0, 0), (1, 0), (1, 1), (0, 2)]]
    assert _replica_windows(members[:1], holds_three, None) == []


def test_a_group_across_pipeline_replicas_holds_what_no_pipeline_alone_can():
    # stages 0 and 1 of one pipeline cannot hold the model between them; of both pipelines they can
    sim = simulate_pipeline(lan_job())
    big, n = get_model("llama3-8b"), 512
    need = prefill_memory_bytes(big, n)
    free = [int(0.4 * need), int(0.4 * need), 0, 0]
    assert _simulate(sim, ["A100-80GB"] * 4, free, backlog((n,)), big, "bf16", 0, "minimal").split_groups == []
    pre = _simulate(sim, ["A100-80GB"] * 4, free, backlog((n,)), big, "bf16", 0, "replicas")
    [group] = pre.split_groups
    assert set(group["pipelines"]) == {0, 1} and set(group["stages"]) == {0, 1}
    assert sum(group["layers"]) == big.num_layers
    last = len(group["layers"]) - 1
    for i, (j, k) in enumerate(zip(group["stages"], group["layers"])):
        assert split_memory_bytes(big, k, n, i in (0, last)) <= free[j]
    assert {(p.pipeline, p.stage) for p in pre.placements} == {(0, 0), (1, 0), (0, 1), (1, 1)}
    units: dict[int, int] = {}
    for p in pre.placements:
        units[p.request] = units.get(p.request, 0) + p.units
    done = [p for p in pre.placements if p.done]
    assert done and all(units[p.request] == big.num_layers * -(-n // SPLIT_CHUNK) for p in done)
    assert training_unchanged(sim, pre)
    kept = simulate_bubbletea(sim, ["A100-80GB"] * 4, free, backlog((n,)), big)
    assert kept.prefill_tokens_per_s() >= pre.prefill_tokens_per_s() > 0


def test_a_group_holds_as_many_requests_as_its_memory_holds_caches_for():
    # no stage holds a copy: one group over each pipeline's four stages, whose last stage idles only
    # at the ends of the iteration (1F1B), so requests wait there holding their caches: the bound
    # binds, also over the iteration boundary (requests running into the next iteration's start)
    sim = simulate_pipeline(lan_job(m=12))
    T, big = sim.iteration_s, get_model("llama3-8b")
    free = [int(0.31 * prefill_memory_bytes(big, 512))] * 4
    pre = _steady(sim, ["A100-80GB"] * 4, free, backlog((256, 512)), big, "bf16", 0, "run")
    assert [g["stages"] for g in pre.split_groups] == [[0, 1, 2, 3]]
    layers = pre.split_groups[0]["layers"]
    cap = split_kv_tokens(big, layers, free, 512)
    assert cap >= 16 * 512
    kv = lambda j, c, tokens: split_memory_bytes(big, c, 512, j in (0, 3), inflight=0) + \
        2 * c * tokens * big.num_kv_heads * big.head_dim * 2  # noqa: E731  (bf16)
    assert all(kv(j, c, cap) <= free[j] for j, c in enumerate(layers))  # cap tokens fit beside the layers
    assert any(kv(j, c, cap + 1) > free[j] for j, c in enumerate(layers))  # one more does not
    assert len(pre.group_logs) == sim.job.num_pipelines
    for log, bound in pre.group_logs.values():
        assert bound == cap
        assert any(e > T for _, e, _ in log)  # some requests run into the next iteration
        assert cap - 2 * 512 < _peak_tokens(log, T) <= cap  # the bound binds, never passed
    for r in range(sim.job.num_pipelines):  # the log is the placements': each request's first to last unit
        spans: dict[int, tuple[float, float]] = {}
        for p in pre.placements:
            if p.pipeline == r:
                s, e = spans.get(p.request, (p.start_s, p.end_s))
                spans[p.request] = (min(s, p.start_s), max(e, p.end_s))
        [(log, _)] = [v for k, v in pre.group_logs.items() if k[0][0] == r]
        assert all(s >= ls - 1e-12 and e <= le + 1e-12 for (s, e), (ls, le, _) in zip(sorted(spans.values()), log))
    assert training_unchanged(sim, pre)  # the parts past the end, mapped onto the start, move nothing


def test_peak_tokens_counts_the_part_past_the_end_at_the_start():
    log = [(0.0, 5.0, 100), (4.0, 12.0, 50)]  # the second runs 2 s into the next iteration
    assert _peak_tokens(log, 10.0) == 150  # [0, 2) and [4, 5)
    assert _peak_tokens(log + [(1.0, 3.0, 10)], 10.0) == 160
    assert _peak_tokens([(0.0, 5.0, 100), (5.0, 9.0, 100)], 10.0) == 100  # an end frees before the next start
    # unfinished: held to the end, and its like from the iteration before never let go
    assert _peak_tokens([(2.0, float("inf"), 7)], 10.0) == 14


def test_rate_mode_serves_at_most_what_arrives_with_causal_ttft():
    sim = simulate_pipeline(wan_job())
    wl = InferenceWorkload("gpt2", ((256, 1.0),), requests_per_s=20.0)
    pre = simulate_bubbletea(sim, ["A100-80GB"] * 4, [40 * 2**30] * 4, wl, GPT2)
    assert 0 < len(pre.served) <= pre.requests_offered
    took = prefill_time_s(GPT2, 256, "A100-80GB")
    for p in pre.placements:
        assert p.start_s >= p.arrival_s
    assert min(pre.ttft_s()) >= took - 1e-12
    assert pre.summary()["ttft_mean_s"] >= took


def test_a_low_arrival_rate_is_reported_as_the_limit():
    sim = simulate_pipeline(wan_job())
    wl = InferenceWorkload("gpt2", ((256, 1.0),), requests_per_s=5.0)
    pre = simulate_bubbletea(sim, ["A100-80GB"] * 4, [40 * 2**30] * 4, wl, GPT2)
    summary = pre.summary()
    assert pre.requests_offered > 0 and pre.arrival_limited()
    assert summary["prefill_arrival_limited"] is True
    assert summary["prefill_requests_started"] == pre.requests_offered  # every arrival started
    assert 0 < summary["prefill_offered_share_served"] <= 1
    assert pre.prefill_busy_s < pre.fillable_s
    full = simulate_bubbletea(sim, ["A100-80GB"] * 4, [40 * 2**30] * 4, backlog((256,)), GPT2)
    assert not full.arrival_limited() and full.prefill_busy_s > pre.prefill_busy_s


def test_steady_state_joins_the_tail_and_the_head():
    assert steady_state_gaps([(0.0, 1.0), (2.0, 3.0), (4.0, 5.0)], 5.0) == [(2.0, 3.0), (4.0, 6.0)]
    assert steady_state_gaps([(0.5, 1.0), (4.0, 5.0)], 5.0) == [(0.5, 1.0), (4.0, 5.0)]


def test_end_to_end_report_keeps_training_unchanged():
    sc = GeoScenario.from_dict(small_dict())
    from planner.geo.atlas import solve_atlas

    res = solve_atlas(sc)
    pre, same = run_prefill(sc, res.plan, res.sim)
    assert same is True and pre.placements


class LinearUnits:
    """Unit times of a 2-layer model: 10 µs per token, whatever the context (hand-checkable)."""

    class spec:
        num_layers = 2

    def unit_s(self, lo: int, c: int) -> float:
        return 1e-5 * c


def walk(gaps, ends=None, tokens=1000):
    from planner.geo.bubbletea import _Gpu

    gpu = _Gpu((0, 0), gaps, LinearUnits(), {tokens}, ends)
    out: list[PrefillPlacement] = []
    gpu.run(0, tokens, 0.0, out)
    return gpu, out


def test_a_chunk_is_the_time_boxs_not_the_gaps():
    """The 5 ms box aims units at 2.5 ms: at 10 µs per token the largest ladder chunk under it is 128
    tokens (1.28 ms). A 2 ms gap takes one such unit and leaves its 0.72 ms tail idle (no smaller
    chunk sized to the gap's rest); long gaps take the same 128-token units."""
    from planner.geo.bubbletea import chunk_for_box

    units = LinearUnits()
    assert chunk_for_box(units, 0, 1000) == 128
    assert chunk_for_box(units, 768, 232) == 232  # the prompt's rest fits the box whole
    gpu, out = walk([(0.0, 0.002), (1.0, 2.0)])
    first = [p for p in out if p.start_s < 0.5]
    assert len(first) == 1 and first[0].units == 1
    assert first[0].end_s - first[0].start_s == pytest.approx(1.28e-3)
    # 1000 tokens = 6 chunks of 128, then the rest 232 (2.32 ms) whole, each through 2 layers: 14 units
    assert sum(p.units for p in out) == 14
    assert sum(p.end_s - p.start_s for p in out) == pytest.approx(2 * 1000 * 1e-5)
    assert out[-1].done and gpu.overrun_s == 0.0


def test_units_start_only_within_the_forecast_and_a_long_forecast_overruns():
    """A forecast shorter than the gap leaves its tail idle; one longer than the gap lets the unit
    running at the gap's true end overrun it (counted, at most one unit)."""
    _, short = walk([(0.0, 1.0)], ends=[0.005])
    assert short and max(p.end_s for p in short) <= 0.005 + 1e-12
    assert sum(p.units for p in short) == 3  # 3 × 1.28 ms fit 5 ms, a fourth would not
    gpu, long = walk([(0.0, 0.005), (1.0, 2.0)], ends=[0.5, 2.0])
    in_first = [p for p in long if p.start_s < 0.5]
    assert in_first[-1].end_s > 0.005  # ran past the gap's true end
    assert 0 < gpu.overrun_s <= 1.28e-3 + 1e-12
    assert gpu.overrun_s == pytest.approx(in_first[-1].end_s - 0.005)


def test_the_forecast_is_the_shortest_of_the_last_measured_lengths():
    from planner.geo.bubbletea import GapForecast, forecast_gap_ends

    f = GapForecast(window=2)
    assert f.forecast_s(("F", 0)) is None  # never measured
    for length in (0.3, 0.1, 0.2):
        f.record(("F", 0), length)
    assert f.forecast_s(("F", 0)) == pytest.approx(0.1)  # window of 2: 0.1 and 0.2
    f.record(("F", 0), 0.4)
    assert f.forecast_s(("F", 0)) == pytest.approx(0.2)
    with pytest.raises(ValueError, match="measured -1"):
        f.record(1, -1.0)
    # by index: none measured -> no room; the default forecast is each gap's own length (steady state)
    g = GapForecast()
    g.record(1, 0.05)
    assert forecast_gap_ends([(0.0, 1.0), (2.0, 3.0)], g) == [0.0, pytest.approx(2.05)]
    assert forecast_gap_ends([(0.0, 1.0), (2.0, 3.0)], None) == [1.0, 3.0]


def test_a_forecast_too_long_shows_as_overrun_and_changed_training():
    """Through simulate_bubbletea: forecasts twice each gap's length make units overrun the true ends,
    and the re-simulation with the prefill reserved then shows training moved."""
    from planner.geo.bubbletea import GapForecast

    sim = simulate_pipeline(wan_job())
    big = get_model("llama3-8b")
    honest = simulate_bubbletea(sim, ["A100-80GB"] * 4, [60 * 2**30] * 4, backlog((2048,)), big)
    assert honest.overrun_s == 0.0 and training_unchanged(sim, honest)
    forecasts = {}
    for r in range(sim.job.num_pipelines):
        for j in range(4):
            f = forecasts[(r, j)] = GapForecast()
            for i, (s, e) in enumerate(compute_idle_gaps(sim, r, j)):
                f.record(i, 2 * (e - s))
    greedy = simulate_bubbletea(sim, ["A100-80GB"] * 4, [60 * 2**30] * 4, backlog((2048,)), big, forecasts=forecasts)
    assert greedy.overrun_s > 0 and greedy.summary()["prefill_overrun_s"] == greedy.overrun_s
    assert not training_unchanged(sim, greedy)


def test_utilization_with_prefill_over_more_gpus_than_the_plans():
    sim = simulate_pipeline(wan_job())
    pre = simulate_bubbletea(sim, ["A100-80GB"] * 4, [40 * 2**30] * 4, backlog(), GPT2)
    n = sim.job.num_gpus
    assert pre.gpu_utilization_with_prefill(2 * n) == pytest.approx(pre.gpu_utilization_with_prefill() / 2)
    with pytest.raises(ValueError, match="fewer than the plan's"):
        pre.gpu_utilization_with_prefill(n - 1)
