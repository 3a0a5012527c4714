"""What one pipeline stage costs: a range of layers on one device type, for one micro-batch.

A pipeline cuts the runtime's units (contracts/units.py) into contiguous stages; the d GPUs of one
stage train it with ZeRO-1 and run AdamW over their 1/d of its state. Priced here: compute (the
device type's α + β·m divided among the units by their training FLOPs, `unit_flops`), the
optimizer, the stage's collectives, the fp32 activation and gradient crossing each boundary
(`boundary_bytes`), a tied embedding's all-reduce between the first and last stage (`tied_sync_s`),
and the stage's memory (planner/core/stage_memory.py's exact model).

The terms and their sources: docs/models/pipeline_simulation.md ("What one stage costs").
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from functools import lru_cache

from contracts.catalog import device_dtype, get_gpu_type
from contracts.cluster import split_profile_key
from contracts.constants import FP32_BYTES, MEMORY_HEADROOM
from contracts.plan import PIPELINE_SCHEDULES
from contracts.specs import ModelSpec
from contracts.pipeline_order import schedule_in_flight
from contracts.units import runtime_units
from planner.costmodel.collectives import Link, all_reduce_s, sharded_step_comm_s
from planner.costmodel.training import compute_dtype_bytes

log = logging.getLogger(__name__)

SCHEDULES = PIPELINE_SCHEDULES
# bytes per element of an activation or gradient between stages: the runtime sends fp32
WIRE_BYTES = FP32_BYTES


@dataclass(frozen=True)
class UnitFlops:
    """Training FLOPs per token of one unit kind: forward, and backward (with recomputation)."""

    forward: float
    backward: float

    @property
    def total(self) -> float:
        return self.forward + self.backward


@dataclass(frozen=True)
class StageEstimate:
    """One stage on one GPU type, for one micro-batch (times) and per GPU (memory)."""

    forward_s: float
    backward_s: float
    sync_s: float  # ZeRO-1 reduce-scatter + all-gather among the stage's d GPUs, once per step
    optimizer_s: float  # AdamW over this GPU's 1/d of the stage's state, once per step
    memory_bytes: int
    capacity_bytes: int
    num_params: int

    @property
    def compute_s(self) -> float:
        return self.forward_s + self.backward_s

    @property
    def fits(self) -> bool:
        return self.memory_bytes <= self.capacity_bytes


def unit_flops(spec: ModelSpec, seq: int, recompute: str) -> dict[str, UnitFlops]:
    """Per token: "embed", "block" (each one), "head" (docs/models/pipeline_simulation.md)."""
    h, V, L = spec.hidden, spec.vocab_size, spec.num_layers
    block_matmul = (spec.matmul_params() - V * h) / L
    attention = 4.0 * spec.q_width * seq  # QKᵀ and AV over the s×s square, forward
    fwd = 2.0 * block_matmul + attention
    bwd = 2.0 * fwd + (fwd if recompute == "full" else 0.0)
    return {"embed": UnitFlops(0.0, 0.0), "block": UnitFlops(fwd, bwd),
            "head": UnitFlops(2.0 * V * h, 4.0 * V * h)}


def in_flight(schedule: str, stage: int, num_stages: int, num_microbatches: int) -> int:
    """Micro-batches whose activations stage `stage` of `num_stages` holds at once: the runtime's
    schedule (contracts/pipeline_order.schedule_in_flight; 1F1B min(S-s, M), GPipe M)."""
    return schedule_in_flight(schedule, num_stages, stage, num_microbatches)


def base_type(kind: str) -> str:
    """The catalog type of a device kind: a type, or a profile key with a CPU quota ("cpu@share0.5",
    contracts.cluster.profile_key), whose step profile is measured under its quota but whose
    memory and dtype are the type's."""
    return split_profile_key(kind)[0]


class PipelineCostModel:
    """Stage costs of one model, sequence length, micro-batch and dtype, cached per device kind (a
    catalog type or a CPU-quota profile key: `base_type`)."""

    def __init__(self, spec: ModelSpec, seq: int, micro_batch: int, dtype: str, schedule: str = "1f1b",
                 profiles_dir: str | None = None):
        in_flight(schedule, 0, 1, 1)  # validates the schedule
        self.spec, self.seq, self.micro_batch, self.dtype = spec, seq, micro_batch, dtype
        self.schedule = schedule
        self.profiles_dir = profiles_dir
        self._profiles: dict[tuple[str, str], object] = {}
        self._flops = {rc: unit_flops(spec, seq, rc) for rc in ("none", "full")}
        units = runtime_units(spec)
        self._embed_params, self._block_params, self._head_params = units[0].numel, units[1].numel, units[-1].numel

    # --- what crosses a boundary ---
    def boundary_bytes(self) -> int:
        """One micro-batch's activation (and, backward, its gradient) as the runtime sends it: s·b·h fp32."""
        return self.seq * self.micro_batch * self.spec.hidden * WIRE_BYTES

    def dtype_of(self, kind: str) -> str:
        """The dtype the kind trains in (bf16 falls back to fp16 on a part without it)."""
        return device_dtype(base_type(kind), self.dtype)

    # --- time ---
    def profile(self, gpu_type: str, recompute: str):
        key = (gpu_type, recompute)
        if key not in self._profiles:
            from planner.core.profiles import get_step_profile

            self._profiles[key] = get_step_profile(gpu_type, self.spec, self.seq, self.dtype_of(gpu_type),
                                                   recompute, self.profiles_dir)
        return self._profiles[key]

    def _seconds_per_flop(self, gpu_type: str, recompute: str) -> float:
        f = self._flops[recompute]
        whole = self.spec.num_layers * f["block"].total + f["head"].total + f["embed"].total
        return self.profile(gpu_type, recompute).step_time_s(self.micro_batch) / whole

    def compute_s(self, gpu_type: str, recompute: str, num_layers: int, first: bool,
                  last: bool) -> tuple[float, float]:
        """(forward, backward) seconds of one micro-batch through the stage."""
        f = self._flops[recompute]
        fwd = num_layers * f["block"].forward + (f["embed"].forward if first else 0.0) + (
            f["head"].forward if last else 0.0)
        bwd = num_layers * f["block"].backward + (f["embed"].backward if first else 0.0) + (
            f["head"].backward if last else 0.0)
        k = self._seconds_per_flop(gpu_type, recompute)
        return fwd * k, bwd * k

    def layer_s(self, gpu_type: str, recompute: str) -> float:
        """Forward+backward of one block for one micro-batch."""
        return self._flops[recompute]["block"].total * self._seconds_per_flop(gpu_type, recompute)

    def ends_s(self, gpu_type: str, recompute: str, first: bool, last: bool) -> float:
        """Forward+backward of the embedding (first stage) and the head (last stage)."""
        f = self._flops[recompute]
        flops = (f["embed"].total if first else 0.0) + (f["head"].total if last else 0.0)
        return flops * self._seconds_per_flop(gpu_type, recompute)

    def stage_params(self, num_layers: int, first: bool, last: bool) -> int:
        return (num_layers * self._block_params + (self._embed_params if first else 0)
                + (self._head_params if last else 0))

    def stage_units(self, num_layers: int, first: bool, last: bool) -> int:
        return num_layers + (1 if first else 0) + (1 if last else 0)

    def sync_s(self, gpu_type: str, num_layers: int, first: bool, last: bool, dp: int, link: Link,
               reduce_link: Link | None = None) -> float:
        """ZeRO-1 inside the stage, as the runtime issues it: every unit's fp32 gradient
        reduce-scattered and its updated parameters all-gathered in the compute dtype, one call each.
        `reduce_link`: the reduce-scatters' own figures where they were measured apart (else `link`)."""
        return sum(self.sync_parts_s(gpu_type, num_layers, first, last, dp, link, reduce_link))

    def sync_parts_s(self, gpu_type: str, num_layers: int, first: bool, last: bool, dp: int, link: Link,
                     reduce_link: Link | None = None) -> tuple[float, float]:
        """(reduce-scatters, all-gathers) of `sync_s` apart: the runtime runs the optimizer step between
        them (and, in a pipeline, a world all-reduce before it). A tied replica of the embedding on the
        last stage is no part of it (its gradient is all-reduced whole: `tied_sync_s`)."""
        n = self.stage_params(num_layers, first, last)
        units = self.stage_units(num_layers, first, last)
        cbytes = compute_dtype_bytes(base_type(gpu_type), self.dtype_of(gpu_type))
        reduce_link = reduce_link or link
        return (sharded_step_comm_s(0.0, n * FP32_BYTES, units, dp, reduce_link, reduce_link),
                sharded_step_comm_s(n * cbytes, 0.0, units, dp, link, link))

    def runtime_state(self, num_layers: int, stage: int, num_stages: int) -> tuple[int, int, int, int]:
        """(reduce-scattered params, reduce-scatter calls, all-gathered = AdamW params, all-gather calls)
        of stage `stage` as models/pipeline.py runs it: its units (contracts/units.py), and with a
        tied embedding and 2+ stages the last stage's whole replica of "embed" too, whose gradient (and
        the first stage's) is all-reduced over both stages instead of reduce-scattered
        (`tied_sync_s`), then sharded, updated and all-gathered like any unit."""
        first, last = stage == 0, stage == num_stages - 1
        params, units = self.stage_params(num_layers, first, last), self.stage_units(num_layers, first, last)
        if not (self.spec.tied_embeddings and num_stages > 1):
            return params, units, params, units
        if last:  # the replica joins the state, not the reduce-scatters
            return params, units, params + self._embed_params, units + 1
        return params - self._embed_params, units - 1, params, units  # the first stage's embed: all-reduced

    def runtime_sync_parts_s(self, gpu_type: str, num_layers: int, stage: int, num_stages: int, dp: int,
                             link: Link, reduce_link: Link | None = None) -> tuple[float, float]:
        """(reduce-scatters, all-gathers) of a stage as models/pipeline.py issues them (`runtime_state`)."""
        rs_params, rs_calls, ag_params, ag_calls = self.runtime_state(num_layers, stage, num_stages)
        cbytes = compute_dtype_bytes(base_type(gpu_type), self.dtype_of(gpu_type))
        reduce_link = reduce_link or link
        return (sharded_step_comm_s(0.0, rs_params * FP32_BYTES, rs_calls, dp, reduce_link, reduce_link),
                sharded_step_comm_s(ag_params * cbytes, 0.0, ag_calls, dp, link, link))

    def tied_bytes(self) -> int:
        """The tied embedding's full fp32 gradient all-reduced between the first and last stage ("embed":
        the token table and, for learned positions, the position table)."""
        return self._embed_params * FP32_BYTES if self.spec.tied_embeddings else 0

    def optimizer_s(self, gpu_type: str, recompute: str, num_params: int, dp: int) -> float:
        """AdamW over this GPU's 1/dp of the stage's parameters (ZeRO-1)."""
        return self.profile(gpu_type, recompute).optimizer_time_s(num_params / dp)

    # --- memory ---
    def capacity_bytes(self, gpu_type: str) -> int:
        return int(get_gpu_type(base_type(gpu_type)).memory_bytes * MEMORY_HEADROOM)

    def memory_bytes(self, gpu_type: str, num_layers: int, in_flight_mb: int, dp: int, recompute: str) -> int:
        """A whole-model bound, not the runtime's stage (stage_memory_bytes is): planner.core.memory of the
        model cut to `num_layers` blocks (embedding, head and loss included) plus the kept activations of
        `in_flight_mb` - 1 more micro-batches, one block's kept bytes (2 blocks' activations minus 1) each."""
        return _stage_memory(self.spec, self.micro_batch, self.seq, self.dtype_of(gpu_type), recompute,
                             dp, base_type(gpu_type), num_layers, in_flight_mb)

    def stage_memory_bytes(self, gpu_type: str, num_layers: int, stage: int, num_stages: int, num_microbatches: int,
                           dp: int, recompute: str) -> int:
        """Peak bytes per GPU of stage `stage` of `num_stages` with `num_layers` blocks (docs/models/pipeline_simulation.md)."""
        return _runtime_stage_memory(self.spec, self.micro_batch, self.seq, self.dtype_of(gpu_type), dp,
                                     base_type(gpu_type), num_layers, stage, num_stages, num_microbatches,
                                     self.schedule, recompute)

    def stage_max_layers(self, gpu_type: str, stage: int, num_stages: int, num_microbatches: int, dp: int,
                         recompute: str) -> int:
        """The most blocks stage `stage` of `num_stages` fits on one GPU of `gpu_type` (0: not one; memory
        grows with the blocks, so a bisection over the exact memory of each count)."""
        cap = self.capacity_bytes(gpu_type)

        def fits(n: int) -> bool:
            try:
                return self.stage_memory_bytes(gpu_type, n, stage, num_stages, num_microbatches, dp, recompute) <= cap
            except ValueError as e:  # not priced (e.g. no attention kernel for this type and dtype): refused
                log.debug("%s cannot hold a stage: %s", gpu_type, e)
                return False

        return _last_fitting(fits, self.spec.num_layers)

    def max_layers(self, gpu_type: str, in_flight_mb: int, dp: int, recompute: str) -> int:
        """The most blocks a stage fits on one GPU of `gpu_type` (0: not even one; memory grows with
        the blocks, so a bisection over the exact memory of each count)."""
        cap = self.capacity_bytes(gpu_type)
        return _max_layers(self.spec, self.micro_batch, self.seq, self.dtype_of(gpu_type), recompute, dp,
                           base_type(gpu_type), in_flight_mb, cap)

    def estimate_stage(self, gpu_type: str, num_layers: int, stage: int, num_stages: int, num_microbatches: int,
                       dp: int, recompute: str, link: Link, reduce_link: Link | None = None) -> StageEstimate:
        first, last = stage == 0, stage == num_stages - 1
        fwd, bwd = self.compute_s(gpu_type, recompute, num_layers, first, last)
        params = self.stage_params(num_layers, first, last)
        k = in_flight(self.schedule, stage, num_stages, num_microbatches)
        return StageEstimate(fwd, bwd, self.sync_s(gpu_type, num_layers, first, last, dp, link, reduce_link),
                             self.optimizer_s(gpu_type, recompute, params, dp),
                             self.stage_memory_bytes(gpu_type, num_layers, stage, num_stages, num_microbatches, dp,
                                                     recompute),
                             self.capacity_bytes(gpu_type), params)


def tied_sync_s(num_bytes: int, num_ranks: int, link: Link) -> float:
    """The tied embedding's gradient summed between the first and the last stage, once per step, as
    models/pipeline.py does it: one all-reduce of the whole `num_bytes` fp32 gradient
    (PipelineCostModel.tied_bytes) over the group of both stages' ranks (2d: Megatron's embedding
    group), a ring (planner/costmodel/collectives.all_reduce_s) over `link`: its slowest edge (the
    ring crosses from the first stage's ranks to the last's and back once, one flow per direction)
    and the call latency of its steps. 0 when nothing is tied (num_bytes 0)."""
    if num_bytes <= 0:
        return 0.0
    return all_reduce_s(num_bytes, num_ranks, link)


def _config(micro_batch: int, seq: int, dtype: str, recompute: str, dp: int, gpu_type: str):
    from planner.core.memory import MemoryConfig

    return MemoryConfig(micro_batch=micro_batch, seq=seq, dtype=dtype, recompute=recompute, dp=dp,
                        zero=1 if dp > 1 else 0, device_type=gpu_type)


@lru_cache(maxsize=4096)
def _blocks_memory(spec: ModelSpec, micro_batch: int, seq: int, dtype: str, recompute: str, dp: int, gpu_type: str,
                   num_layers: int) -> tuple[int, int]:
    """(peak bytes, activation bytes) of the runtime's model cut to `num_layers` blocks."""
    from planner.core.memory import estimate_memory

    m = estimate_memory(replace(spec, num_layers=num_layers), _config(micro_batch, seq, dtype, recompute, dp,
                                                                        gpu_type))
    return m.peak_bytes, m.activations_bytes


@lru_cache(maxsize=4096)
def _stage_memory(spec: ModelSpec, micro_batch: int, seq: int, dtype: str, recompute: str, dp: int, gpu_type: str,
                  num_layers: int, in_flight_mb: int) -> int:
    peak, _ = _blocks_memory(spec, micro_batch, seq, dtype, recompute, dp, gpu_type, num_layers)
    if in_flight_mb <= 1:
        return peak
    one = _blocks_memory(spec, micro_batch, seq, dtype, recompute, dp, gpu_type, 1)[1]
    two = _blocks_memory(spec, micro_batch, seq, dtype, recompute, dp, gpu_type, 2)[1]
    return peak + (in_flight_mb - 1) * num_layers * max(two - one, 0)


@lru_cache(maxsize=4096)
def _max_layers(spec: ModelSpec, micro_batch: int, seq: int, dtype: str, recompute: str, dp: int, gpu_type: str,
                in_flight_mb: int, capacity_bytes: int) -> int:
    def fits(n: int) -> bool:
        try:
            return _stage_memory(spec, micro_batch, seq, dtype, recompute, dp, gpu_type, n, in_flight_mb) <= capacity_bytes
        except ValueError as e:  # e.g. no fused attention kernel for this type and dtype: not priced, so refused
            log.debug("%s cannot hold a stage: %s", gpu_type, e)
            return False

    return _last_fitting(fits, spec.num_layers)


def _last_fitting(fits, most: int) -> int:
    """The largest n in 0..most with fits(n) (memory grows with the blocks: a bisection; 0: none fits)."""
    lo, hi = 0, most
    if fits(hi):
        return hi
    while hi - lo > 1:  # invariant: lo fits (or is 0), hi does not
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


def position_pipeline(num_layers: int, micro_batch: int, dp: int, stage: int, num_stages: int,
                      num_microbatches: int, schedule: str):
    """A pipeline in which stage `stage` of `num_stages` has `num_layers` blocks on dp ranks of
    `micro_batch` rows each and every other stage one block on one rank: what stage_memory needs to
    price that stage (nothing of the others enters its memory). Its model has num_layers + p − 1 blocks."""
    from contracts.plan import PipelineSpec, PipelineStage

    stages, first, nxt = [], 0, dp
    for j in range(num_stages):
        n = num_layers if j == stage else 1
        if j == stage:
            devices, rows = tuple(range(dp)), (micro_batch,) * dp
        else:
            devices, rows, nxt = (nxt,), (micro_batch * dp,), nxt + 1
        stages.append(PipelineStage(first, n, devices, rows))
        first += n
    return PipelineSpec(schedule, micro_batch * dp, num_microbatches, tuple(stages))


@lru_cache(maxsize=65536)
def _runtime_stage_memory(spec: ModelSpec, micro_batch: int, seq: int, dtype: str, dp: int, gpu_type: str,
                          num_layers: int, stage: int, num_stages: int, num_microbatches: int, schedule: str,
                          recompute: str) -> int:
    from planner.core.stage_memory import estimate_stage_memory

    pipe = position_pipeline(num_layers, micro_batch, dp, stage, num_stages, num_microbatches, schedule)
    model = replace(spec, num_layers=num_layers + num_stages - 1)
    return estimate_stage_memory(model, pipe, stage, 0, 1.0 / dp, seq, dtype, recompute, gpu_type).peak_bytes
