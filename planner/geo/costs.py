"""Cost tables for geo planning: per-layer compute time and per-stage memory of the
training model on each GPU type, the bytes crossing a stage boundary, and the DP
gradient all-reduce inside a datacenter.

Time: the profile store's forward+backward time of one micro-batch of the whole
model (`planner.core.profiles.get_step_profile`: measured where a profile exists,
else FLOPs ÷ (catalog peak × calibrated efficiency)), divided among layers and
the LM head in proportion to their FLOPs (ModelSpec.flops_per_token: 6·N_matmul
+ 12·L·h·s per token). Forward is 1/3 of it and backward 2/3; with full
recomputation the backward also re-runs the forward (8·N instead of 6·N).

Memory: `planner.core.memory.estimate_memory` (the project's memory model) when it
is available, read as `base + layers · per_layer` (the difference of a 2-layer
and a 1-layer model) plus the activations of the extra in-flight micro-batches
(1F1B: stage j of p keeps min(p − j, m) micro-batches' activations; GPipe all m). `base` holds the
embeddings, LM head and logits on every stage, which over-estimates middle
stages (safe side). Without the memory model, the documented formula below.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from functools import lru_cache

from planner.core.catalog import get_gpu_type
from planner.geo.scenario import BITS_PER_BYTE, GBPS, INTRA_DC_LATENCY_S, GeoScenario
from planner.core.specs import ModelSpec, get_model, with_max_seq

log = logging.getLogger(__name__)

MEMORY_HEADROOM = 0.9  # keep 10 % of each GPU free for the allocator's fragmentation and NCCL buffers
DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
# Training states per parameter: mixed precision keeps 16-bit weights and gradients plus fp32
# master weights and Adam's m and v (2 + 2 + 12 = 16 bytes, DESIGN.md); fp32 keeps 4 + 4 + 8.
# ZeRO-1 shards the optimizer part (12 or 8 bytes) across the DP replicas of a stage.
STATE_BYTES = {"mixed": (2, 2, 12), "fp32": (4, 4, 8)}
RECOMPUTE_FLOPS = 4.0 / 3.0  # full recomputation: forward runs twice (8·N vs 6·N)


@dataclass(frozen=True)
class StageCost:
    dc: str
    gpu_type: str
    first_layer: int
    num_layers: int
    forward_s: float
    backward_s: float
    allreduce_s: float
    memory_bytes: int
    capacity_bytes: int
    num_params: int


class GeoCosts:
    """Cost tables of one scenario's training model (cached per GPU type and recompute mode)."""

    def __init__(self, scenario: GeoScenario, schedule: str = "1f1b"):
        self.scenario = scenario
        self.schedule = schedule  # GPipe keeps every micro-batch's activations; 1F1B at most p - j
        self.spec: ModelSpec = with_max_seq(get_model(scenario.model), scenario.seq)
        self.seq, self.micro_batch, self.dtype = scenario.seq, scenario.micro_batch, scenario.dtype
        self.tokens = self.seq * self.micro_batch
        # per micro-batch an activation of s·b·h elements crosses a stage boundary (and its gradient back)
        self.transfer_bytes = self.tokens * self.spec.hidden * DTYPE_BYTES[self.dtype]
        self._time: dict[tuple[str, str], tuple[float, float]] = {}
        self._mem: dict[tuple, tuple[float, float]] = {}

    # --- time ---
    def _flops_per_token(self) -> tuple[float, float]:
        """(one block, the LM head): training FLOPs per token, as ModelSpec.flops_per_token splits them."""
        s = self.spec
        head = 6.0 * s.vocab_size * s.hidden
        return (s.flops_per_token(self.seq) - head) / s.num_layers, head

    def _times(self, gpu_type: str, recompute: str) -> tuple[float, float]:
        key = (gpu_type, recompute)
        if key not in self._time:
            from planner.core.profiles import get_step_profile  # the profile store: read once per type

            prof = get_step_profile(gpu_type, self.spec, self.seq, self.dtype, recompute)
            total = prof.step_time_s(self.micro_batch)
            block, head = self._flops_per_token()
            whole = self.spec.num_layers * block + head
            self._time[key] = (total * block / whole, total * head / whole)
        return self._time[key]

    def layer_time_s(self, gpu_type: str, recompute: str) -> float:
        """Forward+backward of one layer for one micro-batch."""
        return self._times(gpu_type, recompute)[0]

    def head_time_s(self, gpu_type: str, recompute: str) -> float:
        return self._times(gpu_type, recompute)[1]

    # --- memory ---
    def _memory_terms(self, first: bool, last: bool, inflight: int, dp: int, recompute: str) -> tuple[float, float]:
        """(base bytes, bytes per layer) of one stage's peak."""
        key = (first, last, inflight, dp, recompute)
        if key not in self._mem:
            try:
                base, per_layer, act = _memory_model_terms(self.spec, self.micro_batch, self.seq, self.dtype,
                                                           recompute, dp)
            except (ImportError, AttributeError):
                base, per_layer, act = self._formula_terms(first, last, dp, recompute)
            self._mem[key] = (base, per_layer + (inflight - 1) * act)
        return self._mem[key]

    def _formula_terms(self, first: bool, last: bool, dp: int, recompute: str) -> tuple[float, float, float]:
        """Fallback when planner.core.memory is absent: states 16 B/param (ZeRO-1 over dp), activations
        per layer per micro-batch s·b·h·(34 + 5·a·s/h) bytes in 16-bit, 2·s·b·h with full
        recomputation plus one layer re-materialized (Korthikanti et al. 2022, eq. 1-2);
        logits s·b·V in fp32 and their gradient on the last stage. The models' attention is
        F.scaled_dot_product_attention, which on a GPU in bf16/fp16 runs FlashAttention and
        keeps no s×s scores: the 5·a·s/h term is dropped there (kept for fp32)."""
        s = self.spec
        w, g, opt = STATE_BYTES["fp32" if self.dtype == "fp32" else "mixed"]
        per_param = w + g + opt / dp
        scale = 2 if self.dtype == "fp32" else 1
        sbh = self.tokens * s.hidden
        scores = 0.0 if self.dtype in ("bf16", "fp16") else 5 * s.num_heads * self.seq / s.hidden
        full_layer = sbh * (34 + scores) * scale
        act = 2 * sbh * scale if recompute == "full" else full_layer
        base = full_layer if recompute == "full" else 0.0
        if first:
            base += s.vocab_size * s.hidden * per_param
        if last:
            base += (s.vocab_size * s.hidden + s.final_norm_params()) * per_param + 2 * 4 * self.tokens * s.vocab_size
        return base, s.block_params() * per_param + act, act

    def in_flight(self, j: int, p: int, m: int) -> int:
        """Micro-batches whose activations stage j of p holds at once."""
        return m if self.schedule == "gpipe" else min(p - j, m)

    def stage_memory_bytes(self, num_layers: int, j: int, p: int, m: int, dp: int, recompute: str) -> int:
        base, per_layer = self._memory_terms(j == 0, j == p - 1, self.in_flight(j, p, m), dp, recompute)
        return int(base + num_layers * per_layer)

    def capacity_bytes(self, gpu_type: str) -> int:
        return int(get_gpu_type(gpu_type).memory_bytes * MEMORY_HEADROOM)

    def max_layers(self, gpu_type: str, j: int, p: int, m: int, dp: int, recompute: str) -> int:
        """The most layers stage j (of p) fits on one GPU of `gpu_type`."""
        base, per_layer = self._memory_terms(j == 0, j == p - 1, self.in_flight(j, p, m), dp, recompute)
        return int((self.capacity_bytes(gpu_type) - base) // per_layer)

    # --- communication ---
    def stage_params(self, num_layers: int, first: bool, last: bool) -> int:
        s = self.spec
        n = num_layers * s.block_params()
        if first:
            n += s.embedding_params() - (0 if s.tied_embeddings else s.vocab_size * s.hidden)
        if last:
            n += s.vocab_size * s.hidden + s.final_norm_params()
        return n

    def grad_bytes(self, num_params: int) -> float:
        """Gradients are reduced in the training dtype (PyTorch DDP/FSDP default)."""
        return num_params * DTYPE_BYTES[self.dtype]

    def allreduce_s(self, num_params: int, dp: int, gbps: float) -> float:
        """Ring all-reduce among dp GPUs: 2(dp−1)/dp of the gradient bytes over each GPU's link."""
        if dp <= 1:
            return 0.0
        wire = 2 * (dp - 1) / dp * self.grad_bytes(num_params) * BITS_PER_BYTE / (gbps * GBPS)
        return wire + 2 * (dp - 1) * INTRA_DC_LATENCY_S

    def stage_cost(self, dc: str, gpu_type: str, first_layer: int, num_layers: int, j: int, p: int, m: int,
                   dp: int, recompute: str) -> StageCost:
        t = num_layers * self.layer_time_s(gpu_type, recompute)
        if j == p - 1:
            t += self.head_time_s(gpu_type, recompute)
        fwd = t / (4.0 if recompute == "full" else 3.0)  # forward is 1 of the 3 (or 4) passes
        params = self.stage_params(num_layers, j == 0, j == p - 1)
        ar = self.allreduce_s(params, dp, self.scenario.datacenter(dc).intra_dc_gbps)
        return StageCost(dc, gpu_type, first_layer, num_layers, fwd, t - fwd, ar,
                         self.stage_memory_bytes(num_layers, j, p, m, dp, recompute),
                         self.capacity_bytes(gpu_type), params)


@lru_cache(maxsize=256)
def _memory_model_terms(spec: ModelSpec, micro_batch: int, seq: int, dtype: str, recompute: str,
                        dp: int) -> tuple[float, float, float]:
    """(base, per-layer peak, per-layer activations of one micro-batch) from the memory model."""
    from planner.core.memory import MemoryConfig, estimate_memory

    cfg = MemoryConfig(micro_batch=micro_batch, seq=seq, dtype=dtype, recompute=recompute, dp=dp,
                       zero=1 if dp > 1 else 0)
    one = estimate_memory(replace(spec, num_layers=1), cfg)
    two = estimate_memory(replace(spec, num_layers=2), cfg)
    per_layer = two.peak_bytes - one.peak_bytes
    return one.peak_bytes - per_layer, per_layer, two.activations_bytes - one.activations_bytes
