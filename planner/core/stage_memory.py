"""Peak memory of one rank of a pipeline stage, as models/pipeline.py runs it (pure Python, no torch).

Stage s of S holds its units (contracts/units.py; a replica of "embed" on the last stage of a tied
model), ZeRO-1 inside the stage, and runs the schedule's order of forwards and backwards of its rows
of each micro-batch. The model walks that order (`schedule_order`, the one the runtime runs; for
1F1B `walk_order`'s first cycles) and takes, at every op, each moment (forward end, loss, head, last
block, embedding backward, optimizer step) with the micro-batches then in flight and the receive and
send buffers then alive; the peak is the largest. The per-layer pieces are planner/core/memory.py's.
Tensor parallel (`tp`): the rank is TP rank 0 of its (stage, DP index)'s group, with that rank's units,
widths, vocabulary rows, loss and embedding (docs/models/tensor_parallel.md; measured in
tests/e2e/test_tensor_parallel_runs.py).

`estimate_rank_memory` is the same model asked from the rank's geometry alone (stage position, blocks, rows),
for a caller that prices stages before a PipelineSpec exists: the joint search (planner/geo/scale/memory.py).

Every term and moment: docs/models/memory.md ("One rank of a pipeline stage"); the measured check is
tests/e2e/test_stage_memory.py.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from functools import lru_cache

from contracts.constants import RECOMPUTE, STEP_CHUNK_NUMEL
from planner.core.memory import (FP32_BYTES, INT64_BYTES, MemoryConfig, block_backward_transient_bytes,
                                 block_saved_bytes, block_weight_copy_bytes, head_saved_bytes_per_token, loss_bytes,
                                 tp_embedding_saved_bytes, tp_units, tp_vocab_rows)
from contracts.plan import PIPELINE_SCHEDULES, PipelineSpec, Plan
from contracts.specs import ModelSpec, get_model, with_max_seq
from contracts.pipeline_order import schedule_in_flight, schedule_order


def walk_order(schedule: str, num_stages: int, stage: int, num_microbatches: int) -> list[tuple[str, int]]:
    """The ops whose moments the memory walk takes. An op's moments depend only on its kind, the next op's
    kind, whether a backward ran before it and the micro-batches then in flight; 1F1B's steady cycles
    repeat those exactly, so the order of min(M, warm-up + 3) micro-batches (warm-up forwards, a first
    cycle, a later one, the last before the cool-down, the cool-down) holds every combination the whole
    order holds: the walk costs O(stages), not O(micro-batches). GPipe keeps its whole order (its
    in-flight micro-batches, and so its moments, grow with M)."""
    if schedule == "1f1b":
        warm = min(num_stages - 1 - stage, num_microbatches)
        num_microbatches = min(num_microbatches, warm + 3)
    return schedule_order(schedule, num_stages, stage, num_microbatches)


@dataclass(frozen=True)
class StageMemory:
    """Bytes of one pipeline rank at its peak moment (`phase`); peak_bytes is the sum of the parts."""

    stage: int
    in_flight: int  # micro-batches held at once
    params_bytes: int
    grads_bytes: int
    optimizer_bytes: int
    tied_replica_bytes: int  # of the three above: the last stage's replica of the embedding unit
    activations_bytes: int  # saved activations of the micro-batches in flight at the peak
    buffers_bytes: int  # receive / send buffers alive at the peak (outside the saved activations)
    transient_bytes: int  # gradients and temporaries of the op running at the peak
    inputs_bytes: int
    peak_bytes: int
    phase: str
    phases: dict[str, int]  # every candidate moment's total

    def to_dict(self) -> dict:
        return asdict(self)


@lru_cache(maxsize=4096)
def _layer_pieces(spec: ModelSpec, rows: int, seq: int, dtype: str, device_type: str, tp: int) -> tuple[int, int, int, int]:
    """planner/core/memory.py's per-layer pieces for `rows` rows: (a block's saved bytes, its autocast weight
    copies, its backward transient, the head's saved bytes per token). Cached: the joint search asks the
    same rank shape thousands of times with other shares and positions (planner/geo/scale/memory.py)."""
    cfg = MemoryConfig(micro_batch=rows, seq=seq, dtype=dtype, device_type=device_type, tp=tp)
    return (block_saved_bytes(spec, cfg, rows, seq), block_weight_copy_bytes(spec, cfg),
            block_backward_transient_bytes(spec, cfg, rows * seq), head_saved_bytes_per_token(spec, cfg))


def _owned(numel: int, fraction: float) -> int:
    return int(math.floor(numel * fraction + 0.5))  # round half up, as models/runtime.shard_bounds


def estimate_stage_memory(spec: ModelSpec, pipeline: PipelineSpec, stage: int, dp_index: int, shard_fraction: float,
                          seq: int, dtype: str = "fp32", recompute: str = "none",
                          device_type: str = "cpu", tp: int = 1) -> StageMemory:
    """Peak bytes of rank (stage, dp_index) of `pipeline` training `spec` (docs/models/memory.md); `tp`: each
    rank of the stage is TP rank 0 of a group of tp (docs/models/tensor_parallel.md)."""
    S = len(pipeline.stages)
    if not 0 <= stage < S or not 0 <= dp_index < len(pipeline.stages[stage].rows):
        raise ValueError(f"no rank (stage {stage}, dp index {dp_index}) in a pipeline of {S} stages")
    if pipeline.num_layers != spec.num_layers:
        raise ValueError(f"pipeline stages cover {pipeline.num_layers} layers, model {spec.name} has {spec.num_layers}")
    st = pipeline.stages[stage]
    return estimate_rank_memory(spec, pipeline.schedule, S, pipeline.num_microbatches, stage, st.first_layer,
                                st.num_layers, st.rows[dp_index], shard_fraction, seq, dtype, recompute, device_type, tp)


def estimate_rank_memory(spec: ModelSpec, schedule: str, num_stages: int, num_microbatches: int, stage: int,
                         first_layer: int, num_layers: int, rows: int, shard_fraction: float, seq: int,
                         dtype: str = "fp32", recompute: str = "none", device_type: str = "cpu",
                         tp: int = 1) -> StageMemory:
    """`estimate_stage_memory` from the rank's geometry alone: stage `stage` of `num_stages` holding blocks
    [first_layer, first_layer + num_layers) and `rows` rows of each of `num_microbatches` micro-batches. For a
    caller that prices stages before a PipelineSpec exists (the joint search, planner/geo/scale/memory.py)."""
    S, M = num_stages, num_microbatches
    if not 0 <= stage < S:
        raise ValueError(f"no stage {stage} in a pipeline of {S} stages")
    if schedule not in PIPELINE_SCHEDULES:
        raise ValueError(f"schedule must be one of {', '.join(PIPELINE_SCHEDULES)}, got {schedule!r}")
    if rows < 1 or num_layers < 1 or M < 1:
        raise ValueError(f"a stage rank needs rows, layers and micro-batches >= 1, got {rows}, {num_layers}, {M}")
    if first_layer < 0 or first_layer + num_layers > spec.num_layers:
        raise ValueError(f"blocks [{first_layer}, {first_layer + num_layers}) are not within model {spec.name}'s "
                         f"{spec.num_layers}")
    if recompute not in RECOMPUTE:
        raise ValueError(f"recompute must be one of {', '.join(RECOMPUTE)}, got {recompute!r}")
    full = recompute == "full"
    first, last = stage == 0, stage == S - 1
    b = rows  # this rank's rows of every micro-batch
    # tensor parallel: V is this rank's vocabulary rows (logits, the head, the embedding's gradient)
    N, h, V, T = b * seq, spec.hidden, tp_vocab_rows(spec.vocab_size, tp), seq
    saved, copies, in_block, head_per_token = _layer_pieces(spec, b, seq, dtype, device_type, tp)
    units = tp_units(spec, tp)
    replica = last and not first and spec.tied_embeddings
    mine = ([units[0]] if first or replica else []) + list(units[1 + first_layer:1 + first_layer + num_layers]) \
        + ([units[-1]] if last else [])
    numel = sum(u.numel for u in mine)
    owned = [_owned(u.numel, shard_fraction) for u in mine]
    params, grads, optimizer = FP32_BYTES * numel, FP32_BYTES * numel, 2 * FP32_BYTES * sum(owned)
    rep = (2 * FP32_BYTES * units[0].numel + 2 * FP32_BYTES * owned[0]) if replica else 0
    inputs = INT64_BYTES * N * M * ((1 if first else 0) + (1 if last else 0))

    # one micro-batch in flight
    L = num_layers
    piece = FP32_BYTES * N * h  # one receive buffer, one input gradient, one block input: (rows, T, h) fp32
    # full recomputation (a checkpoint per block): each block keeps only its fp32 input
    blocks = L * (piece if full else saved + copies)
    # in the backward of a checkpointed block its saved tensors (less its input, already kept) and its
    # autocast weight copies are rebuilt
    rebuilt = saved - piece + copies if full else 0
    positions = INT64_BYTES * T if first and spec.positional == "learned" else 0
    positions += tp_embedding_saved_bytes(tp, N) if first else 0  # TP: the embedding's local ids and mask
    out = 0 if last else FP32_BYTES * N * h
    # log_softmax's saved output (TP: the vocabulary-parallel CE's saved softmax, the same N·V_r fp32)
    head = head_per_token * N + FP32_BYTES * N * V if last else 0
    per_mb = blocks + positions + out + head
    F = schedule_in_flight(schedule, S, stage, M)
    dense = FP32_BYTES * (V * h + (spec.max_seq * h if spec.positional == "learned" else 0))

    # Walk the schedule's order: each op's moments with what is alive then (activations, buffers,
    # transient); a phase's total is its largest over the ops.
    phases: dict[str, tuple[int, int, int]] = {}

    def moment(name: str, parts: tuple[int, int, int]) -> None:
        if name not in phases or sum(parts) > sum(phases[name]):
            phases[name] = parts

    order = walk_order(schedule, S, stage, M)
    in_block = in_block if L else 0  # the same in every backward
    live = backs = 0
    for i, (op, _) in enumerate(order):
        nxt = order[i + 1][0] if i + 1 < len(order) else None
        # the next op's receive, posted when this op starts (models/pipeline.py)
        ahead = piece if (nxt == "F" and not first) or (nxt == "B" and not last) else 0
        # the previous backward's input gradient, still being sent until this backward's send
        pending = piece if not first and backs else 0
        if op == "F":
            live += 1
            moment("forward_end", (live * per_mb, ahead + pending, 0))
            continue
        act = live * per_mb  # the micro-batch being run still whole
        if last:
            # one rank: the grad of nll and of the logits; TP: the CE's forward (the logit slice, its statistics)
            moment("loss", (act, ahead + pending, loss_bytes(tp, V, N) - FP32_BYTES * N * V))
            # log_softmax's saved output is gone; the grad of the logits takes its place (both 4·N·V)
            moment("head", (act, ahead + pending, FP32_BYTES * (N * h + V * h)))
        if L:  # + the incoming gradient: the receive buffer (the head's input gradient on the last stage)
            moment("last_block", (act - head + rebuilt, ahead + pending + piece, in_block))
        if first:
            # the embedding's backward: its dense (V, h) gradient (and the positions' (T, h)), the input gradient
            # (TP: and the masked copy of the incoming gradient, (rows, T, h) fp32)
            moment("embed_backward", (act - per_mb, ahead, dense + piece + (piece if tp > 1 else 0)))
        live -= 1
        backs += 1
    largest_slice = max(owned[1:] if replica else owned)  # the norm leaves out the tied replica
    phases["step"] = (0, 0, FP32_BYTES * sum(owned) + 2 * FP32_BYTES * min(largest_slice, STEP_CHUNK_NUMEL) - grads)
    state = params + grads + optimizer + inputs
    totals = {k: state + sum(v) for k, v in phases.items()}
    phase = max(totals, key=totals.get)
    a, buf, tr = phases[phase]
    return StageMemory(stage, F, params, grads, optimizer, rep, a, buf, tr, inputs, totals[phase], phase, totals)


def estimate_plan_stage_memory(plan: Plan, device_index: int, device_type: str = "cpu") -> StageMemory:
    """`estimate_stage_memory` for the rank of a pipeline plan that trains device `device_index`."""
    if plan.pipeline is None:
        raise ValueError("plan has no pipeline: use planner.core.memory.estimate_memory")
    s, i = plan.pipeline.stage_of(device_index)
    a = next(x for x in plan.assignments if x.device_index == device_index)
    spec = with_max_seq(get_model(plan.model), plan.seq)
    # the assignment's tensor-parallel degree (docs/DESIGN.md "Plans at scale"; 1 on a plan without it)
    return estimate_stage_memory(spec, plan.pipeline, s, i, a.shard_fraction, plan.seq, plan.dtype, plan.recompute,
                                 device_type, tp=getattr(a, "tp", None) or 1)


__all__ = ["StageMemory", "estimate_stage_memory", "estimate_rank_memory", "estimate_plan_stage_memory"]
