"""Atlas: plan one training job across datacenters (arXiv 2411.14458).

Pipeline parallelism across datacenters, data parallelism inside each: every one
of `num_pipelines` pipelines runs the same chain of stages, a DC holding `k` of
them uses `num_pipelines · k` of its GPUs. The search chooses

- which datacenters and which of their GPU types ("units": a DC's GPUs of one
  type), in which pipeline order (consecutive DCs need a WAN link);
- the DP degree (`num_pipelines`, a divisor of the micro-batch count) and the
  number of stages per unit, hence how many GPUs of each DC are used;
- the layer split: minimize the slowest stage's time subject to each stage's
  memory (`geo_costs`), with 1F1B's in-flight micro-batches per stage;
- activation recomputation, when memory needs it;
- `k` TCP connections per WAN transfer (the fewest that reach the link rate:
  `min(link, k · window/RTT)`), and the order in which the pipelines take turns
  on each WAN link (temporal sharing: "fifo" or "pipeline" priority).

Candidates are ranked by a closed-form 1F1B estimate, the best few are run
through the discrete-event simulator (`pipeline_sim`), and the simulated
iteration time decides. The baselines (`geo_eval`) use the same search and simulator.
"""
from __future__ import annotations

import heapq
import itertools
import logging
import math
import time
from dataclasses import dataclass, replace
from typing import Any

from planner.core.catalog import get_gpu_type
from planner.geo.costs import GeoCosts, StageCost
from planner.core.constants import BITS_PER_BYTE, GBIT
from planner.geo.scenario import INTRA_DC_LATENCY_S, GeoScenario
from planner.geo.pipeline_sim import Channel, PipelineJob, SimResult, Stage, simulate_pipeline

log = logging.getLogger(__name__)

MAX_CONNECTIONS = 64  # past a few dozen parallel streams, real stacks lose to per-flow overheads
STAGE_OPTIONS = (1, 2, 4, 8)  # stages per DC tried (plus "all the DC's GPUs")
MAX_COMBINATIONS = 2000  # above this many stage-count combinations, try only {1, all}
SIMULATE_TOP = 16  # most candidates (by the closed-form estimate) run through the simulator
KEEP_PER_SUBSET = 3  # candidates kept per subset of datacenters
SHORTLIST_FACTOR = 2.0  # simulate the kept candidates estimated within 2x of the best
TIE_TOLERANCE = 1e-12  # equal iteration times (to rounding): more room for prefill, then fewer GPUs


@dataclass(frozen=True)
class StagePlan:
    dc: str
    gpu_type: str
    first_layer: int
    num_layers: int
    forward_s: float  # one micro-batch
    backward_s: float
    allreduce_s: float  # the stage's DP gradient all-reduce inside its DC
    memory_bytes: int  # predicted peak per GPU
    capacity_bytes: int  # GPU memory × headroom
    optimizer_s: float = 0.0  # AdamW over one GPU's shard of the stage, once per step

    def label(self) -> str:
        last = self.first_layer + self.num_layers - 1
        return f"{self.dc} {self.gpu_type} L{self.first_layer}-{last}"

    def to_dict(self) -> dict[str, Any]:
        return {"dc": self.dc, "gpu_type": self.gpu_type, "first_layer": self.first_layer,
                "num_layers": self.num_layers, "forward_s": self.forward_s, "backward_s": self.backward_s,
                "allreduce_s": self.allreduce_s, "optimizer_s": self.optimizer_s,
                "memory_bytes": self.memory_bytes, "capacity_bytes": self.capacity_bytes}


@dataclass(frozen=True)
class GeoPlan:
    chain: tuple[str, ...]  # datacenters in pipeline order
    stages: tuple[StagePlan, ...]
    num_pipelines: int  # DP degree inside each datacenter
    num_microbatches: int  # per pipeline
    recompute: str
    connections: tuple[tuple[str, int], ...]  # ("a-b", TCP connections per transfer) per WAN hop
    link_order: str  # whose turn on a WAN link: "fifo" or "pipeline"
    sharing: str = "temporal"  # "temporal" (Atlas) or "fair"

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    def gpus_per_dc(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for s in self.stages:
            out[s.dc] = out.get(s.dc, 0) + self.num_pipelines
        return out

    @property
    def num_gpus(self) -> int:
        return self.num_pipelines * self.num_stages

    def layer_split(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for s in self.stages:
            out[s.dc] = out.get(s.dc, 0) + s.num_layers
        return out

    def to_dict(self) -> dict[str, Any]:
        return {"datacenters": list(self.chain), "gpus_per_dc": self.gpus_per_dc(),
                "layers_per_dc": self.layer_split(), "dp_degree": self.num_pipelines,
                "num_stages": self.num_stages, "microbatches_per_pipeline": self.num_microbatches,
                "recompute": self.recompute, "connections": dict(self.connections),
                "link_order": self.link_order, "wan_sharing": self.sharing,
                "stages": [s.to_dict() for s in self.stages]}


def _link_name(x: str, y: str) -> str:
    return f"{x}-{y}"


def build_job(scenario: GeoScenario, costs: GeoCosts, plan: GeoPlan, schedule: str = "1f1b") -> PipelineJob:
    """The simulator's view of a plan: stages, and a channel per boundary (LAN or WAN link)."""
    channels: dict[str, Channel] = {}
    hops = []
    conns = dict(plan.connections)
    for a, b in zip(plan.stages, plan.stages[1:]):
        if a.dc == b.dc:
            dc = scenario.datacenter(a.dc)
            name = f"lan:{a.dc}"
            channels[name] = Channel(name, INTRA_DC_LATENCY_S, dc.intra_dc_gbps, dc.intra_dc_gbps)
        else:
            link = scenario.link(a.dc, b.dc)
            name = _link_name(a.dc, b.dc)
            channels[name] = Channel(name, link.one_way_latency_s, link.throughput_gbps(conns[name]), link.gbps,
                                     plan.sharing)
        hops.append(name)
    stages = tuple(Stage(s.forward_s, s.backward_s, s.allreduce_s, s.label(), s.optimizer_s) for s in plan.stages)
    return PipelineJob(stages, tuple(hops), tuple(channels.values()), plan.num_pipelines,
                       plan.num_microbatches, costs.transfer_bytes, schedule, plan.link_order)


Unit = tuple[str, str]  # (datacenter, GPU type): the GPUs of one type in one DC
MAX_UNITS = 6  # more (DC, type) groups than this: each DC offers only its type of most TFLOP/s


def _units(scenario: GeoScenario) -> list[Unit]:
    units = [(dc.name, g) for dc in scenario.datacenters for g, _ in dc.gpus]
    if len(units) <= MAX_UNITS:
        return units
    return [(dc.name, max(dc.gpus, key=lambda gn: gn[1] * get_gpu_type(gn[0]).peak_tflops(scenario.dtype))[0])
            for dc in scenario.datacenters]


def _chains(scenario: GeoScenario, all_datacenters: bool = False) -> dict[frozenset, list[tuple[Unit, ...]]]:
    """Per set of units: its orders in which consecutive units are in one DC or share a WAN link,
    and a DC's units are next to each other (the pipeline crosses each WAN link once)."""
    units = _units(scenario)
    names = {dc.name for dc in scenario.datacenters}
    out: dict[frozenset, list[tuple[Unit, ...]]] = {}
    for n in range(1, len(units) + 1):
        for perm in itertools.permutations(units, n):
            dcs = [u[0] for u in perm]
            runs = [x for i, x in enumerate(dcs) if i == 0 or dcs[i - 1] != x]
            if len(runs) != len(set(runs)) or (all_datacenters and set(runs) != names):
                continue
            if all(x == y or scenario.has_link(x, y) for x, y in zip(dcs, dcs[1:])):
                out.setdefault(frozenset(perm), []).append(perm)
    return out


def _divisors(n: int, limit: int) -> list[int]:
    return [d for d in range(1, min(n, limit) + 1) if n % d == 0]


def split_layers(layer_s: list[float], head_s: float, caps: list[int], num_layers: int) -> list[int] | None:
    """Layers per stage minimizing the slowest stage (stage j: n_j · layer_s[j], plus head_s on the
    last), then the total compute (one micro-batch's pass), with 1 <= n_j <= caps[j] and
    Σ n_j = num_layers; None when no split fits.

    Exact: the optimal bottleneck T is one of the finitely many stage times n · layer_s[j]
    (+ head_s), and T is feasible iff Σ_j min(caps[j], ⌊(T − head_j) / layer_s[j]⌋) >= num_layers
    with every term >= 1 (monotone in T: a binary search over the sorted candidates). At that T,
    every stage gets one layer and the rest go to the fastest stages first, each up to its room."""
    p = len(layer_s)
    if p > num_layers or any(c < 1 for c in caps) or sum(min(c, num_layers) for c in caps) < num_layers:
        return None
    head = [head_s if j == p - 1 else 0.0 for j in range(p)]

    def room(t: float) -> list[int] | None:
        out = []
        for j in range(p):
            n = min(caps[j], num_layers, int((t - head[j]) / layer_s[j] * (1 + 1e-12) + 1e-9))
            if n < 1:
                return None
            out.append(n)
        return out if sum(out) >= num_layers else None

    times = sorted({n * layer_s[j] + head[j] for j in range(p) for n in range(1, min(caps[j], num_layers) + 1)})
    lo, hi = 0, len(times) - 1  # times[hi] is feasible (every stage at its cap reaches num_layers)
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if room(times[mid]) is not None else (mid + 1, hi)
    upper = room(times[lo])
    counts, left = [1] * p, num_layers - p
    for j in sorted(range(p), key=lambda j: (layer_s[j], j)):
        add = min(upper[j] - 1, left)
        counts[j] += add
        left -= add
    return counts


def _estimate_s(plan_stages: list[StageCost], hops: list[tuple[float, float, float]], d: int, m: int,
                costs: GeoCosts) -> float:
    """Closed-form 1F1B iteration time used only to rank candidates: one micro-batch's round trip
    through every stage and hop, then (m-1) periods of the bottleneck. The period is the slowest
    of: a stage's compute; a shared WAN direction's busy time per period (d transfers); and
    1F1B's in-flight limit: stage j keeps at most min(p-j, m) micro-batches in flight, so it
    waits for the round trip from j to the end and back once per that many micro-batches.
    hops: (one transfer's serialisation s, latency s, the link's busy s per period)."""
    p = len(plan_stages)
    period = max(s.forward_s + s.backward_s for s in plan_stages)
    for _, _, busy in hops:
        period = max(period, busy)
    trip = 0.0
    for j in range(p - 1, -1, -1):
        trip += plan_stages[j].forward_s + plan_stages[j].backward_s
        if j < p - 1:
            trip += 2 * (hops[j][0] + hops[j][1])
        period = max(period, trip / costs.in_flight(j, p, m))
    return trip + (m - 1) * period + max(s.allreduce_s + s.optimizer_s for s in plan_stages)


NETWORKS = ("atlas", "single_fair")  # k saturating connections + temporal sharing | 1 connection + fair sharing


@dataclass(frozen=True)
class _Candidate:
    estimate_s: float
    num_gpus: int
    plan: GeoPlan


def _wan_hops(scenario: GeoScenario, chain: tuple[Unit, ...], network: str) -> dict:
    """(connections, per-transfer Gbit/s, link Gbit/s, one-way latency) per consecutive DC pair."""
    out = {}
    for (x, _), (y, _) in zip(chain, chain[1:]):
        if x == y:
            continue
        link = scenario.link(x, y)
        k = min(MAX_CONNECTIONS, link.connections_to_saturate()) if network == "atlas" else 1
        out[(x, y)] = (k, link.throughput_gbps(k), link.gbps, link.one_way_latency_s)
    return out


def _lower_bound_s(costs: GeoCosts, where_types: list[str], wan_busy: float, m: int, rc: str) -> float:
    """A bound no plan of these stages beats (branch and bound): the stage time can be no lower
    than the perfectly balanced L / Σ(1/t_j), the first micro-batch crosses every layer."""
    inv = sum(1.0 / costs.layer_time_s(g, rc) for g in where_types)
    balanced = costs.spec.num_layers / inv
    fastest = min(costs.layer_time_s(g, rc) for g in where_types)
    return (m - 1) * max(balanced, wan_busy) + costs.spec.num_layers * fastest


def _candidates(scenario: GeoScenario, costs: GeoCosts, network: str, all_datacenters: bool,
                keep: int) -> tuple[list[_Candidate], int]:
    """The `keep` best candidates by estimate of every set of units (a DC's GPUs of one type),
    and how many configurations were considered.

    Phase 1 searches the DP degree and the stages per unit for each set of units in one
    order (compute and memory barely depend on the order); phase 2 puts each kept
    configuration in its best order (the WAN hops, latencies and first/last stage differ)."""
    num_mb = scenario.global_batch // scenario.micro_batch
    L = costs.spec.num_layers
    bits = costs.transfer_bytes * BITS_PER_BYTE
    considered = 0
    out: list[_Candidate] = []
    for orders in _chains(scenario, all_datacenters).values():
        best: list[tuple[float, int, int, _Candidate]] = []  # max-heap of the kept: (-estimate, -gpus, id, cand)
        counter = itertools.count()
        chain = orders[0]
        wan = _wan_hops(scenario, chain, network)
        counts = [dict(scenario.datacenter(dc).gpus)[g] for dc, g in chain]
        for d in sorted(_divisors(num_mb, min(counts)), reverse=True):
            m = num_mb // d
            # the busiest WAN direction per period (temporal: d transfers in a row; fair: link-bound)
            wan_busy = max([d * bits / (r * GBIT) if network == "atlas" else
                            max(bits / (r * GBIT), d * bits / (cap * GBIT)) for _, r, cap, _ in wan.values()],
                           default=0.0)
            options = [sorted({k for k in STAGE_OPTIONS if k <= c // d} | {min(c // d, L)}, reverse=True)
                       for c in counts]
            if math.prod(len(o) for o in options) > MAX_COMBINATIONS:
                options = [sorted({1, o[0]}, reverse=True) for o in options]
            for ks in itertools.product(*options):
                if sum(ks) > L:
                    continue
                considered += 1
                where_types = [g for (_, g), k in zip(chain, ks) for _ in range(k)]
                for rc in ("none", "full"):
                    if len(best) >= keep and _lower_bound_s(costs, where_types, wan_busy, m, rc) >= -best[0][0]:
                        continue
                    cand = _make_candidate(scenario, costs, chain, ks, d, m, rc, wan, network)
                    if cand is not None:
                        heapq.heappush(best, (-cand.estimate_s, -cand.num_gpus, next(counter), cand))
                        if len(best) > keep:
                            heapq.heappop(best)
                        break  # recomputation only when the plan does not fit without it
        for _, _, _, cand in best:  # phase 2
            p = cand.plan
            per_unit = {u: sum(1 for s in p.stages if (s.dc, s.gpu_type) == u) for u in orders[0]}
            for other_chain in orders[1:]:
                considered += 1
                other = _make_candidate(scenario, costs, other_chain, [per_unit[u] for u in other_chain],
                                        p.num_pipelines, p.num_microbatches, p.recompute,
                                        _wan_hops(scenario, other_chain, network), network)
                if other is not None and other.estimate_s < cand.estimate_s:
                    cand = other
            out.append(cand)
    return sorted(out, key=lambda c: (c.estimate_s, c.num_gpus)), considered


def _make_candidate(scenario, costs, chain, ks, d, m, rc, wan, network) -> _Candidate | None:
    where = [u for u, k in zip(chain, ks) for _ in range(k)]
    p = len(where)
    layer_s = [costs.layer_time_s(g, rc) for _, g in where]
    head_s = costs.head_time_s(where[-1][1], rc)
    caps = [costs.max_layers(g, j, p, m, d, rc) for j, (_, g) in enumerate(where)]
    split = split_layers(layer_s, head_s, caps, costs.spec.num_layers)
    if split is None:
        return None
    stages, first = [], 0
    for j, ((dc, g), n) in enumerate(zip(where, split)):
        stages.append(costs.stage_cost(dc, g, first, n, j, p, m, d, rc))
        first += n
    bits = costs.transfer_bytes * BITS_PER_BYTE
    hops = []
    for a, b in zip(where, where[1:]):
        if a[0] == b[0]:
            wire = bits / (scenario.datacenter(a[0]).intra_dc_gbps * GBIT)
            hops.append((wire, INTRA_DC_LATENCY_S, wire))
        else:
            _, rate, cap, lat = wan[(a[0], b[0])]
            wire = bits / (rate * GBIT)
            # temporal: d transfers one after another; fair: d at once, at most the link's capacity
            busy = d * wire if network == "atlas" else max(wire, d * bits / (cap * GBIT))
            hops.append((wire, lat, busy))
    dcs = tuple(x for i, (x, _) in enumerate(chain) if i == 0 or chain[i - 1][0] != x)
    plan = GeoPlan(
        dcs, tuple(StagePlan(s.dc, s.gpu_type, s.first_layer, s.num_layers, s.forward_s, s.backward_s,
                               s.allreduce_s, s.memory_bytes, s.capacity_bytes, s.optimizer_s) for s in stages),
        d, m, rc, tuple((_link_name(x, y), wan[(x, y)][0]) for x, y in zip(dcs, dcs[1:])), "fifo",
        "temporal" if network == "atlas" else "fair")
    return _Candidate(_estimate_s(stages, hops, d, m, costs), plan.num_gpus, plan)


def _better(a: tuple[float, int, int], b: tuple[float, int, int] | None) -> bool:
    """(iteration_s, -prefill-capable GPUs, GPUs): faster wins; only at an equal time (to rounding,
    TIE_TOLERANCE relative) the plan leaving more GPUs room for prefill, then the one with fewer GPUs.
    A slower plan never wins, so the result is never slower than any plan it was compared with."""
    if b is None:
        return True
    if abs(a[0] - b[0]) <= TIE_TOLERANCE * min(a[0], b[0]):
        return a[1:] < b[1:] and a[0] <= b[0]
    return a[0] < b[0]


def prefill_capable_gpus(plan: GeoPlan, prefill_bytes: int | None) -> int:
    """GPUs whose stage leaves `prefill_bytes` free (0 without a prefill workload)."""
    if not prefill_bytes:
        return 0
    return plan.num_pipelines * sum(1 for s in plan.stages if s.capacity_bytes - s.memory_bytes >= prefill_bytes)


@dataclass(frozen=True)
class AtlasResult:
    plan: GeoPlan
    sim: SimResult
    num_candidates: int
    solve_time_s: float


def solve_atlas(scenario: GeoScenario, costs: GeoCosts | None = None, schedule: str = "1f1b",
                network: str = "atlas", all_datacenters: bool = False,
                simulate_top: int = SIMULATE_TOP, prefill_bytes: int | None = None,
                compare_with: tuple[GeoPlan, ...] = ()) -> AtlasResult:
    """The fastest memory-feasible plan (by simulated iteration time) for `scenario`.

    `network="single_fair"` with `all_datacenters=True` is the pipeline baseline: the same
    search, but one TCP connection per transfer, fair sharing, and every datacenter used.
    `compare_with`: plans (the baselines') simulated beside the search's shortlist; the result is
    the fastest of all, so it is never slower than any of them."""
    if network not in NETWORKS:
        raise ValueError(f"network must be one of {NETWORKS}, got {network!r}")
    t0 = time.perf_counter()
    costs = costs or GeoCosts(scenario, schedule)
    if costs.schedule != schedule:
        raise ValueError(f"cost tables are for {costs.schedule}, not {schedule}")
    cands, considered = _candidates(scenario, costs, network, all_datacenters, keep=KEEP_PER_SUBSET)
    if not cands:
        raise ValueError(
            f"no memory-feasible plan{' using every datacenter' if all_datacenters else ''}: {costs.spec.name} "
            f"at micro_batch {scenario.micro_batch}, seq {scenario.seq} does not fit the GPUs "
            f"even with recomputation and one layer per GPU"
        )
    # the estimate only ranks: simulate every kept configuration that is not far off the best
    # the best of each subset of datacenters first, then the rest by estimate
    firsts, seen = [], set()
    for c in cands:
        if frozenset(c.plan.chain) not in seen:
            seen.add(frozenset(c.plan.chain))
            firsts.append(c)
    rest = [c for c in cands if c not in firsts]
    shortlist = [c for c in firsts + rest if c.estimate_s <= SHORTLIST_FACTOR * cands[0].estimate_s][:simulate_top]
    best: tuple[float, int, int] | None = None
    best_plan, best_sim = None, None
    for plan in [c.plan for c in shortlist] + list(compare_with):
        sim = simulate_pipeline(build_job(scenario, costs, plan, schedule))
        key = (sim.iteration_s, -prefill_capable_gpus(plan, prefill_bytes), plan.num_gpus)
        if _better(key, best):
            best, best_plan, best_sim = key, plan, sim
    if network == "atlas" and best_plan.num_pipelines > 1 and len(best_plan.chain) > 1:
        plan = replace(best_plan, link_order="pipeline")  # the other turn-taking rule on the WAN
        sim = simulate_pipeline(build_job(scenario, costs, plan, schedule))
        if _better((sim.iteration_s, *best[1:]), best) and sim.iteration_s < best[0]:
            best, best_plan, best_sim = (sim.iteration_s, *best[1:]), plan, sim
    log.info("geo %s: %d configurations, simulated %d (+%d compared), best %.3f s", network, considered,
             len(shortlist), len(compare_with), best[0])
    return AtlasResult(best_plan, best_sim, considered, time.perf_counter() - t0)
