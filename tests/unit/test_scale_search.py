"""The joint search (planner/geo/scale/) on a tiny mixed cluster with made-up per-layer profiles.

Checked against brute force over the same families: every structure priced, every layer split of a
structure enumerated, every structure simulated; the fluid bound against its hand-computed value.
"""
from __future__ import annotations

import itertools
import math

import pytest

from contracts.cluster import ClusterSpec
from contracts.plan import Plan
from contracts.specs import ModelSpec
from planner.core.layer_profiles import LayerMeasurement, LayerProfiles
from planner.geo.scale.costs import ScaleCosts, tables_from_layer_profiles
from planner.geo.scale.plan_file import to_plan_dict
from planner.geo.scale.price import price_exactly
from planner.geo.scale.search import (_divisors, _proportional, block_rates, enumerate_layouts, fluid_bound_s,
                                      node_kinds, solve_scale)
from planner.geo.scale.structure import Structure, StructurePricer

SPEC = ModelSpec("t6", "gpt2", 6, 256, 8, 8, 1024, 1000, 256, tied_embeddings=False, linear_bias=True)
SEQ, BATCH = 256, 16
# per block, forward seconds per row at tp 1 (backward twice that); the head twice a block
SPEED = {"A100-40GB": 0.010, "V100-16GB": 0.030}
ALPHA_S = 0.002  # per block and micro-batch: what makes larger micro-batches cheaper per row
TP_EFFICIENCY = 0.8  # a TP group of t computes t·0.8 times as fast


def _layers(device: str, mb: int, tp: int) -> list[list[float]]:
    per_row = SPEED[device] / (tp * TP_EFFICIENCY if tp > 1 else 1)
    block = ALPHA_S + per_row * mb
    update = 1e-3 / tp
    return [[ALPHA_S / 4, 0.0, update]] + [[block, 2 * block, update]] * SPEC.num_layers + [[2 * block, 4 * block, update]]


def _costs(cluster: ClusterSpec) -> ScaleCosts:
    ms = tuple(LayerMeasurement(d, mb, tp, tuple(tuple(x) for x in _layers(d, mb, tp)))
               for d in SPEED for mb in (1, 2, 4) for tp in (1, 2))
    lp = LayerProfiles(SPEC.name, SEQ, "fp32", "none", "made up for the test", ms)
    return ScaleCosts.for_cluster(cluster, SPEC, SEQ, "fp32", tables_from_layer_profiles(lp, SPEC))


def _cluster(a_nodes: int = 2, v_nodes: int = 2, gpus: int = 2) -> ClusterSpec:
    nodes = ([{"name": f"a{i}", "datacenter": "d", "gpus": {"A100-40GB": gpus}} for i in range(a_nodes)]
             + [{"name": f"v{i}", "datacenter": "d", "gpus": {"V100-16GB": gpus}} for i in range(v_nodes)])
    return ClusterSpec.from_dict({"name": "tiny-mixed", "nodes": nodes,
                                  "network": {"intra_node_gbps": 300, "inter_node_gbps": 10}})


def _every_structure(cluster, costs, max_tp=2, max_stages=4):
    kinds = node_kinds(cluster)
    for tps in itertools.product((1, 2), repeat=len(kinds)):
        if max(tps) > max_tp:
            continue
        tp_of = {k.device_type: t for k, t in zip(kinds, tps)}
        for layouts in enumerate_layouts(kinds, tp_of, max_stages, SPEC.num_layers, block_rates(costs, kinds, max_tp)):
            for b in _divisors(BATCH):
                yield Structure(layouts, b, BATCH // b)


@pytest.fixture(scope="module")
def solved():
    cluster = _cluster()
    costs = _costs(cluster)
    return cluster, costs, solve_scale(cluster, costs, BATCH, max_tp=2, max_stages=4, time_limit_s=60)


def test_layer_split_is_the_least_bottleneck(solved):
    cluster, costs, _ = solved
    pricer = StructurePricer(costs, BATCH)
    checked = 0
    for st in _every_structure(cluster, costs):
        if st.num_stages < 2:
            continue
        found = pricer.price(st)
        best = math.inf
        for cut in itertools.combinations(range(1, SPEC.num_layers), st.num_stages - 1):
            sizes = [b - a for a, b in zip((0,) + cut, cut + (SPEC.num_layers,))]
            first, worst = 0, 0.0
            for s, n in enumerate(sizes):
                worst = max(worst, pricer.stage_time(st, s, first, n))
                first += n
            best = min(best, worst)
        if found is None:
            assert best == math.inf
            continue
        assert max(sp.time_s for sp in found.stages) == pytest.approx(best, rel=1e-12)
        checked += 1
    assert checked > 20


def test_search_finds_the_best_estimate_and_beats_flat(solved):
    cluster, costs, result = solved
    pricer = StructurePricer(costs, BATCH)
    priced = [p for p in (pricer.price(st) for st in _every_structure(cluster, costs)) if p is not None]
    best_estimate = min(priced, key=lambda p: p.estimate_s)
    # the pruned search simulates the best-estimated structure: its answer is no slower than it
    exact = price_exactly(cluster, pricer, best_estimate)
    assert result.plan.iteration_s <= exact.iteration_s * (1 + 1e-9)
    # ... and no slower than any flat (one-stage) plan of the families, simulated
    flats = [price_exactly(cluster, pricer, p) for p in priced if p.structure.num_stages == 1]
    assert result.flat is not None
    assert result.plan.iteration_s <= min(f.iteration_s for f in flats if f is not None) * (1 + 1e-9)
    assert result.status == "complete"


def test_search_is_no_slower_than_every_structure_simulated(solved):
    """Brute force: every structure of the families simulated. The search simulates its shortlist only;
    on this instance its answer is the best of them all."""
    cluster, costs, result = solved
    pricer = StructurePricer(costs, BATCH)
    sims = [price_exactly(cluster, pricer, p) for p in
            (pricer.price(st) for st in _every_structure(cluster, costs)) if p is not None]
    best = min(s.iteration_s for s in sims if s is not None)
    assert result.plan.iteration_s <= best * (1 + 1e-9)


def test_bound_is_the_fluid_bound_and_below_every_plan(solved):
    cluster, costs, result = solved
    assert 0 < result.bound_s <= result.plan.iteration_s
    assert result.gap == pytest.approx(result.plan.iteration_s / result.bound_s - 1)
    # one type: the LP's optimum is B · Σ_u (cheapest GPU-seconds per sample of unit u) / GPUs
    one = _cluster(a_nodes=2, v_nodes=0)
    c1 = _costs(one)
    per_sample = 0.0
    for u in range(c1.num_units):
        per_sample += min(tp * sum(c1.tables[("A100-40GB", tp)].range_s(u, u + 1, r)) / r
                          for tp in (1, 2) for r in (1, 2, 4))
    assert fluid_bound_s(c1, node_kinds(one), BATCH, 2) == pytest.approx(BATCH * per_sample / 4, rel=1e-6)


def test_plan_file_keys_and_tp1_plans_load(solved):
    cluster, costs, result = solved
    tp1 = solve_scale(cluster, costs, BATCH, max_tp=1, max_stages=4)
    d = to_plan_dict(cluster, SPEC.name, BATCH, SEQ, "fp32", tp1.plan)
    assert d["tensor_parallel"] is False
    assert all({"stage", "tp", "tp_group"} <= set(a) for a in d["assignments"])
    plan = Plan.from_dict(d)  # today's contracts read it (the three keys are ignored)
    assert plan.pipeline is not None and plan.pipeline.num_microbatches == tp1.plan.structure.num_microbatches


def test_tp_plan_file_groups(solved):
    cluster, costs, _ = solved
    pricer = StructurePricer(costs, BATCH)
    st = next(s for s in _every_structure(cluster, costs)
              if s.num_stages == 2 and all(p.tp == 2 for lay in s.stages for p in lay.parts) and s.micro_batch == 4)
    plan = price_exactly(cluster, pricer, pricer.price(st))
    d = to_plan_dict(cluster, SPEC.name, BATCH, SEQ, "fp32", plan)
    assert d["tensor_parallel"] is True
    groups: dict[int, list[dict]] = {}
    for a in d["assignments"]:
        if a["stage"] is not None:
            assert a["tp"] == 2
            groups.setdefault(a["tp_group"], []).append(a)
    assert all(len(g) == 2 and len({(a["micro_batch"], a["shard_fraction"]) for a in g}) == 1 for g in groups.values())
    for s in range(2):  # per stage, counted once per TP group: the global batch and the whole state
        heads = [g[0] for g in groups.values() if g[0]["stage"] == s]
        assert sum(a["batch"] for a in heads) == BATCH
        assert sum(a["shard_fraction"] for a in heads) == pytest.approx(1.0)
    p = Plan.from_dict(d)  # the contracts read its TP groups, and write the same file back
    assert p.tensor_parallel and p.tp_degree == 2 and Plan.from_dict(p.to_dict()) == p


def test_bad_input_is_refused():
    cluster = _cluster()
    with pytest.raises(ValueError, match="max_tp"):
        solve_scale(cluster, _costs(cluster), BATCH, max_tp=3)
    mixed = ClusterSpec.from_dict({"name": "m", "nodes": [{"name": "n", "datacenter": "d",
                                                           "gpus": {"A100-40GB": 1, "V100-16GB": 1}}]})
    with pytest.raises(ValueError, match="one GPU type"):
        solve_scale(mixed, _costs(cluster), BATCH)


def test_proportional_split_follows_the_blocks():
    nodes = tuple(range(20))
    assert [len(g) for g in _proportional(nodes, [6, 6, 2])] == [9, 8, 3]
    assert [len(g) for g in _proportional(nodes, [1, 1])] == [10, 10]
    assert [len(g) for g in _proportional((0, 1, 2), [1, 2])] == [1, 2]
    assert _proportional((0, 1), [1, 1, 1]) is None


def test_uneven_node_splits_are_searched():
    """On 2 + 5 nodes, the V100s' 5 nodes over 3 stages split (3, 1, 1) as well as evenly (2, 2, 1); the
    search's answer is no slower than every structure of the families (uneven ones included) simulated."""
    cluster = _cluster(a_nodes=2, v_nodes=5, gpus=2)
    costs = _costs(cluster)
    kinds = node_kinds(cluster)
    layouts = enumerate_layouts(kinds, {k.device_type: 1 for k in kinds}, 4, SPEC.num_layers,
                                block_rates(costs, kinds, 1))
    v100 = [tuple(lay.num_nodes for lay in stages if lay.parts[0].device_type == "V100-16GB") for stages in layouts
            if all(len(lay.parts) == 1 for lay in stages)]
    assert (2, 2, 1) in v100 and (3, 1, 1) in v100
    result = solve_scale(cluster, costs, BATCH, max_tp=1, max_stages=4, time_limit_s=60)
    pricer = StructurePricer(costs, BATCH)
    sims = [price_exactly(cluster, pricer, p) for p in
            (pricer.price(st) for st in _every_structure(cluster, costs, max_tp=1, max_stages=4)) if p is not None]
    assert result.plan.iteration_s <= min(s.iteration_s for s in sims if s is not None) * (1 + 1e-9)
    print("tiny 2+5: search", result.plan.iteration_s, "every structure simulated", len(sims),
          [lay.num_nodes for lay in result.plan.structure.stages])
