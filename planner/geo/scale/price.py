"""A structure priced exactly: block by block, uneven shares, exact memory, the pipeline simulator.

`price_exactly` takes a structure and its layer split (planner/geo/scale/structure.py) and prices what
the runtime would run: each stage's rows split again with every block's own measured time, its
ZeRO-1 shares water-filled under each rank's exact memory (planner/geo/scale/split.py,
planner/geo/scale/memory.py), its syncs at those shares, and the iteration from GPUMix's pipeline
simulator (planner/geo/pipeline_sim.py, 1F1B with the runtime's step: receives posted one op ahead,
each stage's reduce-scatters after its last backward, a world all-reduce, then the updates and the
all-gathers). A stage enters the simulator as its slowest replica (every replica of a stage runs the
same schedule on its rows and waits for its inputs from the stage before, so the slowest one paces
it); a boundary as one dedicated channel per hop whose transfer of one micro-batch takes the busiest
NIC's time (`StructurePricer.hop_s`). docs/models/scale.md ("Pricing").
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from contracts.cluster import ClusterSpec
from planner.geo.pipeline_sim import Channel, PipelineJob, Stage, iteration_times
from planner.geo.scale.split import largest_share, split_rows, water_level
from planner.geo.scale.structure import StageLayout, boundary_s, Structure, StructurePrice, StructurePricer

# the world all-reduce of the runtime's step end (gradient norm, overflow flag, loss): 3 float64
STATS_BYTES = 24


@dataclass(frozen=True)
class Replica:
    """One TP group of one stage: its devices (cluster device indices), rows and state share."""

    device_type: str
    tp: int
    node: int
    devices: tuple[int, ...]
    rows: int
    shard_fraction: float  # of the stage's state (each TP rank: this share of its 1/tp slice)
    memory_bytes: int  # predicted peak of each of its ranks
    compute_s: float  # forward + backward of one micro-batch of its rows


@dataclass(frozen=True)
class PricedStage:
    layout: StageLayout
    first_layer: int
    num_layers: int
    replicas: tuple[Replica, ...]  # the used TP groups (rows >= 1)
    forward_s: float
    backward_s: float
    hop_s: float
    reduce_s: float
    gather_s: float
    update_s: float


@dataclass(frozen=True)
class PricedPlan:
    structure: Structure
    stages: tuple[PricedStage, ...]
    iteration_s: float  # simulated
    estimate_s: float  # the closed form the search ranked by
    extrapolated: bool  # the simulator extrapolated a proved recurrence (else simulated whole)

    @property
    def num_gpus(self) -> int:
        return sum(r.tp for s in self.stages for r in s.replicas)


def device_offsets(cluster: ClusterSpec) -> list[int]:
    out, i = [], 0
    for node in cluster.nodes:
        out.append(i)
        i += len(node.devices)
    return out


def _replica_devices(cluster: ClusterSpec, layout: StageLayout) -> list[list[tuple[int, tuple[int, ...]]]]:
    """Per part, its TP groups in order: (node, device indices), node by node."""
    offsets = device_offsets(cluster)
    out = []
    for p in layout.parts:
        groups = []
        for n in p.nodes:
            for g in range(p.gpus_per_node // p.tp):
                groups.append((n, tuple(offsets[n] + g * p.tp + k for k in range(p.tp))))
        out.append(groups)
    return out


def price_exactly(cluster: ClusterSpec, pricer: StructurePricer, found: StructurePrice) -> PricedPlan | None:
    """The plan of `found` priced as the runtime runs it (module docstring); None where the exact
    split or memory refuses it."""
    exact = StructurePricer(pricer.costs, pricer.global_batch, uniform_blocks=False)
    c = pricer.costs
    st = found.structure
    S, M = st.num_stages, st.num_microbatches
    stages: list[PricedStage] = []
    for s, sp in enumerate(found.stages):
        layout = st.stages[s]
        first, last = s == 0, s == S - 1
        groups = exact._groups(layout, sp.first_layer, sp.num_layers, s, S, M)
        split = split_rows(groups, st.micro_batch)
        if split is None:
            return None
        placed = _replica_devices(cluster, layout)
        reps = []  # (part, node, devices, rows)
        for p, rows, where in zip(layout.parts, split.rows, placed):
            for r, (node, devs) in zip(rows, where):
                if r > 0:
                    reps.append((p, node, devs, r))
        cap = {p.device_type: c.capacity_bytes(p.device_type) for p in layout.parts}

        def mem(p, r: int, f: float) -> int:
            return c.memory_bytes(p.device_type, p.tp, sp.first_layer, sp.num_layers, s, S, M, r, f)

        rooms = [largest_share(lambda f, p=p, r=r: mem(p, r, f) <= cap[p.device_type]) for p, _, _, r in reps]
        updates = [c.update_s(p.device_type, p.tp, sp.first_layer, sp.num_layers, first, last) for p, _, _, _ in reps]
        level = water_level(rooms, updates)
        if level is None:
            return None
        _, shares = level
        replicas = []
        fb = (0.0, 0.0)
        for (p, node, devs, r), f in zip(reps, shares):
            x = c.compute_s(p.device_type, p.tp, r, sp.first_layer, sp.num_layers, first, last)
            if x is None:
                return None
            if x[0] + x[1] > fb[0] + fb[1]:
                fb = x
            m = mem(p, r, f)
            if m > cap[p.device_type]:
                return None
            replicas.append(Replica(p.device_type, p.tp, node, devs, r, f, m, x[0] + x[1]))
        params = c.stage_params(sp.first_layer, sp.num_layers, first, last)
        rs, ag = exact.sync_s(layout, params, shares)
        upd = max(f * u for f, u in zip(shares, updates))
        stages.append(PricedStage(layout, sp.first_layer, sp.num_layers, tuple(replicas), fb[0], fb[1], 0.0, rs, ag,
                                  upd))
    # the boundaries, with each stage's exact rows
    hops = []
    for s in range(S - 1):
        hops.append(_hop_s(c, stages[s], stages[s + 1]))
    stages = [replace(ps, hop_s=hops[s] if s < S - 1 else 0.0) for s, ps in enumerate(stages)]
    iteration, extrapolated = simulate(c, st, stages)
    return PricedPlan(st, tuple(stages), iteration, found.estimate_s, extrapolated)


def _hop_s(c, here: PricedStage, there: PricedStage) -> float:
    """The busiest node of a boundary (structure.boundary_s) with each stage's exact rows."""
    def node_rows(ps: PricedStage) -> list[tuple[str, int, int]]:
        gpus = {p.device_type: p.gpus_per_node for p in ps.layout.parts}
        by_node: dict[int, tuple[str, int]] = {}
        for r in ps.replicas:
            t, n = by_node.get(r.node, (r.device_type, 0))
            by_node[r.node] = (t, n + r.rows)
        return [(t, gpus[t], n) for t, n in by_node.values()]

    return boundary_s(c, node_rows(here), node_rows(there))


def simulate(c, st: Structure, stages: list[PricedStage]) -> tuple[float, bool]:
    """The iteration of the plan in GPUMix's pipeline simulator (module docstring)."""
    S = st.num_stages
    transfer = c.boundary_bytes(st.micro_batch)
    channels, hop_names = [], []
    for s in range(S - 1):
        hop = stages[s].hop_s
        gbps = transfer * 8 / hop / 1e9 if hop > 0 else 1e9
        channels.append(Channel(f"hop{s}", 0.0, gbps, gbps))
        hop_names.append(f"hop{s}")
    world = sum(r.tp for ps in stages for r in ps.replicas)
    types = sorted({r.device_type for ps in stages for r in ps.replicas})
    world_s = 2 * (world - 1) * max(c.inter_s(a, b, 1, STATS_BYTES / world, ring=True)
                                    for a in types for b in types) if world > 1 else 0.0
    tied_s = 0.0
    if c.spec.tied_embeddings and S > 1:  # the embedding's full fp32 gradient all-reduced over both end stages
        k = len(stages[0].replicas) + len(stages[-1].replicas)
        gpus = min(p.gpus_per_node for ps in (stages[0], stages[-1]) for p in ps.layout.parts)
        tied_s = 2 * (k - 1) * max(c.inter_s(a, b, gpus, c.embed_bytes() / k, ring=True) for a in types for b in types)
    job = PipelineJob(
        stages=tuple(Stage(ps.forward_s, ps.backward_s, ps.reduce_s, label=ps.layout.label,
                           optimizer_s=ps.update_s + ps.gather_s) for ps in stages),
        hops=tuple(hop_names), channels=tuple(channels), num_pipelines=1, num_microbatches=st.num_microbatches,
        transfer_bytes=transfer, schedule="1f1b", runtime_step=True, world_sync_s=world_s, tied_sync_s=tied_s)
    it = iteration_times(job)
    return it.iteration_s, it.extrapolated


__all__ = ["Replica", "PricedStage", "PricedPlan", "price_exactly", "simulate", "device_offsets"]
