"""The joint search: stages over groups of nodes × uneven data parallelism × tensor parallelism.

Hierarchical (docs/models/scale.md):

1. **Structures** are enumerated: how many stages S (≤ `max_stages`), which nodes each stage holds,
   the TP degree of each GPU type (≤ `max_tp`, dividing its node's GPUs, measured), the micro-batch
   B (a divisor of the global batch) and so M. Node groups come in two families: *pure* stages (each
   stage one GPU type; the types' stages in either order, a type's nodes split evenly over its
   stages, a type may be left out whole) and *mixed* stages (every stage holds an even share of
   every type's nodes). S = 1 mixed is flat (uneven) data parallelism with TP. The pure family also
   splits a type's nodes unevenly, in proportion to the blocks its stages would hold, for every
   division of the blocks over the types within `UNEVEN_WINDOW_BLOCKS` of the types' shares of the
   cluster's block rate (a heuristic restriction, for speed).
2. **Each structure** gets its least-bottleneck layer split and each stage its exact row split
   (planner/geo/scale/structure.py, planner/geo/scale/split.py) and is ranked by the closed-form 1F1B
   estimate.
3. **The best few** (`shortlist`, and always the best flat one) are priced exactly: block by block,
   water-filled ZeRO-1 shares under the exact memory model, GPUMix's pipeline simulator
   (planner/geo/scale/price.py). The fastest simulated plan is the answer.

`bound_s` is a lower bound of every plan's iteration: the fluid compute bound, the least T at which
the GPUs, each type at its cheapest measured GPU-seconds per sample of each unit (any TP degree and
micro-batch), can run every unit of every sample (a small LP over types × units). The gap
`iteration / bound − 1` is reported with every answer; it counts what no plan avoids (bubbles,
communication, updates, memory) as well as what the search leaves.
"""
from __future__ import annotations

import itertools
import logging
import math
import time
from dataclasses import dataclass

from contracts.cluster import ClusterSpec
from planner.geo.scale.costs import ScaleCosts
from planner.geo.scale.price import PricedPlan, price_exactly
from planner.geo.scale.structure import StageLayout, StagePart, Structure, StructurePrice, StructurePricer

log = logging.getLogger(__name__)

DEFAULT_MAX_STAGES = 8
DEFAULT_SHORTLIST = 4
TP_DEGREES = (1, 2, 4, 8)
# uneven node splits: a kind's blocks within this many of its share of the cluster's block rate
UNEVEN_WINDOW_BLOCKS = 3


@dataclass(frozen=True)
class NodeKind:
    device_type: str
    gpus_per_node: int
    nodes: tuple[int, ...]  # node indices of the cluster


@dataclass(frozen=True)
class ScaleResult:
    status: str  # "complete": every structure of the families priced; "time_limit": cut by the limit
    plan: PricedPlan
    flat: PricedPlan | None  # the best one-stage plan (flat uneven data parallelism), for comparison
    bound_s: float
    num_structures: int  # structures priced in closed form
    num_simulated: int
    solve_s: float

    @property
    def gap(self) -> float:
        return self.plan.iteration_s / self.bound_s - 1.0 if self.bound_s > 0 else math.inf


def node_kinds(cluster: ClusterSpec) -> list[NodeKind]:
    """Nodes grouped by (GPU type, GPUs per node); ValueError where a node mixes types or a device is
    emulated (the joint search prices whole nodes of one measured type)."""
    kinds: dict[tuple[str, int], list[int]] = {}
    for i, node in enumerate(cluster.nodes):
        types = {d.type for d in node.devices}
        if len(types) != 1 or any(d.emulated for d in node.devices):
            raise ValueError(f"node {node.name!r}: the joint search needs nodes of one GPU type, not emulated "
                             f"({', '.join(sorted(types))})")
        kinds.setdefault((types.pop(), len(node.devices)), []).append(i)
    return [NodeKind(t, g, tuple(ns)) for (t, g), ns in sorted(kinds.items())]


def _chunks(nodes: tuple[int, ...], k: int) -> list[tuple[int, ...]]:
    """`nodes` in k contiguous groups as even as possible (the larger first)."""
    q, r = divmod(len(nodes), k)
    out, i = [], 0
    for j in range(k):
        n = q + (1 if j < r else 0)
        out.append(nodes[i:i + n])
        i += n
    return out


def _proportional(nodes: tuple[int, ...], weights: list[int]) -> list[tuple[int, ...]] | None:
    """`nodes` in contiguous groups in proportion to `weights` (largest remainders, every group at least
    one node); None where there are fewer nodes than groups."""
    if len(nodes) < len(weights):
        return None
    total = sum(weights)
    exact = [len(nodes) * w / total for w in weights]
    counts = [max(1, math.floor(x)) for x in exact]
    by_remainder = sorted(range(len(weights)), key=lambda j: (counts[j] - exact[j], j))
    i = 0
    while sum(counts) < len(nodes):
        counts[by_remainder[i % len(counts)]] += 1
        i += 1
    while sum(counts) > len(nodes):
        j = max((j for j in range(len(counts)) if counts[j] > 1), key=lambda j: (counts[j] - exact[j], -j))
        counts[j] -= 1
    out, i = [], 0
    for n in counts:
        out.append(nodes[i:i + n])
        i += n
    return out


def _block_totals(stage_counts: list[int], num_layers: int, centre: list[float], window: int):
    """Every way to give each kind's stages (stage_counts[i] of them) a total of blocks, at least one per
    stage, the totals summing to num_layers, each within `window` blocks of its `centre`."""
    if len(stage_counts) == 1:
        if num_layers >= stage_counts[0] and abs(num_layers - centre[0]) <= window:
            yield (num_layers,)
        return
    rest = sum(stage_counts[1:])
    for k in range(stage_counts[0], num_layers - rest + 1):
        if abs(k - centre[0]) <= window:
            for tail in _block_totals(stage_counts[1:], num_layers - k, centre[1:], window):
                yield (k,) + tail


def enumerate_layouts(kinds: list[NodeKind], tps: dict[str, int], max_stages: int,
                      num_layers: int | None = None, block_rates: dict[str, float] | None = None,
                      window: int = UNEVEN_WINDOW_BLOCKS) -> list[tuple[StageLayout, ...]]:
    """The node groups of both families (module docstring) at one TP degree per type. With
    `num_layers`, the pure family also splits each kind's nodes over its stages in proportion to the
    blocks they would hold: for every division of the blocks over the kinds within `window` blocks of
    the kinds' shares of `block_rates` (blocks per second per node; None: every division), each kind's
    total as even as possible over its stages (the first stages one more), its nodes in proportion."""
    out: list[tuple[StageLayout, ...]] = []
    seen = set()

    def part(k: NodeKind, nodes: tuple[int, ...]) -> StagePart:
        return StagePart(k.device_type, k.gpus_per_node, tps[k.device_type], nodes)

    def add(stages: tuple[StageLayout, ...]) -> None:
        if stages not in seen:
            seen.add(stages)
            out.append(stages)

    # pure: s_k stages of kind k (0: the kind left out)
    ranges = [range(0, min(len(k.nodes), max_stages) + 1) for k in kinds]
    for counts in itertools.product(*ranges):
        S = sum(counts)
        if not 1 <= S <= max_stages:
            continue
        used = [(k, c) for k, c in zip(kinds, counts) if c > 0]
        for order in itertools.permutations(used):
            add(tuple(StageLayout((part(k, g),)) for k, c in order for g in _chunks(k.nodes, c)))
            if num_layers is None or S == len(order) or S > num_layers:
                continue  # one stage per kind: nothing to split unevenly
            rates = [len(k.nodes) * (block_rates or {}).get(k.device_type, 1.0) for k, _ in order]
            centre = [num_layers * r / sum(rates) for r in rates]
            reach = window if block_rates else num_layers
            for totals in _block_totals([c for _, c in order], num_layers, centre, reach):
                groups = [_proportional(k.nodes, [len(b) for b in _chunks(tuple(range(t)), c)])
                          for (k, c), t in zip(order, totals)]
                if all(g is not None for g in groups):
                    add(tuple(StageLayout((part(k, g),)) for (k, _), gs in zip(order, groups) for g in gs))
    # mixed: every stage an even share of every kind
    if len(kinds) > 1:
        for S in range(1, min(max_stages, min(len(k.nodes) for k in kinds)) + 1):
            groups = [_chunks(k.nodes, S) for k in kinds]
            add(tuple(StageLayout(tuple(part(k, groups[i][s]) for i, k in enumerate(kinds))) for s in range(S)))
    return out


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def solve_scale(cluster: ClusterSpec, costs: ScaleCosts, global_batch: int, *, max_tp: int = 8,
                max_stages: int = DEFAULT_MAX_STAGES, shortlist: int = DEFAULT_SHORTLIST,
                time_limit_s: float = 60.0) -> ScaleResult:
    """The fastest plan of the families (module docstring). ValueError on bad input or when nothing fits."""
    if max_tp not in TP_DEGREES:
        raise ValueError(f"max_tp must be one of {', '.join(map(str, TP_DEGREES))}, got {max_tp!r}")
    if global_batch < 1:
        raise ValueError(f"global batch must be >= 1, got {global_batch}")
    start = time.perf_counter()
    kinds = node_kinds(cluster)
    tp_options = {}
    for k in kinds:
        opts = [t for t in costs.tp_degrees(k.device_type) if t <= max_tp and k.gpus_per_node % t == 0
                and costs.spec.num_heads % t == 0]
        if not opts:
            raise ValueError(f"no measured compute for {k.device_type} at a TP degree <= {max_tp} "
                             f"(measured: {costs.tp_degrees(k.device_type) or 'none'})")
        tp_options[k.device_type] = opts
    pricer = StructurePricer(costs, global_batch)
    rates = block_rates(costs, kinds, max_tp)
    candidates: list[tuple[float, int, Structure]] = []
    for tps in itertools.product(*(tp_options[k.device_type] for k in kinds)):
        tp_of = {k.device_type: t for k, t in zip(kinds, tps)}
        for layouts in enumerate_layouts(kinds, tp_of, max_stages, costs.spec.num_layers, rates):
            if len(layouts) > costs.spec.num_layers:
                continue
            most = min(sum(p.num_replicas * costs.max_rows(p.device_type, p.tp) for p in lay.parts) for lay in layouts)
            fewest = min(lay.num_replicas for lay in layouts)
            for b in _divisors(global_batch):
                # fewer rows than a quarter of the smallest stage's TP groups leaves most of it idle:
                # such a structure is the same structure on fewer nodes, which the families hold
                if b > most or 4 * b < fewest:
                    continue
                st = Structure(layouts, b, global_batch // b)
                candidates.append((pricer.lower_bound_s(st), len(candidates), st))
    # priced in the order of their lower bounds; one whose bound cannot enter the shortlist (the
    # `shortlist` best estimates so far, and the best flat one) is skipped: the shortlist is exact
    candidates.sort(key=lambda c: (c[0], c[1]))
    priced: list[StructurePrice] = []
    best: list[float] = []  # the shortlist's estimates, ascending
    best_flat = math.inf
    status, num = "complete", 0
    for bound, _, st in candidates:
        if bound == math.inf:
            continue
        flat = st.num_stages == 1
        if len(best) >= shortlist and bound >= best[shortlist - 1] and (not flat or bound >= best_flat):
            continue
        if time.perf_counter() - start > time_limit_s:
            status = "time_limit"
            break
        num += 1
        found = pricer.price(st)
        if found is None:
            continue
        priced.append(found)
        best = sorted(best + [found.estimate_s])[:shortlist]
        if flat:
            best_flat = min(best_flat, found.estimate_s)
    if not priced:
        raise ValueError(f"no plan fits: no structure of {len(cluster.nodes)} nodes holds the model at global "
                         f"batch {global_batch} within memory")
    priced.sort(key=lambda p: p.estimate_s)
    flat = [p for p in priced if p.structure.num_stages == 1]
    chosen = priced[:shortlist] + ([flat[0]] if flat and flat[0] not in priced[:shortlist] else [])
    plans = []
    for p in chosen:
        exact = price_exactly(cluster, pricer, p)
        if exact is not None:
            plans.append(exact)
    if not plans:
        raise ValueError("no plan fits once priced exactly (the shortlisted structures' exact memory refused them)")
    best = min(plans, key=lambda p: p.iteration_s)
    flats = [p for p in plans if p.structure.num_stages == 1]
    bound = fluid_bound_s(costs, kinds, global_batch, max_tp)
    return ScaleResult(status, best, min(flats, key=lambda p: p.iteration_s) if flats else None, bound, num,
                       len(plans), time.perf_counter() - start)


def block_rates(costs: ScaleCosts, kinds: list[NodeKind], max_tp: int) -> dict[str, float]:
    """Per GPU type, the blocks per second one node computes per sample at its cheapest measured
    GPU-seconds per sample of the middle unit (any TP degree ≤ max_tp dividing the node, any measured
    micro-batch): how the uneven node splits share the blocks among the kinds."""
    unit = costs.num_units // 2
    out = {}
    for k in kinds:
        best = cheapest_sample_s(costs, k, unit, max_tp)
        out[k.device_type] = k.gpus_per_node / best if best < math.inf else 0.0
    return out


def cheapest_sample_s(costs: ScaleCosts, kind: NodeKind, unit: int, max_tp: int) -> float:
    """The least GPU-seconds per sample of `unit` on `kind` over its measured TP degrees (≤ max_tp,
    dividing the node) and micro-batches; inf where nothing is measured."""
    best = math.inf
    for tp in costs.tp_degrees(kind.device_type):
        if tp > max_tp or kind.gpus_per_node % tp:
            continue
        table = costs.tables[(kind.device_type, tp)]
        for r in table.micro_batches:
            fb = table.range_s(unit, unit + 1, r)
            if fb is not None:
                best = min(best, tp * (fb[0] + fb[1]) / r)
    return best


def fluid_bound_s(costs: ScaleCosts, kinds: list[NodeKind], global_batch: int, max_tp: int) -> float:
    """The fluid compute bound (module docstring): min T such that fractions y[t,u] of every unit's
    samples over the types satisfy Σ_t y[t,u] = B and Σ_u w[t,u]·y[t,u] ≤ n_t·T, with w[t,u] the
    cheapest measured GPU-seconds per sample of unit u on type t. Solved exactly as an LP (PuLP)."""
    import pulp

    units = range(costs.num_units)
    w = {}
    for k in kinds:
        for u in units:
            w[(k.device_type, u)] = cheapest_sample_s(costs, k, u, max_tp)
    prob = pulp.LpProblem("fluid_bound", pulp.LpMinimize)
    # T: the iteration's compute time
    T = pulp.LpVariable("T", lowBound=0)
    # y[t,u]: samples of unit u computed on type t
    y = {(k.device_type, u): pulp.LpVariable(f"y_{i}_{u}", lowBound=0) for i, k in enumerate(kinds) for u in units
         if w[(k.device_type, u)] < math.inf}
    prob += T
    for u in units:  # every sample passes every unit
        prob += pulp.lpSum(v for (t, uu), v in y.items() if uu == u) == global_batch
    for k in kinds:  # each type's GPU-seconds within its GPUs' time
        prob += pulp.lpSum(w[(t, u)] * v for (t, u), v in y.items() if t == k.device_type) \
            <= len(k.nodes) * k.gpus_per_node * T
    prob.solve(pulp.PULP_CBC_CMD(msg=False, timeLimit=10))
    if pulp.LpStatus[prob.status] != "Optimal":
        return 0.0
    return float(T.value())


__all__ = ["NodeKind", "ScaleResult", "node_kinds", "enumerate_layouts", "solve_scale", "fluid_bound_s", "block_rates",
           "DEFAULT_MAX_STAGES", "TP_DEGREES"]
