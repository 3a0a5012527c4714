"""planner/core/memory.py: ZeRO and shard-fraction arithmetic by hand, affinity, bad input (the CLI and the
torch-free import: tests/e2e/test_memory_cli.py)."""
from __future__ import annotations

from dataclasses import replace

import pytest

from planner.core.memory import MemoryConfig, estimate_memory, estimate_peak_phases
from contracts.specs import PRESETS

TINY = PRESETS["tiny"]
P = 124_672  # tiny: 2·block(49_984) + wte 256·64 + wpe 128·64 + ln_f 128
S4 = 6_144 + 2 * 12_496 + 32  # a quarter of each runtime unit (embed, 2 blocks, head) = 31_168


def test_tiny_param_count_by_hand():
    block = 64 * 192 + 192 + 64 * 64 + 64 + 2 * 64 * 256 + 256 + 64 + 4 * 64
    assert block == 49_984
    assert TINY.num_params == 2 * block + 256 * 64 + 128 * 64 + 2 * 64 == P
    assert S4 == P // 4


@pytest.mark.parametrize("zero,params,grads,optimizer", [
    (0, 4 * P, 4 * P, 8 * P),  # one GPU: full params, full grads (until reduced), the moments
    (1, 4 * P, 4 * P, 8 * S4),  # AdamW state ÷4 (the slices' gradients exist after the reduce only)
    (2, 4 * P, 0, 8 * S4),  # the full gradient exists one unit at a time: not a state
    (3, 4 * S4, 0, 8 * S4),  # + parameters: the master slice only
])
def test_zero_stages_by_hand(zero, params, grads, optimizer):
    b = estimate_memory(TINY, MemoryConfig(dp=4, zero=zero))
    assert (b.num_params, b.params_bytes, b.grads_bytes, b.optimizer_bytes) == (P, params, grads, optimizer)
    assert b.peak_bytes == b.params_bytes + b.grads_bytes + b.optimizer_bytes + b.activations_bytes + b.other_bytes


def test_uneven_shard_fraction_by_hand():
    # 30 % of every unit, rounded half up: 7_372.8 -> 7_373, 14_995.2 -> 14_995 (x2), 38.4 -> 38
    s = 7_373 + 2 * 14_995 + 38
    b = estimate_memory(TINY, MemoryConfig(dp=8, zero=1, shard_fraction=0.3))
    assert b.optimizer_bytes == 8 * s
    assert b.grads_bytes == 4 * P  # stage 1 holds the full gradient through backward
    b3 = estimate_memory(TINY, MemoryConfig(dp=8, zero=3, shard_fraction=0.3))
    assert b3.params_bytes == 4 * s and b3.grads_bytes == 0
    # the default shard is the even one, 1/dp: 3_072 + 2 x 6_248 + 16
    assert estimate_memory(TINY, MemoryConfig(dp=8, zero=1)).optimizer_bytes == 8 * (3_072 + 2 * 6_248 + 16)


def test_7b_model_states_unsharded():
    spec = PRESETS["llama2-7b"]
    b = estimate_memory(spec, MemoryConfig(seq=512, dtype="bf16"))
    n = spec.num_params
    assert b.params_bytes == 4 * n and b.grads_bytes == 4 * n  # full fp32 params and grads
    assert b.optimizer_bytes == 8 * n


def test_accumulation_grows_memory_only_where_boundaries_are_kept():
    spec = PRESETS["gpt2"]

    def peak(zero: int, n: int) -> int:
        return estimate_memory(spec, MemoryConfig(micro_batch=2, accum_steps=n, seq=256, zero=zero, dp=4)).peak_bytes

    # zero 1 accumulates in the full gradient: micro-batches do not add up (the inputs aside)
    assert peak(1, 4) - peak(1, 2) < 64 * 1024
    # zero 2/3 keep every micro-batch's L+1 unit boundaries (4·h·N bytes each) and more of them
    bd = 4 * spec.hidden * 2 * 256
    for zero in (2, 3):
        grow = peak(zero, 4) - peak(zero, 3)
        assert (spec.num_layers + 1) * bd <= grow <= (spec.num_layers + 3) * bd, (zero, grow / bd)


def _affine(values: list[int], tol: int = 16) -> bool:
    return all(abs((values[i + 2] - values[i + 1]) - (values[i + 1] - values[i])) <= tol
               for i in range(len(values) - 2))


@pytest.mark.parametrize("name,dtype,recompute", [("llama2-7b", "bf16", "full"), ("gpt2", "fp32", "none"),
                                                  ("tiny-llama", "bf16", "full")])
def test_every_phase_is_affine_in_shard_fraction_and_micro_batch(name, dtype, recompute):
    spec = PRESETS[name]

    def phases(m: int, f: float) -> dict[str, int]:
        return estimate_peak_phases(spec, MemoryConfig(micro_batch=m, seq=128, dtype=dtype, recompute=recompute,
                                                       zero=1, dp=4, shard_fraction=f))

    # (the step's chunk temporaries saturate at 2^24 elements: all four shards stay on one side)
    by_f = [phases(2, f) for f in (0.45, 0.6, 0.75, 0.9)]
    by_m = [phases(m, 0.25) for m in (1, 2, 3, 4)]
    for k in by_f[0]:
        assert _affine([p[k] for p in by_f]), k  # rounding of f·P only
        assert _affine([p[k] for p in by_m], tol=0), k
    # the peak is the largest phase
    cfg = MemoryConfig(micro_batch=2, seq=128, dtype=dtype, recompute=recompute, zero=1, dp=4, shard_fraction=0.25)
    assert estimate_memory(spec, cfg).peak_bytes == max(estimate_peak_phases(spec, cfg).values())


@pytest.mark.parametrize("name,dtype,recompute", [("llama2-7b", "bf16", "full"), ("gpt2", "fp32", "none"),
                                                  ("tiny-llama", "bf16", "none"), ("gpt2-xl", "bf16", "full")])
def test_every_phase_is_affine_in_accumulation_steps_from_two_on(name, dtype, recompute):
    """The planner's moments at n > 3 are extrapolated from n = 2 and 3 (training.runtime_memory_fns):
    at every stage and shard, each moment of the model at n equals that line exactly, and the
    extrapolated moments are the model's own."""
    from planner.costmodel.training import runtime_memory_fns

    spec = PRESETS[name]
    for zero in (1, 2, 3):
        memory_fn, phases_fn = runtime_memory_fns(spec, 128, dtype, recompute, 4, zero, "A100-80GB")
        for m in (1, 3):
            for f in (0.0, 0.37, 1.0):
                def direct(n: int) -> tuple[float, ...]:
                    phases = estimate_peak_phases(spec, MemoryConfig(
                        micro_batch=m, accum_steps=n, seq=128, dtype=dtype, recompute=recompute, dp=4, zero=zero,
                        shard_fraction=max(f, 1e-12), device_type="A100-80GB"))
                    return tuple(float(phases[k]) for k in sorted(phases))

                two, three = direct(2), direct(3)
                for n in (4, 9, 57, 1000, 123_457):
                    line = tuple(a + (n - 2) * (b - a) for a, b in zip(two, three))
                    assert direct(n) == line == phases_fn(m, n, f), (zero, m, f, n)
                    assert memory_fn(m, n, f) == max(direct(n)), (zero, m, f, n)


def test_recompute_and_bf16_reduce_activations():
    spec = PRESETS["gpt2-medium"]
    base = estimate_memory(spec, MemoryConfig(micro_batch=8, seq=1024))
    full = estimate_memory(spec, MemoryConfig(micro_batch=8, seq=1024, recompute="full"))
    bf16 = estimate_memory(spec, MemoryConfig(micro_batch=8, seq=1024, dtype="bf16"))
    assert full.peak_bytes < 0.6 * base.peak_bytes
    assert bf16.activations_bytes < base.activations_bytes


def test_tp_pp_are_analytic_and_divide_the_model():
    spec = PRESETS["llama2-13b"]
    one = estimate_memory(spec, MemoryConfig(seq=2048, dtype="bf16"))
    split = estimate_memory(spec, MemoryConfig(seq=2048, dtype="bf16", tp=4, pp=2))
    assert split.params_bytes < one.params_bytes / 7  # ÷8, plus the first stage's embedding
    assert split.peak_bytes < one.peak_bytes / 4


@pytest.mark.parametrize("kwargs,match", [
    (dict(micro_batch=-1), "micro_batch"),
    (dict(seq=0), "seq"),
    (dict(dtype="fp8"), "dtype"),
    (dict(recompute="some"), "recompute"),
    (dict(dp=0), "dp"),
    (dict(zero=4), "zero"),
    (dict(zero=1, shard_fraction=1.5), "shard_fraction"),
    (dict(zero=0, shard_fraction=0.5), "zero >= 1"),
])
def test_bad_config(kwargs, match):
    with pytest.raises(ValueError, match=match):
        MemoryConfig(**kwargs)


@pytest.mark.parametrize("cfg,match", [
    (MemoryConfig(seq=256), "max_seq 128"),
    (MemoryConfig(tp=3), "tp=3 must divide num_heads 4"),
    (MemoryConfig(pp=3), "pp=3 > num_layers 2"),
])
def test_bad_config_for_model(cfg, match):
    with pytest.raises(ValueError, match=match):
        estimate_memory(TINY, cfg)


def test_state_only_gpu():
    b = estimate_memory(replace(TINY), MemoryConfig(micro_batch=0, dp=2, zero=1))
    assert b.activations_bytes == 0 and b.peak_bytes > b.params_bytes + b.grads_bytes


