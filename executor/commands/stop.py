"""`python -m executor stop --run-dir R [--timeout S]`: stop a running run (its launcher, torchrun and
ranks). Only processes verified as the run's are signalled (executor.launch.stop_run): a run recorded
on another host is asked through the store and refused if it does not answer; a recorded pid that is
now another process is refused (exit 2, one line)."""
from __future__ import annotations

import argparse

HELP = "stop a running run: torchrun's group and every rank; status becomes 'stopped'"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--run-dir", required=True)
    p.add_argument("--timeout", type=float, default=30.0,
                   help="seconds the launcher has to end the run before it is killed (another host's: refused)")


def run(args: argparse.Namespace) -> int:
    from executor.launch import stop_run

    if not args.timeout > 0 or args.timeout == float("inf"):
        raise ValueError(f"--timeout must be a positive number of seconds, got {args.timeout}")
    print(f"run {args.run_dir}: {stop_run(args.run_dir, timeout_s=args.timeout)}")
    return 0
