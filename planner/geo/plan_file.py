"""A geo plan as a plan file (contracts/plan.py) that `python -m executor launch` runs.

`geo_plan_to_plan` turns Atlas's choice (a chain of stages, each on one datacenter's GPUs of one
type, replicated `d` times) into a `Plan` with a `pipeline` section: a node per datacenter, stage j
as d devices each taking the per-pipeline micro-batch's rows, even ZeRO-1 shards inside a stage, the
scenario's WAN links and TCP connections. Its predicted figures come from planner/geo/emulated.py
(the runtime's own behaviour), the search's idealised simulation kept in the notes. A one-stage plan
is written as a plain data-parallel plan; `check_runnable` refuses what the runtime cannot run.

The mapping in full: docs/models/pipeline_simulation.md ("Atlas's search", the plan file).
"""
from __future__ import annotations

import logging
from dataclasses import replace
from typing import Any

from contracts.cluster import ClusterSpec, DeviceSpec, NetworkSpec, NodeSpec
from contracts.constants import MEMORY_HEADROOM
from contracts.plan import (Assignment, BaselineResult, PipelineSpec, PipelineStage, Plan, WanLink, link_key)
from planner.core.profiles import with_profile_notes
from planner.geo.atlas import GeoPlan
from planner.geo.emulated import (dp_memory_bytes, predict_dp_plan, predict_plan_iteration_s, simulate_plan,
                                   stage_sources)
from planner.geo.scenario import DEFAULT_TCP_WINDOW_BYTES, MAX_MICROBATCHES, GeoScenario

log = logging.getLogger(__name__)


def scenario_cluster(scenario: GeoScenario, geo: GeoPlan) -> ClusterSpec:
    """One node per datacenter the plan uses (chain order), its stages' devices in stage order."""
    d = geo.num_pipelines
    nodes = []
    for dc in geo.chain:
        devices = tuple(DeviceSpec(s.gpu_type) for s in geo.stages if s.dc == dc for _ in range(d))
        nodes.append(NodeSpec(dc, dc, devices))
    intra = min(scenario.datacenter(dc).intra_dc_gbps for dc in geo.chain)
    links = [l.gbps for l in scenario.wan if l.a in geo.chain and l.b in geo.chain]
    return ClusterSpec(f"{scenario.name}-geo", tuple(nodes), NetworkSpec(intra, min(links, default=intra)))


def _take_devices(cluster: ClusterSpec, geo: GeoPlan) -> list[tuple[int, ...]]:
    """Device indices of each stage: the next d free devices of the stage's type on its node."""
    free: dict[tuple[str, str], list[int]] = {}
    for i, (node, dev) in enumerate(cluster.devices()):
        if not dev.emulated:
            free.setdefault((node.name, dev.type), []).append(i)
    out = []
    for j, s in enumerate(geo.stages):
        pool = free.get((s.dc, s.gpu_type), [])
        if len(pool) < geo.num_pipelines:
            raise ValueError(f"geo plan: stage {j} needs {geo.num_pipelines} {s.gpu_type} on {s.dc!r}, "
                             f"the cluster has {len(pool)} left")
        out.append(tuple(pool[:geo.num_pipelines]))
        del pool[:geo.num_pipelines]
    return out


def scenario_wan(scenario: GeoScenario, chain: tuple[str, ...]) -> tuple[WanLink, ...]:
    return tuple(WanLink(l.a, l.b, l.gbps, l.rtt_ms, l.per_connection_gbps)
                 for l in scenario.wan if l.a in chain and l.b in chain)


def plan_connections(geo: GeoPlan) -> dict[str, int]:
    """link_key -> TCP connections per transfer, from the plan's ("x-y", k) per hop of its chain."""
    named = dict(geo.connections)
    out = {}
    for x, y in zip(geo.chain, geo.chain[1:]):
        k = named.get(f"{x}-{y}")
        if k is not None:
            out[link_key(x, y)] = k
    return out


def check_runnable(plan: Plan, headroom: float = MEMORY_HEADROOM) -> None:
    """ValueError (one line) when the runtime could not run `plan` as planned."""
    devices = plan.cluster.devices()
    p = plan.pipeline
    if p is not None:
        for s, st in enumerate(p.stages):
            if st.num_layers < 1:
                raise ValueError(f"geo plan: pipeline stage {s} has no layers; the runtime needs at least one "
                                 "block per stage")
        if p.num_layers != _num_layers(plan):
            raise ValueError(f"geo plan: the stages cover {p.num_layers} layers, the model has {_num_layers(plan)}")
        nodes = [devices[st.devices[0]][0].name for st in p.stages]
        if plan.wan:
            for a, b in zip(nodes, nodes[1:]):
                if a != b and not any({w.a, w.b} == {a, b} for w in plan.wan):
                    raise ValueError(f"geo plan: stages on {a!r} and {b!r} have no wan link between them")
    for a in plan.assignments:
        if not a.used:
            continue
        cap = devices[a.device_index][1].memory_bytes * headroom
        if a.predicted_memory_bytes > cap:
            raise ValueError(f"geo plan: device {a.device_index} ({a.type} on {a.node}) needs "
                             f"{a.predicted_memory_bytes / 2**30:.2f} GiB, over its {cap / 2**30:.2f} GiB")


def _num_layers(plan: Plan) -> int:
    from planner.geo.emulated import model_spec

    return model_spec(plan).num_layers


def _assignments(cluster: ClusterSpec, per_device: dict[int, tuple[int, int, float]], memory: dict[int, int],
                 step: dict[int, float]) -> tuple[Assignment, ...]:
    out = []
    for i, (node, dev) in enumerate(cluster.devices()):
        m, n, f = per_device.get(i, (0, 0, 0.0))
        out.append(Assignment(i, node.name, dev.type, m, n, m * n, f, int(memory.get(i, 0)), float(step.get(i, 0.0)),
                              dev.emulated, dev.slowdown, dev.memory_gb))
    return tuple(out)


NO_TIMELINE = "no simulated timeline"
PRICED = "priced from:"  # a note per stage: the measurement its compute is priced from (emulated.stage_sources)


def no_timeline_note(num_microbatches: int) -> str:
    """What a pipeline plan past MAX_MICROBATCHES says in place of its simulated timeline."""
    return (f"{NO_TIMELINE}: {num_microbatches} micro-batches per iteration, more than the {MAX_MICROBATCHES} the "
            "timeline is simulated for; predicted_iteration_s comes from bounded simulations whose cycles were "
            "proved to recur (planner/geo/pipeline_sim.py)")


def _draft(scenario: GeoScenario, geo: GeoPlan, schedule: str, cluster: ClusterSpec | None,
           wan: tuple[WanLink, ...] | None, baselines: dict[str, BaselineResult] | None, notes: tuple[str, ...],
           search_iteration_s: float | None, solve_s: float) -> tuple[Plan, dict, tuple[str, ...], dict]:
    """The plan file of `geo` before it is priced: (draft, per_device, notes, common fields)."""
    cluster = cluster or scenario_cluster(scenario, geo)
    wan = scenario_wan(scenario, geo.chain) if wan is None else wan
    conns = plan_connections(geo)
    taken = _take_devices(cluster, geo)
    d, b, m = geo.num_pipelines, scenario.micro_batch, geo.num_microbatches
    per_device = {i: (b, m, 1.0 / d) for devs in taken for i in devs}
    for devs in taken:  # shares sum exactly to 1 per stage: the last replica takes the float remainder
        per_device[devs[-1]] = (b, m, 1.0 - (d - 1) * (1.0 / d))
    extra = [] if search_iteration_s is None else [
        f"geo search: {search_iteration_s:.4g} s/iteration simulated with Atlas's temporal WAN sharing and "
        f"{scenario.dtype} transfers; predicted_iteration_s simulates this file as the runtime runs it "
        "(fp32 rows on the wire, links shared fairly)"]
    lost = [f"{l.a}-{l.b}" for l in scenario.wan if l.a in geo.chain and l.b in geo.chain
            and l.per_connection_gbps is None and l.tcp_window_bytes != DEFAULT_TCP_WINDOW_BYTES]
    if lost:
        extra.append(f"wan links {', '.join(lost)}: the plan file carries gbps, rtt_ms and a per-connection rate, "
                     "not a TCP window; its prediction prices one connection by the default window over the RTT")
    common = dict(model=scenario.model, global_batch=scenario.global_batch, seq=scenario.seq, dtype=scenario.dtype,
                  recompute=geo.recompute, baselines=dict(baselines or {}), solve_s=solve_s, zero=1,
                  wan=wan, connections=conns)
    pipe = None
    if geo.num_stages > 1:
        stages = tuple(PipelineStage(s.first_layer, s.num_layers, devs, (b,) * d, s.dc)
                       for s, devs in zip(geo.stages, taken))
        pipe = PipelineSpec(schedule, d * b, m, stages)
    draft = Plan(cluster=cluster, assignments=_assignments(cluster, per_device, {}, {}), predicted_iteration_s=0.0,
                 predicted_samples_per_s=0.0, pipeline=pipe, **common)
    return draft, per_device, (*notes, *extra), common


def predict_geo_plan_s(scenario: GeoScenario, geo: GeoPlan, *, schedule: str = "1f1b",
                       cluster: ClusterSpec | None = None, wan: tuple[WanLink, ...] | None = None,
                       profiles_dir: str | None = None, rtt: bool = True) -> float:
    """The predicted_iteration_s `geo_plan_to_plan` writes for a pipeline `geo`, at a cost bounded by its
    stages, not its micro-batches (pipeline_sim.iteration_times: no timeline is built)."""
    if geo.num_stages < 2:
        raise ValueError("predict_geo_plan_s prices pipelines; a one-stage plan is data parallel")
    draft, *_ = _draft(scenario, geo, schedule, cluster, wan, None, (), None, 0.0)
    check_runnable(draft)
    return predict_plan_iteration_s(draft, profiles_dir, rtt)


def geo_plan_to_plan(scenario: GeoScenario, geo: GeoPlan, *, schedule: str = "1f1b",
                     cluster: ClusterSpec | None = None, wan: tuple[WanLink, ...] | None = None,
                     baselines: dict[str, BaselineResult] | None = None, notes: tuple[str, ...] = (),
                     search_iteration_s: float | None = None, solve_s: float = 0.0,
                     profiles_dir: str | None = None, rtt: bool = True) -> Plan:
    """The plan file of `geo` (docs/models/pipeline_simulation.md), predicted by planner/geo/emulated.py and checked
    by `check_runnable`. `cluster`/`wan`: the cluster and links to place it on (default: the
    scenario's datacenters used, and their links)."""
    draft, per_device, notes, common = _draft(scenario, geo, schedule, cluster, wan, baselines, notes,
                                              search_iteration_s, solve_s)
    cluster = draft.cluster
    if draft.pipeline is None:
        it, steps = predict_dp_plan(draft, profiles_dir, rtt)
        memory = dp_memory_bytes(draft, profiles_dir)
        plan = Plan(cluster=cluster, assignments=_assignments(cluster, per_device, memory, steps),
                    predicted_iteration_s=it, predicted_samples_per_s=scenario.global_batch / it,
                    notes=(*notes, "one stage: written as a data-parallel plan (no pipeline)"), **common)
        check_runnable(plan)
        return with_profile_notes(plan, profiles_dir)
    check_runnable(draft)  # a stage without layers is refused before it is priced
    sim = simulate_plan(draft, profiles_dir, rtt)
    pipe = draft.pipeline
    notes = (*notes, *(f"{PRICED} {line}" for line in stage_sources(draft, profiles_dir)))
    if not sim.ops:
        notes = (*notes, no_timeline_note(pipe.num_microbatches))
    plan = Plan(cluster=cluster, assignments=_assignments(cluster, per_device, sim.memory_bytes, sim.step_s),
                predicted_iteration_s=sim.iteration_s, predicted_samples_per_s=scenario.global_batch / sim.iteration_s,
                pipeline=PipelineSpec(schedule, pipe.micro_batch, pipe.num_microbatches, pipe.stages, sim.ops),
                notes=notes, **common)
    check_runnable(plan)
    return with_profile_notes(plan, profiles_dir)


def evaluate_pipeline_plan(plan: Plan, headroom: float = MEMORY_HEADROOM, profiles_dir: str | None = None,
                           rtt: bool = True) -> Plan:
    """A pipeline plan file with its predictions (each device's memory and step end, the iteration, the
    simulated timeline) recomputed by planner/geo/emulated.py as `geo_plan_to_plan` wrote them; a note for
    each device predicted over its memory × `headroom`. Its baselines are kept as they were."""
    if plan.pipeline is None:
        raise ValueError("plan: not a pipeline plan (no 'pipeline' section)")
    check_runnable(plan, headroom=float("inf"))  # the stages and links; memory is said below, not refused
    sim = simulate_plan(plan, profiles_dir, rtt)
    devices = plan.cluster.devices()
    notes = [n for n in plan.notes if not n.startswith((NO_TIMELINE, "re-evaluated:", PRICED))]
    notes += [f"{PRICED} {line}" for line in stage_sources(plan, profiles_dir)]
    assignments = []
    for a in plan.assignments:
        if a.device_index in sim.memory_bytes:
            a = replace(a, predicted_memory_bytes=int(sim.memory_bytes[a.device_index]),
                        predicted_step_s=float(sim.step_s[a.device_index]))
            cap = devices[a.device_index][1].memory_bytes * headroom
            if a.predicted_memory_bytes > cap:
                notes.append(f"re-evaluated: device {a.device_index} ({a.type} on {a.node}) is predicted at "
                             f"{a.predicted_memory_bytes / 2**30:.2f} GiB, over its memory × headroom "
                             f"{headroom:g} ({cap / 2**30:.2f} GiB)")
        assignments.append(a)
    p = plan.pipeline
    if not sim.ops:
        notes.append(no_timeline_note(p.num_microbatches))
    return with_profile_notes(replace(plan, assignments=tuple(assignments), predicted_iteration_s=sim.iteration_s,
                                      predicted_samples_per_s=plan.global_batch / sim.iteration_s,
                                      notes=tuple(notes), pipeline=replace(p, simulated_ops=sim.ops)), profiles_dir)


def report_baselines(baselines: dict[str, Any]) -> dict[str, BaselineResult]:
    """The geo report's baselines (evaluate.BaselineOutcome) as plan baselines."""
    return {k: BaselineResult(b.iteration_s, b.iteration_s is None, b.note or b.description)
            for k, b in baselines.items()}
