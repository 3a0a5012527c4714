"""`python -m executor submit --model M --global-batch B --steps N [--seq S] [--cluster C]`: queue a job
after planning it against the pool (a job no device set of the pool can run exits 2, nothing queued)."""
from __future__ import annotations

import argparse

HELP = "queue a training job for the local orchestrator (GPUMix picks the devices); prints its id"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="preset name or config.json path")
    p.add_argument("--global-batch", type=int, required=True)
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--seq", type=int, default=None, help="tokens per sample (default: the model's, at most 2048)")
    p.add_argument("--priority", type=int, default=0, help="higher runs first among otherwise equal jobs")
    p.add_argument("--cluster", help="cluster JSON of the pool (default: this machine's detected inventory)")
    p.add_argument("--json", action="store_true", help="one JSON object: the queued job")


def run(args: argparse.Namespace) -> int:
    from contracts.cli import print_json
    from contracts.cluster import ClusterSpec
    from executor.orchestrator import local_cluster
    from executor.queue import JobQueue, job_spec_of
    from planner.schedule.frenzy import check_runnable

    job = job_spec_of(args.model, args.global_batch, args.steps, seq=args.seq, priority=args.priority)
    # planned against the pool before it is queued: what no device set can run is refused here
    check_runnable(job, ClusterSpec.load(args.cluster) if args.cluster else local_cluster())
    queue = JobQueue()
    job_id = queue.submit(job.model, job.global_batch, job.steps, seq=job.seq, priority=job.priority)
    if args.json:
        print_json(queue.get(job_id).to_dict())
    else:
        print(job_id)
    return 0
