"""Atlas's search: every pipeline structure, each with its exactly best layer split.

A structure is an ordered chain of units (one datacenter's GPUs of one type), the stages per unit,
the data-parallel degree and the recompute mode; all are enumerated (cut to fewer stage counts past
MAX_STRUCTURES, then refused). Each is priced by a closed-form 1F1B estimate E (stage times, the
first micro-batch's boundary crossings, the busiest WAN direction per period, stage 0's tail), and
`split_for_estimate` finds the layer split minimizing E exactly. Structures are evaluated in order
of a lower bound on E (branch and bound); the simulator (pipeline_sim) decides among the best.

The estimate's terms and why the split is exact: docs/models/pipeline_simulation.md ("Atlas's search").
"""
from __future__ import annotations

import bisect
import heapq
import itertools
import logging
from dataclasses import dataclass

from contracts.catalog import get_gpu_type
from planner.costmodel.collectives import bytes_per_s
from planner.geo.costs import GeoCosts
from planner.geo.scenario import INTRA_DC_LATENCY_S, GeoScenario

log = logging.getLogger(__name__)

Unit = tuple[str, str]  # (datacenter, GPU type): the GPUs of one type in one DC
MAX_UNITS = 6  # more (DC, type) groups than this: each DC offers only its type of most TFLOP/s
MAX_CONNECTIONS = 64  # past a few dozen parallel streams, real stacks lose to per-flow overheads
NETWORKS = ("atlas", "single_fair")  # k saturating connections + temporal sharing | 1 connection + fair sharing
RECOMPUTES = ("none", "full")
STAGE_OPTIONS = (1, 2, 4, 8)  # stages per unit tried when the full enumeration is too large
MAX_STRUCTURES = 400_000  # structures (with both recompute modes) enumerated in full
KEEP_PER_SUBSET = 2  # candidates kept per subset of units, beside the best overall
KEEP_OVERALL = 40  # candidates kept overall (the estimate ranks them; the simulator decides among them)


def units(scenario: GeoScenario) -> list[Unit]:
    out = [(dc.name, g) for dc in scenario.datacenters for g, _ in dc.gpus]
    if len(out) <= MAX_UNITS:
        return out
    return [(dc.name, max(dc.gpus, key=lambda gn: gn[1] * get_gpu_type(gn[0]).peak_tflops(scenario.dtype))[0])
            for dc in scenario.datacenters]


def chains(scenario: GeoScenario, all_datacenters: bool = False) -> dict[frozenset, list[tuple[Unit, ...]]]:
    """Per set of units: its orders in which consecutive units are in one DC or share a WAN link,
    and a DC's units are next to each other (the pipeline crosses each WAN link once)."""
    names = {dc.name for dc in scenario.datacenters}
    out: dict[frozenset, list[tuple[Unit, ...]]] = {}
    pool = units(scenario)
    for n in range(1, len(pool) + 1):
        for perm in itertools.permutations(pool, n):
            dcs = [u[0] for u in perm]
            runs = [x for i, x in enumerate(dcs) if i == 0 or dcs[i - 1] != x]
            if len(runs) != len(set(runs)) or (all_datacenters and set(runs) != names):
                continue
            if all(x == y or scenario.has_link(x, y) for x, y in zip(dcs, dcs[1:])):
                out.setdefault(frozenset(perm), []).append(perm)
    return out


def divisors(n: int, limit: int) -> list[int]:
    return [d for d in range(1, min(n, limit) + 1) if n % d == 0]


def split_layers(layer_s: list[float], head_s: float, caps: list[int], num_layers: int) -> list[int] | None:
    """Layers per stage minimizing the slowest stage, then the total compute (`split_for_estimate`
    with an overwhelming weight on the slowest stage)."""
    got = split_for_estimate(layer_s, head_s, caps, num_layers, weight=float("inf"))
    return None if got is None else got[0]


def split_for_estimate(layer_s: list[float], head_s: float, caps: list[int], num_layers: int, weight: float,
                       floor_s: float = 0.0,
                       tails: list[tuple[float, float]] | None = None) -> tuple[list[int], float] | None:
    """The split minimizing  Σ_j n_j · layer_s[j] + max_j g_j(n_j),
    g_j(n) = weight · max(n · layer_s[j] + head_j, floor_s) + a_j + b_j · n  (tails[j] = (a_j, b_j) >= 0,
    head_j = head_s on the last stage), with 1 <= n_j <= caps[j] and Σ n_j = num_layers: (counts, the
    value) or None when no split fits. weight = inf: the smallest max_j (n_j · layer_s[j] + head_j), then
    the smallest sum (tails ignored).

    Exact: every g_j increases with n, so at a bound X on the max each stage can take up to
    u_j(X) = max{n <= caps[j] : g_j(n) <= X} layers, and the cheapest split under that bound gives every
    stage one layer and the rest to the stages of the smallest layer_s first. The optimal X is one of
    the finitely many g_j(n): the smallest feasible one is found by bisection, then larger ones are
    scanned until the sum's floor plus X alone cannot beat the best found."""
    p = len(layer_s)
    if p > num_layers or any(c < 1 for c in caps) or sum(min(c, num_layers) for c in caps) < num_layers:
        return None
    tails = tails or [(0.0, 0.0)] * p
    head = [head_s if j == p - 1 else 0.0 for j in range(p)]
    top = [min(c, num_layers) for c in caps]
    lists: dict[tuple, list[float]] = {}  # stages alike (type, cap, tail) share one list
    g = []
    for j in range(p):
        key = (layer_s[j], head[j], top[j], tails[j])
        if key not in lists:
            if weight == float("inf"):
                lists[key] = [n * layer_s[j] + head[j] for n in range(1, top[j] + 1)]
            else:
                a, b = tails[j]
                lists[key] = [weight * max(n * layer_s[j] + head[j], floor_s) + a + b * n
                              for n in range(1, top[j] + 1)]
        g.append(lists[key])
    order = sorted(range(p), key=lambda j: (layer_s[j], j))

    def fill(x: float) -> list[int] | None:
        upper = [bisect.bisect_right(gj, x * (1 + 1e-12) + 1e-15) for gj in g]
        if min(upper) < 1 or sum(upper) < num_layers:
            return None
        counts, left = [1] * p, num_layers - p
        for j in order:
            add = min(upper[j] - 1, left)
            counts[j] += add
            left -= add
        return counts

    def value(counts: list[int]) -> tuple[float, float]:
        return sum(n * t for n, t in zip(counts, layer_s)), max(gj[n - 1] for gj, n in zip(g, counts))

    bounds = sorted({v for gj in lists.values() for v in gj})
    lo, hi = 0, len(bounds) - 1  # bounds[hi] is feasible: every stage at its cap reaches num_layers
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if fill(bounds[mid]) is not None else (mid + 1, hi)
    best = fill(bounds[lo])
    best_value = sum(value(best))
    if weight == float("inf"):
        return best, best_value
    floor_sum = value(fill(bounds[-1]))[0]  # the smallest sum any split reaches
    for x in bounds[lo + 1:]:
        if floor_sum + x >= best_value:
            break  # a larger bound costs more in the max than the sum can still save
        counts = fill(x)
        v = sum(value(counts))
        if v < best_value:
            best, best_value = counts, v
    return best, best_value


@dataclass(frozen=True)
class Hop:
    wire_s: float  # one transfer's serialisation
    latency_s: float
    busy_s: float  # WAN: the direction's busy time per period (d transfers); 0 on a LAN (a path each)


@dataclass(frozen=True)
class Candidate:
    estimate_s: float  # R: what candidates are ranked by (docs/models/pipeline_simulation.md)
    num_gpus: int
    where: tuple[Unit, ...]  # the unit of each stage, in pipeline order
    counts: tuple[int, ...]  # layers per stage
    num_pipelines: int
    num_microbatches: int
    recompute: str
    connections: tuple[tuple[tuple[str, str], int], ...]  # ((x, y), TCP connections) per WAN hop
    bound_s: float = 0.0  # E of this split: the minimum of E over the structure's splits


class Search:
    """The structures of one scenario, network treatment and cost tables."""

    def __init__(self, scenario: GeoScenario, costs: GeoCosts, network: str = "atlas",
                 all_datacenters: bool = False):
        if network not in NETWORKS:
            raise ValueError(f"network must be one of {NETWORKS}, got {network!r}")
        self.scenario, self.costs, self.network = scenario, costs, network
        self.chains = chains(scenario, all_datacenters)
        self.num_mb = scenario.global_batch // scenario.micro_batch
        self.L = costs.spec.num_layers
        self.considered = 0
        self._tails: dict[tuple, tuple[float, float]] = {}
        self._hops: dict[tuple, Hop] = {}
        self._caps: dict[tuple, int] = {}
        self._times: dict[tuple, tuple[float, float]] = {}

    def times(self, gpu_type: str, rc: str) -> tuple[float, float]:
        """(one layer, the head) forward+backward of one micro-batch."""
        key = (gpu_type, rc)
        if key not in self._times:
            self._times[key] = (self.costs.layer_time_s(gpu_type, rc), self.costs.head_time_s(gpu_type, rc))
        return self._times[key]

    def cap(self, gpu_type: str, j: int, p: int, m: int, d: int, rc: str) -> int:
        # a stage's memory depends on its position only through first / last, its micro-batches in
        # flight and the step's micro-batches (planner/costmodel/pipeline.stage_memory_bytes)
        key = (gpu_type, j == 0, j == p - 1, self.costs.in_flight(j, p, m), m, d, rc)
        if key not in self._caps:
            self._caps[key] = self.costs.max_layers(gpu_type, j, p, m, d, rc)
        return self._caps[key]

    def connections(self, x: str, y: str) -> int:
        link = self.scenario.link(x, y)
        return min(MAX_CONNECTIONS, link.connections_to_saturate()) if self.network == "atlas" else 1

    def hop(self, a: Unit, b: Unit, d: int) -> Hop:
        key = (a[0], b[0], d)
        if key not in self._hops:
            self._hops[key] = self._hop(a, b, d)
        return self._hops[key]

    def _hop(self, a: Unit, b: Unit, d: int) -> Hop:
        nbytes = self.costs.transfer_bytes
        if a[0] == b[0]:
            return Hop(nbytes / bytes_per_s(self.scenario.datacenter(a[0]).intra_dc_gbps), INTRA_DC_LATENCY_S, 0.0)
        link = self.scenario.link(a[0], b[0])
        wire = nbytes / bytes_per_s(link.throughput_gbps(self.connections(a[0], b[0])))
        # temporal: d transfers one after another; fair: d at once, at most the link's capacity
        busy = d * wire if self.network == "atlas" else max(wire, d * nbytes / bytes_per_s(link.gbps))
        return Hop(wire, link.one_way_latency_s, busy)

    def tail_terms(self, unit: Unit, first: bool, last: bool, d: int, rc: str) -> tuple[float, float]:
        """(intercept, per-layer slope) of a stage's collectives + optimizer step, once per step
        after its last backward (affine in its layers)."""
        key = (unit, first, last, d, rc)
        if key not in self._tails:
            m = self.costs.model
            link = self.costs.dc_link(unit[0])

            def tail(n: int) -> float:
                return (m.sync_s(unit[1], n, first, last, d, link)
                        + m.optimizer_s(unit[1], rc, m.stage_params(n, first, last), d))

            slope = tail(2) - tail(1)
            self._tails[key] = (tail(1) - slope, slope)
        return self._tails[key]

    def _options(self, kmax: int, level: int) -> list[int]:
        """Stage counts tried for a unit of up to `kmax` stages: all of them (level 0), STAGE_OPTIONS
        and all (1), one or all (2), all (3)."""
        if level == 0:
            return list(range(1, kmax + 1))
        return sorted({o for o in (STAGE_OPTIONS, (1,), ())[level - 1] if o <= kmax} | {kmax})

    def _units_of(self, chain: tuple[Unit, ...]) -> list[int]:
        return [dict(self.scenario.datacenter(dc).gpus)[g] for dc, g in chain]

    def structures(self, level: int = 0):
        """(subset, chain, d, ks, rc) of every structure at `level` (`_options`)."""
        for subset, orders in self.chains.items():
            for chain in orders:
                counts = self._units_of(chain)
                for d in divisors(self.num_mb, min(counts)):
                    options = [self._options(min(c // d, self.L), level) for c in counts]
                    for ks in itertools.product(*options):
                        if sum(ks) <= self.L:
                            for rc in RECOMPUTES:
                                yield subset, chain, d, ks, rc

    def count(self, level: int = 0) -> int:
        """Structures at `level`, counted without listing them (a DP over the units' stage counts)."""
        total = 0
        for orders in self.chains.values():
            for chain in orders:
                counts = self._units_of(chain)
                for d in divisors(self.num_mb, min(counts)):
                    ways = {0: 1}
                    for c in counts:
                        nxt: dict[int, int] = {}
                        for s, w in ways.items():
                            for k in self._options(min(c // d, self.L), level):
                                if s + k <= self.L:
                                    nxt[s + k] = nxt.get(s + k, 0) + w
                        ways = nxt
                    total += len(RECOMPUTES) * sum(ways.values())
                    if total > MAX_STRUCTURES:
                        return total  # past the limit: the exact figure does not matter
        return total

    def where(self, chain: tuple[Unit, ...], ks: tuple[int, ...]) -> tuple[Unit, ...]:
        return tuple(u for u, k in zip(chain, ks) for _ in range(k))

    def _fixed(self, chain: tuple[Unit, ...], d: int, rc: str) -> tuple:
        """What a structure's lower bound needs that does not depend on its stage counts."""
        c = self.costs
        tau = [self.times(g, rc)[0] for _, g in chain]
        head = self.times(chain[-1][1], rc)[1]
        hops = [self.hop(a, b, d) for a, b in zip(chain, chain[1:])]
        lan = [2 * (h.wire_s + h.latency_s) for h in (self.hop(u, u, d) for u in chain)]
        H = sum(2 * (h.wire_s + h.latency_s) for h in hops)
        W = max((h.busy_s for h in hops), default=0.0)
        # every stage's tail is at least a middle stage's of its type: no embedding, no head
        tails = [self.tail_terms(u, False, False, d, rc) for u in chain]
        # the most layers a stage of each unit holds: a middle stage (no embedding, head, tokens) at one
        # micro-batch in flight of one per step (stage 1 of 3, m = 1), the least memory per layer
        most = [min(self.cap(g, 1, 3, 1, d, rc), self.L) for _, g in chain]
        steps = sorted({n * t for t, c in zip(tau, most) for n in range(1, c + 1)})
        # a round trip over each boundary between units: what R's in-flight limit charges it
        trips = [2 * (max(h.wire_s, h.busy_s) + h.latency_s) for h in hops]
        return tau, head, lan, H, W, min(a for a, _ in tails), min(b for _, b in tails), most, steps, trips

    def lower_bound(self, fixed: tuple, d: int, ks: tuple[int, ...]) -> float:
        """No split of this structure has a smaller R (docs/models/pipeline_simulation.md): Σ t_j >= L · min τ + head;
        max_j [(m − 1) · max(t_j, W) + tail_j] >= (m − 1) · max(W, the least slowest stage that holds
        the layers within the stages' largest memory caps, one layer plus the head) and >= the
        largest tail, which is at least the average one; R's period is at least each unit boundary's
        in-flight limit with one layer per stage. inf: the layers cannot fit."""
        tau, head, lan, H, W, a_min, b_min, most, steps, trips = fixed
        m, p = self.num_mb // d, sum(ks)
        if sum(k * c for k, c in zip(ks, most)) < self.L:
            return float("inf")  # the layers do not fit even at the fewest micro-batches in flight
        # the smallest slowest stage: the least T at which the stages' rooms min(most, ⌊T/τ⌋) hold L layers
        lo, hi = 0, len(steps) - 1
        while lo < hi:
            mid = (lo + hi) // 2
            t = steps[mid] * (1 + 1e-12)
            if sum(k * min(c, int(t / x)) for k, c, x in zip(ks, most, tau)) >= self.L:
                hi = mid
            else:
                lo = mid + 1
        period = max(W, steps[lo], tau[-1] + head)
        # R's in-flight limit at the last stage before each unit boundary: the hops from there on and
        # at least one layer per stage from there on, once per min(stages from there on, m) micro-batches
        after, fastest = p, min(tau)
        for i, k in enumerate(ks[:-1]):
            after -= k
            period = max(period, (sum(trips[i:]) + (after + 1) * fastest) / min(after + 1, m))
        steady = (m - 1) * period
        return (self.L * min(tau) + head + H + sum((k - 1) * h for k, h in zip(ks, lan))
                + max(steady, a_min + b_min * self.L / p))

    def evaluate(self, chain, d: int, ks, rc: str) -> Candidate | None:
        """The structure's split minimizing E (exact), ranked by R: E's period raised to 1F1B's
        in-flight limit (stage j waits for its round trip, its suffix and the hops back, once per
        min(p − j, m) micro-batches) and the largest tail after it (R >= E)."""
        self.considered += 1
        c = self.costs
        where = self.where(chain, ks)
        p, m = len(where), self.num_mb // d
        tau = [self.times(g, rc)[0] for _, g in where]
        head = self.times(where[-1][1], rc)[1]
        caps = [self.cap(g, j, p, m, d, rc) for j, (_, g) in enumerate(where)]
        hops = [self.hop(a, b, d) for a, b in zip(where, where[1:])]
        W = max((h.busy_s for h in hops), default=0.0)
        tails = [self.tail_terms(u, j == 0, j == p - 1, d, rc) for j, u in enumerate(where)]
        got = split_for_estimate(tau, head, caps, self.L, m - 1, W, tails)
        if got is None:
            return None
        counts, value = got
        t = [n * x for n, x in zip(counts, tau)]
        t[-1] += head
        H = sum(2 * (h.wire_s + h.latency_s) for h in hops)
        period, trip = max(max(t), W), 0.0
        round_trip = 0.0  # in steady state a WAN transfer also waits for the other pipelines' (busy_s)
        for j in range(p - 1, -1, -1):
            hop = hops[j] if j < p - 1 else Hop(0.0, 0.0, 0.0)
            trip += t[j] + 2 * (hop.wire_s + hop.latency_s)
            round_trip += t[j] + 2 * (max(hop.wire_s, hop.busy_s) + hop.latency_s)
            period = max(period, round_trip / c.in_flight(j, p, m))
        rank = trip + (m - 1) * period + max(a + b * n for (a, b), n in zip(tails, counts))
        dcs = [x for i, (x, _) in enumerate(chain) if i == 0 or chain[i - 1][0] != x]
        conns = tuple(((x, y), self.connections(x, y)) for x, y in zip(dcs, dcs[1:]))
        return Candidate(rank, d * p, where, tuple(counts), d, m, rc, conns, value + head + H)

    def run(self, keep: int = KEEP_PER_SUBSET, keep_overall: int = KEEP_OVERALL,
            within: float = float("inf")) -> tuple[list[Candidate], bool]:
        """The `keep_overall` best candidates (by R) and the `keep` best of every subset of units,
        among those within `within` × the best R, and whether the enumeration was complete.
        Structures are priced in order of their lower bound, and one is skipped when its bound shows
        it can join neither the overall best nor its subset's (nor come within the factor), so the
        first candidate is the exact minimum of R over all structures (each at its E-optimal split)
        and every kept one is exactly what its rank says."""
        level = next((lv for lv in (0, 1, 2, 3) if self.count(lv) <= MAX_STRUCTURES), None)
        if level is None:
            raise ValueError(f"the geo search would price over {MAX_STRUCTURES} pipeline structures even with every "
                             f"unit's GPUs in use: {len(self.chains)} sets of (datacenter, GPU type) units; "
                             "use fewer datacenters or GPU types")
        exact = level == 0
        entries, fixed = [], {}
        for subset, chain, d, ks, rc in self.structures(level):
            key = (chain, d, rc)
            if key not in fixed:
                fixed[key] = self._fixed(chain, d, rc)
            bound = self.lower_bound(fixed[key], d, ks)
            if bound < float("inf"):
                entries.append((bound, subset, chain, d, ks, rc))
        entries.sort(key=lambda e: e[0])
        counter = itertools.count()
        overall: list = []  # max-heaps of the kept: (-R, -gpus, id, candidate)
        kept: dict[frozenset, list] = {}

        def full_above(heap: list, size: int, bound: float) -> bool:
            return len(heap) >= size and bound >= -heap[0][0]

        def push(heap: list, size: int, item: tuple) -> None:
            heapq.heappush(heap, item)
            if len(heap) > size:
                heapq.heappop(heap)

        best = float("inf")
        for bound, subset, chain, d, ks, rc in entries:
            if bound >= within * best:
                break  # sorted by bound: nothing later comes within the factor of the best
            heap = kept.setdefault(subset, [])
            if full_above(overall, keep_overall, bound) and full_above(heap, keep, bound):
                continue
            cand = self.evaluate(chain, d, ks, rc)
            if cand is not None:
                best = min(best, cand.estimate_s)
                item = (-cand.estimate_s, -cand.num_gpus, next(counter), cand)
                push(overall, keep_overall, item)
                push(heap, keep, item)
        out = {id(c): c for heap in [overall, *kept.values()] for *_, c in heap if c.estimate_s <= within * best}
        log.info("geo search (%s): %d of %d structures priced, %s", self.network, self.considered, len(entries),
                 "exact" if exact else f"stage counts cut (level {level}: over {MAX_STRUCTURES} structures in full)")
        return sorted(out.values(), key=lambda c: (c.estimate_s, c.num_gpus)), exact
