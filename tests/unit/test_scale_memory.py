"""The TP-aware stage memory of the joint search (planner/geo/scale/memory.py): at tp 1 it is the
runtime's exact stage model (planner/core/stage_memory.py) to the byte; at tp > 1 each rank holds less."""
from __future__ import annotations

from dataclasses import replace

import pytest

from contracts.plan import PipelineSpec, PipelineStage
from contracts.specs import ModelSpec, get_model
from planner.core.stage_memory import estimate_stage_memory
from planner.geo.scale.memory import tp_stage_memory_bytes

UNTIED = ModelSpec("t8", "gpt2", 8, 256, 8, 8, 1024, 1000, 512, tied_embeddings=False, linear_bias=True)


def _pipeline(layers: int, stage: int, stages: int, rows: int, microbatches: int) -> tuple[PipelineSpec, int]:
    out, first = [], 0
    for j in range(stages):
        n = layers if j == stage else 1
        out.append(PipelineStage(first, n, (j,), (rows,)))
        first += n
    return PipelineSpec("1f1b", rows, microbatches, tuple(out)), first


@pytest.mark.parametrize("spec", [UNTIED, get_model("gpt2")], ids=["untied", "gpt2-tied"])
@pytest.mark.parametrize("layers,stage,stages,microbatches,rows,share", [
    (3, 0, 4, 8, 2, 0.25), (3, 3, 4, 8, 1, 0.1), (5, 1, 3, 2, 3, 0.5), (4, 0, 1, 6, 2, 0.3), (2, 2, 5, 3, 1, 1.0)])
def test_tp1_is_the_runtime_stage_model(spec, layers, stage, stages, microbatches, rows, share):
    pipe, total = _pipeline(layers, stage, stages, rows, microbatches)
    model = replace(spec, num_layers=total)
    first = pipe.stages[stage].first_layer
    for device in ("A100-40GB", "V100-16GB"):
        ref = estimate_stage_memory(model, pipe, stage, 0, share, 256, "fp32", "none", device).peak_bytes
        assert tp_stage_memory_bytes(model, first, layers, stage, stages, microbatches, rows, share, 256, "fp32",
                                     device, 1) == ref


def test_tensor_parallel_ranks_hold_less():
    pipe, total = _pipeline(4, 1, 3, 2, 8)
    model = replace(UNTIED, num_layers=total)
    sizes = [tp_stage_memory_bytes(model, 1, 4, 1, 3, 8, 2, 0.5, 256, "fp32", "A100-40GB", tp) for tp in (1, 2, 4)]
    assert sizes[0] > sizes[1] > sizes[2]
    # the boundary pieces and the residual stream stay whole: not a plain 1/tp of the tp-1 figure
    assert sizes[2] > sizes[0] / 4


def test_bad_tp_is_refused():
    with pytest.raises(ValueError, match="tp 3"):
        tp_stage_memory_bytes(UNTIED, 0, 2, 0, 1, 1, 1, 1.0, 256, "fp32", "A100-40GB", 3)
