"""planner/core/memory.py against the traced runtime (profiler/tracing.py) where a middle block of the
backward holds the most: a zero-3 rank without samples, with more blocks than its prefetch reaches,
holds the prefetched blocks beside the slice gradients of every block above it (`small`: 4 blocks)."""
from __future__ import annotations

import pytest

from contracts.specs import PRESETS
from planner.core.memory import MemoryConfig, estimate_memory
from profiler.tracing import trace_memory


@pytest.mark.parametrize("fraction", [0.05, 0.3])
@pytest.mark.parametrize("options", [dict(prefetch=1), dict(prefetch=2),
                                     dict(dtype="bf16", param_dtype="bf16", prefetch=1, reduce_in_flight=1)],
                         ids=["prefetch1", "prefetch2", "bf16_in_flight"])
def test_a_rank_without_samples_peaks_at_a_middle_block_as_predicted(fraction, options):
    cfg = MemoryConfig(seq=64, dp=4, zero=3, shard_fraction=fraction, micro_batch=0, **options)
    traced = trace_memory(PRESETS["small"], cfg)["peak_bytes"]
    predicted = estimate_memory(PRESETS["small"], cfg).peak_bytes
    assert abs(predicted - traced) <= 64, (predicted, traced)  # the traces agree to a few bytes
