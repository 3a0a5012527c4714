"""Cost tables for geo planning: the shared pipeline cost model (planner/costmodel/pipeline.py)
asked with a scenario's model, batch and datacenters.

Everything is priced there: per-layer compute of one micro-batch on each GPU type (from the step
profile, split by the units' FLOPs), forward/backward split, stage memory from the memory model
(with the schedule's in-flight micro-batches), the ZeRO-1 collectives inside a stage over the
datacenter's network (planner/costmodel/collectives.py) and the optimizer step over the stage's
shard, the activations that cross a boundary (fp32, as the runtime sends them) and a tied
embedding's gradient summed between the first and the last stage. This module only says which
datacenter network a stage's collectives cross, and which link the tied sum takes, and prices
data parallelism across a cut with its all-reduce overlapped with the backward
(`estimate_overlapped_allreduce`).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Sequence

from contracts.constants import DTYPE_BYTES
from contracts.specs import ModelSpec, get_model, with_max_seq
from planner.costmodel.collectives import Link, all_reduce_s, bytes_per_s
from planner.costmodel.pipeline import PipelineCostModel, in_flight, tied_sync_s
from planner.geo.scenario import INTRA_DC_LATENCY_S, GeoScenario

log = logging.getLogger(__name__)

# PyTorch DDP's default bucket_cap_mb (25 MiB): gradients are all-reduced in buckets of about this
# size, each issued as soon as its last gradient is produced by the backward.
DDP_BUCKET_BYTES = 25 * 2**20
# Bucket sizes a practitioner tries across a WAN (bucket_cap_mb): each bucket's ring pays the link's
# latency once, so on a long RTT larger buckets win; the largest, one bucket, is no overlap at all.
BUCKET_CHOICES_BYTES = (DDP_BUCKET_BYTES, 100 * 2**20, 400 * 2**20, 1600 * 2**20, float("inf"))


@dataclass(frozen=True)
class OverlapEstimate:
    """A bucketed gradient all-reduce overlapped with the backward that produces the gradients."""

    end_s: float  # when the last bucket's all-reduce ends (the clock of the `ready` times)
    backward_end_s: float  # when the last gradient was ready: the end of the backward
    total_comm_s: float  # every bucket's all-reduce, back to back (what no overlap would expose)
    num_buckets: int

    @property
    def exposed_s(self) -> float:
        """What of the all-reduce is left after the backward ends: the step's added time."""
        return max(0.0, self.end_s - self.backward_end_s)

    @property
    def hidden_s(self) -> float:
        return self.total_comm_s - self.exposed_s


def estimate_overlapped_allreduce(ready: Sequence[tuple[float, float]], world_size: int, link: Link,
                                  bucket_bytes: float = DDP_BUCKET_BYTES) -> OverlapEstimate:
    """A bucketed DDP/FSDP gradient all-reduce overlapped with the backward.

    `ready`: (time s, bytes) of each gradient piece in the order the backward produces them (last
    layer first). Pieces fill buckets of at least `bucket_bytes` in that order; a bucket is issued
    when its last piece is ready, and the buckets' ring all-reduces (`all_reduce_s` on `link` among
    `world_size` ranks, each paying the call latency) run one after another on the network:
    start_i = max(ready_i, end_{i-1}). The exposed time is what is left after the last piece is
    ready. With every piece ready at one instant this is the unoverlapped all-reduce, bucket by
    bucket. Raises ValueError on no pieces, negative bytes or a world size below 1."""
    if not ready:
        raise ValueError("overlapped all-reduce: no gradient pieces given")
    if world_size < 1:
        raise ValueError(f"overlapped all-reduce: world_size must be >= 1, got {world_size}")
    if bucket_bytes <= 0:
        raise ValueError(f"overlapped all-reduce: bucket_bytes must be > 0, got {bucket_bytes}")
    buckets: list[tuple[float, float]] = []  # (ready s, bytes)
    t_ready, filled = 0.0, 0.0
    for t, b in ready:
        if b < 0:
            raise ValueError(f"overlapped all-reduce: a gradient piece of {b} bytes")
        t_ready, filled = max(t_ready, t), filled + b
        if filled >= bucket_bytes:
            buckets.append((t_ready, filled))
            filled = 0.0
    if filled > 0:
        buckets.append((t_ready, filled))
    end, total = 0.0, 0.0
    for t, b in buckets:
        comm = all_reduce_s(b, world_size, link)
        end, total = max(end, t) + comm, total + comm
    backward_end = max(t for t, _ in ready)
    return OverlapEstimate(max(end, backward_end), backward_end, total, len(buckets))


def estimate_best_bucketed_allreduce(ready: Sequence[tuple[float, float]], world_size: int, link: Link,
                                     bucket_choices: Sequence[float] = BUCKET_CHOICES_BYTES) -> OverlapEstimate:
    """`estimate_overlapped_allreduce` at the bucket size of `bucket_choices` that ends first: the
    strongest DDP configuration of the list (with one bucket among them, never slower than the
    unoverlapped all-reduce)."""
    return min((estimate_overlapped_allreduce(ready, world_size, link, b) for b in bucket_choices),
               key=lambda e: e.end_s)


def uniform_ready(backward_start_s: float, backward_end_s: float, grad_bytes: float,
                  num_pieces: int) -> list[tuple[float, float]]:
    """`grad_bytes` of gradients produced evenly over [start, end] in `num_pieces` pieces (one per
    layer, say): the input of `estimate_overlapped_allreduce` where only the backward's span is known
    (a measured backward time)."""
    if num_pieces < 1 or backward_end_s < backward_start_s:
        raise ValueError(f"uniform_ready: need num_pieces >= 1 and end >= start, got {num_pieces}, "
                         f"[{backward_start_s}, {backward_end_s}]")
    span = backward_end_s - backward_start_s
    return [(backward_start_s + span * (i + 1) / num_pieces, grad_bytes / num_pieces) for i in range(num_pieces)]


@dataclass(frozen=True)
class StageCost:
    dc: str
    gpu_type: str
    first_layer: int
    num_layers: int
    forward_s: float
    backward_s: float
    allreduce_s: float  # the stage's ZeRO-1 collectives among its data-parallel GPUs, once per step
    memory_bytes: int
    capacity_bytes: int
    num_params: int
    optimizer_s: float = 0.0  # AdamW over one GPU's shard of the stage, once per step


class GeoCosts:
    """Cost tables of one scenario's training model (cached per GPU type and recompute mode)."""

    def __init__(self, scenario: GeoScenario, schedule: str = "1f1b"):
        self.scenario = scenario
        self.schedule = schedule  # GPipe keeps every micro-batch's activations; 1F1B at most p - j
        self.spec: ModelSpec = with_max_seq(get_model(scenario.model), scenario.seq)
        self.seq, self.micro_batch, self.dtype = scenario.seq, scenario.micro_batch, scenario.dtype
        self.tokens = self.seq * self.micro_batch
        self.model = PipelineCostModel(self.spec, self.seq, self.micro_batch, self.dtype, schedule)
        # per micro-batch an activation of s·b·h fp32 elements crosses a stage boundary (and its gradient back)
        self.transfer_bytes = self.model.boundary_bytes()

    def dc_link(self, dc: str) -> Link:
        """The links among one datacenter's GPUs (one NIC-class path each)."""
        return Link(bytes_per_s(self.scenario.datacenter(dc).intra_dc_gbps), INTRA_DC_LATENCY_S)

    # --- time ---
    def layer_time_s(self, gpu_type: str, recompute: str) -> float:
        """Forward+backward of one layer for one micro-batch."""
        return self.model.layer_s(gpu_type, recompute)

    def head_time_s(self, gpu_type: str, recompute: str) -> float:
        return self.model.ends_s(gpu_type, recompute, first=False, last=True)

    # --- memory ---
    def in_flight(self, j: int, p: int, m: int) -> int:
        """Micro-batches whose activations stage j of p holds at once."""
        return in_flight(self.schedule, j, p, m)

    def stage_memory_bytes(self, gpu_type: str, num_layers: int, j: int, p: int, m: int, dp: int,
                           recompute: str) -> int:
        return self.model.stage_memory_bytes(gpu_type, num_layers, j, p, m, dp, recompute)

    def capacity_bytes(self, gpu_type: str) -> int:
        return self.model.capacity_bytes(gpu_type)

    def max_layers(self, gpu_type: str, j: int, p: int, m: int, dp: int, recompute: str) -> int:
        """The most layers stage j (of p) fits on one GPU of `gpu_type`."""
        return self.model.stage_max_layers(gpu_type, j, p, m, dp, recompute)

    # --- communication ---
    def stage_params(self, num_layers: int, first: bool, last: bool) -> int:
        return self.model.stage_params(num_layers, first, last)

    def grad_bytes(self, num_params: int) -> float:
        """Gradients reduced in the training dtype (a bucketed DDP all-reduce)."""
        return num_params * DTYPE_BYTES[self.dtype]

    def wan_allreduce_s(self, num_params: int, num_dcs: int, link: Link) -> float:
        """Data parallelism across datacenters, not overlapped: one ring all-reduce of the gradients
        over the DCs (hierarchical: reduced inside each DC first). The baseline prices it overlapped
        with the backward instead (`estimate_overlapped_allreduce`); this is its no-overlap bound."""
        return all_reduce_s(self.grad_bytes(num_params), num_dcs, link)

    def tied_sync_s(self, chain: tuple[str, ...], num_pipelines: int, connections: dict[str, int]) -> float:
        """The tied embedding's all-reduce over the first and the last stage's 2d GPUs (planner/
        costmodel/pipeline.tied_sync_s) of a plan over the datacenters `chain`: inside one DC over its
        network; else its ring crosses the WAN link between the two ends (with its connections,
        `connections`: "x-y" -> k per hop) or, with no direct link, the chain's slowest hop, each of
        its 2(2d − 1) steps paying that one-way latency."""
        first, last = chain[0], chain[-1]
        k = 2 * num_pipelines
        if first == last:
            link = Link(bytes_per_s(self.scenario.datacenter(first).intra_dc_gbps), INTRA_DC_LATENCY_S)
            return tied_sync_s(self.model.tied_bytes(), k, link)
        if self.scenario.has_link(first, last):
            c = connections.get(f"{first}-{last}", connections.get(f"{last}-{first}", 1))
            links = [(self.scenario.link(first, last), c)]
        else:
            links = [(self.scenario.link(x, y), connections.get(f"{x}-{y}", 1)) for x, y in zip(chain, chain[1:])]
        bw = min(bytes_per_s(l.throughput_gbps(c)) for l, c in links)
        latency = max(l.one_way_latency_s for l, _ in links)
        return tied_sync_s(self.model.tied_bytes(), k, Link(bw, latency, call_latency_s=(k - 1) * latency))

    def stage_cost(self, dc: str, gpu_type: str, first_layer: int, num_layers: int, j: int, p: int, m: int,
                   dp: int, recompute: str) -> StageCost:
        e = self.model.estimate_stage(gpu_type, num_layers, j, p, m, dp, recompute, self.dc_link(dc))
        return StageCost(dc, gpu_type, first_layer, num_layers, e.forward_s, e.backward_s, e.sync_s, e.memory_bytes,
                         e.capacity_bytes, e.num_params, e.optimizer_s)

