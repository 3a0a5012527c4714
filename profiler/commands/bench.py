"""`python -m profiler bench [--json]`: measured matmul TFLOP/s per dtype and size, memory GB/s,
and all-reduce / all-gather / broadcast between local ranks fitted to latency + size/bandwidth.
Results are saved to the profile store (the planner reads the collective bandwidth there)."""
from __future__ import annotations

import argparse

from contracts.cli import device_arg, int_arg, print_json, print_table
from profiler.collectives import DEFAULT_SIZES_BYTES, KIB, MIB

HELP = "measure matmul TFLOP/s, memory bandwidth and collective bandwidth on this machine"

# --quick: a smoke run in seconds (CI, a first look), not figures to plan with
QUICK_COLLECTIVE_SIZES = (KIB, 16 * KIB, 256 * KIB, 4 * MIB)
QUICK_MATMUL_SIZES = (128, 256)
QUICK_COPY_BYTES = 32 * MIB
MAX_WORLD_SIZE = 64  # local ranks: one process each on this machine


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--device", type=device_arg, help="torch device (default: cuda if present, else cpu)")
    p.add_argument("--world-size", type=int_arg(1, MAX_WORLD_SIZE), default=2, help="local ranks for the collectives (default 2)")
    p.add_argument("--quick", action="store_true", help="smaller matmuls and copies, collectives only up to 4 MiB")
    p.add_argument("--no-collectives", action="store_true", help="skip the multi-process benchmark")
    p.add_argument("--no-save", action="store_true", help="do not write the profile store")


def run(args: argparse.Namespace) -> int:
    if not args.no_collectives and args.world_size < 2:  # before paying for the torch import
        raise ValueError(f"a collective benchmark needs at least 2 ranks, got {args.world_size}")
    from profiler.commands._checks import require_device
    from profiler.microbench import run_bench  # torch: only when the command runs

    require_device(args.device)

    sizes = None if args.no_collectives else (QUICK_COLLECTIVE_SIZES if args.quick else DEFAULT_SIZES_BYTES)
    bench = run_bench(args.device, sizes=QUICK_MATMUL_SIZES if args.quick else None,
                      copy_bytes=QUICK_COPY_BYTES if args.quick else None, collective_sizes_bytes=sizes,
                      world_size=args.world_size, save=not args.no_save)
    if args.json:
        out = bench.to_dict()
        out["measured"] = True
        out["matmul_tflops"] = {dt: bench.best_tflops(dt) for dt in sorted({m.dtype for m in bench.matmul})}
        if bench.collectives:
            out["collective_gbps"] = {f.op: f.bandwidth_bytes_per_s / 1e9 for f in bench.collectives.fits}
        print_json(out)
        return 0
    print(f"{bench.device_type} ({bench.device_name}), {bench.num_threads} thread(s) — measured")
    print_table([{"dtype": m.dtype, "n": m.size, "TFLOP/s": m.tflops} for m in bench.matmul])
    print(f"memory copy: {bench.memory_gbps:.3g} GB/s (read + write)")
    if bench.collectives:
        c = bench.collectives
        print(f"\ncollectives: {c.world_size} ranks, {c.backend}; t = latency + size / bandwidth")
        print_table([{"op": f.op, "latency_us": f.latency_s * 1e6, "bandwidth_GB/s": f.bandwidth_bytes_per_s / 1e9,
                      "R2": f.r2} for f in c.fits])
    return 0
