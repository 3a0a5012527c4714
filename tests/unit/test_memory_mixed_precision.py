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
    (dict(zero=3, dtype="bf16", param_dtype="fp8"), "MemoryConfig: param_dtype must be one of fp32, bf16, fp16, "
                                                    "got 'fp8'"),
    (dict(zero=2, dtype="bf16", param_dtype="bf16"), "param_dtype bf16 needs zero 3 \\(got zero 2\\)"),
    (dict(zero=0, dtype="fp16", param_dtype="fp16"), "param_dtype fp16 needs zero 3 \\(got zero 0\\)"),
    (dict(zero=3, reduce_dtype="fp16"), "reduce_dtype must be one of fp32, bf16, got 'fp16'"),
    (dict(zero=3, prefetch=-1), "prefetch must be an integer >= 0"),
    (dict(zero=3, prefetch=1.0), "prefetch must be an integer >= 0"),
    (dict(zero=3, prefetch=True), "prefetch must be an integer >= 0"),
    (dict(zero=3, dtype="fp32", param_dtype="bf16"), "param_dtype bf16 needs dtype bf16 \\(got dtype=fp32\\)"),
    (dict(zero=3, dtype="fp16", param_dtype="bf16"), "param_dtype bf16 needs dtype bf16 \\(got dtype=fp16\\)"),
    (dict(zero=3, reduce_in_flight=2), "reduce_in_flight must be 0 or 1"),
    (dict(zero=2, reduce_in_flight=True), "reduce_in_flight must be 0 or 1"),
])
def test_bad_options(kwargs, match):
    with pytest.raises(ValueError, match=match):
        MemoryConfig(dp=4, **kwargs)


def test_good_options_are_accepted_and_serialized():
    cfg = MemoryConfig(dp=4, zero=3, dtype="bf16", param_dtype="bf16", reduce_dtype="bf16", prefetch=2,
                       reduce_in_flight=1)
    d = cfg.to_dict()
    assert (d["param_dtype"], d["reduce_dtype"], d["prefetch"], d["reduce_in_flight"]) == ("bf16", "bf16", 2, 1)
    assert MemoryConfig(**d) == cfg


@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_defaults_are_the_fp32_gather_with_one_unit_prefetched_and_reduces_waited(zero):
    cfg = MemoryConfig(micro_batch=2, accum_steps=2, seq=64, dp=4, zero=zero, dtype="bf16")
    explicit = replace(cfg, param_dtype="fp32", reduce_dtype="fp32", prefetch=1, reduce_in_flight=0)
    assert estimate_memory(TINY, cfg) == estimate_memory(TINY, explicit)
    assert estimate_peak_phases(TINY, cfg) == estimate_peak_phases(TINY, explicit)


# tiny's runtime units (contracts/units.py): the tied embedding 256·64 + 128·64, two blocks, the final norm
EMBED, BLOCK, HEAD = 24_576, 49_984, 128
S4 = (6_144, 12_496, 12_496, 32)  # a quarter of each, round half up


def _phases(**kw) -> dict[str, int]:
    # micro_batch 0: a rank that only holds state, so every moment is unit buffers, by hand
    return estimate_peak_phases(TINY, MemoryConfig(micro_batch=0, seq=64, dp=4, zero=3, **kw))


def test_head_moment_by_hand_for_every_prefetch_and_param_dtype():
    state = 12 * sum(S4)  # master slice and AdamW moments
    for prefetch in range(4):
        for dtype, p in (("fp32", 4), ("bf16", 2)):
            # gathered: the head, the tied embedding and min(prefetch, 2) blocks; the head's and the
            # embedding's gradient buffers (boundary mode: a rank without samples accumulates nothing)
            gathered = p * (HEAD + EMBED + min(prefetch, 2) * BLOCK)
            phases = _phases(prefetch=prefetch, dtype=dtype, param_dtype=dtype)
            assert phases["head"] == state + gathered + p * (HEAD + EMBED), (prefetch, dtype)


def test_a_reduce_left_in_flight_is_held_through_the_next_units_backward():
    # during the last block's backward the tied embedding's reduce (after the head's) is in flight: its
    # flat gradient in the reduce dtype, and with bf16 its slice's result before it lands in the fp32 slice
    for reduce_dtype, rb in (("fp32", 4), ("bf16", 2)):
        waited = _phases(reduce_dtype=reduce_dtype)["last_block"]
        left = _phases(reduce_dtype=reduce_dtype, reduce_in_flight=1)["last_block"]
        assert left - waited == rb * EMBED + (rb * S4[0] if rb == 2 else 0), reduce_dtype


def test_a_unit_reduce_holds_its_buffer_and_the_cast_copy():
    # the last block's reduce: the block and the prefetched first block gathered, the block's fp32
    # gradient beside its bf16 copy (then the copy, the slice's fp32 gradient and its bf16 result), and
    # the slice gradients of the head and the tied embedding already made
    state = 12 * sum(S4)
    made = 4 * (S4[3] + S4[0])
    fp32 = _phases()["reduce_block"]
    bf16 = _phases(reduce_dtype="bf16")["reduce_block"]
    assert fp32 == state + 2 * 4 * BLOCK + made + 4 * BLOCK + 4 * S4[1]
    assert bf16 == state + 2 * 4 * BLOCK + made + max((4 + 2) * BLOCK, 2 * BLOCK + (4 + 2) * S4[1])


def test_half_parameters_drop_autocast_weight_copies_and_halve_the_residual_stream():
    spec = PRESETS["tiny-llama"]
    cfg = MemoryConfig(micro_batch=1, accum_steps=4, seq=128, dp=4, zero=3, dtype="bf16")
    one = estimate_peak_phases(spec, cfg)
    half = estimate_peak_phases(spec, replace(cfg, param_dtype="bf16"))
    # boundary mode at the head: (L + 2)·(n - 1) + L other boundaries, 4 B -> 2 B per element each
    assert one["loss"] - half["loss"] > (spec.num_layers + 2) * 3 * 2 * spec.hidden * 128


@pytest.mark.parametrize("name", ["llama2-7b", "gpt2"])
def test_every_moment_stays_affine_with_the_options(name):
    """The planner extrapolates each moment from 2 and 3 accumulation steps and interpolates in the
    micro-batch and the shard fraction (docs/models/memory.md, "The peak"): the options keep that true."""
    spec = PRESETS[name]
    options = dict(dtype="bf16", param_dtype="bf16", reduce_dtype="bf16", prefetch=2, reduce_in_flight=1)

    def phases(m: int, n: int, f: float) -> dict[str, int]:
        return estimate_peak_phases(spec, MemoryConfig(micro_batch=m, accum_steps=n, seq=128, dp=4, zero=3,
                                                       shard_fraction=f, device_type="H200", **options))

    by_n = [phases(2, n, 0.3) for n in (2, 3, 4, 9)]
    by_m = [phases(m, 2, 0.3) for m in (1, 2, 3)]
    by_f = [phases(2, 2, f) for f in (0.02, 0.05, 0.08)]  # every slice below the 2^24 step chunk
    for k in by_n[0]:
        two, three = by_n[0][k], by_n[1][k]
        assert by_n[2][k] == 2 * three - two and by_n[3][k] == two + 7 * (three - two), k
        assert by_m[2][k] - by_m[1][k] == by_m[1][k] - by_m[0][k], k
        # rounding of f·numel only: half an element of 12-16 B of state per unit
        assert abs((by_f[2][k] - by_f[1][k]) - (by_f[1][k] - by_f[0][k])) <= 16 * (spec.num_layers + 2), k
