"""A plan's structure at scale and how one structure is priced in closed form.

A `Structure` is: an ordered list of stages, each a `StageLayout` (whole nodes of one or several GPU
types, each part at one TP degree inside its nodes), the pipeline's micro-batch B (rows, split over
each stage's TP groups) and so M = global batch / B micro-batches. `price_structure` gives it its
best layer split and, per stage, the exact row split (planner/geo/scale/split.py), the stage's syncs and
its boundary transfers, and the closed-form 1F1B estimate the search ranks by:

    E = Σ_s t_s + (M − 1)·max_s max(t_s, x_s) + 2·Σ_s x_s + max_s rs_s + max_s (opt_s + ag_s)

t_s the stage's time per micro-batch (its slowest replica's forward + backward), x_s its boundary
transfer to the next stage, rs_s / ag_s the ZeRO-1 reduce-scatter / all-gather over its replicas,
opt_s its slowest rank's update. The simulator (planner/geo/scale/price.py) decides among the best.

The layer split: at a bottleneck T a stage takes at most the most blocks whose time stays ≤ T; the
least feasible T (greedy over the stages in order: exact, every stage's time grows with its blocks)
is found by bisection over the stage times (the finitely many times of any stage at any block
count). docs/models/scale.md.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from contracts.constants import FP32_BYTES
from planner.geo.scale.costs import ScaleCosts
from planner.geo.scale.split import ReplicaGroup, RowSplit, split_rows


@dataclass(frozen=True)
class StagePart:
    device_type: str
    gpus_per_node: int
    tp: int
    nodes: tuple[int, ...]  # node indices of the cluster

    @property
    def num_replicas(self) -> int:
        return len(self.nodes) * (self.gpus_per_node // self.tp)


@dataclass(frozen=True)
class StageLayout:
    parts: tuple[StagePart, ...]

    @property
    def num_nodes(self) -> int:
        return sum(len(p.nodes) for p in self.parts)

    @property
    def num_replicas(self) -> int:
        return sum(p.num_replicas for p in self.parts)

    @property
    def shape(self) -> tuple[tuple[str, int, int, int], ...]:
        """What a stage's costs depend on: per part (type, GPUs per node, tp, nodes), not which nodes."""
        return tuple((p.device_type, p.gpus_per_node, p.tp, len(p.nodes)) for p in self.parts)

    @property
    def label(self) -> str:
        return "+".join(f"{len(p.nodes)}x{p.gpus_per_node} {p.device_type} tp{p.tp}" for p in self.parts)


@dataclass(frozen=True)
class Structure:
    stages: tuple[StageLayout, ...]
    micro_batch: int  # rows per micro-batch (every stage)
    num_microbatches: int

    @property
    def num_stages(self) -> int:
        return len(self.stages)


@dataclass(frozen=True)
class StagePrice:
    first_layer: int
    num_layers: int
    split: RowSplit
    time_s: float  # forward + backward per micro-batch, slowest replica
    forward_s: float  # of that replica
    backward_s: float
    hop_s: float  # the boundary transfer to the next stage (0 for the last)
    reduce_s: float  # ZeRO-1 reduce-scatter over the stage's replicas (even shares)
    gather_s: float
    update_s: float  # the slowest rank's update at even shares


@dataclass(frozen=True)
class StructurePrice:
    structure: Structure
    stages: tuple[StagePrice, ...]
    estimate_s: float


class StructurePricer:
    """Prices structures of one job on one `ScaleCosts`; caches what stages of equal layouts share."""

    def __init__(self, costs: ScaleCosts, global_batch: int, uniform_blocks: bool = True):
        self.costs = costs
        self.global_batch = global_batch
        self.L = costs.spec.num_layers
        # the search times a block as the mean block (every block of a decoder is the same shape, the
        # measured ones differ by noise); the chosen plan is priced block by block (price.py)
        self.uniform_blocks = uniform_blocks
        self._stage_cache: dict = {}
        self._compute_cache: dict = {}

    # --- one stage ---
    def _groups(self, layout: StageLayout, first_layer: int, num_layers: int, stage: int, num_stages: int,
                num_microbatches: int) -> list[ReplicaGroup]:
        c = self.costs
        first, last = stage == 0, stage == num_stages - 1
        share = 1.0 / layout.num_replicas
        groups = []
        for p in layout.parts:
            cap = min(c.max_rows(p.device_type, p.tp),
                      c.max_fitting_rows(p.device_type, p.tp, 0, num_layers, stage, num_stages, num_microbatches,
                                         share))

            def t(r: int, p=p) -> float:
                fb = self._compute(p.device_type, p.tp, r, first_layer, num_layers, first, last)
                return math.inf if fb is None else fb[0] + fb[1]

            groups.append(ReplicaGroup(p.device_type, p.tp, p.num_replicas, cap, t))
        return groups

    def _compute(self, device_type: str, tp: int, rows: int, first_layer: int, num_layers: int, first: bool,
                 last: bool) -> tuple[float, float] | None:
        key = (device_type, tp, rows, None if self.uniform_blocks else first_layer, num_layers, first, last)
        if key not in self._compute_cache:
            self._compute_cache[key] = self._compute_uncached(device_type, tp, rows, first_layer, num_layers,
                                                              first, last)
        return self._compute_cache[key]

    def _compute_uncached(self, device_type: str, tp: int, rows: int, first_layer: int, num_layers: int,
                          first: bool, last: bool) -> tuple[float, float] | None:
        c = self.costs
        if not self.uniform_blocks:
            return c.compute_s(device_type, tp, rows, first_layer, num_layers, first, last)
        whole = c.compute_s(device_type, tp, rows, 0, self.L, False, False)
        if whole is None:
            return None
        f, b = whole[0] * num_layers / self.L, whole[1] * num_layers / self.L
        for end, on in ((c.compute_s(device_type, tp, rows, 0, 0, True, False), first),
                        (c.compute_s(device_type, tp, rows, self.L, 0, False, True), last)):
            if on and end is not None:
                f, b = f + end[0], b + end[1]
        return f, b

    def stage_split(self, layout: StageLayout, first_layer: int, num_layers: int, stage: int, num_stages: int,
                    structure: Structure) -> RowSplit | None:
        first, last = stage == 0, stage == num_stages - 1
        key = (layout.shape, num_layers, first, last, min(num_stages - stage, structure.num_microbatches),
               structure.num_microbatches, structure.micro_batch,
               None if self.uniform_blocks else first_layer)
        if key not in self._stage_cache:
            groups = self._groups(layout, first_layer, num_layers, stage, num_stages, structure.num_microbatches)
            self._stage_cache[key] = split_rows(groups, structure.micro_batch)
        return self._stage_cache[key]

    def stage_time(self, structure: Structure, stage: int, first_layer: int, num_layers: int) -> float:
        s = self.stage_split(structure.stages[stage], first_layer, num_layers, stage, structure.num_stages, structure)
        return math.inf if s is None else s.time_s

    # --- the stage's communication ---
    def hop_s(self, structure: Structure, stage: int, split: RowSplit) -> float:
        """The boundary transfer from `stage` to the next per micro-batch: every node sends its rows (one
        copy per TP group, scattered over its ranks) as one flow per GPU, every node of the next stage
        receives its rows likewise: the busiest node's time (`ScaleCosts.inter_s`)."""
        if stage == structure.num_stages - 1:
            return 0.0
        here, there = structure.stages[stage], structure.stages[stage + 1]
        nxt = self.stage_split(there, 0, 1, stage + 1, structure.num_stages, structure)
        return boundary_s(self.costs, _node_rows(here, split), _node_rows(there, nxt))

    def sync_s(self, layout: StageLayout, params: int, shares: list[float] | None = None) -> tuple[float, float]:
        """(reduce-scatter, all-gather) of the stage's fp32 state over its k TP groups as rings (NCCL's
        channels: one flow per GPU across each node boundary), k − 1 steps each; every step a node
        boundary carries the largest share's chunk of the whole state, max f × the stage's bytes."""
        k = layout.num_replicas if shares is None else sum(1 for f in shares if f > 0)
        return (ring_s(self.costs, layout, k, max(shares) if shares else 1.0 / max(k, 1), params * FP32_BYTES),) * 2

    # --- the whole structure ---
    def stage_price(self, structure: Structure, stage: int, first_layer: int, num_layers: int) -> StagePrice | None:
        layout = structure.stages[stage]
        split = self.stage_split(layout, first_layer, num_layers, stage, structure.num_stages, structure)
        if split is None:
            return None
        first, last = stage == 0, stage == structure.num_stages - 1
        # the slowest replica's forward / backward
        fb = (0.0, 0.0)
        for p, rows in zip(layout.parts, split.rows):
            r = max(rows) if rows else 0
            if r > 0:
                x = self._compute(p.device_type, p.tp, r, first_layer, num_layers, first, last)
                if x is not None and x[0] + x[1] > fb[0] + fb[1]:
                    fb = x
        params = self.costs.stage_params(first_layer, num_layers, first, last)
        used = sum(1 for rows in split.rows for r in rows if r > 0)
        rs, ag = self.sync_s(layout, params, [1.0 / used] * used)
        upd = max(self.costs.update_s(p.device_type, p.tp, first_layer, num_layers, first, last)
                  for p, rows in zip(layout.parts, split.rows) if any(rows)) / used
        return StagePrice(first_layer, num_layers, split, split.time_s, fb[0], fb[1],
                          self.hop_s(structure, stage, split), rs, ag, upd)

    def estimate(self, structure: Structure, stages: list[StagePrice]) -> float:
        M = structure.num_microbatches
        ts = [s.time_s for s in stages]
        # 1F1B's steady state is a ping-pong between neighbours: a stage's backward waits for its
        # forward's round trip through the next stage, so the boundaries add to the cycle
        cycle = max(s.time_s + 2 * max(s.hop_s, stages[j - 1].hop_s if j else 0.0) for j, s in enumerate(stages))
        return (sum(ts) + (M - 1) * cycle + 2 * sum(s.hop_s for s in stages)
                + max(s.reduce_s for s in stages) + max(s.update_s + s.gather_s for s in stages))

    def layer_split(self, structure: Structure, bottleneck_s: float) -> list[int] | None:
        """Blocks per stage with every stage's time ≤ bottleneck_s, each stage at least one, greedy in
        order (the most each stage fits, leaving one per later stage); None when none exists."""
        S, L = structure.num_stages, self.L
        out, first = [], 0
        for s in range(S):
            left = S - 1 - s
            most = L - first - left
            if most < 1:
                return None
            if s == S - 1:
                n = most
                if self.stage_time(structure, s, first, n) > bottleneck_s:
                    return None
            else:
                lo, hi = 0, most  # largest n in 1..most with time ≤ T (time grows with n)
                while lo < hi:
                    mid = (lo + hi + 1) // 2
                    if self.stage_time(structure, s, first, mid) <= bottleneck_s:
                        lo = mid
                    else:
                        hi = mid - 1
                if lo < 1:
                    return None
                n = lo
            out.append(n)
            first += n
        return out

    def lower_bound_s(self, structure: Structure) -> float:
        """A lower bound of `price(structure).estimate_s`: with τ_s one block's least time on stage s (its
        rows split at one block's memory, the most rows any block count lets it take), any split has
        t_s ≥ L_s·τ_s, so its bottleneck T ≥ L / Σ_s 1/τ_s and Σ_s t_s ≥ L·min_s τ_s; E ≥ (M − 1)·T + Σ t_s."""
        S, L, M = structure.num_stages, self.L, structure.num_microbatches
        if S > L:
            return math.inf
        taus = []
        for s in range(S):
            split = self.stage_split(structure.stages[s], 0, 1, 1, 3, structure) if 0 < s < S - 1 else \
                self.stage_split(structure.stages[s], 0, 1, s, S, structure)
            if split is None:
                return math.inf
            groups_t = []
            for p, rows in zip(structure.stages[s].parts, split.rows):
                r = max(rows) if rows else 0
                if r > 0:
                    x = self._compute(p.device_type, p.tp, r, 0, 1, False, False)
                    groups_t.append(math.inf if x is None else x[0] + x[1])
            taus.append(max(groups_t))
        if any(t <= 0 for t in taus):
            return 0.0
        bottleneck = L / sum(1.0 / t for t in taus)
        return (M - 1) * bottleneck + L * min(taus)

    def price(self, structure: Structure) -> StructurePrice | None:
        """The structure at its least bottleneck's layer split, with its estimate; None when no split fits."""
        S, L = structure.num_stages, self.L
        if S > L:
            return None
        cands = set()
        for s in range(S):
            for n in range(1, L - S + 2):
                t = self.stage_time(structure, s, 0, n)
                if t < math.inf:
                    cands.add(t)
        cands = sorted(cands)
        if not cands:
            return None
        lo, hi = 0, len(cands) - 1
        if self.layer_split(structure, cands[hi]) is None:
            return None
        while lo < hi:
            mid = (lo + hi) // 2
            if self.layer_split(structure, cands[mid]) is not None:
                hi = mid
            else:
                lo = mid + 1
        split = self.layer_split(structure, cands[lo])
        stages, first = [], 0
        for s, n in enumerate(split):
            sp = self.stage_price(structure, s, first, n)
            if sp is None:
                return None
            stages.append(sp)
            first += n
        return StructurePrice(structure, tuple(stages), self.estimate(structure, stages))


def ring_s(costs: ScaleCosts, layout: StageLayout, k: int, fmax: float, total_bytes: float) -> float:
    """k − 1 ring steps of fmax × total_bytes through the slowest node boundary of the stage (module
    docstring of `StructurePricer.sync_s`); inside one node, the intra-node curve."""
    if k <= 1:
        return 0.0
    step = fmax * total_bytes
    flows = min(p.gpus_per_node for p in layout.parts)
    if layout.num_nodes == 1:
        return (k - 1) * costs.intra_s(layout.parts[0].device_type, flows, step)
    types = [p.device_type for p in layout.parts]
    # a TP-t stage syncs as t rings side by side, one per TP rank over its 1/t slice (the smallest t
    # of the stage's parts: its largest slice)
    rings = min(p.tp for p in layout.parts)
    return (k - 1) * max(costs.inter_s(a, b, flows, step, ring=True, rings=rings) for a in types for b in types)


def _node_rows(layout: StageLayout, split: RowSplit | None) -> list[tuple[str, int, int]]:
    """(type, GPUs per node, rows) of each node of a stage: its TP groups' rows, node by node."""
    out = []
    if split is None:
        return out
    for p, rows in zip(layout.parts, split.rows):
        per_node = p.gpus_per_node // p.tp
        for i in range(0, len(rows), per_node):
            out.append((p.device_type, p.gpus_per_node, sum(rows[i:i + per_node])))
    return out


def boundary_s(costs: ScaleCosts, senders: list[tuple[str, int, int]], receivers: list[tuple[str, int, int]]) -> float:
    """One micro-batch across a boundary: the busiest node, sending or receiving its rows' activation."""
    worst = 0.0
    for ends, others in ((senders, receivers), (receivers, senders)):
        other_types = {t for t, _, r in others if r > 0}
        for t, gpus, rows in set(ends):
            if rows > 0:
                for u in other_types:
                    worst = max(worst, costs.inter_s(t, u, gpus, costs.boundary_bytes(rows)))
    return worst


__all__ = ["ring_s", "boundary_s", "StagePart", "StageLayout", "Structure", "StagePrice", "StructurePrice", "StructurePricer"]
