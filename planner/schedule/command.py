"""`python -m planner schedule`: replay a job trace on a cluster under a scheduling policy."""
from __future__ import annotations

import argparse

from contracts.cli import float_arg, int_arg, print_json, print_table
from contracts.cluster import ClusterSpec
from contracts.constants import DTYPES
from planner.schedule.simulate import ERROR_SIGMA, MAX_ERROR_SIGMA, POLICIES, POLICY_TABLE, simulate_schedule
from contracts.jsonio import check_file_size
from planner.schedule.trace import MAX_TRACE_JOBS, generate_trace, load_trace, save_trace

HELP = ("simulate a job trace (CSV, or --generate) on a cluster under a scheduling policy (gpumix, frenzy, "
        "baselines); jobs may run on mixed-type gangs unless --no-mixed")
MAX_LOAD = 1000.0  # requested GPU-seconds per device-second: past this the queue only grows
SUMMARY_KEYS = ("policy", "num_jobs", "num_failed", "avg_jct_s", "p99_jct_s", "makespan_s", "gpu_utilization",
                "scheduling_overhead_ms_per_job", "num_restarts", "num_mixed_gang_jobs")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--cluster", required=True, help="cluster JSON file")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--trace", help="job trace CSV: job_id,submit_s,model,global_batch,seq,steps,requested_type,requested_gpus")
    src.add_argument("--generate", type=int_arg(0, 2**63 - 1), metavar="SEED", help="generate a trace with this seed instead")
    p.add_argument("--num-jobs", type=int_arg(1, MAX_TRACE_JOBS), default=200, help="jobs to generate (with --generate)")
    p.add_argument("--load", type=float_arg(0.0, MAX_LOAD, low_open=True), default=0.6,
                   help="with --generate: requested GPU-seconds per device-second of the trace's span")
    p.add_argument("--save-trace", metavar="CSV", help="with --generate: also write the trace here")
    p.add_argument("--policy", choices=POLICIES, default="gpumix",
                   help="; ".join(f"{name}: {what}" for name, (what, _) in POLICY_TABLE.items()))
    p.add_argument("--no-mixed", action="store_true",
                   help="one pool per job for every policy (the ablation of mixed-type gangs)")
    p.add_argument("--error-sigma", type=float_arg(0.0, MAX_ERROR_SIGMA), default=ERROR_SIGMA,
                   help="sigma of the lognormal error between predicted and simulated durations (0: exact predictions)")
    p.add_argument("--error-seed", type=int_arg(0, 2**63 - 1), default=0,
                   help="seed of the duration errors (the same seed gives every policy the same errors)")
    p.add_argument("--dtype", choices=DTYPES, default="bf16")
    p.add_argument("--json", action="store_true", help="one JSON object, per-job rows included")


def run(args: argparse.Namespace) -> int:
    check_file_size(args.cluster, "cluster file")  # a huge file is refused before it is read
    cluster = ClusterSpec.load(args.cluster)
    if args.trace:
        jobs = load_trace(args.trace)
    else:
        jobs = generate_trace(args.generate, args.num_jobs, cluster, load=args.load, dtype=args.dtype)
        if args.save_trace:
            try:
                save_trace(jobs, args.save_trace)
            except OSError as e:
                raise ValueError(f"cannot write --save-trace {args.save_trace}: {e.strerror}") from None
    result = simulate_schedule(jobs, cluster, args.policy, dtype=args.dtype, error_sigma=args.error_sigma,
                               error_seed=args.error_seed, mixed=not args.no_mixed)
    if args.json:
        print_json(result.to_dict(jobs=True))
        return 0
    summary = result.to_dict(jobs=False)
    print(f"{result.policy} on {cluster.name} ({cluster.num_devices} devices), {len(jobs)} jobs "
          f"— decisions on predicted times, runs simulated with a seeded error (sigma {args.error_sigma}, "
          f"seed {args.error_seed}), decision overhead measured (CPU time)")
    print_table([{k: summary[k] for k in SUMMARY_KEYS}])
    return 0
