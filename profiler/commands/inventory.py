"""`python -m profiler inventory [--json] [--out cluster.json]`: this machine's devices.
`python -m profiler inventory --slurm [--gres-name gpu] [--partition P] [--type-map T=CATALOG]`:
the SLURM cluster's nodes (`scontrol show node -o`, `sinfo`; profiler/slurm_inventory.py).

The JSON object has `devices` (what the hardware reports; with --slurm: `nodes`, as SLURM
reports them, partitions included) and `cluster` (the cluster file); `--out` writes the
cluster file itself, which `planner plan --cluster` takes.
"""
from __future__ import annotations

import argparse

from contracts.cli import print_json, print_table
from planner.core.profiles import get_device_bench
from profiler.inventory import build_local_cluster, detect_devices

HELP = "list the local devices (CUDA GPUs, else the CPU) and write them as a cluster file"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--out", metavar="PATH", help="write this machine as a cluster file")
    p.add_argument("--slurm", action="store_true", help="the SLURM cluster's nodes instead of this machine")
    p.add_argument("--gres-name", default=None, metavar="NAME",
                   help="--slurm: the site's GRES name of its accelerators (default $GPUMIX_SLURM_GRES, else gpu)")
    p.add_argument("--partition", default=None, help="--slurm: only the nodes of this partition")
    p.add_argument("--type-map", action="append", default=None, metavar="GRES_TYPE=CATALOG_TYPE",
                   help="--slurm: a GRES type that names no single catalog type, e.g. a100=A100-80GB")
    p.add_argument("--profile", default=None, metavar="MODEL",
                   help="--slurm: also measure MODEL's step profile on each device type, as a SLURM job on a "
                        "node of that type (python -m profiler profile there), saved in the profile store here")
    p.add_argument("--seq", type=int, default=128, help="--profile: sequence length (default 128)")
    p.add_argument("--micro-batches", default="4,8,16,32", metavar="M1,M2,...",
                   help="--profile: micro-batch sizes to time (default 4,8,16,32)")


def _save(cluster, path: str | None) -> None:
    if path:
        try:
            cluster.save(path)
        except OSError as e:
            raise ValueError(f"cannot write {path}: {e.strerror}") from None


def run_slurm(args: argparse.Namespace) -> int:
    from profiler.slurm_inventory import (build_slurm_cluster, cluster_name, default_gres_name, parse_type_map,
                                          read_nodes)

    type_map = parse_type_map(args.type_map)
    nodes = read_nodes(args.gres_name)
    if args.partition:
        nodes = [n for n in nodes if args.partition in n.partitions]
        if not nodes:
            raise ValueError(f"no SLURM node in partition {args.partition!r}")
    cluster = build_slurm_cluster(nodes, cluster_name(), type_map)
    _save(cluster, args.out)
    profiles = {}
    if args.profile:
        from profiler.slurm_profile import profile_on_slurm

        for t in cluster.device_types():
            prof, path = profile_on_slurm(t, ["--model", args.profile, "--seq", str(args.seq), "--micro-batches",
                                              args.micro_batches], args.gres_name or default_gres_name(),
                                          args.partition, type_map)
            profiles[t] = {"store_path": path, "alpha_s": prof.alpha_s, "beta_s": prof.beta_s, "host": prof.host}
    if args.json:
        print_json({"nodes": [n.to_dict() for n in nodes], "cluster": cluster.to_dict(), "cluster_file": args.out,
                    "profiles": profiles})
        return 0
    print_table([{"node": n.name, "addr": n.addr, "state": n.state, "partitions": ",".join(n.partitions),
                  "gres": ",".join(f"{t or '-'}:{c}" for t, c in n.gres.items()) or "none",
                  "used": ",".join(f"{t or '-'}:{c}" for t, c in n.gres_used.items()) or "0", "cpus": n.cpus}
                 for n in nodes])
    print(f"\ncluster {cluster.name!r}: {cluster.num_devices} device(s) on {len(cluster.nodes)} usable node(s) "
          f"({', '.join(cluster.device_types())})" + (f", written to {args.out}" if args.out else ""))
    for t, p in profiles.items():
        print(f"{t}: profiled as a SLURM job (host {p['host']}): alpha {p['alpha_s'] * 1e3:.3f} ms, "
              f"beta {p['beta_s'] * 1e3:.3f} ms/sample, saved to {p['store_path']}")
    return 0


def run(args: argparse.Namespace) -> int:
    if args.slurm:
        return run_slurm(args)
    if args.gres_name or args.partition or args.type_map or args.profile:
        raise ValueError("--gres-name, --partition, --type-map and --profile go with --slurm")
    devices = detect_devices()
    cluster = build_local_cluster(devices)
    _save(cluster, args.out)
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
