"""`python -m profiler import --format sailor --profiles FILE --model M [--network FILE]`: measured
per-layer timings (and measured network curves) from elsewhere into the profile store.

`--format sailor` reads Sailor's `profiles_tmp.json` (one model of it, `--model`) and its bandwidth
files; `--format gpumix` reads the GPUMix layer-profile format (docs/profiler.md). Every stored
profile names its source; the fitted α, β and R² per device type and TP degree are printed."""
from __future__ import annotations

import argparse
import datetime

from contracts.cli import int_arg, print_json, print_table
from planner.core.memory_command import MAX_SEQ

HELP = "import measured per-layer profiles (Sailor's or the GPUMix format) and network curves into the store"
MAX_NETWORK_FILES = 8


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--format", choices=("sailor", "gpumix"), required=True, help="the profiles file's format")
    p.add_argument("--profiles", metavar="FILE", help="per-layer profiles (Sailor: profiles_tmp.json)")
    p.add_argument("--model", help="Sailor's model name (OPT-350), a preset or a config.json path; "
                                   "gpumix: defaults to the file's model")
    p.add_argument("--seq", type=int_arg(1, MAX_SEQ), default=None,
                   help="sailor: tokens per sample of the profiled runs (default 2048, Sailor's training configs)")
    p.add_argument("--network", metavar="FILE", action="append", default=[],
                   help="sailor: a bandwidth file (multizone_bandwidths_het.json or intra_node_bandwidths.json); "
                        "may be repeated")
    p.add_argument("--json", action="store_true", help="print one JSON object")


def run(args: argparse.Namespace) -> int:
    from planner.core.profiles import step_profile_path
    from planner.costmodel.netcurve import save_network_profile
    from profiler.importer import (SAILOR_SEQ, import_layer_profiles, read_gpumix_profiles, read_sailor_network,
                                   read_sailor_profiles)

    if not args.profiles and not args.network:
        raise ValueError("nothing to import: give --profiles FILE and/or --network FILE")
    if args.network and args.format != "sailor":
        raise ValueError("--network reads Sailor's bandwidth files: use it with --format sailor")
    if len(args.network) > MAX_NETWORK_FILES:
        raise ValueError(f"at most {MAX_NETWORK_FILES} --network files, got {len(args.network)}")
    if args.format == "sailor" and args.profiles and not args.model:
        raise ValueError("--format sailor needs --model (Sailor's model name, e.g. OPT-350)")
    if args.format == "gpumix" and args.seq is not None:
        raise ValueError("--seq is for --format sailor; a gpumix file states its own seq")
    created = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    layers = spec = None
    if args.profiles:  # read and check everything before writing anything
        if args.format == "sailor":
            layers, spec = read_sailor_profiles(args.profiles, args.model, args.seq or SAILOR_SEQ)
        else:
            layers, spec = read_gpumix_profiles(args.profiles, args.model)
    networks = [read_sailor_network(path) for path in args.network]
    rows = []
    if layers is not None:
        for f in import_layer_profiles(layers, spec, created=created):
            p = f.profile
            rows.append({"device_type": p.device_type, "model": p.model, "seq": p.seq, "dtype": p.dtype, "tp": p.tp,
                         "micro_batches": list(p.micro_batches), "alpha_s": p.alpha_s, "beta_s": p.beta_s,
                         "r2": p.r2, "optimizer_s_per_param": p.optimizer_s_per_param,
                         "path": step_profile_path(p.device_type, p.model, p.seq, p.dtype, p.recompute, tp=p.tp)})
    net_rows = []
    for profile in networks:
        net_rows.append({"name": profile.name, "kind": profile.kind, "num_curves": len(profile.curves),
                         "source": profile.source, "path": save_network_profile(profile)})
    if args.json:
        print_json({"profiles": rows, "network": net_rows, "source": layers.source if layers else None})
        return 0
    if rows:
        print(f"source: {layers.source}")
        print_table([{**r, "micro_batches": ",".join(str(m) for m in r["micro_batches"])} for r in rows],
                    ["device_type", "tp", "micro_batches", "alpha_s", "beta_s", "r2", "optimizer_s_per_param"])
        print(f"{len(rows)} step profile(s) of {spec.name} (seq {layers.seq}, {layers.dtype}) written to the store")
    for r in net_rows:
        print(f"network profile {r['name']} ({r['kind']}, {r['num_curves']} curves) written to {r['path']}")
    return 0
