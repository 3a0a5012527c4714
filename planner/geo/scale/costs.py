"""What the joint search prices: a stage's compute, update, memory and the network between nodes.

`ScaleCosts` joins three measured sources, each the one the rest of GPUMix uses:

* compute and update: a per-layer table (planner/core/layer_profiles.py: forward, backward and update
  seconds of every unit per device type, micro-batch and TP degree), summed over a stage's units at
  the replica's rows. Between two measured micro-batches a stage's time is interpolated linearly
  (exact at the measured ones); past the largest measured one a replica is not priced (refused, never
  extrapolated). Where no table is stored, `from_step_profiles` builds one at tp 1 from the step
  profiles the planner already prices with (planner/costmodel/pipeline.py: α + β·m split over the
  units by their training FLOPs);
* memory: planner/geo/scale/memory.py (the runtime's exact stage model, at the rank's TP degree);
* network: measured bandwidth-vs-message-size curves (planner/costmodel/netcurve.py), between nodes
  and inside one; without them, the cluster file's `inter_node_gbps` / `intra_node_gbps` as flat curves.

Every term: docs/models/scale.md.
"""
from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, field

from contracts.catalog import get_gpu_type
from contracts.cluster import ClusterSpec
from contracts.constants import BITS_PER_BYTE, FP32_BYTES, GBIT, INT64_BYTES, MEMORY_HEADROOM
from contracts.specs import ModelSpec
from contracts.units import runtime_units
from planner.core.layer_profiles import LayerProfiles
from planner.costmodel.netcurve import BandwidthCurve, NetworkProfile
from planner.geo.scale.memory import tp_stage_memory_bytes

# the runtime sends a boundary's activation and its gradient as fp32 rows (planner/costmodel/pipeline.py)
WIRE_BYTES = FP32_BYTES


@dataclass(frozen=True)
class UnitTable:
    """One device type at one TP degree: per measured micro-batch, the prefix sums of the units'
    forward and backward seconds (unit 0 the embedding, 1..L the blocks, then the head), and the
    units' update seconds (median over micro-batches)."""

    micro_batches: tuple[int, ...]
    fwd_prefix: tuple[tuple[float, ...], ...]  # [mb index][unit + 1]
    bwd_prefix: tuple[tuple[float, ...], ...]
    update_prefix: tuple[float, ...]

    @property
    def max_rows(self) -> int:
        return self.micro_batches[-1]

    def range_s(self, lo: int, hi: int, rows: int) -> tuple[float, float] | None:
        """(forward, backward) seconds of units [lo, hi) at `rows` rows, None past the measured range."""
        mbs = self.micro_batches
        if rows < 1 or rows > mbs[-1]:
            return None

        def at(i: int) -> tuple[float, float]:
            return self.fwd_prefix[i][hi] - self.fwd_prefix[i][lo], self.bwd_prefix[i][hi] - self.bwd_prefix[i][lo]

        j = bisect.bisect_left(mbs, rows)
        if mbs[j] == rows:
            return at(j)
        if j == 0:  # below the smallest measured size: proportional to rows (a straight line through 0)
            f, b = at(0)
            return f * rows / mbs[0], b * rows / mbs[0]
        (f0, b0), (f1, b1) = at(j - 1), at(j)
        w = (rows - mbs[j - 1]) / (mbs[j] - mbs[j - 1])
        return f0 + w * (f1 - f0), b0 + w * (b1 - b0)

    def update_s(self, lo: int, hi: int) -> float:
        return self.update_prefix[hi] - self.update_prefix[lo]


def _prefix(xs: list[float]) -> tuple[float, ...]:
    out = [0.0]
    for x in xs:
        out.append(out[-1] + x)
    return tuple(out)


def _units_of(layers_s: tuple[tuple[float, float, float], ...], num_blocks: int) -> list[tuple[float, float, float]]:
    """A measurement's rows as the runtime's units: the embedding, the blocks, the head (a final norm
    timed apart is added to the head)."""
    rows = list(layers_s)
    head = rows[num_blocks + 1:]
    return rows[:num_blocks + 1] + [tuple(sum(x[k] for x in head) for k in range(3))]


def tables_from_layer_profiles(layers: LayerProfiles, spec: ModelSpec) -> dict[tuple[str, int], UnitTable]:
    layers.check_model(spec)
    groups: dict[tuple[str, int], dict[int, list]] = {}
    for m in layers.measurements:
        groups.setdefault((m.device_type, m.tp), {}).setdefault(m.micro_batch, []).append(m)
    out = {}
    for key, by_mb in groups.items():
        mbs = sorted(by_mb)
        fwd, bwd, upd = [], [], []
        for mb in mbs:
            ms = by_mb[mb]
            units = [_units_of(m.layers_s, spec.num_layers) for m in ms]
            n = len(units)
            fwd.append(_prefix([sum(u[i][0] for u in units) / n for i in range(len(units[0]))]))
            bwd.append(_prefix([sum(u[i][1] for u in units) / n for i in range(len(units[0]))]))
            upd.append([sum(u[i][2] for u in units) / n for i in range(len(units[0]))])
        median_upd = [sorted(col)[len(col) // 2] for col in zip(*upd)]
        out[key] = UnitTable(tuple(mbs), tuple(fwd), tuple(bwd), _prefix(median_upd))
    return out


def tables_from_step_profiles(spec: ModelSpec, seq: int, dtype: str, device_types: list[str], max_rows: int,
                              profiles_dir: str | None = None) -> dict[tuple[str, int], UnitTable]:
    """tp-1 tables from the planner's step profiles (measured, else estimated and labelled there): the
    whole step α + β·m split over the units by training FLOPs (PipelineCostModel), the optimizer's
    seconds per parameter times each unit's parameters."""
    from planner.costmodel.pipeline import PipelineCostModel

    out = {}
    units = runtime_units(spec)
    for t in device_types:
        fwd, bwd = [], []
        mbs = tuple(range(1, max_rows + 1))
        for m in mbs:
            pcm = PipelineCostModel(spec, seq, m, dtype, profiles_dir=profiles_dir)
            e = pcm.compute_s(t, "none", 0, True, False)
            blk = pcm.compute_s(t, "none", 1, False, False)
            hd = pcm.compute_s(t, "none", 0, False, True)
            fwd.append(_prefix([e[0]] + [blk[0]] * spec.num_layers + [hd[0]]))
            bwd.append(_prefix([e[1]] + [blk[1]] * spec.num_layers + [hd[1]]))
        prof = PipelineCostModel(spec, seq, 1, dtype, profiles_dir=profiles_dir).profile(t, "none")
        upd = [prof.optimizer_time_s(u.numel) for u in units]
        out[(t, 1)] = UnitTable(mbs, tuple(fwd), tuple(bwd), _prefix(upd))
    return out


@dataclass(frozen=True)
class FlatCurve:
    """A bandwidth that does not depend on the message size (a cluster file's Gbit/s figure)."""

    gbps: float

    def message_time_s(self, message_bytes: float) -> float:
        return message_bytes * BITS_PER_BYTE / (self.gbps * GBIT) if message_bytes > 0 else 0.0


@dataclass
class ScaleCosts:
    """Costs of one model at one seq and dtype on one cluster (module docstring)."""

    spec: ModelSpec
    seq: int
    dtype: str
    tables: dict[tuple[str, int], UnitTable]
    inter: NetworkProfile | None = None  # between nodes
    intra: NetworkProfile | None = None  # inside one node
    zone: str = ""  # the zone of the inter-node curves (one zone: the cluster is one datacenter)
    inter_gbps: float = 100.0
    intra_gbps: float = 300.0
    headroom: float = MEMORY_HEADROOM
    source: str = ""
    # how the inter-node curves are read (NETWORK_READINGS): "flows", a node's traffic as one flow per
    # GPU at the curve of that many GPUs per node; "sailor", as Sailor's simulator reads them: a ring
    # one flow at the one-GPU curve, each replica's point-to-point its own flow at the one-GPU curve
    network_reading: str = "flows"
    _mem: dict = field(default_factory=dict, repr=False)
    _curves: dict = field(default_factory=dict, repr=False)

    @classmethod
    def for_cluster(cls, cluster: ClusterSpec, spec: ModelSpec, seq: int, dtype: str,
                    tables: dict[tuple[str, int], UnitTable], inter: NetworkProfile | None = None,
                    intra: NetworkProfile | None = None, zone: str = "", headroom: float = MEMORY_HEADROOM,
                    source: str = "") -> "ScaleCosts":
        return cls(spec, seq, dtype, tables, inter, intra, zone, cluster.network.inter_node_gbps,
                   cluster.network.intra_node_gbps, headroom, source)

    # --- units ---
    @property
    def num_units(self) -> int:
        return self.spec.num_layers + 2

    def unit_range(self, first_layer: int, num_layers: int, first: bool, last: bool) -> tuple[int, int]:
        lo = 0 if first else 1 + first_layer
        hi = self.num_units if last else 1 + first_layer + num_layers
        return lo, hi

    def tp_degrees(self, device_type: str) -> list[int]:
        return sorted(tp for (t, tp) in self.tables if t == device_type)

    def max_rows(self, device_type: str, tp: int) -> int:
        return self.tables[(device_type, tp)].max_rows

    def compute_s(self, device_type: str, tp: int, rows: int, first_layer: int, num_layers: int, first: bool,
                  last: bool) -> tuple[float, float] | None:
        """(forward, backward) of one micro-batch of `rows` rows through the stage on one TP group."""
        table = self.tables.get((device_type, tp))
        if table is None:
            return None
        lo, hi = self.unit_range(first_layer, num_layers, first, last)
        return table.range_s(lo, hi, rows)

    def update_s(self, device_type: str, tp: int, first_layer: int, num_layers: int, first: bool, last: bool) -> float:
        """The optimizer step over the whole of one TP rank's slice of the stage (a ZeRO-1 share f costs f×)."""
        lo, hi = self.unit_range(first_layer, num_layers, first, last)
        return self.tables[(device_type, tp)].update_s(lo, hi)

    def stage_params(self, first_layer: int, num_layers: int, first: bool, last: bool) -> int:
        units = runtime_units(self.spec)
        lo, hi = self.unit_range(first_layer, num_layers, first, last)
        return sum(u.numel for u in units[lo:hi])

    # --- memory ---
    def capacity_bytes(self, device_type: str) -> int:
        return int(get_gpu_type(device_type).memory_bytes * self.headroom)

    def memory_bytes(self, device_type: str, tp: int, first_layer: int, num_layers: int, stage: int,
                     num_stages: int, num_microbatches: int, rows: int, shard_fraction: float) -> int:
        # the walk of the schedule is the same for every M >= S + 2 (stage_memory.walk_order); only the
        # token ids of the first and last stage (int64, rows·seq per micro-batch) grow with M beyond it
        walked = min(num_microbatches, num_stages + 2)
        extra = (num_microbatches - walked) * INT64_BYTES * rows * self.seq * (
            (1 if stage == 0 else 0) + (1 if stage == num_stages - 1 else 0))
        return extra + tp_stage_memory_bytes(self.spec, first_layer, num_layers, stage, num_stages, walked, rows,
                                             round(shard_fraction, 9), self.seq, self.dtype, device_type, tp)

    def max_fitting_rows(self, device_type: str, tp: int, first_layer: int, num_layers: int, stage: int,
                         num_stages: int, num_microbatches: int, shard_fraction: float) -> int:
        """The most rows (up to the measured largest micro-batch) one rank fits with at least
        `shard_fraction` (taken up to the next power of two: more state, so a safe cap that many
        layouts share; the chosen plan's memory is checked at its own shares)."""
        shard_fraction = min(1.0, 2.0 ** math.ceil(math.log2(shard_fraction))) if shard_fraction > 0 else 0.0
        # a rank's memory depends on its stage only through first / last and the stages after it
        # (the schedule's warm-up): every middle stage with as many stages after it is the same
        if 0 < stage < num_stages - 1:
            stage, num_stages = 1, num_stages - stage + 1
        elif stage == num_stages - 1 and stage > 0:
            stage, num_stages = 1, 2
        key = (device_type, tp, num_layers, stage, num_stages, num_microbatches, round(shard_fraction, 6))
        if key not in self._mem:
            cap = self.capacity_bytes(device_type)
            lo, hi = 0, self.max_rows(device_type, tp)  # memory grows with the rows: a bisection
            while lo < hi:
                mid = (lo + hi + 1) // 2
                if self.memory_bytes(device_type, tp, 0, num_layers, stage, num_stages, num_microbatches,
                                     mid, round(shard_fraction, 6)) <= cap:
                    lo = mid
                else:
                    hi = mid - 1
            self._mem[key] = lo
        return self._mem[key]

    # --- network ---
    def inter_s(self, type_a: str, type_b: str, flows: int, total_bytes: float, ring: bool = False,
                rings: int = 1) -> float:
        """`total_bytes` between a node of type a and one of type b as `flows` concurrent GPU flows (one
        per GPU of the node): the measured curve of that many GPUs per node gives their aggregate
        bandwidth at each flow's message size (docs/models/scale.md, "Network"). Read as Sailor does
        (`network_reading` "sailor"): a ring step (`ring`) of `rings` parallel rings (one per TP rank
        of a tensor-parallel stage, each ring over that rank's 1/tp slice) is one flow per ring at the
        one-GPU curve, each carrying total_bytes / rings; other traffic `flows` flows in parallel, each
        at the one-GPU curve."""
        if total_bytes <= 0:
            return 0.0
        if self.inter is None:
            return FlatCurve(self.inter_gbps).message_time_s(total_bytes)
        if self.network_reading == "sailor":
            one = self._curve(type_a, type_b, 1)
            per = total_bytes / max(1, rings) if ring else total_bytes / flows
            return per / one.bandwidth_bytes_per_s(per)
        return total_bytes / self._curve(type_a, type_b, flows).bandwidth_bytes_per_s(total_bytes / flows)

    def _curve(self, type_a: str, type_b: str, flows: int) -> BandwidthCurve:
        key = (type_a, type_b, flows)
        curve = self._curves.get(key)
        if curve is None:
            curve = self._curves[key] = _curve(self.inter, type_a, type_b, flows, self.zone)
        return curve

    def intra_s(self, device_type: str, flows: int, total_bytes: float) -> float:
        """The same inside one node: the intra-node curve of `flows` GPUs."""
        if total_bytes <= 0:
            return 0.0
        if self.intra is None:
            return FlatCurve(self.intra_gbps).message_time_s(total_bytes)
        curve = _intra(self.intra, device_type, flows)
        return total_bytes / curve.bandwidth_bytes_per_s(total_bytes / flows)

    def embed_bytes(self) -> int:
        """The embedding unit's fp32 gradient (summed between the first and last stage of a tied model)."""
        return runtime_units(self.spec)[0].numel * FP32_BYTES

    def boundary_bytes(self, rows: int) -> int:
        """One boundary's activation (and, backward, its gradient) of `rows` rows: rows·seq·hidden fp32."""
        return rows * self.seq * self.spec.hidden * WIRE_BYTES


NETWORK_READINGS = ("flows", "sailor")


def _curve(profile: NetworkProfile, a: str, b: str, flows: int, zone: str) -> BandwidthCurve:
    """The inter-node curve between a node of type a and one of type b with `flows` GPUs each (the
    largest measured count up to it)."""
    counts = sorted({c.num_gpus_a for c in profile.curves if c.gpu_type_a == a and c.gpu_type_b == b
                     and c.num_gpus_a == c.num_gpus_b})
    if not counts:
        raise ValueError(f"network profile {profile.name!r} has no curve between {a} and {b}")
    n = max([c for c in counts if c <= flows] or counts[:1])
    return profile.curve(a, n, b, n, zone_a=zone, zone_b=zone)


def _intra(profile: NetworkProfile, device_type: str, num_gpus: int) -> BandwidthCurve:
    counts = sorted(c.num_gpus_a for c in profile.curves if c.gpu_type_a == device_type)
    if not counts:
        raise ValueError(f"intra-node network profile {profile.name!r} has no curve for {device_type}")
    n = next((c for c in counts if c >= num_gpus), counts[-1])
    return profile.curve(device_type, n)


__all__ = ["ScaleCosts", "UnitTable", "FlatCurve", "tables_from_layer_profiles", "tables_from_step_profiles",
           "WIRE_BYTES"]
