"""This machine's measured figures and the quality of Cephalo's `α + β·m` time model on it.

    python bench/profile_report.py [--repeats 5] [--quick] [--save] [--json]

1. Micro-benchmarks (one torch thread on a CPU): matmul TFLOP/s per dtype and size, memory copy
   GB/s, and collectives between 2 local ranks fitted to `latency + size / bandwidth` (R² per op).
2. Step profiles of `tiny` and `small` on the executor's code path: the fit, R², counted FLOPs and
   the achieved fraction of the measured matmul peak.
3. The estimate path: `small` estimated from the efficiency calibrated on `tiny` alone, divided by
   `small` measured in the same run.

Nothing is written to the profile store unless `--save`. The model: docs/models/cost.md.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from contracts.cli import print_table  # noqa: E402
from planner.core.profiles import get_step_profile, save_device_bench, save_step_profile  # noqa: E402
from contracts.specs import PRESETS  # noqa: E402
from profiler.collectives import DEFAULT_SIZES_BYTES, KIB, MIB  # noqa: E402
from profiler.microbench import run_bench  # noqa: E402
from profiler.step_profile import profile_local  # noqa: E402

MODELS = (("tiny", 128, (4, 8, 16, 32)), ("small", 256, (2, 4, 8, 16)))
QUICK_SIZES = (KIB, 16 * KIB, 256 * KIB, 4 * MIB)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5, help="timed repeats per micro-batch size (median)")
    ap.add_argument("--quick", action="store_true", help="collectives only up to 4 MiB")
    ap.add_argument("--save", action="store_true", help="also write the results to the profile store")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    args = ap.parse_args()

    t0 = time.perf_counter()
    tmp = tempfile.mkdtemp(prefix="gpumix-report-")
    bench = run_bench(collective_sizes_bytes=QUICK_SIZES if args.quick else DEFAULT_SIZES_BYTES, store_dir=tmp)
    profiles = {}
    for name, seq, sizes in MODELS:
        # store_dir=tmp: efficiencies refer to the matmul peak just measured
        profiles[name] = profile_local(name, seq, micro_batches=sizes, repeats=args.repeats, store_dir=tmp, save=False)
    # the estimate path: a store holding the bench and the tiny profile only
    save_step_profile(profiles["tiny"], store_dir=tmp)
    small_seq = MODELS[1][1]
    estimate = get_step_profile("cpu", PRESETS["small"], small_seq, "fp32", store_dir=tmp)
    measured_small = profiles["small"]
    ratios = {m: estimate.step_time_s(m) / measured_small.step_time_s(m) for m in measured_small.micro_batches}
    if args.save:
        save_device_bench(bench)
        for p in profiles.values():
            save_step_profile(p)
    wall_s = time.perf_counter() - t0

    if args.json:
        print(json.dumps({"bench": bench.to_dict(), "profiles": {k: p.to_dict() for k, p in profiles.items()},
                          "estimated_small": estimate.to_dict(), "estimated_over_measured": ratios,
                          "wall_s": wall_s}, indent=2))
        return 0
    print(f"# {bench.device_type}: {bench.device_name}, {bench.num_threads} torch thread(s), {bench.host} "
          f"— all figures measured ({bench.created})\n")
    print("## Matmul (n×n @ n×n, median)")
    print_table([{"dtype": m.dtype, "n": m.size, "TFLOP/s": m.tflops} for m in bench.matmul])
    print(f"\n## Memory copy: {bench.memory_gbps:.3g} GB/s (read + write)\n")
    c = bench.collectives
    print(f"## Collectives: {c.world_size} ranks, {c.backend}, t = latency + size / bandwidth (fit weighted 1/t²)")
    print_table([{"op": f.op, "latency_us": f.latency_s * 1e6, "bandwidth_GB/s": f.bandwidth_bytes_per_s / 1e9,
                  "R2": f.r2, "t(1KiB)_ms": f.times_s[0] * 1e3, "t(max)_ms": f.times_s[-1] * 1e3,
                  "max_size_MiB": f.sizes_bytes[-1] / MIB} for f in c.fits])
    print("\n## Step profiles (forward+backward of one micro-batch, executor code path, medians)")
    for p in profiles.values():
        print(f"\n{p.model}, seq {p.seq}: α = {p.alpha_s * 1e3:.3f} ms, β = {p.beta_s * 1e3:.3f} ms/sample, "
              f"R² = {p.r2:.4f}; counted {p.flops_per_sample / 1e6:.1f} MFLOP/sample, achieved "
              f"{p.achieved_tflops * 1e3:.1f} GFLOP/s = {p.efficiency:.2f} of the measured matmul peak; "
              f"optimizer {p.optimizer_s_per_param * 1e9:.2f} ns/param")
        print_table([{"micro_batch": m, "median_s": t, "fit_s": p.step_time_s(m),
                      "fit/median": p.step_time_s(m) / t} for m, t in zip(p.micro_batches, p.step_times_s)])
    print(f"\n## small estimated from tiny's calibration ({estimate.source})")
    print_table([{"micro_batch": m, "estimated_s": estimate.step_time_s(m),
                  "measured_fit_s": measured_small.step_time_s(m), "estimated/measured": r}
                 for m, r in ratios.items()])
    print(f"\n(report took {wall_s:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
