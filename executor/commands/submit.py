"""`python -m executor submit --model M --global-batch B --steps N [--seq S]`: queue a job."""
from __future__ import annotations

import argparse

HELP = "queue a training job for the local orchestrator (GPUMix picks the devices); prints its id"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="preset name or config.json path")
    p.add_argument("--global-batch", type=int, required=True)
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--seq", type=int, default=None, help="tokens per sample (default: the model's, at most 2048)")
    p.add_argument("--priority", type=int, default=0, help="higher runs first among otherwise equal jobs")
    p.add_argument("--json", action="store_true", help="one JSON object: the queued job")


def run(args: argparse.Namespace) -> int:
    from executor.queue import JobQueue
    from planner.cli import print_json

    queue = JobQueue()
    job_id = queue.submit(args.model, args.global_batch, args.steps, seq=args.seq, priority=args.priority)
    if args.json:
        print_json(queue.get(job_id).to_dict())
    else:
        print(job_id)
    return 0
