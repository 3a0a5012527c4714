"""Peak memory of one rank of a pipeline stage with tensor parallelism inside its node.

The joint search prices stages before a plan exists: a stage is its blocks, its position among the
stages, the micro-batches and one rank's rows, share and TP degree. Its figure is the runtime's exact
stage model, planner/core/stage_memory.py's `estimate_rank_memory` (the schedule walked, every moment's
live tensors; at tp > 1 the rank is TP rank 0 of its group: Megatron's split without sequence
parallelism, the vocabulary-parallel embedding, head and loss, docs/models/tensor_parallel.md), asked
without recomputation (the per-layer tables' setting). There is one stage walk: this module only adapts
the search's arguments and caches the figure (a solve asks the same rank thousands of times).

Measured: tests/e2e/test_stage_memory.py (tp 1) and tests/e2e/test_tensor_parallel_runs.py (tp 2 x
pipeline 2 x uneven DP 2); the search's view of both: tests/unit/test_scale_memory.py.
"""
from __future__ import annotations

from functools import lru_cache

from contracts.specs import ModelSpec
from planner.core.stage_memory import estimate_rank_memory


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
    return estimate_rank_memory(spec, schedule, num_stages, num_microbatches, stage, first_layer, num_layers, rows,
                                shard_fraction, seq, dtype, "none", device_type, tp).peak_bytes


__all__ = ["tp_stage_memory_bytes"]
