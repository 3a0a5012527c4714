"""Peak memory of one rank of a pipeline stage with tensor parallelism inside its node.

planner/core/stage_memory.py is the exact model of a pipeline rank as models/pipeline.py runs it
(tp = 1). Until planner/core/memory.py models tensor parallelism for pipeline stages, this module
walks the same schedule with the same per-layer pieces asked at the rank's TP degree, under
Megatron's split (Shoeybi et al. 2019; Korthikanti et al. 2022 without sequence parallelism):

* state: the stage's matmul and embedding parameters ÷ tp (norms and row-parallel biases are
  replicated: counted ÷ tp too, < 0.1 % of a block, as planner/core/memory.py's `_local_params`);
  fp32 parameters and gradients of the rank's slice, AdamW's two moments on its ZeRO-1 share
  (`shard_fraction` of the slice);
* a block's saved activations: `block_saved_bytes` at the TP degree (attention and the MLP's inner
  width ÷ tp, the residual stream and the norms' inputs whole), its backward transient likewise;
* the head: the norm's saved tensors whole, the logits and their gradient ÷ tp (vocabulary-parallel);
* the boundary pieces (the rows' (rows, seq, hidden) fp32 activation received, sent, and the input
  gradient): whole on every rank of the TP group.

At tp = 1 it is planner/core/stage_memory.py's figure exactly (tests/unit/test_scale_memory.py).
The pieces and their sources: docs/models/scale.md ("Memory"); docs/models/memory.md for the walk.
"""
from __future__ import annotations

import math
from functools import lru_cache

from contracts.constants import FP32_BYTES, INT64_BYTES, STEP_CHUNK_NUMEL
from contracts.specs import ModelSpec
from contracts.units import runtime_units
from planner.core.memory import (MemoryConfig, block_backward_transient_bytes, block_saved_bytes,
                                 block_weight_copy_bytes, head_saved_bytes_per_token)
from planner.core.stage_memory import walk_order


def _owned(numel: int, fraction: float) -> int:
    return int(math.floor(numel * fraction + 0.5))  # as planner/core/stage_memory.py


@lru_cache(maxsize=4096)
def _pieces(spec: ModelSpec, rows: int, seq: int, dtype: str, device_type: str, tp: int) -> tuple[int, int, int, int]:
    """planner/core/memory.py's per-layer pieces at the TP degree: (a block's saved bytes, its autocast
    weight copies, its backward transient, the head's saved bytes per token)."""
    cfg = MemoryConfig(micro_batch=rows, seq=seq, dtype=dtype, device_type=device_type, tp=tp)
    return (block_saved_bytes(spec, cfg, rows, seq), block_weight_copy_bytes(spec, cfg),
            block_backward_transient_bytes(spec, cfg, rows * seq), head_saved_bytes_per_token(spec, cfg))


@lru_cache(maxsize=200_000)
def tp_stage_memory_bytes(spec: ModelSpec, first_layer: int, num_layers: int, stage: int, num_stages: int,
                          num_microbatches: int, rows: int, shard_fraction: float, seq: int, dtype: str,
                          device_type: str, tp: int, schedule: str = "1f1b") -> int:
    """Peak bytes of one rank (of a TP group of `tp`) of stage `stage` of `num_stages`, holding blocks
    [first_layer, first_layer + num_layers), `rows` rows of every micro-batch, `shard_fraction` of its
    slice's AdamW state (module docstring). No recomputation."""
    if tp < 1 or spec.num_heads % tp or spec.num_kv_heads % tp:
        raise ValueError(f"tp {tp} must divide the model's {spec.num_heads} heads and {spec.num_kv_heads} KV heads")
    if rows < 1 or num_layers < 1:
        raise ValueError(f"a stage rank needs rows >= 1 and layers >= 1, got {rows} and {num_layers}")
    S, M = num_stages, num_microbatches
    first, last = stage == 0, stage == S - 1
    N, h, T = rows * seq, spec.hidden, seq
    V = math.ceil(spec.vocab_size / tp)
    saved, copies, in_block, head_per_token = _pieces(spec, rows, seq, dtype, device_type, tp)
    units = runtime_units(spec)
    replica = last and not first and spec.tied_embeddings
    mine = ([units[0]] if first or replica else []) + list(units[1 + first_layer:1 + first_layer + num_layers]) \
        + ([units[-1]] if last else [])
    slices = [math.ceil(u.numel / tp) for u in mine]
    numel = sum(slices)
    owned = [_owned(n, shard_fraction) for n in slices]
    params, grads, optimizer = FP32_BYTES * numel, FP32_BYTES * numel, 2 * FP32_BYTES * sum(owned)
    inputs = INT64_BYTES * N * M * ((1 if first else 0) + (1 if last else 0))

    piece = FP32_BYTES * N * h  # a receive buffer, an input gradient, a block input: whole on every TP rank
    blocks = num_layers * (saved + copies)
    positions = INT64_BYTES * T if first and spec.positional == "learned" else 0
    out = 0 if last else FP32_BYTES * N * h
    head = head_per_token * N + FP32_BYTES * N * V if last else 0
    per_mb = blocks + positions + out + head
    dense = FP32_BYTES * (V * h + (spec.max_seq * h if spec.positional == "learned" else 0))

    phases: dict[str, int] = {}

    def moment(name: str, total: int) -> None:
        phases[name] = max(phases.get(name, 0), total)

    order = walk_order(schedule, S, stage, M)
    live = backs = 0
    for i, (op, _) in enumerate(order):
        nxt = order[i + 1][0] if i + 1 < len(order) else None
        ahead = piece if (nxt == "F" and not first) or (nxt == "B" and not last) else 0
        pending = piece if not first and backs else 0
        if op == "F":
            live += 1
            moment("forward_end", live * per_mb + ahead + pending)
            continue
        act = live * per_mb
        if last:
            moment("loss", act + ahead + pending + 2 * FP32_BYTES * N * V)
            moment("head", act + ahead + pending + FP32_BYTES * (N * h + V * h))
        moment("last_block", act - head + ahead + pending + piece + in_block)
        if first:
            moment("embed_backward", act - per_mb + ahead + dense + piece)
        live -= 1
        backs += 1
    largest_slice = max(owned[1:] if replica else owned)
    phases["step"] = FP32_BYTES * sum(owned) + 2 * FP32_BYTES * min(largest_slice, STEP_CHUNK_NUMEL) - grads
    state = params + grads + optimizer + inputs
    return state + max(phases.values())


__all__ = ["tp_stage_memory_bytes"]
