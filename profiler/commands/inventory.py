"""`python -m profiler inventory [--json] [--out cluster.json]`: this machine's devices.

The JSON object has `devices` (what the hardware reports) and `cluster` (this machine as a
cluster file); `--out` writes the cluster file itself, which `planner plan --cluster` takes.
"""
from __future__ import annotations

import argparse

from planner.cli import print_json, print_table
from planner.core.profiles import get_device_bench
from profiler.inventory import build_local_cluster, detect_devices

HELP = "list the local devices (CUDA GPUs, else the CPU) and write them as a cluster file"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--out", metavar="PATH", help="write this machine as a cluster file")


def run(args: argparse.Namespace) -> int:
    devices = detect_devices()
    cluster = build_local_cluster(devices)
    if args.out:
        try:
            cluster.save(args.out)
        except OSError as e:
            raise ValueError(f"cannot write {args.out}: {e.strerror}") from None
    bench = {t: get_device_bench(t) for t in cluster.device_types()}
    if args.json:
        print_json({"devices": [d.to_dict() for d in devices], "cluster": cluster.to_dict(),
                    "cluster_file": args.out,
                    "measured": {t: (b.to_dict() if b else None) for t, b in bench.items()}})
        return 0
    print_table([{"device": f"{d.kind}:{d.index}", "name": d.name, "type": d.catalog_type,
                  "memory_GiB": d.memory_bytes / 2**30, "cc": d.compute_capability or "",
                  "SMs": d.num_sms or "", "cores": d.num_cores or ""} for d in devices])
    print(f"\ncluster {cluster.name!r}: {cluster.num_devices} device(s) on node "
          f"{cluster.nodes[0].name!r} ({', '.join(cluster.device_types())})"
          + (f", written to {args.out}" if args.out else ""))
    for t, b in bench.items():
        if b is None:
            print(f"{t}: not benchmarked yet (python -m profiler bench)")
        else:
            print(f"{t}: measured {b.best_tflops('fp32') or 0:.3g} TFLOP/s fp32 matmul, "
                  f"{b.memory_gbps:.3g} GB/s memory ({b.created})")
    return 0
