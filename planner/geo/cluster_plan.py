"""Pipeline stages on a heterogeneous multi-node cluster, priced beside the hetero ILP's plan.

Across slow inter-node links the ILP's data-parallel plan pays the whole model's gradient traffic
every step, while a pipeline sends only activations. So on a cluster of two or more nodes the
nodes become the datacenters of a geo scenario (`cluster_scenario`), Atlas's search
(planner/geo/atlas.py) finds the best pipeline at each micro-batch tried (`MICRO_BATCHES`), each is
written onto the cluster's own devices (planner/geo/plan_file.py) and predicted as the runtime runs
it (planner/geo/emulated.py), and `choose_plan` keeps the faster of that and the ILP's plan, naming
both times. The cost does not grow with the global batch (`pipeline_sim.iteration_times`). Where the
geo search cannot price the cluster (one node, too many nodes, emulation the scenario format cannot
carry) the ILP's plan is kept and the note says why.

The search and the prediction: docs/models/pipeline_simulation.md.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, replace

from contracts.cluster import ClusterSpec
from contracts.plan import BaselineResult, Plan
from contracts.specs import get_model, with_max_seq
from planner.costmodel.collectives import INTER_NODE_HOP_LATENCY_S
from planner.geo.atlas import solve_atlas
from planner.geo.plan_file import geo_plan_to_plan, predict_geo_plan_s
from planner.geo.scenario import MAX_DATACENTERS, Datacenter, GeoScenario, WanLink

log = logging.getLogger(__name__)

# per-pipeline micro-batches tried (those dividing the global batch): each is one geo search
MICRO_BATCHES = (1, 2, 4, 8)
# the round trip between two nodes of one cluster (a switch hop each way: the hop latency twice)
NODE_RTT_MS = 2 * INTER_NODE_HOP_LATENCY_S * 1e3
# a pipeline must beat the ILP's plan by more than this (relative) to be chosen: ties keep DP
CHOICE_TOLERANCE = 1e-9


@dataclass(frozen=True)
class ClusterScenario(GeoScenario):
    """A cluster's nodes as a geo scenario, with no limit on the micro-batches per iteration: what is
    priced of it is iteration times (pipeline_sim.iteration_times), which do not simulate every one."""

    microbatch_limit = None


@dataclass(frozen=True)
class PipelineOption:
    plan: Plan | None  # the fastest pipeline plan on the cluster, None when none could be priced
    reason: str  # why not, or how it was found
    solve_s: float


def cluster_scenario(cluster: ClusterSpec, model: str, global_batch: int, seq: int, dtype: str,
                     micro_batch: int) -> GeoScenario:
    """The cluster as a geo scenario: one datacenter per node (named as the node)."""
    dcs = []
    for node in cluster.nodes:
        counts: dict[str, int] = {}
        for d in node.devices:
            counts[d.type] = counts.get(d.type, 0) + 1
        dcs.append(Datacenter(node.name, tuple(counts.items()), cluster.network.intra_node_gbps))
    names = [n.name for n in cluster.nodes]
    wan = tuple(WanLink(a, b, cluster.network.inter_node_gbps, NODE_RTT_MS)
                for i, a in enumerate(names) for b in names[i + 1:])
    return ClusterScenario(tuple(dcs), wan, model, global_batch, micro_batch, seq, dtype, None, cluster.name)


def why_not(cluster: ClusterSpec) -> str | None:
    """Why pipeline candidates cannot be priced on `cluster` (None: they can)."""
    if len(cluster.nodes) < 2:
        return "one node: pipeline stages are priced on multi-node clusters"
    if len(cluster.nodes) > MAX_DATACENTERS:
        return f"{len(cluster.nodes)} nodes, over the geo search's {MAX_DATACENTERS}"
    if cluster.emulated:
        return "emulated devices (slowdown, memory_gb, cpu_share) are not priced by the geo search"
    return None


def solve_cluster_pipeline(cluster: ClusterSpec, model: str, global_batch: int, seq: int, dtype: str,
                           profiles_dir: str | None = None) -> PipelineOption:
    """The fastest pipeline plan on the cluster's own devices (module docstring)."""
    t0 = time.perf_counter()
    reason = why_not(cluster)
    if reason:
        return PipelineOption(None, reason, 0.0)
    spec = with_max_seq(get_model(model), seq)
    fastest: tuple[float, GeoScenario, object] | None = None  # (predicted s, scenario, geo plan)
    tried, errors = [], []
    for b in MICRO_BATCHES:
        if global_batch % b:
            tried.append(f"micro-batch {b}: does not divide the global batch")
            continue
        try:
            scenario = cluster_scenario(cluster, model, global_batch, seq, dtype, b)
            geo = solve_atlas(scenario).plan
            if geo.num_stages < 2:
                tried.append(f"micro-batch {b}: one stage (data parallel)")
                continue
            it = predict_geo_plan_s(scenario, geo, cluster=cluster, wan=(), profiles_dir=profiles_dir)
        except ValueError as e:
            errors.append(f"micro-batch {b}: {e}")
            continue
        tried.append(f"micro-batch {b}: {it:.4g} s")
        if fastest is None or it < fastest[0]:
            fastest = (it, scenario, geo)
    best: Plan | None = None  # only the fastest is written out whole, with its simulated timeline
    if fastest is not None:
        try:
            best = geo_plan_to_plan(fastest[1], fastest[2], cluster=cluster, wan=(), profiles_dir=profiles_dir)
        except ValueError as e:  # priced above from the same job, so not expected; said, never hidden
            errors.append(f"micro-batch {fastest[1].micro_batch}: its plan file: {e}")
    solve_s = time.perf_counter() - t0
    log.info("pipeline candidates on %s (%s, %d layers): %s", cluster.name, model, spec.num_layers,
             "; ".join(tried + errors))
    if best is None:
        return PipelineOption(None, "; ".join(tried + errors), solve_s)
    return PipelineOption(best, "; ".join(tried), solve_s)


def choose_plan(dp: Plan, option: PipelineOption) -> Plan:
    """The faster of the ILP's data-parallel plan and the pipeline option, each one's predicted time
    in the other's baselines ("data_parallel", "pipeline") and a note saying which was chosen."""
    if option.plan is None:
        return replace(dp, notes=(*dp.notes, f"pipeline stages not chosen: {option.reason}"))
    pipe, t_dp, t_pp = option.plan, dp.predicted_iteration_s, option.plan.predicted_iteration_s
    stages = "/".join(str(s.num_layers) for s in pipe.pipeline.stages)
    desc = (f"{len(pipe.pipeline.stages)} stages ({stages} layers) × {len(pipe.pipeline.stages[0].devices)} "
            f"data-parallel, {pipe.pipeline.num_microbatches} micro-batches")
    if t_pp < t_dp * (1 - CHOICE_TOLERANCE):
        note = (f"pipeline chosen: {desc}, predicted {t_pp:.4g} s/iteration against {t_dp:.4g} s for pure data "
                f"parallelism (the hetero ILP's plan)")
        baselines = {**dp.baselines, "data_parallel": BaselineResult(t_dp, False, "the hetero ILP's plan"),
                     **pipe.baselines}
        return replace(pipe, baselines=baselines, notes=(*pipe.notes, note), solve_s=dp.solve_s + option.solve_s)
    note = (f"data parallelism kept: predicted {t_dp:.4g} s/iteration against {t_pp:.4g} s for the best pipeline "
            f"({desc})")
    return replace(dp, baselines={**dp.baselines, "pipeline": BaselineResult(t_pp, False, desc)},
                   notes=(*dp.notes, note), solve_s=dp.solve_s + option.solve_s)
