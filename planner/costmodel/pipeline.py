"""What one pipeline stage costs: a range of layers on one device type, for one micro-batch.

A pipeline cuts the runtime's units (planner/core/units.py: "embed", "block.0" .. "block.L-1",
"head") into contiguous stages; the first stage holds the embedding, the last the final norm and
the LM head (and the loss). The d GPUs that hold one stage (one per data-parallel pipeline) train
it in data parallel with ZeRO-1 (planner/core/units.py: a reduce-scatter of the fp32 gradients and
an all-gather of the updated parameters in the compute dtype, once per optimizer step), then run
AdamW over their 1/d of the stage's state.

Time (seconds, one micro-batch of `micro_batch` samples):
- compute: the device type's step profile (planner.core.profiles.get_step_profile: measured, or
  FLOPs ÷ (peak × calibrated efficiency)) of the whole model, `α + β·m`, divided among the units
  in proportion to their training FLOPs per token (`unit_flops`). A block: 2·N_b matmul + 4·q·s
  attention FLOPs forward, twice that backward, and with full recomputation its forward once more
  in backward (models/decoder.py checkpoints blocks, not the head). The head: 2·V·h forward,
  4·V·h backward. The embedding lookup has no matmul FLOPs (0).
- optimizer: the profile's optimizer_s_per_param × the stage's parameters / d.
- collectives: planner.costmodel.collectives.sharded_step_comm_s over the stage's units.

Memory (bytes per GPU): planner.core.memory.estimate_memory of the model cut to the stage's
`num_layers` blocks (exact for those blocks, asked at each layer count, never extrapolated) on the
device type, at ZeRO-1 over d, plus the kept activations of the extra micro-batches the schedule
holds in flight (1F1B: stage j of p keeps min(p − j, m); GPipe all m), one block's kept bytes
(the memory model's activations of 2 blocks minus 1) per block each. The memory model prices the
embedding, the head and the loss on every stage (it models the whole runtime): safe on the high
side for the middle stages (planner/core/memory.py has no stage-level entry point yet).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from functools import lru_cache

from planner.core.catalog import device_dtype, get_gpu_type
from planner.core.constants import DTYPE_BYTES, FP32_BYTES, MEMORY_HEADROOM
from planner.core.specs import ModelSpec
from planner.core.units import runtime_units
from planner.costmodel.collectives import Link, sharded_step_comm_s
from planner.costmodel.training import compute_dtype_bytes

log = logging.getLogger(__name__)

SCHEDULES = ("1f1b", "gpipe")


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
    """Per token: "embed", "block" (each one), "head" (module docstring)."""
    h, V, L = spec.hidden, spec.vocab_size, spec.num_layers
    block_matmul = (spec.matmul_params() - V * h) / L
    attention = 4.0 * spec.q_width * seq  # QKᵀ and AV over the s×s square, forward
    fwd = 2.0 * block_matmul + attention
    bwd = 2.0 * fwd + (fwd if recompute == "full" else 0.0)
    return {"embed": UnitFlops(0.0, 0.0), "block": UnitFlops(fwd, bwd),
            "head": UnitFlops(2.0 * V * h, 4.0 * V * h)}


def in_flight(schedule: str, stage: int, num_stages: int, num_microbatches: int) -> int:
    """Micro-batches whose activations stage `stage` of `num_stages` holds at once."""
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule must be one of {SCHEDULES}, got {schedule!r}")
    if schedule == "gpipe":
        return num_microbatches
    return min(num_stages - stage, num_microbatches)  # 1F1B (Narayanan et al. 2021)


class PipelineCostModel:
    """Stage costs of one model, sequence length, micro-batch and dtype, cached per device type."""

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
    def boundary_bytes(self, gpu_type: str) -> int:
        """One micro-batch's activation (and, backward, its gradient): s·b·h in the compute dtype."""
        return self.seq * self.micro_batch * self.spec.hidden * DTYPE_BYTES[device_dtype(gpu_type, self.dtype)]

    # --- time ---
    def profile(self, gpu_type: str, recompute: str):
        key = (gpu_type, recompute)
        if key not in self._profiles:
            from planner.core.profiles import get_step_profile

            self._profiles[key] = get_step_profile(gpu_type, self.spec, self.seq, device_dtype(gpu_type, self.dtype),
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

    def sync_s(self, gpu_type: str, num_layers: int, first: bool, last: bool, dp: int, link: Link) -> float:
        """ZeRO-1 inside the stage, as the runtime issues it: every unit's fp32 gradient
        reduce-scattered and its updated parameters all-gathered in the compute dtype, one call each."""
        n = self.stage_params(num_layers, first, last)
        cbytes = compute_dtype_bytes(gpu_type, device_dtype(gpu_type, self.dtype))
        return sharded_step_comm_s(n * cbytes, n * FP32_BYTES, 2 * self.stage_units(num_layers, first, last), dp,
                                   link)

    def optimizer_s(self, gpu_type: str, recompute: str, num_params: int, dp: int) -> float:
        """AdamW over this GPU's 1/dp of the stage's parameters (ZeRO-1)."""
        return self.profile(gpu_type, recompute).optimizer_time_s(num_params / dp)

    # --- memory ---
    def capacity_bytes(self, gpu_type: str) -> int:
        return int(get_gpu_type(gpu_type).memory_bytes * MEMORY_HEADROOM)

    def memory_bytes(self, gpu_type: str, num_layers: int, in_flight_mb: int, dp: int, recompute: str) -> int:
        """Peak bytes per GPU of a stage of `num_layers` blocks holding `in_flight_mb` micro-batches."""
        return _stage_memory(self.spec, self.micro_batch, self.seq, device_dtype(gpu_type, self.dtype), recompute,
                             dp, gpu_type, num_layers, in_flight_mb)

    def max_layers(self, gpu_type: str, in_flight_mb: int, dp: int, recompute: str) -> int:
        """The most blocks a stage fits on one GPU of `gpu_type` (0: not even one; memory grows with
        the blocks, so a bisection over the exact memory of each count)."""
        cap = self.capacity_bytes(gpu_type)
        return _max_layers(self.spec, self.micro_batch, self.seq, device_dtype(gpu_type, self.dtype), recompute, dp,
                           gpu_type, in_flight_mb, cap)

    def estimate_stage(self, gpu_type: str, num_layers: int, stage: int, num_stages: int, num_microbatches: int,
                       dp: int, recompute: str, link: Link) -> StageEstimate:
        first, last = stage == 0, stage == num_stages - 1
        fwd, bwd = self.compute_s(gpu_type, recompute, num_layers, first, last)
        params = self.stage_params(num_layers, first, last)
        k = in_flight(self.schedule, stage, num_stages, num_microbatches)
        return StageEstimate(fwd, bwd, self.sync_s(gpu_type, num_layers, first, last, dp, link),
                             self.optimizer_s(gpu_type, recompute, params, dp),
                             self.memory_bytes(gpu_type, num_layers, k, dp, recompute),
                             self.capacity_bytes(gpu_type), params)


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

    lo, hi = 0, spec.num_layers
    if fits(hi):
        return hi
    while hi - lo > 1:  # invariant: lo fits (or is 0), hi does not
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo
