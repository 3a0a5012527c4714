"""Predicted (planner/core/memory.py) vs traced (profiler/tracing.py: one whole step of the sharded
runtime, live tensor bytes) peak memory of one rank, over a matrix of configurations: both model
families, 0.1M to 13B parameters (FakeTensorMode from 124M up; real tensors for the small ones),
micro-batch 1-8, sequence 32-4096, fp32 and bf16, recomputation none/full, shard fractions 1/16
to 1, and for every sharded row ZeRO 1, 2 and 3 with 1 and 2 accumulation steps.

    python bench/memory_accuracy.py            # the whole matrix (about 20 min on 2 busy cores)
    python bench/memory_accuracy.py --quick    # the models below 1B only

Target: every |error| <= 3 %. Exit code 1 when missed.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from planner.core.memory import MemoryConfig, estimate_memory  # noqa: E402
from contracts.specs import PRESETS  # noqa: E402
from contracts.constants import GIB

MEDIAN_TARGET_PCT = 3.0
MAX_TARGET_PCT = 3.0
BIG_PARAMS = 1_000_000_000  # --quick skips models at least this large

# (model, micro_batch, seq, dtype, recompute, shard_fraction or None for a full state on one GPU)
MATRIX = [
    ("tiny", 1, 128, "fp32", "none", None),
    ("tiny", 8, 128, "bf16", "none", None),
    ("tiny", 4, 128, "fp32", "full", 0.5),
    ("tiny", 2, 32, "bf16", "full", 0.1),
    ("tiny-llama", 2, 128, "fp32", "none", 0.25),
    ("tiny-llama", 8, 128, "bf16", "full", None),
    ("tiny-llama", 1, 64, "bf16", "none", None),
    ("small", 4, 256, "fp32", "full", None),
    ("small", 2, 256, "bf16", "none", 0.3),
    ("small", 8, 256, "bf16", "full", None),
    ("gpt2", 1, 1024, "fp32", "none", None),
    ("gpt2", 8, 1024, "bf16", "full", 0.125),
    ("gpt2", 4, 512, "fp32", "full", None),
    ("gpt2", 2, 256, "bf16", "none", 0.5),
    ("gpt2", 1, 128, "fp32", "none", None),
    ("gpt2-medium", 4, 1024, "bf16", "none", None),
    ("gpt2-medium", 1, 512, "fp32", "full", 0.25),
    ("gpt2-large", 2, 1024, "bf16", "full", None),
    ("gpt2-xl", 1, 1024, "fp32", "none", 0.5),
    ("qwen2-0.5b", 1, 4096, "bf16", "full", None),
    ("qwen2-0.5b", 4, 1024, "fp32", "none", 0.25),
    ("qwen2-0.5b", 8, 512, "bf16", "none", 0.5),
    ("tinyllama-1.1b", 8, 2048, "bf16", "full", 0.125),
    ("tinyllama-1.1b", 2, 512, "fp32", "none", None),
    ("tinyllama-1.1b", 1, 2048, "fp32", "full", 0.5),
    ("gpt-2.7b", 1, 2048, "bf16", "full", 0.25),
    ("llama2-7b", 1, 4096, "bf16", "full", 0.125),
    ("llama2-7b", 2, 2048, "bf16", "none", 0.25),
    ("llama2-7b", 1, 1024, "fp32", "full", None),
    ("mistral-7b", 1, 4096, "bf16", "full", 0.0625),
    ("mistral-7b", 4, 512, "bf16", "none", 0.5),
    ("llama3-8b", 1, 2048, "bf16", "full", 0.125),
    ("llama3-8b", 1, 128, "fp32", "none", None),
    ("llama2-13b", 1, 2048, "bf16", "full", 0.125),
]



def configs_of(micro_batch: int, seq: int, dtype: str, recompute: str,
               fraction: float | None) -> list[MemoryConfig]:
    """One GPU holding everything, or every stage and accumulation count of a sharded rank."""
    if fraction is None:
        return [MemoryConfig(micro_batch=micro_batch, seq=seq, dtype=dtype, recompute=recompute, zero=0)]
    dp = max(2, round(1 / fraction)) if fraction < 1 else 2
    return [MemoryConfig(micro_batch=micro_batch, accum_steps=n, seq=seq, dtype=dtype, recompute=recompute, dp=dp,
                         zero=zero, shard_fraction=fraction) for zero in (1, 2, 3) for n in (1, 2)]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="only the models below 1B parameters")
    args = ap.parse_args()
    from profiler.tracing import trace_memory

    rows = [r for r in MATRIX if not (args.quick and PRESETS[r[0]].num_params >= BIG_PARAMS)]
    errors = []
    print(f"{'model':15s} {'mb':>2s} {'seq':>5s} {'dtype':5s} {'recomp':6s} {'shard':>6s} {'zero':>4s} {'acc':>3s} "
          f"{'mode':4s} {'predicted GiB':>14s} {'traced GiB':>11s} {'error':>8s} {'trace s':>8s}")
    for name, mb, seq, dtype, recompute, fraction in rows:
        spec = PRESETS[name]
        for cfg in configs_of(mb, seq, dtype, recompute, fraction):
            fake = spec.num_params > 100_000_000  # real tensors where they fit in a few hundred MB
            predicted = estimate_memory(spec, cfg).peak_bytes
            t0 = time.perf_counter()
            traced = trace_memory(spec, cfg, fake=fake)["peak_bytes"]
            trace_s = time.perf_counter() - t0
            err = 100.0 * (predicted - traced) / traced
            errors.append(abs(err))
            print(f"{name:15s} {mb:2d} {seq:5d} {dtype:5s} {recompute:6s} {fraction or 1.0:6.4g} {cfg.zero:4d} "
                  f"{cfg.accum_steps:3d} {'fake' if fake else 'real':4s} {predicted / GIB:14.4f} {traced / GIB:11.4f} {err:+7.3f}% "
                  f"{trace_s:8.1f}", flush=True)
    med, worst = statistics.median(errors), max(errors)
    ok = med <= MEDIAN_TARGET_PCT and worst <= MAX_TARGET_PCT
    print(f"\n{len(errors)} configurations: median |error| {med:.3f} %, max |error| {worst:.3f} % "
          f"(target median <= {MEDIAN_TARGET_PCT} %, max <= {MAX_TARGET_PCT} %): {'PASS' if ok else 'FAIL'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
