"""planner/core/memory.py against the traced rank (profiler/tracing.py) when the embedding unit's
gradient goes out as the step's rows (MemoryConfig.step_tokens, models/sharded.py set_batch_split):
tied and untied, keep and boundary modes, a rank without samples, fp32 and bf16 reduces, zero 2 and
3; within 0.5 % of the traced peak, as tests/e2e/test_profiler_memory_mixed.py asks of the table."""
from __future__ import annotations

import pytest

from contracts import wire
from contracts.specs import PRESETS, ModelSpec
from contracts.units import runtime_units
from planner.core.memory import MemoryConfig, estimate_with_phases
from profiler.tracing import trace_memory

TOL_PCT = 0.5
SEQ = 64
STEP_TOKENS = 3 * SEQ  # 3 samples over the 4 ranks (fewer bytes than the tiny tables)
MODES = {"keep": dict(micro_batch=2), "boundaries": dict(micro_batch=1, accum_steps=3),
         "no_samples": dict(micro_batch=0)}
OPTIONS = {"zero3_in_flight": dict(zero=3, reduce_in_flight=1),
           "zero3_reduce_bf16": dict(zero=3, dtype="bf16", param_dtype="bf16", reduce_dtype="bf16"),
           "zero2": dict(zero=2, reduce_in_flight=1)}


@pytest.mark.parametrize("name", ["tiny", "tiny-llama"])
@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("option", list(OPTIONS))
def test_rows_moments_match_the_traced_rank(name, mode, option):
    spec = PRESETS[name]
    cfg = MemoryConfig(seq=SEQ, dp=4, shard_fraction=0.3, step_tokens=STEP_TOKENS, **MODES[mode], **OPTIONS[option])
    rb = 2 if cfg.reduce_dtype == "bf16" else 4
    assert wire.token_rows_exchange(STEP_TOKENS, runtime_units(spec)[0].numel, spec.hidden, rb, 4)
    pred, phases = estimate_with_phases(spec, cfg)
    assert "embed_rows_add" in phases  # the rows' moments are priced, not the table's
    traced = trace_memory(spec, cfg)
    err = 100.0 * abs(pred.peak_bytes - traced["peak_bytes"]) / traced["peak_bytes"]
    assert err <= TOL_PCT, (pred.peak_bytes, traced["peak_bytes"], phases)


WIDE = {fam: ModelSpec(f"wide-{fam}", fam, 1, 64, 4, 4, 256, 4096, 64, tied_embeddings=tied)
        for fam, tied in (("gpt2", True), ("llama", False))}


@pytest.mark.parametrize("fam", list(WIDE))
@pytest.mark.parametrize("option", [dict(zero=2, reduce_in_flight=1),
                                    dict(zero=3, dtype="bf16", param_dtype="bf16", reduce_dtype="bf16")])
def test_rows_moment_is_the_peak_and_matches(fam, option):
    """A wide vocabulary, a rank without samples and a step of nearly as many rows as the rule allows:
    the rows' own moment is the step's peak, so the trace checks it."""
    spec = WIDE[fam]
    cfg = MemoryConfig(seq=SEQ, dp=4, shard_fraction=0.3, step_tokens=56 * SEQ, micro_batch=0, **option)
    pred, phases = estimate_with_phases(spec, cfg)
    assert max(phases, key=phases.get) == "embed_rows_add"
    traced = trace_memory(spec, cfg)
    err = 100.0 * abs(pred.peak_bytes - traced["peak_bytes"]) / traced["peak_bytes"]
    assert err <= TOL_PCT, (pred.peak_bytes, traced["peak_bytes"], phases)
