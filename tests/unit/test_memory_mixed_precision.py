"""planner/core/memory.py's gather and reduce options (param_dtype, reduce_dtype, prefetch): their
validation, the defaults giving the fp32-gather figures, and the arithmetic of what they change.
The model against the traced runtime: tests/e2e/test_profiler_memory_mixed.py."""
from __future__ import annotations

from dataclasses import replace

import pytest

from planner.core.memory import MemoryConfig, estimate_memory, estimate_peak_phases
from contracts.specs import PRESETS

TINY = PRESETS["tiny"]


@pytest.mark.parametrize("kwargs,match", [
    (dict(zero=3, param_dtype="fp8"), r"param_dtype must be one of \('fp32', 'bf16', 'fp16'\), got 'fp8'"),
    (dict(zero=2, param_dtype="bf16"), "param_dtype bf16 needs zero=3 \\(got zero=2\\)"),
    (dict(zero=0, param_dtype="fp16"), "param_dtype fp16 needs zero=3 \\(got zero=0\\)"),
    (dict(zero=3, reduce_dtype="fp16"), r"reduce_dtype must be one of \('fp32', 'bf16'\), got 'fp16'"),
    (dict(zero=3, prefetch=-1), "prefetch must be an integer >= 0"),
    (dict(zero=3, prefetch=1.0), "prefetch must be an integer >= 0"),
    (dict(zero=3, prefetch=True), "prefetch must be an integer >= 0"),
])
def test_bad_options(kwargs, match):
    with pytest.raises(ValueError, match=match):
        MemoryConfig(dp=4, **kwargs)


def test_good_options_are_accepted_and_serialized():
    cfg = MemoryConfig(dp=4, zero=3, dtype="bf16", param_dtype="bf16", reduce_dtype="bf16", prefetch=2)
    d = cfg.to_dict()
    assert (d["param_dtype"], d["reduce_dtype"], d["prefetch"]) == ("bf16", "bf16", 2)
    assert MemoryConfig(**d) == cfg


@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_defaults_are_the_fp32_gather_with_one_unit_prefetched(zero):
    cfg = MemoryConfig(micro_batch=2, accum_steps=2, seq=64, dp=4, zero=zero, dtype="bf16")
    explicit = replace(cfg, param_dtype="fp32", reduce_dtype="fp32", prefetch=1)
    assert estimate_memory(TINY, cfg) == estimate_memory(TINY, explicit)
    assert estimate_peak_phases(TINY, cfg) == estimate_peak_phases(TINY, explicit)
