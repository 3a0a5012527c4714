"""`python -m executor orchestrate [--once]`: start queued jobs on this machine's devices."""
from __future__ import annotations

import argparse

HELP = "run the local scheduler loop: queued jobs -> free local devices -> real runs"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--once", action="store_true", help="one pass, then exit")
    p.add_argument("--poll-s", type=float, default=2.0, help="seconds between passes")
    p.add_argument("--cluster", help="cluster JSON of this machine (default: the detected inventory)")
    p.add_argument("--json", action="store_true", help="with --once: one JSON object, what the pass changed")


def run(args: argparse.Namespace) -> int:
    from executor.orchestrator import Orchestrator
    from planner.cli import print_json
    from planner.core.cluster import ClusterSpec

    if not 0 < args.poll_s < float("inf"):
        raise ValueError(f"--poll-s must be positive, got {args.poll_s}")
    orch = Orchestrator(cluster=ClusterSpec.load(args.cluster) if args.cluster else None)
    if args.once:
        report = orch.tick()
        if args.json:
            print_json(report.to_dict())
        else:
            print(f"started {report.started or 'none'}; finished "
                  f"{[f'{i}:{s}' for i, s in report.finished] or 'none'}" + (" (another pass held the lock)"
                                                                              if report.skipped else ""))
        return 0
    print(f"orchestrating {orch.cluster.num_devices} local devices every {args.poll_s:g} s (Ctrl-C stops)")
    orch.run_forever(args.poll_s)
    return 0
