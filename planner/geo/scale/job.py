"""The joint search for `planner.entry.plan_job`: its costs from the profile store, its plan as a file.

Where it runs: a cluster of at least SCALE_MIN_NODES nodes (below it the ILP and the geo pipeline
search of planner/geo/cluster_plan.py cover the space), every node of one GPU type, not emulated.
Its compute comes from the stored per-layer table of the model (`profiler import`; every TP degree
measured) or, without one, from the step profiles at tp 1 (planner/geo/scale/costs.py); its network
from the stored measured curves (`profiler import --network`) where a zone of theirs is the
cluster's datacenter, else the cluster file's Gbit/s. docs/models/scale.md ("In planner plan").
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from contracts.cluster import ClusterSpec
from contracts.constants import MEMORY_HEADROOM
from contracts.plan import Plan
from contracts.specs import ModelSpec
from planner.core.layer_profiles import load_layer_profiles
from planner.costmodel.netcurve import NetworkProfile, list_network_profiles, load_network_profile
from planner.geo.scale.costs import ScaleCosts, tables_from_layer_profiles, tables_from_step_profiles
from planner.geo.scale.plan_file import to_plan, to_plan_dict
from planner.geo.scale.search import ScaleResult, node_kinds, solve_scale

log = logging.getLogger(__name__)

SCALE_MIN_NODES = 7  # the geo pipeline search of `planner plan` covers 2-6 nodes
# tp > 1 plans cannot run until the runtime's tensor parallelism lands: the default search is tp 1
DEFAULT_MAX_TP = 1
STEP_PROFILE_MAX_ROWS = 8  # rows per replica priced from a step profile (α + β·m holds at any m)


@dataclass(frozen=True)
class ScaleOutcome:
    result: ScaleResult
    plan: Plan | None  # the contracts' Plan (every TP degree 1), None for a tp > 1 plan
    plan_dict: dict[str, Any]  # the plan file's JSON, with stage / tp / tp_group
    source: str


def applies(cluster: ClusterSpec) -> bool:
    if len(cluster.nodes) < SCALE_MIN_NODES:
        return False
    try:
        node_kinds(cluster)
    except ValueError:
        return False
    return True


def _network(cluster: ClusterSpec, profiles_dir: str | None) -> tuple[NetworkProfile | None, NetworkProfile | None, str]:
    zones = {n.datacenter for n in cluster.nodes}
    inter = intra = None
    zone = ""
    for name in list_network_profiles(profiles_dir):
        p = load_network_profile(name, profiles_dir)
        if p is None:
            continue
        if p.kind == "inter_node" and inter is None and len(zones) == 1:
            z = next(iter(zones))
            if any(c.zone_a == z for c in p.curves):
                inter, zone = p, z
        elif p.kind == "intra_node" and intra is None:
            intra = p
    return inter, intra, zone


def build_costs(cluster: ClusterSpec, spec: ModelSpec, seq: int, dtype: str, headroom: float = MEMORY_HEADROOM,
                profiles_dir: str | None = None) -> ScaleCosts:
    layers = load_layer_profiles(spec.name, seq, dtype, "none", profiles_dir)
    types = sorted({d.type for n in cluster.nodes for d in n.devices})
    if layers is not None and all(any(m.device_type == t for m in layers.measurements) for t in types):
        tables, source = tables_from_layer_profiles(layers, spec), layers.source
    else:
        tables = tables_from_step_profiles(spec, seq, dtype, types, STEP_PROFILE_MAX_ROWS, profiles_dir)
        source = "step profiles (tp 1), split over the units by FLOPs"
    inter, intra, zone = _network(cluster, profiles_dir)
    return ScaleCosts.for_cluster(cluster, spec, seq, dtype, tables, inter, intra, zone, headroom, source)


def solve_job_at_scale(cluster: ClusterSpec, spec: ModelSpec, model: str, global_batch: int, seq: int, dtype: str,
                       *, max_tp: int = DEFAULT_MAX_TP, time_limit_s: float = 60.0, headroom: float = MEMORY_HEADROOM,
                       profiles_dir: str | None = None) -> ScaleOutcome:
    costs = build_costs(cluster, spec, seq, dtype, headroom, profiles_dir)
    result = solve_scale(cluster, costs, global_batch, max_tp=max_tp, time_limit_s=time_limit_s)
    p = result.plan
    notes = (f"joint search (planner/geo/scale): {len(p.stages)} stage(s), micro-batch {p.structure.micro_batch} × "
             f"{p.structure.num_microbatches}, {result.num_structures} structures priced ({result.status}), "
             f"{result.gap:.1%} above the fluid compute bound; compute from {costs.source}",)
    tp_any = any(r.tp > 1 for st in p.stages for r in st.replicas)
    plan = None if tp_any else to_plan(cluster, model, global_batch, seq, dtype, p, notes, result.solve_s)
    return ScaleOutcome(result, plan, to_plan_dict(cluster, model, global_batch, seq, dtype, p, notes, result.solve_s),
                        costs.source)


__all__ = ["ScaleOutcome", "applies", "build_costs", "solve_job_at_scale", "SCALE_MIN_NODES", "DEFAULT_MAX_TP"]
