"""`python -m profiler memory`: the traced per-GPU peak of one real training step.

Same flags as `python -m planner memory` plus `--fake` (FakeTensorMode: shapes only, so
7B-class models trace on a laptop); same keys, plus `measured: true`.
"""
from __future__ import annotations

import argparse

from contracts.cli import int_arg, print_json
from planner.core.memory_command import add_memory_arguments, breakdown_dict, config_from_args, print_breakdown
from contracts.specs import get_model
from profiler.commands._checks import require_fits_in_memory

HELP = "trace the per-GPU peak memory of one training step of the project's model code (MemTracker)"


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_memory_arguments(p)
    p.add_argument("--fake", action="store_true", help="trace under FakeTensorMode (no real memory or data)")
    p.add_argument("--seed", type=int_arg(0, 2**32 - 1), default=0, help="torch seed for the model and the batch")


def run(args: argparse.Namespace) -> int:
    spec = get_model(args.model)
    cfg = config_from_args(args, spec)
    if not args.fake:  # a real trace allocates the step: refuse one this machine cannot hold
        require_fits_in_memory(spec, cfg, "--model/--micro-batch/--seq", " (trace it with --fake)")
    from profiler.tracing import trace_memory  # torch: only when the command runs

    traced = trace_memory(spec, cfg, fake=args.fake, seed=args.seed)
    result = breakdown_dict(spec.name, cfg, traced)
    if args.json:
        print_json(result)
    else:
        print_breakdown(result, "traced (measured, fake tensors)" if args.fake else "traced (measured)")
    return 0
