"""Atlas planning: layer split, memory feasibility, WAN choices, baselines (the CLI:
tests/e2e/test_geo_cli.py)."""
import pytest

from contracts.catalog import device_dtype, get_gpu_type
from planner.geo.atlas import build_job, solve_atlas
from planner.geo.search import split_for_estimate, split_layers
from contracts.constants import MEMORY_HEADROOM
from planner.geo.costs import GeoCosts
from planner.geo.evaluate import simulate_geo
from planner.geo.scenario import GeoScenario
from planner.geo.pipeline_sim import simulate_pipeline


def small_dict(**over):
    """Three small DCs: a and b joined by a 10 Gbit/s link (1 Gbit/s per connection), c behind 50 Mbit/s."""
    d = {"name": "small",
         "datacenters": [{"name": "a", "gpus": {"A100-80GB": 4}}, {"name": "b", "gpus": {"A100-80GB": 4}},
                         {"name": "c", "gpus": {"A100-40GB": 4}}],
         "wan": [{"a": "a", "b": "b", "gbps": 10, "rtt_ms": 50, "per_connection_gbps": 1.0},
                 {"a": "b", "b": "c", "gbps": 0.05, "rtt_ms": 200}],
         "model": "gpt2-xl", "global_batch": 32, "micro_batch": 2, "seq": 1024,
         "inference": {"model": "gpt2", "prompt_tokens": [128, 256, 512], "backlog": True}}
    d.update(over)
    return d


@pytest.fixture(scope="module")
def report():
    return simulate_geo(GeoScenario.from_dict(small_dict()))


def test_split_layers_hand_solved():
    # stage 1 is twice as fast: 12 layers split 4/8 gives 4·1.0 = 8·0.5 = 4 s
    assert split_layers([1.0, 0.5], 0.0, [12, 12], 12) == [4, 8]
    # memory caps bind: stage 1 holds at most 5 layers
    assert split_layers([1.0, 0.5], 0.0, [12, 5], 12) == [7, 5]
    # the LM head (2 s) on the last stage shifts layers forward
    assert split_layers([1.0, 1.0], 2.0, [12, 12], 12) == [7, 5]
    assert split_layers([1.0, 1.0], 0.0, [5, 5], 12) is None  # does not fit
    assert split_layers([1.0] * 3, 0.0, [9, 9, 9], 2) is None  # more stages than layers


def test_plan_is_memory_feasible_and_complete(report):
    plan = report.plan
    assert sum(s.num_layers for s in plan.stages) == 48  # gpt2-xl
    assert [s.first_layer for s in plan.stages] == [sum(x.num_layers for x in plan.stages[:j])
                                                   for j in range(plan.num_stages)]
    for s in plan.stages:
        assert 0 < s.memory_bytes <= s.capacity_bytes
        assert s.capacity_bytes == int(get_gpu_type(s.gpu_type).memory_bytes * MEMORY_HEADROOM)
    for dc, n in plan.gpus_per_dc().items():
        assert n <= GeoScenario.from_dict(small_dict()).datacenter(dc).num_gpus


def test_memory_bound_forces_more_stages_or_recompute():
    # llama2-7b does not fit one 16 GB GPU: the planner must split it (or refuse)
    d = small_dict(model="llama2-7b", seq=2048, global_batch=16, micro_batch=1)
    d["datacenters"] = [{"name": "a", "gpus": {"V100-16GB": 16}}]
    d["wan"] = []
    res = solve_atlas(GeoScenario.from_dict(d))
    assert res.plan.num_stages >= 8  # 6.7e9 params · 16 bytes/param / 16 GiB > 6
    assert all(s.memory_bytes <= s.capacity_bytes for s in res.plan.stages)
    d["datacenters"] = [{"name": "a", "gpus": {"V100-16GB": 2}}]
    with pytest.raises(ValueError, match="no memory-feasible plan"):
        solve_atlas(GeoScenario.from_dict(d))


def test_memory_grows_with_layers_and_in_flight_microbatches():
    costs = GeoCosts(GeoScenario.from_dict(small_dict()))
    g = "A100-80GB"
    one, two = (costs.stage_memory_bytes(g, n, 1, 4, 8, 1, "none") for n in (1, 2))
    assert two > one
    # 1F1B: stage 1 of 4 keeps 3 micro-batches in flight, stage 2 keeps 2
    assert costs.stage_memory_bytes(g, 4, 1, 4, 8, 1, "none") > costs.stage_memory_bytes(g, 4, 2, 4, 8, 1, "none")
    # full recomputation keeps each block's input only (planner/core/stage_memory.py, exact for it too)
    assert costs.stage_memory_bytes(g, 4, 1, 4, 8, 1, "full") < costs.stage_memory_bytes(g, 4, 1, 4, 8, 1, "none")
    # ZeRO-1 inside the stage: 4 data-parallel GPUs shard the optimizer state
    assert costs.stage_memory_bytes(g, 4, 1, 4, 8, 4, "none") < costs.stage_memory_bytes(g, 4, 1, 4, 8, 1, "none")
    # GPipe keeps all 8 micro-batches' activations on every stage
    gpipe = GeoCosts(GeoScenario.from_dict(small_dict()), schedule="gpipe")
    assert gpipe.stage_memory_bytes(g, 4, 1, 4, 8, 1, "none") > costs.stage_memory_bytes(g, 4, 1, 4, 8, 1, "none")
    assert gpipe.in_flight(3, 4, 8) == 8 and costs.in_flight(3, 4, 8) == 1


def test_atlas_leaves_out_the_slow_dc_and_saturates_the_link(report):
    plan = report.plan
    assert "c" not in plan.chain  # behind 50 Mbit/s
    if len(plan.chain) > 1:
        assert dict(plan.connections)["a-b"] == 10  # 10 Gbit/s / 1 Gbit/s per connection
    atlas = report.sim.iteration_s
    for name, b in report.baselines.items():
        assert b.iteration_s is not None and b.iteration_s >= atlas * (1 - 1e-9), name
    assert report.baselines["dp_across_dcs"].iteration_s > 10 * atlas  # 50 Mbit/s all-reduce of 1.5B


def test_plan_simulation_is_reproducible(report):
    sc = GeoScenario.from_dict(small_dict())
    again = simulate_pipeline(build_job(sc, GeoCosts(sc), report.plan))
    assert again.iteration_s == pytest.approx(report.sim.iteration_s)


def test_temporal_sharing_with_many_connections_beats_one_fair_connection():
    # the same placement, only the network treatment differs
    # an untied model too large for one DC: gpt2-xl's tied embedding (321 MB summed over the WAN each
    # step) keeps its plan in one DC
    sc = GeoScenario.from_dict(small_dict(global_batch=64, model="llama2-7b", micro_batch=1))
    costs = GeoCosts(sc)
    res = solve_atlas(sc, costs, all_datacenters=False)
    from dataclasses import replace

    if len(res.plan.chain) == 1:
        pytest.skip("plan stayed in one DC")
    fair = replace(res.plan, connections=tuple((k, 1) for k, _ in res.plan.connections), sharing="fair")
    t_fair = simulate_pipeline(build_job(sc, costs, fair)).iteration_s
    assert t_fair > res.sim.iteration_s


def test_stage_memory_is_the_runtimes_stage_model(report):
    """Each stage's memory is planner/core/stage_memory's exact per-rank model at its position."""
    from contracts.plan import PipelineSpec, PipelineStage
    from planner.core.stage_memory import estimate_stage_memory

    sc = GeoScenario.from_dict(small_dict())
    spec = GeoCosts(sc).spec
    plan = report.plan
    d, b = plan.num_pipelines, sc.micro_batch
    stages, nxt = [], 0
    for s in plan.stages:
        stages.append(PipelineStage(s.first_layer, s.num_layers, tuple(range(nxt, nxt + d)), (b,) * d))
        nxt += d
    pipe = PipelineSpec("1f1b", d * b, plan.num_microbatches, tuple(stages))
    for j, s in enumerate(plan.stages):
        assert s.memory_bytes <= s.capacity_bytes
        if plan.recompute == "none":
            want = estimate_stage_memory(spec, pipe, j, 0, 1.0 / d, sc.seq, device_dtype(s.gpu_type, sc.dtype),
                                         "none", s.gpu_type).peak_bytes
            assert s.memory_bytes == want


def test_a_datacenter_with_two_gpu_types_uses_both_faster_ones_with_more_layers():
    d = small_dict()
    d["datacenters"], d["wan"] = [{"name": "a", "gpus": {"A100-80GB": 4, "H100-SXM": 4}}], []
    mixed = solve_atlas(GeoScenario.from_dict(d))
    assert mixed.plan.chain == ("a",) and {s.gpu_type for s in mixed.plan.stages} == {"A100-80GB", "H100-SXM"}
    h100 = max(s.num_layers for s in mixed.plan.stages if s.gpu_type == "H100-SXM")
    a100 = max(s.num_layers for s in mixed.plan.stages if s.gpu_type == "A100-80GB")
    assert h100 > a100  # 989 vs 312 TFLOP/s: the split follows speed
    d["datacenters"] = [{"name": "a", "gpus": {"H100-SXM": 4}}]
    assert mixed.sim.iteration_s < solve_atlas(GeoScenario.from_dict(d)).sim.iteration_s


def _brute_split(layer_s, head_s, caps, num_layers, weight=None, floor_s=0.0, tails=None):
    """Every composition of num_layers into len(layer_s) parts within caps: the best value of
    split_for_estimate's objective (weight None: the (slowest stage, total) pair)."""
    import itertools

    p, best = len(layer_s), None
    tails = tails or [(0.0, 0.0)] * p
    for cut in itertools.combinations(range(1, num_layers), p - 1):
        counts = [b - a for a, b in zip((0,) + cut, cut + (num_layers,))]
        if any(n > c for n, c in zip(counts, caps)):
            continue
        times = [n * t for n, t in zip(counts, layer_s)]
        times[-1] += head_s
        if weight is None:
            key = (max(times), sum(times))
        else:
            key = sum(n * t for n, t in zip(counts, layer_s)) + max(
                weight * max(t, floor_s) + a + b * n for t, (a, b), n in zip(times, tails, counts))
        best = key if best is None or key < best else best
    return best


def test_split_layers_is_exact_against_brute_force():
    import random

    rng = random.Random(7)
    for _ in range(300):
        p, L = rng.randint(1, 4), rng.randint(1, 12)
        layer_s = [rng.choice([0.5, 1.0, 1.5, rng.uniform(0.2, 2.0)]) for _ in range(p)]
        head_s = rng.choice([0.0, rng.uniform(0.0, 3.0)])
        caps = [rng.randint(1, L + 1) for _ in range(p)]
        want = _brute_split(layer_s, head_s, caps, L)
        got = split_layers(layer_s, head_s, caps, L)
        if want is None:
            assert got is None
            continue
        times = [n * t for n, t in zip(got, layer_s)]
        times[-1] += head_s
        assert sum(got) == L and all(1 <= n <= c for n, c in zip(got, caps))
        assert max(times) == pytest.approx(want[0], rel=1e-12) and sum(times) == pytest.approx(want[1], rel=1e-12)


def test_split_for_the_estimate_is_exact_against_brute_force():
    import random

    rng = random.Random(11)
    for _ in range(300):
        p, L = rng.randint(1, 4), rng.randint(1, 12)
        layer_s = [rng.choice([0.5, 1.0, rng.uniform(0.2, 2.0)]) for _ in range(p)]
        head_s = rng.choice([0.0, rng.uniform(0.0, 3.0)])
        caps = [rng.randint(1, L + 1) for _ in range(p)]
        weight, floor_s = rng.choice([0, 1, 3, 15]), rng.choice([0.0, rng.uniform(0.0, 4.0)])
        tails = [(rng.uniform(0, 2), rng.choice([0.0, rng.uniform(0, 1)])) for _ in range(p)]
        want = _brute_split(layer_s, head_s, caps, L, weight, floor_s, tails)
        got = split_for_estimate(layer_s, head_s, caps, L, weight, floor_s, tails)
        if want is None:
            assert got is None
            continue
        counts, value = got
        assert sum(counts) == L and all(1 <= n <= c for n, c in zip(counts, caps))
        assert value == pytest.approx(want, rel=1e-12)


def tiny_scenario(**over) -> GeoScenario:
    """Small enough to price every structure and every layer split: gpt2 (12 layers), 3 units."""
    d = {"name": "tiny",
         "datacenters": [{"name": "a", "gpus": {"A100-80GB": 2, "H100-SXM": 2}}, {"name": "b", "gpus": {"L4": 4}}],
         "wan": [{"a": "a", "b": "b", "gbps": 5, "rtt_ms": 40}],
         "model": "gpt2", "global_batch": 8, "micro_batch": 1, "seq": 1024}
    d.update(over)
    return GeoScenario.from_dict(d)


def _estimate_by_hand(sc, costs, where, counts, d, rc):
    """planner/geo/search.py's E for one structure and split, from the cost tables and the scenario."""
    from planner.costmodel.collectives import bytes_per_s
    from planner.geo.scenario import INTRA_DC_LATENCY_S

    p, m = len(where), sc.global_batch // sc.micro_batch // d
    t = [n * costs.layer_time_s(g, rc) for (_, g), n in zip(where, counts)]
    t[-1] += costs.head_time_s(where[-1][1], rc)
    H, W = 0.0, 0.0
    for (x, _), (y, _) in zip(where, where[1:]):
        if x == y:
            H += 2 * (costs.transfer_bytes / bytes_per_s(sc.datacenter(x).intra_dc_gbps) + INTRA_DC_LATENCY_S)
        else:
            link = sc.link(x, y)
            wire = costs.transfer_bytes / bytes_per_s(link.throughput_gbps(link.connections_to_saturate()))
            H += 2 * (wire + link.one_way_latency_s)
            W = max(W, d * wire)
    first = 0
    tails = []
    for j, ((dc, g), n) in enumerate(zip(where, counts)):
        s = costs.stage_cost(dc, g, first, n, j, p, m, d, rc)
        tails.append(s.allreduce_s + s.optimizer_s)
        first += n
    return sum(t) + H + max((m - 1) * max(tj, W) + a for tj, a in zip(t, tails))


def test_the_search_is_exact_against_brute_force_on_a_small_scenario():
    """Every structure (DC subset and order, stages per unit, DP degree, recompute) and every layer split
    priced by hand: the search's splits minimize E, and its best candidate is the least R of all."""
    import itertools

    from planner.geo.search import Search

    sc = tiny_scenario()
    costs = GeoCosts(sc)
    search = Search(sc, costs)
    found, exact = search.run()
    priced = search.considered
    assert exact
    L, num_mb, best_r, checked = costs.spec.num_layers, sc.global_batch // sc.micro_batch, float("inf"), 0
    assert search.count() == sum(1 for _ in search.structures())
    for subset, chain, d, ks, rc in search.structures():
        cand = search.evaluate(chain, d, ks, rc)
        where = search.where(chain, ks)
        p, m = len(where), num_mb // d
        caps = [costs.max_layers(g, j, p, m, d, rc) for j, (_, g) in enumerate(where)]
        brute = None
        for cut in itertools.combinations(range(1, L), p - 1):
            counts = [b - a for a, b in zip((0,) + cut, cut + (L,))]
            if all(n <= c for n, c in zip(counts, caps)):
                e = _estimate_by_hand(sc, costs, where, counts, d, rc)
                brute = e if brute is None or e < brute else brute
        if brute is None:
            assert cand is None
            continue
        assert cand.bound_s == pytest.approx(brute, rel=1e-9)
        assert cand.estimate_s >= cand.bound_s * (1 - 1e-12)  # R >= E
        best_r = min(best_r, cand.estimate_s)
        checked += 1
    assert checked > 100
    assert found[0].estimate_s == pytest.approx(best_r, rel=1e-12)
    assert priced < checked  # the bounds skipped structures in the run (without changing its answer)


TYPES = ["A100-80GB", "A100-40GB", "H100-SXM", "V100-32GB", "L4"]


def random_scenario(seed: int) -> GeoScenario:
    """1-3 datacenters of 1-2 GPU types (1-4 GPUs each), WAN links 0.05-100 Gbit/s, 10-200 ms."""
    import random

    rng = random.Random(seed)
    names = [f"dc{i}" for i in range(rng.randint(1, 3))]
    dcs = [{"name": x, "gpus": {t: rng.choice([1, 2, 4]) for t in rng.sample(TYPES, rng.randint(1, 2))}}
           for x in names]
    wan = [{"a": names[i], "b": names[j], "gbps": round(10 ** rng.uniform(-1.3, 2), 3), "rtt_ms": rng.uniform(10, 200)}
           for i in range(len(names)) for j in range(i + 1, len(names)) if j == i + 1 or rng.random() < 0.5]
    mb = rng.choice([1, 2])
    return GeoScenario.from_dict({"name": f"random{seed}", "datacenters": dcs, "wan": wan,
                                  "model": rng.choice(["gpt2", "gpt2-medium", "gpt2-large"]),
                                  "global_batch": mb * rng.choice([4, 8, 16, 32]), "micro_batch": mb,
                                  "seq": rng.choice([512, 1024])})


def test_the_search_against_baselines_computed_apart_on_random_scenarios():
    """No baseline's plan is a candidate of the search, so it can lose: the report names exactly the
    faster baselines. The search's layer split minimizes its estimate, not the simulation, so an even
    split can beat it by a little (3.4 % on one of these scenarios); it loses to no baseline by more
    than 5 %, and never to DP, the fair one-connection pipeline or the best single datacenter here."""
    checked = 0
    for seed in range(20):
        report = simulate_geo(random_scenario(seed))
        t = report.sim.iteration_s
        assert set(report.baselines) == {"dp_across_dcs", "pp_single_connection_fair", "best_single_dc",
                                         "even_layer_split"}
        faster = [k for k, b in report.baselines.items() if b.iteration_s is not None and b.iteration_s < t * (1 - 1e-9)]
        assert report.slower_than() == faster
        for name, b in report.baselines.items():
            if b.iteration_s is not None:
                limit = 1.05 if name == "even_layer_split" else 1 + 1e-9
                assert t <= b.iteration_s * limit, (seed, name, t, b.iteration_s)
                checked += 1
        # the plan's own timeline is what is reported: re-simulating it gives the same time
        again = simulate_pipeline(build_job(report.scenario, GeoCosts(report.scenario), report.plan))
        assert again.iteration_s == pytest.approx(t)
    assert checked >= 50


def test_optimizer_step_and_stage_collectives_are_in_the_plans_timeline(report):
    sim, plan = report.sim, report.plan
    assert all(s.optimizer_s > 0 for s in plan.stages)
    steps = [o for o in sim.step_ops if o.kind == "OPT"]
    assert len(steps) == plan.num_gpus
    for o in steps:  # each after its stage's last backward (and its collectives)
        last = max(x.end_s for x in sim.ops if x.stage == o.stage and x.pipeline == o.pipeline)
        assert o.start_s >= last - 1e-12
        assert o.end_s - o.start_s == pytest.approx(plan.stages[o.stage].optimizer_s)
    assert sim.iteration_s >= max(o.end_s for o in steps) - 1e-12
    if plan.num_pipelines > 1:
        assert all(s.allreduce_s > 0 for s in plan.stages)


def test_utilization_is_over_every_gpu_of_the_scenario(report):
    """GPUs the plan leaves out count as idle: forward/backward time over all 12 GPUs × iteration,
    recounted here from the plan's operations; the plan's own GPUs' figure is reported beside."""
    sim = report.sim
    busy = sum(o.end_s - o.start_s for o in sim.ops if o.kind in ("F", "B"))
    every = sum(sum(dc["gpus"].values()) for dc in small_dict()["datacenters"])
    assert every == 12 and report.plan.num_gpus < every  # c is left out
    assert report.gpu_utilization() == pytest.approx(busy / (every * sim.iteration_s))
    out = report.to_dict()
    assert out["num_scenario_gpus"] == every and out["num_plan_gpus"] == report.plan.num_gpus
    assert out["gpu_utilization"] == pytest.approx(busy / (every * sim.iteration_s))
    assert out["gpu_utilization_plan_gpus"] == pytest.approx(busy / (report.plan.num_gpus * sim.iteration_s))
    assert out["gpu_utilization"] < out["gpu_utilization_plan_gpus"]
    pre = report.prefill
    with_prefill = (pre.training_busy_s + sum(p.end_s - p.start_s for p in pre.placements)) / (every * sim.iteration_s)
    assert out["gpu_utilization_with_prefill"] == pytest.approx(with_prefill)
    for b in report.baselines.values():
        if b.iteration_s is not None:
            assert b.gpu_utilization == pytest.approx(b.gpu_utilization_plan_gpus * b.num_gpus / every)


def test_the_baselines_are_no_candidates_and_a_faster_one_is_reported(monkeypatch):
    """The plan is the search's alone (the same as solve_atlas on the scenario): a baseline made to
    look twice as fast, its plan and timeline included, is named in slower_than, not taken."""
    import dataclasses

    from planner.geo import evaluate

    sc = GeoScenario.from_dict(small_dict(inference=None))
    alone = solve_atlas(sc, GeoCosts(sc))
    real = evaluate.simulate_baselines

    def with_a_fast_one(scenario, costs):
        out = real(scenario, costs)
        b = out["pp_single_connection_fair"]
        fast = 0.5 * alone.iteration_s
        out["pp_single_connection_fair"] = dataclasses.replace(b, iteration_s=fast,
                                                               sim=dataclasses.replace(b.sim, iteration_s=fast))
        return out

    monkeypatch.setattr(evaluate, "simulate_baselines", with_a_fast_one)
    report = simulate_geo(sc)
    assert report.baselines["pp_single_connection_fair"].plan != alone.plan  # across all three DCs
    assert report.plan == alone.plan and report.chosen_from == "search"
    assert report.sim.iteration_s == pytest.approx(alone.iteration_s)
    assert report.slower_than() == ["pp_single_connection_fair"]
    assert report.to_dict()["speedup_vs_pp_single_connection_fair"] == pytest.approx(0.5)


def test_dp_across_datacenters_overlaps_its_all_reduce_with_the_backward():
    """DP over a and b (100 Gbit/s, 2 ms; c's 50 Mbit/s link is not on their path): the step is the
    slower datacenter's iteration on its half of the batch plus what of the bucketed WAN all-reduce
    the backward does not hide: more than the iteration alone, less than the all-reduce after it
    unoverlapped (costs.wan_allreduce_s over the a-b link, the no-overlap price). On the 10 Gbit/s,
    50 ms link of the other tests the all-reduce is 14x the iteration and one bucket is the best."""
    import dataclasses

    from planner.costmodel.collectives import Link, bytes_per_s
    from planner.geo.evaluate import simulate_dp_baseline, solve_each_dc

    wan = [{"a": "a", "b": "b", "gbps": 100, "rtt_ms": 2, "per_connection_gbps": 25.0},
           {"a": "b", "b": "c", "gbps": 0.05, "rtt_ms": 200}]
    sc = GeoScenario.from_dict(small_dict(inference=None, wan=wan))
    costs = GeoCosts(sc)
    dp = simulate_dp_baseline(sc, costs, ["a", "b"], solve_each_dc(sc))
    compute = max(solve_atlas(dataclasses.replace(sc, datacenters=(sc.datacenter(n),), wan=(), global_batch=16))
                  .iteration_s for n in ("a", "b"))  # a and b are alike: half the batch each
    link, per_dc = sc.link("a", "b"), dp.num_gpus // 2
    no_overlap = costs.wan_allreduce_s(costs.spec.num_params, 2, Link(
        bytes_per_s(link.throughput_gbps(per_dc)), link.one_way_latency_s, call_latency_s=2 * link.one_way_latency_s))
    assert compute < dp.iteration_s < compute + no_overlap * 0.9
    assert "after the backward" in dp.note
