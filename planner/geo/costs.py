"""Cost tables for geo planning: the shared pipeline cost model (planner/costmodel/pipeline.py)
asked with a scenario's model, batch and datacenters.

Everything is priced there: per-layer compute of one micro-batch on each GPU type (from the step
profile, split by the units' FLOPs), forward/backward split, stage memory from the memory model
(with the schedule's in-flight micro-batches), the ZeRO-1 collectives inside a stage over the
datacenter's network (planner/costmodel/collectives.py) and the optimizer step over the stage's
shard, the activations that cross a boundary (fp32, as the runtime sends them) and a tied
embedding's gradient summed between the first and the last stage. This module only says which
datacenter network a stage's collectives cross, and which link the tied sum takes.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

from contracts.constants import DTYPE_BYTES
from contracts.specs import ModelSpec, get_model, with_max_seq
from planner.costmodel.collectives import Link, all_reduce_s, bytes_per_s
from planner.costmodel.pipeline import PipelineCostModel, in_flight, tied_sync_s
from planner.geo.scenario import INTRA_DC_LATENCY_S, GeoScenario

log = logging.getLogger(__name__)


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
        """Data parallelism across datacenters: one bucketed ring all-reduce of the gradients over the
        DCs (hierarchical: reduced inside each DC first), the strongest form a practitioner runs."""
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

