"""The prediction of a GIVEN plan on given hardware: what `executor launch` will measure.

`predict_plan(plan)` simulates exactly the plan's pipeline (its stages, rows, micro-batches,
schedule, devices and links) with planner/geo/pipeline_sim and the stage cost model
(planner/costmodel/pipeline.py); `predict_dp_plan(plan)` prices a data-parallel plan across the
same links. Every term follows the runtime (models/pipeline.py, models/sharded.py): the profiled
compute, fp32 boundary transfers posted one op ahead, fairly shared WAN links with their RTT (or
without, where the emulation cannot add delay), the step's syncs, the optimizer and the exact stage
memory. Stages of identical replicas run as that many pipelines; any other plan (uneven rows or
stage widths, mixed kinds in a stage, a stage across nodes) as one pipeline of each stage's slowest
replica (`build_replica_job`, the rule planner/geo/scale prices by). bench/geo_real.py and
tests/e2e/test_pipeline_span_nodes.py measure runs against it.

Every term, and what is not modelled: docs/models/pipeline_simulation.md ("The prediction of a given plan").
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any

from contracts.catalog import CPU_TYPE
from contracts.cluster import ClusterSpec, DeviceSpec, NodeSpec
from contracts.constants import BITS_PER_BYTE, GBIT
from contracts.plan import Plan, WanLink as PlanWanLink, link_key
from contracts.specs import ModelSpec, get_model, with_max_seq
from planner.costmodel.collectives import (INTER_NODE_HOP_LATENCY_S, Link, all_reduce_s, bytes_per_s,
                                          sharded_step_comm_s)
from planner.core.profiles import collective_set_key, get_collective_profile
from planner.core.stage_memory import estimate_plan_stage_memory
from planner.core.stage_profiles import StageProfile, get_stage_profile
from planner.costmodel.pipeline import PipelineCostModel, base_type, tied_sync_s
from planner.costmodel.training import CostModel, build_comm_model
from planner.geo.pipeline_sim import Channel, PipelineJob, SimResult, Stage, iteration_times, simulate_pipeline
from planner.geo.scenario import MAX_MICROBATCHES, WanLink as ScenarioWanLink

log = logging.getLogger(__name__)

# the world all-reduce of models/pipeline.py's step end: the gradient norm, the overflow flag, the loss
STATS_BYTES = 3 * 8
# the simulator's op kinds -> the measured timeline's op names (DESIGN: timeline.json)
OP_NAMES = {"F": "forward", "B": "backward", "AR": "grad_sync", "TIED": "grad_sync", "SYNC": "grad_sync",
            "OPT": "optimizer",
            "P": "prefill"}


@dataclass(frozen=True)
class PlanSimulation:
    """A pipeline plan simulated: the iteration, its timeline rows and per-device figures."""

    iteration_s: float
    ops: tuple[dict[str, Any], ...]  # {"stage", "replica", "op", "mb", "start_s", "end_s"}
    step_s: dict[int, float]  # device_index -> when its last operation (its optimizer step) ends
    memory_bytes: dict[int, int]  # device_index -> predicted peak
    sim: SimResult | None  # None where the timeline was not simulated (simulate_plan)


def model_spec(plan: Plan) -> ModelSpec:
    return with_max_seq(get_model(plan.model), plan.seq)


def _collective_links(cluster: ClusterSpec, node: NodeSpec, devices: list[DeviceSpec], spec: ModelSpec,
                      dtype: str, profiles_dir: str | None) -> tuple[Link, Link]:
    """(all-gather, reduce-scatter) links among ranks of one node: the measured gloo fits for CPU
    ranks when `profiler bench` has them, else the cluster's intra_node_gbps (training.build_comm_model)."""
    comm = build_comm_model(devices, False, cluster, spec, 1, dtype, profiles_dir, interleaved=False)
    return comm.gather_link, comm.reduce_link


def wan_rate(w: PlanWanLink, connections: int, rtt: bool) -> tuple[float, float]:
    """(Gbit/s one transfer reaches on its `connections`, one-way latency s) of a plan's WAN link."""
    if not rtt or w.rtt_ms <= 0:
        return w.gbps, 0.0
    link = ScenarioWanLink(w.a, w.b, w.gbps, w.rtt_ms, per_connection_gbps=w.per_connection_gbps)
    return link.throughput_gbps(connections), link.one_way_latency_s


def _wan_of(plan: Plan, a: str, b: str) -> PlanWanLink | None:
    return next((w for w in plan.wan if {w.a, w.b} == {a, b}), None)


def node_channel(plan: Plan, a: str, b: str, rtt: bool) -> Channel:
    """The channel between two nodes: the plan's WAN link (fair sharing), else inter_node_gbps."""
    name = link_key(a, b)
    w = _wan_of(plan, a, b)
    if w is None:
        gbps = plan.cluster.network.inter_node_gbps
        return Channel(name, INTER_NODE_HOP_LATENCY_S, gbps, gbps, "fair")
    per_transfer, latency = wan_rate(w, plan.connections.get(name, 1), rtt)
    return Channel(name, latency, per_transfer, w.gbps, "fair")


def _stage_layout(plan: Plan) -> tuple[int, int, list[tuple[NodeSpec, DeviceSpec]]] | None:
    """(replicas d, rows per replica, each stage's node and device kind) of a plan whose stages are d
    identical replicas each (one node, one kind, equal rows: the simulator runs d pipelines); None for
    any other plan (`build_replica_job` prices it by its slowest replicas)."""
    p = plan.pipeline
    assert p is not None
    devices = plan.cluster.devices()
    d = len(p.stages[0].devices)
    out = []
    for st in p.stages:
        nodes = {devices[i][0].name for i in st.devices}
        kinds = {devices[i][1] for i in st.devices}
        if len(st.devices) != d or len(set(st.rows)) != 1 or len(nodes) != 1 or len(kinds) != 1:
            return None
        out.append(devices[st.devices[0]])
    return d, p.micro_batch // d, out


def ring_link(plan: Plan, ranks: list[int], intra: dict[str, Link], rtt: bool) -> Link:
    """The link of a ring collective over `ranks` (device indices, in rank order). Bandwidth: its
    slowest edge (inside a node the node's collective link `intra[node]`, across nodes the channel
    between them, one flow per direction: `node_channel`'s per-transfer rate). Latency of one call
    (a reduce-scatter or an all-gather: k − 1 steps, each rank's step waiting for its neighbour's):
    the chain of k − 1 hops goes once around the ring, so it pays the nodes' own call latency plus
    (k − 1)/k of the one-way latencies of the node boundaries it crosses (about one round trip
    between two nodes), not (k − 1) times the largest."""
    devices = plan.cluster.devices()
    nodes = [devices[i][0].name for i in ranks]
    k = len(ranks)
    if k <= 1:
        return Link(min(intra[n].bandwidth_bytes_per_s for n in set(nodes)), 0.0, call_latency_s=0.0)
    bw = min(intra[n].bandwidth_bytes_per_s for n in set(nodes))
    local = max(intra[n].latency_s(k) for n in set(nodes))
    crossing = 0.0
    for a, b in zip(nodes, nodes[1:] + nodes[:1]):
        if a == b:
            continue
        if plan.wan and _wan_of(plan, a, b) is None:
            raise ValueError(f"plan: a ring collective joins nodes {a!r} and {b!r}, which no wan link of the "
                             "plan joins")
        ch = node_channel(plan, a, b, rtt)
        bw = min(bw, bytes_per_s(ch.per_transfer_gbps))
        crossing += ch.latency_s
    call = local + (k - 1) / k * crossing
    return Link(bw, call / math.ceil(math.log2(k)), call_latency_s=call)


def device_memory_bytes(plan: Plan, device_index: int, kind: str) -> int:
    """Predicted peak of one rank: planner/core/stage_memory.estimate_plan_stage_memory, exact for the
    runtime (full recomputation included), at the device's own rows and shard fraction."""
    return estimate_plan_stage_memory(plan, device_index, base_type(kind)).peak_bytes


def measured_stage(plan: Plan, j: int, kind: str, rows: int, model: PipelineCostModel,
                   profiles_dir: str | None) -> StageProfile | None:
    """Stage j's stage profile (planner/core/stage_profiles.py) on `kind` at `rows` rows, where one is
    stored and is not older than the kind's step profile (the newest measurement prices the stage)."""
    st, num = plan.pipeline.stages[j], len(plan.pipeline.stages)
    sp = get_stage_profile(kind, model.spec, plan.seq, model.dtype_of(kind), plan.recompute, st.first_layer,
                           st.num_layers, j == 0, j == num - 1, rows, profiles_dir)
    if sp is None:
        return None
    step = model.profile(kind, plan.recompute)
    return sp if not step.measured or sp.created >= step.created else None


def stage_sources(plan: Plan, profiles_dir: str | None = None) -> list[str]:
    """One line per stage of a pipeline plan: the measurement its compute is priced from (a stage
    profile, or the step profile of its device kind split over its layers by FLOPs)."""
    if plan.pipeline is None:
        return []
    devices, models = plan.cluster.devices(), {}
    out = []
    for j, st in enumerate(plan.pipeline.stages):
        seen = set()
        for i, rows in zip(st.devices, st.rows):
            kind = devices[i][1].profile_key
            if (kind, rows) in seen:
                continue
            seen.add((kind, rows))
            if rows not in models:
                models[rows] = PipelineCostModel(model_spec(plan), plan.seq, rows, plan.dtype,
                                                 plan.pipeline.schedule, profiles_dir)
            model = models[rows]
            sp = measured_stage(plan, j, kind, rows, model, profiles_dir)
            where = f"stage {j}" if len(st.devices) == 1 else f"stage {j} ({kind}, {rows} row(s))"
            out.append(f"{where}: " + (sp.describe() if sp is not None else
                                       "step profile " + model.profile(kind, plan.recompute).describe()
                                       + " (split over the stage's layers by FLOPs)"))
    return out


def build_plan_job(plan: Plan, profiles_dir: str | None = None, rtt: bool = True) -> tuple[PipelineJob, dict]:
    """The simulator's job of a pipeline plan (docs/models/pipeline_simulation.md), and each device's predicted memory."""
    p = plan.pipeline
    if p is None:
        raise ValueError("plan: not a pipeline plan (no 'pipeline' section); use predict_dp_plan")
    uniform = _stage_layout(plan)
    if uniform is None:
        return build_replica_job(plan, profiles_dir, rtt)
    spec = model_spec(plan)
    d, rows, layout = uniform
    num = len(p.stages)
    model = PipelineCostModel(spec, plan.seq, rows, plan.dtype, p.schedule, profiles_dir)
    by_index = {a.device_index: a for a in plan.assignments}
    links: dict[str, tuple[Link, Link]] = {}
    for node, dev in layout:
        if node.name not in links:
            links[node.name] = _collective_links(plan.cluster, node, [dev], spec, plan.dtype, profiles_dir)
    stages, memory = [], {}
    for j, (st, (node, dev)) in enumerate(zip(p.stages, layout)):
        kind = dev.profile_key
        gather, reduce = links[node.name]
        measured = measured_stage(plan, j, kind, rows, model, profiles_dir)
        if measured is None:
            fwd, bwd = model.compute_s(kind, plan.recompute, st.num_layers, j == 0, j == num - 1)
        else:
            fwd, bwd = measured.forward_s, measured.backward_s
        _, _, state_params, _ = model.runtime_state(st.num_layers, j, num)
        rs_s, ag_s = model.runtime_sync_parts_s(kind, st.num_layers, j, num, d, gather, reduce)
        share = max(by_index[i].shard_fraction for i in st.devices)  # the largest shard's step ends last
        if measured is not None and measured.optimizer_s_per_param is not None:
            adamw = measured.optimizer_s_per_param * state_params * share * dev.slowdown
        else:
            adamw = model.profile(kind, plan.recompute).optimizer_time_s(state_params * share) * dev.slowdown
        stages.append(Stage(fwd * dev.slowdown, bwd * dev.slowdown, rs_s,
                            f"{node.name} {dev.label} L{st.first_layer}-{st.first_layer + st.num_layers - 1}",
                            adamw + ag_s))
        memory.update({i: device_memory_bytes(plan, i, kind) for i in st.devices})
    channels: dict[str, Channel] = {}
    hops = []
    for (a, _), (b, _) in zip(layout, layout[1:]):
        if a.name == b.name:
            gather = links[a.name][0]
            name = f"lan:{a.name}"
            gbps = gather.bandwidth_bytes_per_s * BITS_PER_BYTE / GBIT
            lat = gather.call_latency_s if gather.call_latency_s is not None else gather.hop_latency_s
            channels[name] = Channel(name, lat, gbps, gbps, "dedicated")
        else:
            ch = node_channel(plan, a.name, b.name, rtt)
            channels[ch.name] = ch
            name = ch.name
        hops.append(name)
    intra = {n: g for n, (g, _) in links.items()}
    tied = 0.0
    if num > 1 and model.tied_bytes():
        ends = sorted(p.stages[0].devices + p.stages[-1].devices)
        tied = tied_sync_s(model.tied_bytes(), len(ends), ring_link(plan, ends, intra, rtt))
    world = sorted(i for st in p.stages for i in st.devices)
    stats = all_reduce_s(STATS_BYTES, len(world), ring_link(plan, world, intra, rtt))
    job = PipelineJob(tuple(stages), tuple(hops), tuple(channels.values()), d, p.num_microbatches,
                      model.boundary_bytes(), p.schedule, "fifo", tied, runtime_step=True, world_sync_s=stats)
    return job, memory


def _measured_kinds(plan: Plan, ranks: list[int], profiles_dir: str | None) -> list[DeviceSpec] | None:
    """The kinds whose collectives were measured for `ranks` (CPU ranks): the ranks' own, else those of
    all the plan's ranks (profiler/run_profile.py times a run's devices together, each under its CPU
    quota: a throttled rank slows every call it joins); None when neither was measured."""
    devices = plan.cluster.devices()
    for group in (ranks, [a.device_index for a in plan.used]):
        kinds = [devices[i][1] for i in group]
        key = collective_set_key(d.profile_key for d in kinds)
        if all(d.type == CPU_TYPE for d in kinds) and get_collective_profile(key, profiles_dir) is not None:
            return kinds
    return None


def _ranks_links(plan: Plan, ranks: list[int], node: NodeSpec, spec: ModelSpec,
                 profiles_dir: str | None) -> tuple[Link, Link]:
    """(all-gather, reduce-scatter) links among `ranks` inside `node`: from their measured collectives
    (`_measured_kinds`), else `_collective_links` of the node's kinds among them."""
    kinds = _measured_kinds(plan, ranks, profiles_dir)
    if kinds is not None:
        comm = build_comm_model(kinds, False, plan.cluster, spec, 1, plan.dtype, profiles_dir, interleaved=False)
        return comm.gather_link, comm.reduce_link
    devices = plan.cluster.devices()
    here = sorted({devices[i][1] for i in ranks if devices[i][0].name == node.name}, key=lambda k: k.label)
    return _collective_links(plan.cluster, node, here, spec, plan.dtype, profiles_dir)


def _ring_all_reduce_s(plan: Plan, ranks: list[int], nbytes: float, spec: ModelSpec, profiles_dir: str | None,
                       rtt: bool) -> float:
    """One all-reduce of `nbytes` over `ranks`: where the ranks' all-reduce was measured, one call of it
    (its latency, the bytes at the slower of its bandwidth and the ring's slowest edge, `_ring_links`),
    else a reduce-scatter and an all-gather over the ring (`all_reduce_s`)."""
    link = _ring_links(plan, ranks, spec, profiles_dir, rtt)[0]
    kinds = _measured_kinds(plan, ranks, profiles_dir)
    fit = None if kinds is None else get_collective_profile(
        collective_set_key(d.profile_key for d in kinds), profiles_dir).fit("all_reduce")
    if fit is None or len(ranks) < 2:
        return all_reduce_s(nbytes, len(ranks), link)
    ring_bw = link.bandwidth_bytes_per_s / (2 * (len(ranks) - 1) / len(ranks))  # algorithm bandwidth of the ring
    return fit.latency_s + nbytes / min(fit.bandwidth_bytes_per_s, ring_bw)


def _ring_links(plan: Plan, ranks: list[int], spec: ModelSpec, profiles_dir: str | None,
                rtt: bool) -> tuple[Link, Link]:
    """(all-gather, reduce-scatter) links of a ring over `ranks` (device indices) that may span nodes
    and mix kinds: inside each node `_ranks_links`, across nodes the channels between them (`ring_link`)."""
    devices = plan.cluster.devices()
    gathers, reduces = {}, {}
    for name in dict.fromkeys(devices[i][0].name for i in ranks):
        node = next(n for n in plan.cluster.nodes if n.name == name)
        gathers[name], reduces[name] = _ranks_links(plan, ranks, node, spec, profiles_dir)
    return ring_link(plan, ranks, gathers, rtt), ring_link(plan, ranks, reduces, rtt)


def _piece_s(plan: Plan, a: int, b: int, nbytes: float, spec: ModelSpec, profiles_dir: str | None,
             rtt: bool) -> tuple[float, float]:
    """(one-way latency s, seconds on the wire) of `nbytes` sent from device `a` to device `b`: inside a
    node at the bandwidth of the two ranks' collective link (`_ranks_links`) and its hop latency, not a
    collective call's (a measured call waits for throttled ranks' next quota period, as a step-end
    collective does; a receive posted one op ahead lands while its rank computes), across nodes on
    `node_channel`."""
    devices = plan.cluster.devices()
    (na, _), (nb, _) = devices[a], devices[b]
    if na.name == nb.name:
        gather, _ = _ranks_links(plan, [a, b], na, spec, profiles_dir)
        return gather.hop_latency_s, nbytes / gather.bandwidth_bytes_per_s
    ch = node_channel(plan, na.name, nb.name, rtt)
    return ch.latency_s, nbytes * BITS_PER_BYTE / (ch.per_transfer_gbps * GBIT)


def _hop_channel(plan: Plan, j: int, row_bytes: float, spec: ModelSpec, profiles_dir: str | None,
                 rtt: bool) -> Channel:
    """Boundary j as one dedicated channel: each rank of stage j sends every rank of stage j+1 the rows
    their ranges share (models/pipeline.row_pieces), pieces on one path sharing it; the channel carries
    one micro-batch in the slowest path's time (its latency, then its pieces' bytes at its rate)."""
    p = plan.pipeline
    here, there = p.stages[j], p.stages[j + 1]
    paths: dict[tuple[str, str], tuple[float, float]] = {}  # path -> (latency, seconds on the wire)
    devices = plan.cluster.devices()
    for a, (a0, ra) in zip(here.devices, _ranges(here.rows)):
        for b, (b0, rb) in zip(there.devices, _ranges(there.rows)):
            shared = min(a0 + ra, b0 + rb) - max(a0, b0)
            if shared <= 0:
                continue
            lat, wire_s = _piece_s(plan, a, b, shared * row_bytes, spec, profiles_dir, rtt)
            na, nb = devices[a][0].name, devices[b][0].name
            key = (f"device {a}", f"device {b}") if na == nb else (na, nb)  # inside a node: a path per pair
            old = paths.get(key, (0.0, 0.0))
            paths[key] = (max(old[0], lat), old[1] + wire_s)
    lat, wire_s = max(paths.values(), key=lambda v: v[0] + v[1])
    gbps = p.micro_batch * row_bytes * BITS_PER_BYTE / max(wire_s, 1e-12) / GBIT
    return Channel(f"hop{j}", lat, gbps, gbps, "dedicated")


def _ranges(rows: tuple[int, ...]) -> list[tuple[int, int]]:
    """(first row, rows) of each rank of a stage: consecutive ranges in data-parallel order."""
    out, first = [], 0
    for r in rows:
        out.append((first, r))
        first += r
    return out


def build_replica_job(plan: Plan, profiles_dir: str | None = None, rtt: bool = True) -> tuple[PipelineJob, dict]:
    """The simulator's job of a pipeline plan whose stages are not identical replicas (different device
    counts, uneven rows, mixed kinds, a stage across nodes), and each device's predicted memory. Every
    replica of a stage runs the stage's schedule on its own rows and the stage after waits for all of
    their pieces, so the stage enters the simulator as one pipeline at its slowest replica's forward and
    backward; its reduce-scatters and all-gathers are rings over all its ranks (across nodes where it
    spans them), its update the slowest rank's AdamW at its shard; a boundary is `_hop_channel`."""
    p = plan.pipeline
    spec = model_spec(plan)
    devices = plan.cluster.devices()
    by_index = {a.device_index: a for a in plan.assignments}
    models: dict[int, PipelineCostModel] = {}

    def model_of(rows: int) -> PipelineCostModel:
        if rows not in models:
            models[rows] = PipelineCostModel(spec, plan.seq, rows, plan.dtype, p.schedule, profiles_dir)
        return models[rows]

    num, whole = len(p.stages), model_of(p.micro_batch)
    stages, memory = [], {}
    for j, st in enumerate(p.stages):
        first, last = j == 0, j == num - 1
        fwd = bwd = update = 0.0
        for i, rows in zip(st.devices, st.rows):
            node, dev = devices[i]
            _, _, state_params, _ = whole.runtime_state(st.num_layers, j, num)
            measured = measured_stage(plan, j, dev.profile_key, rows, model_of(rows), profiles_dir)
            if measured is None:
                f, b = model_of(rows).compute_s(dev.profile_key, plan.recompute, st.num_layers, first, last)
            else:
                f, b = measured.forward_s, measured.backward_s
            if measured is not None and measured.optimizer_s_per_param is not None:
                adamw = measured.optimizer_s_per_param * state_params * by_index[i].shard_fraction
            else:
                adamw = whole.profile(dev.profile_key, plan.recompute).optimizer_time_s(
                    state_params * by_index[i].shard_fraction)
            fwd, bwd = max(fwd, f * dev.slowdown), max(bwd, b * dev.slowdown)
            update = max(update, adamw * dev.slowdown)
            memory[i] = device_memory_bytes(plan, i, dev.profile_key)
        gather, reduce = _ring_links(plan, list(st.devices), spec, profiles_dir, rtt)
        rs_s, ag_s = whole.runtime_sync_parts_s(devices[st.devices[0]][1].profile_key, st.num_layers, j, num,
                                                len(st.devices), gather, reduce)
        where = "+".join(dict.fromkeys(f"{devices[i][0].name} {devices[i][1].label}" for i in st.devices))
        stages.append(Stage(fwd, bwd, rs_s, f"{where} L{st.first_layer}-{st.first_layer + st.num_layers - 1}",
                            update + ag_s))
    row_bytes = whole.boundary_bytes() / p.micro_batch
    channels = tuple(_hop_channel(plan, j, row_bytes, spec, profiles_dir, rtt) for j in range(num - 1))
    tied = 0.0
    if num > 1 and whole.tied_bytes():
        ends = sorted(p.stages[0].devices + p.stages[-1].devices)
        tied = _ring_all_reduce_s(plan, ends, whole.tied_bytes(), spec, profiles_dir, rtt)  # as tied_sync_s
    world = sorted(i for st in p.stages for i in st.devices)
    stats = _ring_all_reduce_s(plan, world, STATS_BYTES, spec, profiles_dir, rtt)
    job = PipelineJob(tuple(stages), tuple(c.name for c in channels), channels, 1, p.num_microbatches,
                      whole.boundary_bytes(), p.schedule, "fifo", tied, runtime_step=True, world_sync_s=stats)
    return job, memory


def timeline_rows(sim: SimResult) -> tuple[dict[str, Any], ...]:
    """The simulation as plan rows {"stage", "replica", "op", "mb", "start_s", "end_s"} in the measured
    timeline's op names; each transfer is a send on its sender (from its first byte on the wire) and a
    receive on its receiver, from when the receive was posted (runtime step; as models/pipeline.py's
    timeline records it, one op ahead) to the arrival."""
    rows = [{"stage": o.stage, "replica": o.pipeline, "op": OP_NAMES[o.kind], "mb": o.microbatch,
             "start_s": o.start_s, "end_s": o.end_s} for o in sim.ops + sim.step_ops]
    for t in sim.transfers:
        src, dst = (t.hop, t.hop + 1) if t.direction == "fwd" else (t.hop + 1, t.hop)
        recv_start = t.start_s if t.posted_s is None else min(t.posted_s, t.start_s)
        for stage, op, start in ((src, f"send_{t.direction}", t.start_s), (dst, f"recv_{t.direction}", recv_start)):
            rows.append({"stage": stage, "replica": t.pipeline, "op": op, "mb": t.microbatch,
                         "start_s": start, "end_s": t.end_s})
    rows.sort(key=lambda r: (r["stage"], r["replica"], r["start_s"], r["end_s"]))
    return tuple(rows)


def simulate_plan(plan: Plan, profiles_dir: str | None = None, rtt: bool = True) -> PlanSimulation:
    """The pipeline plan simulated as the runtime runs it (docs/models/pipeline_simulation.md). Past MAX_MICROBATCHES
    micro-batches the timeline is not built: the iteration and each device's step end come from
    pipeline_sim.iteration_times (bounded simulations whose recurrence it proves; refused otherwise),
    `ops` is empty and `sim` None."""
    job, memory = build_plan_job(plan, profiles_dir, rtt)
    p = plan.pipeline
    if p.num_microbatches > MAX_MICROBATCHES:
        times = iteration_times(job, MAX_MICROBATCHES)
        ends, sim, rows = times.worker_end_s, None, ()
        iteration = times.iteration_s
    else:
        sim = simulate_pipeline(job)
        ends, rows, iteration = sim.worker_end_s(), timeline_rows(sim), sim.iteration_s
    # one pipeline per replica, or one for the whole plan (build_replica_job: each stage at its slowest replica)
    step = {dev: ends[(r if job.num_pipelines > 1 else 0, j)] for j, st in enumerate(p.stages)
            for r, dev in enumerate(st.devices)}
    return PlanSimulation(iteration, rows, step, memory, sim)


def predict_plan_iteration_s(plan: Plan, profiles_dir: str | None = None, rtt: bool = True) -> float:
    """`simulate_plan`'s iteration seconds without its timeline, at a cost bounded by the plan's stages rather
    than its micro-batches (pipeline_sim.iteration_times)."""
    job, _ = build_plan_job(plan, profiles_dir, rtt)
    return iteration_times(job, MAX_MICROBATCHES).iteration_s


def predict_plan(plan: Plan, profiles_dir: str | None = None, rtt: bool = True) -> tuple[float, tuple[dict, ...]]:
    """(iteration seconds, simulated timeline rows) of a pipeline plan on its hardware and links."""
    s = simulate_plan(plan, profiles_dir, rtt)
    return s.iteration_s, s.ops


def predict_dp_plan(plan: Plan, profiles_dir: str | None = None, rtt: bool = True) -> tuple[float, dict[int, float]]:
    """(iteration seconds, device_index -> step seconds) of a data-parallel plan (no `pipeline`) on its
    links: each device's n·(α + β·m)·slowdown + its optimizer share (planner/costmodel/training.py),
    then the ZeRO collectives of the whole model over every used rank (the runtime synchronizes
    after compute, nothing overlapped), over the ring's slowest edge (`ring_link`)."""
    if plan.pipeline is not None:
        raise ValueError("plan: a pipeline plan; use predict_plan")
    spec = model_spec(plan)
    cost = CostModel.build(plan.cluster, spec, plan.seq, plan.dtype, plan.recompute, 1.0, profiles_dir, plan.zero)
    devices = plan.cluster.devices()
    used = [a.device_index for a in plan.assignments if a.used]
    if not used:
        raise ValueError("plan: no device is used")
    nodes = {devices[i][0].name for i in used}
    kinds = {devices[i][1] for i in used}
    comm = cost.comm_model(kinds, len(nodes) > 1)
    if len(nodes) > 1:
        # each node's own collective figures (measured gloo fits for CPU ranks) inside it, the WAN across
        gathers, reduces = {}, {}
        for node in nodes:
            members = sorted({devices[i][1] for i in used if devices[i][0].name == node}, key=lambda d: d.type)
            node_spec = next(n for n in plan.cluster.nodes if n.name == node)
            gathers[node], reduces[node] = _collective_links(plan.cluster, node_spec, members, spec, plan.dtype,
                                                             profiles_dir)
        comm_s = sharded_step_comm_s(comm.gather_bytes, comm.reduce_bytes, comm.num_calls, len(used),
                                     ring_link(plan, used, gathers, rtt), ring_link(plan, used, reduces, rtt))
    else:
        comm_s = comm.comm_s(len(used))
    by_index = {a.device_index: a for a in plan.assignments}
    steps = {i: cost.coeffs[devices[i][1]].step_s(by_index[i].micro_batch, by_index[i].accum_steps,
                                                  by_index[i].shard_fraction) + comm_s for i in used}
    return max(steps.values()), steps


def dp_memory_bytes(plan: Plan, profiles_dir: str | None = None) -> dict[int, int]:
    """device_index -> predicted peak of a data-parallel plan's used devices: the sharded runtime's
    memory model at the device's (micro-batch, accumulation steps, shard fraction), as `planner plan`."""
    spec = model_spec(plan)
    cost = CostModel.build(plan.cluster, spec, plan.seq, plan.dtype, plan.recompute, 1.0, profiles_dir, plan.zero)
    devices = plan.cluster.devices()
    return {a.device_index: int(cost.estimate_memory_bytes(devices[a.device_index][1], a.micro_batch, a.accum_steps,
                                                           a.shard_fraction))
            for a in plan.assignments if a.used}
