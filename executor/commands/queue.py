"""`python -m executor queue [--json]`: the local job queue."""
from __future__ import annotations

import argparse
import time

HELP = "list the jobs of the local queue (queued, running, done, failed, cancelled)"
COLUMNS = ("id", "state", "model", "global_batch", "seq", "steps", "devices", "submitted", "run_dir", "reason")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--state", action="append", help="only jobs in this state (repeatable)")
    p.add_argument("--json", action="store_true", help='one JSON object: {"jobs": [...]}')


def run(args: argparse.Namespace) -> int:
    from executor.queue import JobQueue
    from contracts.cli import print_json, print_table

    jobs = JobQueue().list(args.state)
    if args.json:
        print_json({"jobs": [j.to_dict() for j in jobs]})
        return 0
    rows = [{**j.to_dict(), "devices": ",".join(map(str, j.devices)),
             "submitted": time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(j.submitted_s)),
             "run_dir": j.run_dir or "", "reason": j.reason or ""} for j in jobs]
    print_table(rows, COLUMNS)
    return 0
