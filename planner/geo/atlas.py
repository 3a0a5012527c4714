"""Atlas: plan one training job across datacenters (arXiv 2411.14458).

Pipeline parallelism across datacenters, data parallelism inside each. The search chooses the
datacenters and GPU types in pipeline order, the data-parallel degree, the stages per unit, the
layer split under each stage's memory, recomputation, the TCP connections per WAN transfer and the
pipelines' turn order on each link. planner/geo/search.py ranks every structure by a closed-form
1F1B estimate; the best few are simulated (`pipeline_sim.iteration_times`), and the simulated time
decides. The baselines (planner/geo/evaluate.py) are computed apart and compared with the result.
The winner's whole simulation (`AtlasResult.sim`, its Gantt) runs only when asked for.

The search, the estimate and the baselines: docs/models/pipeline_simulation.md ("Atlas's search").
"""
from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, replace
from functools import cached_property
from typing import Any

from planner.geo.costs import GeoCosts
from planner.geo.scenario import INTRA_DC_LATENCY_S, MAX_MICROBATCHES, GeoScenario
from planner.geo.pipeline_sim import Channel, PipelineJob, SimResult, Stage, iteration_times, simulate_pipeline
from planner.geo.search import KEEP_PER_SUBSET, NETWORKS, Candidate, Search

log = logging.getLogger(__name__)

SIMULATE_TOP = 48  # most candidates (by the estimate; the best of each DC subset first) simulated
SHORTLIST_FACTOR = 1.5  # simulate the kept candidates estimated within 1.5x of the best
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
    """The simulator's view of a plan: stages, a channel per boundary (LAN or WAN link), and the tied
    embedding's sum between the first and the last stage (GeoCosts.tied_sync_s). The search's
    estimate E leaves that sum out (a constant of the chain, it only makes E a lower bound of the
    simulation); the simulated shortlist, which decides, has it."""
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
    tied = costs.tied_sync_s(plan.chain, plan.num_pipelines, conns) if len(stages) > 1 else 0.0
    return PipelineJob(stages, tuple(hops), tuple(channels.values()), plan.num_pipelines,
                       plan.num_microbatches, costs.transfer_bytes, schedule, plan.link_order, tied)


def plan_from(scenario: GeoScenario, costs: GeoCosts, cand: Candidate, network: str) -> GeoPlan:
    """The plan of a search candidate: its stages priced by the cost tables."""
    p, first, stages = len(cand.where), 0, []
    for j, ((dc, g), n) in enumerate(zip(cand.where, cand.counts)):
        c = costs.stage_cost(dc, g, first, n, j, p, cand.num_microbatches, cand.num_pipelines, cand.recompute)
        stages.append(StagePlan(c.dc, c.gpu_type, first, n, c.forward_s, c.backward_s, c.allreduce_s,
                                c.memory_bytes, c.capacity_bytes, c.optimizer_s))
        first += n
    dcs = tuple(x for i, (x, _) in enumerate(cand.where) if i == 0 or cand.where[i - 1][0] != x)
    return GeoPlan(dcs, tuple(stages), cand.num_pipelines, cand.num_microbatches, cand.recompute,
                   tuple((_link_name(x, y), k) for (x, y), k in cand.connections), "fifo",
                   "temporal" if network == "atlas" else "fair")


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
    job: PipelineJob  # the plan as the simulator's job
    iteration_s: float  # its simulated iteration
    num_candidates: int
    solve_time_s: float
    exact: bool = False  # every structure was enumerated: the shortlist holds the exact minimum of the estimate
    best_estimate_s: float | None = None  # that minimum (planner/geo/search.py's E)

    @cached_property
    def sim(self) -> SimResult:
        """The plan's whole simulation (every operation: the Gantt), run on first use."""
        return simulate_pipeline(self.job)


def solve_atlas(scenario: GeoScenario, costs: GeoCosts | None = None, schedule: str = "1f1b",
                network: str = "atlas", all_datacenters: bool = False,
                simulate_top: int = SIMULATE_TOP, prefill_bytes: int | None = None) -> AtlasResult:
    """The fastest memory-feasible plan (by simulated iteration time) for `scenario`.

    `network="single_fair"` with `all_datacenters=True` is the pipeline baseline: the same
    search, but one TCP connection per transfer, fair sharing, and every datacenter used."""
    t0 = time.perf_counter()
    costs = costs or GeoCosts(scenario, schedule)
    if costs.schedule != schedule:
        raise ValueError(f"cost tables are for {costs.schedule}, not {schedule}")
    search = Search(scenario, costs, network, all_datacenters)
    found, exact = search.run(keep=KEEP_PER_SUBSET, within=SHORTLIST_FACTOR)
    cands = [(c, plan_from(scenario, costs, c, network)) for c in found]
    considered = search.considered
    if not cands:
        raise ValueError(
            f"no memory-feasible plan{' using every datacenter' if all_datacenters else ''}: {costs.spec.name} "
            f"at micro_batch {scenario.micro_batch}, seq {scenario.seq} does not fit the GPUs "
            f"even with recomputation and one layer per GPU"
        )
    # the estimate only ranks: simulate the best of each subset of datacenters first, then the rest
    firsts, seen = [], set()
    for c, plan in cands:
        if frozenset(plan.chain) not in seen:
            seen.add(frozenset(plan.chain))
            firsts.append((c, plan))
    rest = [x for x in cands if x not in firsts]
    top = cands[0][0].estimate_s
    shortlist = [plan for _, plan in firsts + rest][:simulate_top]
    best: tuple[float, int, int] | None = None
    best_plan, best_job, unpriced = None, None, []
    for plan in shortlist:
        job = build_job(scenario, costs, plan, schedule)
        try:
            it = iteration_times(job, MAX_MICROBATCHES).iteration_s
        except ValueError as e:  # too long to simulate whole and not proved to recur: not priced
            unpriced.append(str(e))
            continue
        key = (it, -prefill_capable_gpus(plan, prefill_bytes), plan.num_gpus)
        if _better(key, best):
            best, best_plan, best_job = key, plan, job
    if best_plan is None:
        raise ValueError(f"no candidate plan could be priced: {unpriced[0]}")
    if network == "atlas" and best_plan.num_pipelines > 1 and len(best_plan.chain) > 1:
        plan = replace(best_plan, link_order="pipeline")  # the other turn-taking rule on the WAN
        job = build_job(scenario, costs, plan, schedule)
        try:
            it = iteration_times(job, MAX_MICROBATCHES).iteration_s
        except ValueError as e:
            unpriced.append(str(e))
            it = math.inf
        if _better((it, *best[1:]), best) and it < best[0]:
            best, best_plan, best_job = (it, *best[1:]), plan, job
    if unpriced:
        log.info("geo %s: %d candidates not priced (%s)", network, len(unpriced), unpriced[0])
    log.info("geo %s: %d configurations, simulated %d, best %.3f s", network, considered, len(shortlist), best[0])
    return AtlasResult(best_plan, best_job, best[0], considered, time.perf_counter() - t0, exact, top)
