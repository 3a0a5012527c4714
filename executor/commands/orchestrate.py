"""`python -m executor orchestrate [--once] [--backend local|slurm ...]`: start queued jobs on
this machine's devices (local) or on a SLURM cluster's (slurm: SLURM's job states are the truth)."""
from __future__ import annotations

import argparse

HELP = "run the scheduler loop: queued jobs -> free devices (this machine's, or SLURM's) -> real runs"


def add_arguments(p: argparse.ArgumentParser) -> None:
    from executor.commands.launch import add_backend_arguments

    p.add_argument("--once", action="store_true", help="one pass, then exit")
    p.add_argument("--poll-s", type=float, default=2.0, help="seconds between passes")
    p.add_argument("--cluster", help="cluster JSON of the pool (default: the detected inventory; with "
                                     "--backend slurm: `profiler inventory --slurm` now)")
    p.add_argument("--json", action="store_true", help="with --once: one JSON object, what the pass changed")
    add_backend_arguments(p)


def run(args: argparse.Namespace) -> int:
    from executor.orchestrator import Orchestrator, SlurmOrchestrator
    from contracts.cli import print_json
    from contracts.cluster import ClusterSpec

    if not 0 < args.poll_s < float("inf"):
        raise ValueError(f"--poll-s must be positive, got {args.poll_s}")
    cluster = ClusterSpec.load(args.cluster) if args.cluster else None
    if args.backend == "slurm":
        from executor.commands.launch import slurm_settings

        orch = SlurmOrchestrator(cluster=cluster, settings=slurm_settings(args))
    else:
        orch = Orchestrator(cluster=cluster)
    if args.once:
        report = orch.tick()
        if args.json:
            print_json(report.to_dict())
        else:
            print(f"started {report.started or 'none'}; finished "
                  f"{[f'{i}:{s}' for i, s in report.finished] or 'none'}" + (" (another pass held the lock)"
                                                                              if report.skipped else ""))
        return 0
    where = f"SLURM cluster {orch.cluster.name}" if args.backend == "slurm" else "local"
    print(f"orchestrating {orch.cluster.num_devices} {where} devices every {args.poll_s:g} s (Ctrl-C stops)",
          flush=True)
    orch.run_forever(args.poll_s)
    return 0
