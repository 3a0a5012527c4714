"""A geo scenario end to end: the Atlas plan, its baselines and BubbleTea, all simulated.

Baselines, each computed by its own code apart from the search, on the same cost tables and
simulator: "dp_across_dcs" (a full replica per datacenter, gradients all-reduced over the WAN in
buckets overlapped with the backward, costs.estimate_overlapped_allreduce),
"pp_single_connection_fair" (one TCP connection per transfer, links shared fairly),
"best_single_dc" (each datacenter planned alone) and "even_layer_split" (the chosen stages, layers
split evenly). No baseline's plan is a candidate of the search, so the comparison can fail: the
report's `slower_than` names every baseline faster than the plan.

Utilization is over every GPU of the scenario (a GPU the plan leaves out is idle), the plan's own
GPUs' beside it (`*_plan_gpus`).

Each baseline's model: docs/models/pipeline_simulation.md ("Atlas's search"); BubbleTea's:
docs/models/bubbletea.md.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, replace
from typing import Any

from planner.geo.bubbletea import PrefillResult, prefill_memory_bytes, simulate_bubbletea, training_unchanged
from planner.geo.atlas import AtlasResult, GeoPlan, StagePlan, build_job, solve_atlas
from planner.geo.costs import GeoCosts, estimate_best_bucketed_allreduce
from planner.costmodel.collectives import Link, bytes_per_s
from planner.geo.scenario import GeoScenario
from planner.geo.pipeline_sim import SimResult, simulate_pipeline
from contracts.specs import get_model

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class BaselineOutcome:
    name: str
    iteration_s: float | None  # None: infeasible
    gpu_utilization: float | None  # over every GPU of the scenario
    num_gpus: int  # the GPUs the baseline uses
    description: str
    note: str = ""
    plan: GeoPlan | None = None  # pipeline baselines: their plan (never a candidate of the search)
    sim: SimResult | None = None
    gpu_utilization_plan_gpus: float | None = None  # over the baseline's own GPUs

    def to_dict(self) -> dict[str, Any]:
        return {"iteration_s": self.iteration_s, "gpu_utilization": self.gpu_utilization,
                "gpu_utilization_plan_gpus": self.gpu_utilization_plan_gpus,
                "num_gpus": self.num_gpus, "description": self.description, "note": self.note}


def _sub_scenario(scenario: GeoScenario, dc: str, global_batch: int) -> GeoScenario:
    return replace(scenario, datacenters=(scenario.datacenter(dc),), wan=(), global_batch=global_batch,
                   inference=None, name=f"{scenario.name}/{dc}")


def _widest_tree(scenario: GeoScenario, dcs: list[str], connections: int) -> tuple[float, float]:
    """(bottleneck Gbit/s, largest one-way latency s) of the links joining `dcs` in the maximum
    spanning tree (Kruskal) of the scenario's links: the tree pruned of the branches that lead to
    no datacenter of `dcs`."""
    parent = {dc.name: dc.name for dc in scenario.datacenters}

    def find(x: str) -> str:
        while parent[x] != x:
            x = parent[x]
        return x

    edges = sorted(scenario.wan, key=lambda l: -l.throughput_gbps(connections))
    used = []
    for link in edges:
        ra, rb = find(link.a), find(link.b)
        if ra != rb:
            parent[ra] = rb
            used.append(link)
    if len({find(d) for d in dcs}) > 1:
        raise ValueError(f"no wan links connect datacenters {dcs}: add links between them")
    while True:  # drop leaves outside `dcs` until every leaf is one of them
        degree: dict[str, int] = {}
        for l in used:
            degree[l.a], degree[l.b] = degree.get(l.a, 0) + 1, degree.get(l.b, 0) + 1
        leaves = {x for x, k in degree.items() if k == 1 and x not in dcs}
        if not leaves:
            break
        used = [l for l in used if l.a not in leaves and l.b not in leaves]
    return (min(l.throughput_gbps(connections) for l in used), max(l.one_way_latency_s for l in used))


def solve_each_dc(scenario: GeoScenario, schedule: str = "1f1b") -> dict[str, AtlasResult]:
    """The best plan of each datacenter alone on the whole batch (those the model fits)."""
    out = {}
    for dc in scenario.datacenters:
        try:
            out[dc.name] = solve_atlas(_sub_scenario(scenario, dc.name, scenario.global_batch), schedule=schedule)
        except ValueError:
            pass  # the model does not fit this DC
    return out


def gradient_ready(costs: GeoCosts, result: AtlasResult) -> dict[int, tuple[float, int]]:
    """layer -> (when its gradient is final, its parameters) in one datacenter's plan: the gradient of
    a stage's layers is final during the stage's last backward (the last micro-batch's, over its
    pipelines), the stage's later layers first, evenly over that backward; the first layer carries
    the embedding, the last the head (costs.stage_params)."""
    plan, sim = result.plan, result.sim
    L, out = costs.spec.num_layers, {}
    for j, st in enumerate(plan.stages):
        last_b = max((o for o in sim.ops if o.stage == j and o.kind == "B"), key=lambda o: o.end_s)
        span = last_b.end_s - last_b.start_s
        for k in range(st.num_layers):
            layer = st.first_layer + st.num_layers - 1 - k
            params = costs.stage_params(1, layer == 0, layer == L - 1)
            out[layer] = (last_b.start_s + span * (k + 1) / st.num_layers, params)
    return out


def simulate_dp_baseline(scenario: GeoScenario, costs: GeoCosts, datacenters: list[str] | None = None,
                         alone: dict[str, AtlasResult] | None = None) -> BaselineOutcome:
    """DP across `datacenters` (default: all of them); `alone` = solve_each_dc(scenario) if known.

    Each DC runs its own best plan on its share of the batch (shares by throughput); the gradients
    are all-reduced over the WAN as DDP does: in buckets issued as the last micro-batch's backward
    finalizes them, layer by layer in every DC (`gradient_ready`), overlapped with that backward, at
    the bucket size that ends first (costs.estimate_best_bucketed_allreduce). The step pays the
    slowest DC's iteration plus what of the WAN all-reduce is left after the last backward (its
    own syncs and optimizer step are not overlapped with that rest: a slight overestimate)."""
    desc = "data parallel across datacenters, gradient all-reduce over the WAN overlapped with the backward"
    num_mb = scenario.global_batch // scenario.micro_batch
    names = datacenters or [dc.name for dc in scenario.datacenters]
    alone = solve_each_dc(scenario, costs.schedule) if alone is None else alone
    # throughput of each DC alone on the whole batch decides its share
    rate = {n: scenario.global_batch / alone[n].sim.iteration_s for n in names if n in alone}
    if not rate:
        return BaselineOutcome("dp_across_dcs", None, None, 0, desc, "no datacenter holds a full replica")
    # shares in whole micro-batches by largest remainder, in grains that keep DP divisors available
    grain = 8 if num_mb >= 8 * len(rate) else 1
    units, total = num_mb // grain, sum(rate.values())
    share = {n: int(units * r / total) for n, r in rate.items()}
    for n in sorted(rate, key=lambda n: units * rate[n] / total - share[n], reverse=True)[:units - sum(share.values())]:
        share[n] += 1
    share = {n: u * grain for n, u in share.items()}
    share[max(rate, key=rate.get)] += num_mb - sum(share.values())  # the remainder goes to the fastest DC
    sims = {n: alone[n] if mbs == num_mb else
            solve_atlas(_sub_scenario(scenario, n, mbs * scenario.micro_batch), schedule=costs.schedule)
            for n, mbs in share.items() if mbs}
    gpus = sum(r.plan.num_gpus for r in sims.values())
    compute_end = max(r.sim.iteration_s for r in sims.values())
    exposed, comm, buckets = 0.0, 0.0, 0
    if len(sims) > 1:
        connections = min(r.plan.num_gpus for r in sims.values())  # one connection per GPU's shard
        gbps, lat = _widest_tree(scenario, list(sims), connections)
        D = len(sims)
        # a ring over the D datacenters: 2(D−1) steps, each paying the one-way latency once
        link = Link(bytes_per_s(gbps), lat, call_latency_s=2 * (D - 1) * lat)
        ready = [gradient_ready(costs, r) for r in sims.values()]
        pieces = [(max(rd[layer][0] for rd in ready), costs.grad_bytes(ready[0][layer][1]))
                  for layer in reversed(range(costs.spec.num_layers))]
        est = estimate_best_bucketed_allreduce(pieces, D, link)
        exposed, comm, buckets = est.exposed_s, est.total_comm_s, est.num_buckets
    iteration = compute_end + exposed
    busy = sum(r.sim.compute_busy_s() for r in sims.values())
    note = (f"WAN all-reduce {comm:.3g} s in {buckets} buckets, {exposed:.3g} s of it after the backward, "
            f"compute {compute_end:.3g} s over {', '.join(sims)}")
    return BaselineOutcome("dp_across_dcs", iteration, busy / (scenario_gpus(scenario) * iteration), gpus, desc,
                           note, gpu_utilization_plan_gpus=busy / (gpus * iteration))


def scenario_gpus(scenario: GeoScenario) -> int:
    """Every GPU of the scenario: the denominator of its utilization."""
    return sum(dc.num_gpus for dc in scenario.datacenters)


def _outcome(name: str, scenario: GeoScenario, plan: GeoPlan, sim: SimResult, desc: str,
             note: str) -> BaselineOutcome:
    over_all = sim.compute_busy_s() / (scenario_gpus(scenario) * sim.iteration_s)
    return BaselineOutcome(name, sim.iteration_s, over_all, plan.num_gpus, desc, note, plan, sim,
                           sim.gpu_utilization())


def _from_atlas(name: str, scenario: GeoScenario, result: AtlasResult, desc: str) -> BaselineOutcome:
    p = result.plan
    note = f"{'→'.join(p.chain)}, {p.num_pipelines} pipelines × {p.num_stages} stages"
    return _outcome(name, scenario, p, result.sim, desc, note)


def even_split_plan(scenario: GeoScenario, costs: GeoCosts, plan: GeoPlan) -> GeoPlan | None:
    """`plan`'s stages with the layers split evenly (the first L mod p stages one more); None when
    a stage then does not fit its GPU's memory."""
    L, p = costs.spec.num_layers, plan.num_stages
    counts = [L // p + (1 if j < L % p else 0) for j in range(p)]
    stages, first = [], 0
    for j, (s, n) in enumerate(zip(plan.stages, counts)):
        c = costs.stage_cost(s.dc, s.gpu_type, first, n, j, p, plan.num_microbatches, plan.num_pipelines,
                             plan.recompute)
        if c.memory_bytes > c.capacity_bytes:
            return None
        stages.append(StagePlan(c.dc, c.gpu_type, first, n, c.forward_s, c.backward_s, c.allreduce_s,
                                c.memory_bytes, c.capacity_bytes, c.optimizer_s))
        first += n
    return replace(plan, stages=tuple(stages))


def simulate_even_split(scenario: GeoScenario, costs: GeoCosts, plan: GeoPlan) -> BaselineOutcome:
    desc = "the plan's stages with the layers split evenly"
    even = even_split_plan(scenario, costs, plan)
    if even is None:
        return BaselineOutcome("even_layer_split", None, None, 0, desc, "an even split does not fit the GPUs' memory")
    sim = simulate_pipeline(build_job(scenario, costs, even, costs.schedule))
    note = "/".join(str(s.num_layers) for s in even.stages) + " layers per stage"
    return _outcome("even_layer_split", scenario, even, sim, desc, note)


def simulate_baselines(scenario: GeoScenario, costs: GeoCosts) -> dict[str, BaselineOutcome]:
    """The baselines that do not depend on the plan, each by its own code (none is given to the
    search): DP across every datacenter, the fair one-connection pipeline, the best single DC."""
    alone = solve_each_dc(scenario, costs.schedule)
    out = {"dp_across_dcs": simulate_dp_baseline(scenario, costs, alone=alone)}
    desc = "pipeline across every datacenter, 1 TCP connection per transfer, fair sharing"
    try:
        out["pp_single_connection_fair"] = _from_atlas(
            "pp_single_connection_fair", scenario,
            solve_atlas(scenario, costs, costs.schedule, network="single_fair", all_datacenters=True), desc)
    except ValueError as e:
        out["pp_single_connection_fair"] = BaselineOutcome("pp_single_connection_fair", None, None, 0, desc, str(e))
    if alone:
        name = min(alone, key=lambda n: alone[n].sim.iteration_s)
        out["best_single_dc"] = _from_atlas("best_single_dc", scenario, alone[name],
                                            f"best plan inside one datacenter ({name})")
    else:
        out["best_single_dc"] = BaselineOutcome("best_single_dc", None, None, 0, "one datacenter only",
                                                "the model fits no single datacenter")
    return out


@dataclass
class GeoReport:
    scenario: GeoScenario
    plan: GeoPlan
    sim: SimResult
    baselines: dict[str, BaselineOutcome]
    prefill: PrefillResult | None
    training_unchanged: bool | None  # re-simulated with prefill reserved: every training op identical
    solve_time_s: float
    num_candidates: int
    chosen_from: str = "search"  # the plan is the search's; no baseline's plan is a candidate
    search_exact: bool = False  # every structure enumerated (planner/geo/search.py), not a reduced set

    @property
    def num_scenario_gpus(self) -> int:
        return scenario_gpus(self.scenario)

    def gpu_utilization(self) -> float:
        """Forward/backward GPU time over every GPU of the scenario × the iteration (a GPU the plan
        leaves out counts as idle)."""
        return self.sim.compute_busy_s() / (self.num_scenario_gpus * self.sim.iteration_s)

    def gpu_utilization_with_prefill(self) -> float:
        """Training and prefill GPU time over every GPU of the scenario × the iteration."""
        if self.prefill is None:
            return self.gpu_utilization()
        return self.prefill.gpu_utilization_with_prefill(self.num_scenario_gpus)

    def slower_than(self) -> list[str]:
        """Baselines faster than the plan (to rounding): the comparison the search can lose, since
        no baseline's plan is one of its candidates."""
        t = self.sim.iteration_s
        return [k for k, v in self.baselines.items() if v.iteration_s is not None and v.iteration_s < t * (1 - 1e-9)]

    @property
    def baseline_iteration_s(self) -> float | None:
        """DESIGN.md's baseline: data parallelism across the datacenters (None when not run)."""
        dp = self.baselines.get("dp_across_dcs")
        return dp.iteration_s if dp else None

    def to_dict(self) -> dict[str, Any]:
        util, pre = self.gpu_utilization(), self.prefill
        d: dict[str, Any] = {
            "scenario": self.scenario.name,
            "iteration_s": self.sim.iteration_s,
            "baseline_iteration_s": self.baseline_iteration_s,
            "baselines": {k: v.to_dict() for k, v in self.baselines.items()},
            "num_scenario_gpus": self.num_scenario_gpus,
            "num_plan_gpus": self.plan.num_gpus,
            # over every GPU of the scenario; `*_plan_gpus`: over the plan's own GPUs
            "gpu_utilization": util,
            "gpu_utilization_training_only": util,  # forward/backward only, beside the one with prefill
            "gpu_utilization_with_prefill": self.gpu_utilization_with_prefill(),
            "gpu_utilization_plan_gpus": self.sim.gpu_utilization(),
            "gpu_utilization_with_prefill_plan_gpus": pre.gpu_utilization_with_prefill() if pre else
            self.sim.gpu_utilization(),
            # rate mode: the share of the offered requests whose prefill finished (None with a backlog)
            "prefill_served_share": pre.summary()["prefill_offered_share_served"] if pre else None,
            "prefill_tokens_per_s": pre.prefill_tokens_per_s() if pre else 0.0,
            "prefill": pre.summary() if pre else None,
            "training_unchanged_by_prefill": self.training_unchanged,
            "wan_utilization": self.sim.channel_utilization(),
            "plan": self.plan.to_dict(),
            "solve_s": self.solve_time_s,
            "num_candidates": self.num_candidates,
            "kind": "simulated",
            "chosen_from": self.chosen_from,
            "search_exact": self.search_exact,
            "slower_than": self.slower_than(),
        }
        for k, v in self.baselines.items():
            if v.iteration_s:
                d[f"speedup_vs_{k}"] = v.iteration_s / self.sim.iteration_s
        return d


def run_prefill(scenario: GeoScenario, plan: GeoPlan, sim: SimResult) -> tuple[PrefillResult | None, bool | None]:
    """BubbleTea on the plan's timeline, and whether the training timeline stays identical with it:
    re-simulated with the prefill outside the collectives reserved (every training op at the same
    times), and the prefill inside a collective overlapping no compute op of that timeline."""
    if scenario.inference is None:
        return None, None
    spec = get_model(scenario.inference.model)
    free = [s.capacity_bytes - s.memory_bytes for s in plan.stages]
    pre = simulate_bubbletea(sim, [s.gpu_type for s in plan.stages], free, scenario.inference, spec,
                             scenario.dtype)
    return pre, training_unchanged(sim, pre)


def simulate_geo(scenario: GeoScenario, schedule: str = "1f1b", baselines: bool = True) -> GeoReport:
    """Plan `scenario` with Atlas, simulate it, then its baselines apart (none is a candidate of the
    search: `GeoReport.slower_than` names those faster than the plan) and BubbleTea's prefill."""
    t0 = time.perf_counter()
    costs = GeoCosts(scenario, schedule)
    inf = scenario.inference
    need = None if inf is None else prefill_memory_bytes(get_model(inf.model), min(t for t, _ in inf.prompt_tokens),
                                                          scenario.dtype)
    atlas = solve_atlas(scenario, costs, schedule, prefill_bytes=need)
    solve_s = time.perf_counter() - t0
    base = simulate_baselines(scenario, costs) if baselines else {}
    if baselines:
        base["even_layer_split"] = simulate_even_split(scenario, costs, atlas.plan)
    pre, same = run_prefill(scenario, atlas.plan, atlas.sim)
    return GeoReport(scenario, atlas.plan, atlas.sim, base, pre, same, solve_s, atlas.num_candidates, "search",
                     atlas.exact)
