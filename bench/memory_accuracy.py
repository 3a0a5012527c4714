"""Predicted (planner/core/memory.py) vs traced (profiler/tracing.py: one whole step of the sharded
runtime, live tensor bytes) peak memory of one rank, over a matrix of configurations: both model
families, 0.1M to 13B parameters (FakeTensorMode from 124M up; real tensors for the small ones),
micro-batch 1-8, sequence 32-4096, fp32 and bf16, recomputation none/full, shard fractions 1/16
to 1, and for every sharded row ZeRO 1, 2 and 3 with 1 and 2 accumulation steps; at ZeRO 3 also the
runtime's gather/reduce options (OPTION_SETS: bf16 parameters, prefetch 0 and 2, bf16 reduces left in
flight).

    python bench/memory_accuracy.py            # the whole matrix (tens of minutes on 2 busy cores)
    python bench/memory_accuracy.py --quick    # the models below 1B only
    python bench/memory_accuracy.py --cuda     # CUDA_MATRIX on the GPU: torch.cuda.max_memory_allocated

Target: every |error| <= 3 %. Exit code 1 when missed.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from dataclasses import replace

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from planner.core.memory import MemoryConfig, estimate_memory  # noqa: E402
from contracts.specs import PRESETS  # noqa: E402
from contracts.constants import GIB  # noqa: E402

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

# ZeRO 3's gather/reduce options (planner/core/memory.py MemoryConfig), each row's sharded configs again;
# bf16 parameters only where the row computes in bf16
OPTION_SETS = [dict(param_dtype="bf16"), dict(prefetch=0), dict(prefetch=2, reduce_dtype="bf16", reduce_in_flight=1)]

# --cuda: (model, layers kept, micro_batch, accum_steps, seq, dtype, recompute, shard fraction, options)
CUDA_MATRIX = [
    ("gpt2", 4, 2, 1, 512, "bf16", "none", 0.25, {}),
    ("gpt2", 4, 2, 1, 512, "bf16", "none", 0.25, dict(param_dtype="bf16")),
    ("gpt2", 4, 1, 3, 512, "bf16", "none", 0.25, dict(param_dtype="bf16", prefetch=2)),
    ("gpt2", 4, 2, 1, 512, "fp32", "none", 0.25, dict(prefetch=0, reduce_dtype="bf16", reduce_in_flight=1)),
    ("qwen2-0.5b", 4, 2, 1, 512, "bf16", "none", 0.25, {}),
    ("qwen2-0.5b", 4, 2, 1, 512, "bf16", "none", 0.25, dict(param_dtype="bf16", reduce_in_flight=1)),
    ("qwen2-0.5b", 4, 1, 2, 1024, "bf16", "full", 0.25, dict(param_dtype="bf16", reduce_dtype="bf16", prefetch=2)),
    ("tinyllama-1.1b", 3, 1, 2, 1024, "bf16", "none", 0.5, dict(param_dtype="bf16", prefetch=0, reduce_in_flight=1)),
    ("llama2-7b", 2, 1, 1, 512, "bf16", "none", 0.125, dict(param_dtype="bf16")),
    ("llama2-7b", 2, 1, 2, 1024, "bf16", "full", 0.125,
     dict(param_dtype="bf16", prefetch=2, reduce_dtype="bf16", reduce_in_flight=1)),
]


def configs_of(micro_batch: int, seq: int, dtype: str, recompute: str,
               fraction: float | None) -> list[MemoryConfig]:
    """One GPU holding everything, or every stage and accumulation count of a sharded rank (and at
    ZeRO 3 every option set of OPTION_SETS that applies)."""
    if fraction is None:
        return [MemoryConfig(micro_batch=micro_batch, seq=seq, dtype=dtype, recompute=recompute, zero=0)]
    dp = max(2, round(1 / fraction)) if fraction < 1 else 2
    out = [MemoryConfig(micro_batch=micro_batch, accum_steps=n, seq=seq, dtype=dtype, recompute=recompute, dp=dp,
                        zero=zero, shard_fraction=fraction) for zero in (1, 2, 3) for n in (1, 2)]
    options = [o for o in OPTION_SETS if o.get("param_dtype", dtype) == dtype]
    return out + [replace(c, **o) for c in out if c.zero == 3 for o in options]


def options_of(cfg: MemoryConfig) -> str:
    """The row's non-default gather/reduce options, short."""
    parts = [f"p={cfg.param_dtype}" if cfg.param_dtype != "fp32" else "", f"pf={cfg.prefetch}" if cfg.prefetch != 1 else "",
             f"r={cfg.reduce_dtype}" if cfg.reduce_dtype != "fp32" else "", "infl" if cfg.reduce_in_flight else ""]
    return ",".join(p for p in parts if p) or "-"


def run_cuda() -> int:
    """CUDA_MATRIX on the first GPU: predicted (the catalog type of the device) against the allocator's peak."""
    import torch

    from contracts.catalog import match_gpu_type
    from profiler.tracing import cuda_step_peak

    device = torch.device("cuda", 0)
    props = torch.cuda.get_device_properties(device)
    gpu = match_gpu_type(props.name, props.total_memory)
    if gpu is None:
        print(f"{props.name}: not a catalog GPU type")
        return 1
    print(f"{props.name} ({gpu}), torch {torch.__version__}")
    print(f"{'model':15s} {'L':>2s} {'mb':>2s} {'acc':>3s} {'seq':>5s} {'dtype':5s} {'recomp':6s} {'shard':>5s} "
          f"{'options':24s} {'predicted MiB':>13s} {'measured MiB':>12s} {'error':>8s} {'overhead MiB':>12s}")
    errors = []
    for name, layers, mb, n, seq, dtype, recompute, fraction, options in CUDA_MATRIX:
        spec = replace(PRESETS[name], num_layers=layers)
        cfg = MemoryConfig(micro_batch=mb, accum_steps=n, seq=seq, dtype=dtype, recompute=recompute, dp=4, zero=3,
                           shard_fraction=fraction, device_type=gpu, **options)
        predicted = estimate_memory(spec, cfg).peak_bytes
        measured = cuda_step_peak(spec, cfg, device)
        err = 100.0 * (predicted - measured["peak_bytes"]) / measured["peak_bytes"]
        errors.append(abs(err))
        print(f"{name:15s} {layers:2d} {mb:2d} {n:3d} {seq:5d} {dtype:5s} {recompute:6s} {fraction:5.2f} "
              f"{options_of(cfg):24s} {predicted / 2**20:13.2f} {measured['peak_bytes'] / 2**20:12.2f} {err:+7.3f}% "
              f"{measured['overhead_bytes'] / 2**20:12.2f}", flush=True)
    ok = max(errors) <= MAX_TARGET_PCT
    print(f"\n{len(errors)} configurations: max |error| {max(errors):.3f} % (target <= {MAX_TARGET_PCT} %): "
          f"{'PASS' if ok else 'FAIL'}")
    return 0 if ok else 1


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="only the models below 1B parameters")
    ap.add_argument("--cuda", action="store_true", help="CUDA_MATRIX on the GPU instead (max_memory_allocated)")
    args = ap.parse_args()
    if args.cuda:
        return run_cuda()
    from profiler.tracing import trace_memory

    rows = [r for r in MATRIX if not (args.quick and PRESETS[r[0]].num_params >= BIG_PARAMS)]
    errors = []
    print(f"{'model':15s} {'mb':>2s} {'seq':>5s} {'dtype':5s} {'recomp':6s} {'shard':>6s} {'zero':>4s} {'acc':>3s} "
          f"{'options':24s} {'mode':4s} {'predicted GiB':>14s} {'traced GiB':>11s} {'error':>8s} {'trace s':>8s}")
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
                  f"{cfg.accum_steps:3d} {options_of(cfg):24s} {'fake' if fake else 'real':4s} {predicted / GIB:14.4f} {traced / GIB:11.4f} {err:+7.3f}% "
                  f"{trace_s:8.1f}", flush=True)
    med, worst = statistics.median(errors), max(errors)
    ok = med <= MEDIAN_TARGET_PCT and worst <= MAX_TARGET_PCT
    print(f"\n{len(errors)} configurations: median |error| {med:.3f} %, max |error| {worst:.3f} % "
          f"(target median <= {MEDIAN_TARGET_PCT} %, max <= {MAX_TARGET_PCT} %): {'PASS' if ok else 'FAIL'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
