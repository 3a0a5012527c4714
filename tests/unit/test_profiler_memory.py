"""profiler/tracing.py (one real step of the sharded runtime, live tensor bytes) against planner/core/memory.py.

The prediction is pure arithmetic over the spec; the trace runs ShardedRuntime (start-up and one
whole step: forward, backward, reduction, clipping, AdamW) on real or fake tensors. Every ZeRO
stage, with and without accumulation and recompute, fp32 and bf16: within 3 % each."""
from __future__ import annotations

from dataclasses import replace

import pytest

from planner.core.memory import MemoryConfig, estimate_memory, estimate_startup_bytes
from contracts.specs import PRESETS
from contracts.units import runtime_units
from profiler.tracing import trace_memory

TOL_PCT = 3.0
KEYS = ("params_bytes", "grads_bytes", "optimizer_bytes", "activations_bytes", "other_bytes", "peak_bytes")

GRID = [  # (model, zero, micro_batch, accum_steps, dtype, recompute, shard fraction)
    ("tiny", 1, 2, 1, "fp32", "none", 0.5),
    ("tiny", 2, 1, 3, "fp32", "none", 0.3),
    ("tiny", 3, 2, 1, "fp32", "none", 0.3),
    ("tiny", 3, 2, 2, "bf16", "full", 0.2),
    ("tiny-llama", 1, 1, 2, "bf16", "full", 0.25),
    ("tiny-llama", 2, 2, 1, "bf16", "none", 0.5),
    ("tiny-llama", 3, 1, 3, "fp32", "full", 0.4),
    ("tiny-llama", 3, 2, 1, "fp32", "none", 1 / 3),
]


def _cfg(zero, mb, n, dtype, recompute, f, seq=64):
    return MemoryConfig(micro_batch=mb, accum_steps=n, seq=seq, dtype=dtype, recompute=recompute, dp=4, zero=zero,
                        shard_fraction=f)


def _err_pct(predicted: int, traced: int) -> float:
    return 100.0 * abs(predicted - traced) / traced


@pytest.mark.parametrize("case", GRID, ids=lambda c: "-".join(map(str, c[:6])))
def test_predicted_vs_traced_real_tensors_every_stage(case):
    name, *rest = case
    cfg = _cfg(*rest)
    traced = trace_memory(PRESETS[name], cfg)
    assert traced["measured"] is True and traced["fake"] is False
    assert traced["peak_bytes"] == sum(traced[k] for k in KEYS[:-1])
    pred = estimate_memory(PRESETS[name], cfg)
    assert _err_pct(pred.peak_bytes, traced["peak_bytes"]) <= TOL_PCT, (pred.peak_bytes, traced["peak_bytes"])
    # the state kept between steps is counted exactly, byte for byte
    assert (pred.params_bytes, pred.optimizer_bytes) == (traced["params_bytes"], traced["optimizer_bytes"])
    assert _err_pct(estimate_startup_bytes(PRESETS[name], cfg), traced["startup_peak_bytes"]) <= 0.1


@pytest.mark.parametrize("zero,n,dtype,recompute", [(1, 1, "bf16", "none"), (2, 3, "bf16", "none"),
                                                    (3, 1, "bf16", "none"), (3, 2, "fp32", "full")])
def test_fake_trace_of_7b_shaped_blocks_every_stage(zero, n, dtype, recompute):
    # Llama-2-7B's real shapes (h 4096, vocab 32000, untied head) with 2 of its 32 blocks: fake tensors
    spec = replace(PRESETS["llama2-7b"], num_layers=2)
    cfg = MemoryConfig(micro_batch=1, accum_steps=n, seq=256, dtype=dtype, recompute=recompute, dp=8, zero=zero)
    traced = trace_memory(spec, cfg, fake=True)
    assert traced["fake"] is True
    assert _err_pct(estimate_memory(spec, cfg).peak_bytes, traced["peak_bytes"]) <= TOL_PCT


@pytest.mark.parametrize("zero,dtype", [(1, "bf16"), (3, "fp32")])
def test_an_explicit_head_dim_is_predicted_exactly(zero, dtype):
    # Mistral-Nemo style: head_dim 48 with hidden 128 and 4 heads (q is 192 wide, not 128)
    from contracts.specs import spec_from_hf_dict

    spec = spec_from_hf_dict({"model_type": "mistral", "hidden_size": 128, "num_attention_heads": 4,
                              "num_key_value_heads": 2, "head_dim": 48, "intermediate_size": 256,
                              "num_hidden_layers": 2, "vocab_size": 512, "max_position_embeddings": 256,
                              "sliding_window": None})
    cfg = MemoryConfig(micro_batch=2, seq=64, dtype=dtype, zero=zero, dp=2)
    assert _err_pct(estimate_memory(spec, cfg).peak_bytes, trace_memory(spec, cfg)["peak_bytes"]) <= TOL_PCT


def test_fake_equals_real():
    small = _cfg(3, 1, 2, "fp32", "none", 0.5)
    real, fake = trace_memory(PRESETS["tiny"], small), trace_memory(PRESETS["tiny"], small, fake=True)
    assert fake["peak_bytes"] == real["peak_bytes"] and fake["startup_peak_bytes"] == real["startup_peak_bytes"]


def test_a_zero3_rank_holds_its_shard_plus_the_units_in_flight_only():
    """From the traces: GPT-2's shapes (tied 50257 x 768 embedding) with 4 blocks, a 1/8 shard,
    a tiny batch so activations are small. Start-up never holds more than the shard state and one
    unit; the step holds at most the shard state, the units in flight (at the head: the head, the
    tied embedding and the prefetched last block gathered, the head's and the embedding's full
    gradients) and the activations that the replicated run of the same step holds too."""
    spec = replace(PRESETS["gpt2"], num_layers=4)
    sizes = sorted((u.numel for u in runtime_units(spec)), reverse=True)
    z3 = trace_memory(spec, MemoryConfig(micro_batch=1, seq=16, dp=8, zero=3), fake=True)
    z1 = trace_memory(spec, MemoryConfig(micro_batch=1, seq=16, dp=8, zero=1), fake=True)
    # the state: master slice and moments; the slices' gradients exist during the step only
    shard_state = z3["params_bytes"] + z3["optimizer_bytes"] + 4 * spec.num_params // 8
    assert shard_state == pytest.approx(16 * spec.num_params / 8, rel=1e-4)
    assert z3["startup_peak_bytes"] <= shard_state + 4 * sizes[0]
    # gathered: head, tied embedding, prefetched block; gradients: a unit's .grad and its flat copy
    in_flight = 4 * (sizes[0] + sizes[1] + sizes[2]) + 2 * 4 * sizes[0]
    activations = z1["peak_bytes"] - (z1["params_bytes"] + 4 * spec.num_params + z1["optimizer_bytes"])
    assert z3["peak_bytes"] <= shard_state + in_flight + activations
    # and far less than a rank holding the replicated parameters and gradients
    assert z3["peak_bytes"] < 0.6 * z1["peak_bytes"]


def test_trace_rejects_what_the_runtime_does_not_run():
    for cfg in (MemoryConfig(tp=2), MemoryConfig(pp=2)):
        with pytest.raises(ValueError, match="analytic"):
            trace_memory(PRESETS["tiny"], cfg)


