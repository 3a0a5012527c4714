"""profiler/tracing.py (MemTracker over one real training step) against planner/memory.py.

The prediction is pure arithmetic over the spec; the trace runs the decoder, the loss and the
AdamW step under MemTracker. Same tolerances as bench/memory_accuracy.py on a small subset."""
from __future__ import annotations

import json
import statistics
import subprocess
import sys
from dataclasses import replace

import pytest

from planner.memory import MemoryConfig, estimate_memory
from planner.specs import PRESETS
from profiler.tracing import trace_memory

MEDIAN_TOL_PCT = 3.0
MAX_TOL_PCT = 8.0
KEYS = ("params_bytes", "grads_bytes", "optimizer_bytes", "activations_bytes", "other_bytes", "peak_bytes")

SUBSET = [  # (model, micro_batch, seq, dtype, recompute, shard fraction or None)
    ("tiny", 2, 128, "fp32", "none", None),
    ("tiny", 4, 64, "bf16", "full", 0.5),
    ("tiny-llama", 3, 128, "fp32", "full", 0.25),
    ("tiny-llama", 2, 96, "bf16", "none", None),
]


def _cfg(mb, seq, dtype, recompute, fraction):
    return MemoryConfig(micro_batch=mb, seq=seq, dtype=dtype, recompute=recompute,
                        zero=0 if fraction is None else 1, shard_fraction=fraction)


def _err_pct(predicted: int, traced: int) -> float:
    return 100.0 * abs(predicted - traced) / traced


def test_predicted_vs_traced_real_tensors():
    errors = []
    for name, *rest in SUBSET:
        cfg = _cfg(*rest)
        traced = trace_memory(PRESETS[name], cfg)
        assert traced["measured"] is True and traced["fake"] is False
        assert traced["peak_bytes"] == sum(traced[k] for k in KEYS[:-1])
        errors.append(_err_pct(estimate_memory(PRESETS[name], cfg).peak_bytes, traced["peak_bytes"]))
    assert statistics.median(errors) <= MEDIAN_TOL_PCT and max(errors) <= MAX_TOL_PCT, errors


def test_fake_trace_of_a_larger_model_and_fake_equals_real():
    # GPT-2's real shapes (vocab 50257, tied head) with 2 of its 12 blocks: fake tensors, no memory
    spec = replace(PRESETS["gpt2"], num_layers=2)
    cfg = _cfg(2, 256, "bf16", "full", 0.25)
    traced = trace_memory(spec, cfg, fake=True)
    assert traced["fake"] is True
    assert _err_pct(estimate_memory(spec, cfg).peak_bytes, traced["peak_bytes"]) <= MAX_TOL_PCT
    # the fake trace sees the same storages as the real one
    small = _cfg(1, 64, "fp32", "none", 0.5)
    assert trace_memory(PRESETS["tiny"], small, fake=True)["peak_bytes"] == \
        trace_memory(PRESETS["tiny"], small)["peak_bytes"]


def test_trace_rejects_what_the_runtime_does_not_run():
    for cfg in (MemoryConfig(tp=2), MemoryConfig(pp=2), MemoryConfig(dp=2, zero=2), MemoryConfig(dp=2, zero=3)):
        with pytest.raises(ValueError, match="analytic"):
            trace_memory(PRESETS["tiny"], cfg)


def test_profiler_cli():
    r = subprocess.run([sys.executable, "-m", "profiler", "memory", "--model", "tiny-llama", "--micro-batch", "2",
                        "--seq", "64", "--dp", "2", "--json"], capture_output=True, text=True, check=True)
    d = json.loads(r.stdout)
    assert d["measured"] is True and all(k in d for k in ("num_params", *KEYS))
    # (tp/pp/ZeRO-2+ rejection is tested in-process above: these fail before torch is imported)
    for args in (["--model", "nope"], ["--model", "tiny", "--shard-fraction", "0"]):
        r = subprocess.run([sys.executable, "-m", "profiler", "memory", *args], capture_output=True, text=True)
        assert r.returncode == 2, (args, r.stderr)
        assert len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.stderr
