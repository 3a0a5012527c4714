"""`python -m planner evaluate`: recompute a plan file's predictions with the current cost model (a pipeline
plan's with planner/geo/emulated.py, as `planner geo --out` and `planner plan` wrote them; its baselines kept)."""
from __future__ import annotations

import argparse

from contracts.cli import print_json
from contracts.constants import MEMORY_HEADROOM
from contracts.plan import Plan
from planner.hetero.plan_command import print_plan
from planner.hetero.solve import evaluate_plan

HELP = "recompute a plan file's predicted memory, step and iteration times and baselines"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--plan", required=True, help="plan file (python -m planner plan --out P)")
    p.add_argument("--headroom", type=float, default=MEMORY_HEADROOM, help="memory share the capacity check allows")
    p.add_argument("--json", action="store_true", help="print the re-evaluated plan file as one JSON object")


def run(args: argparse.Namespace) -> int:
    if not 0 < args.headroom <= 1:
        raise ValueError(f"headroom must be in (0, 1], got {args.headroom}")
    plan = Plan.load(args.plan)
    if plan.pipeline is not None:  # a pipeline plan: re-predicted as the runtime runs it (planner/geo/emulated.py)
        from planner.geo.plan_file import evaluate_pipeline_plan

        plan = evaluate_pipeline_plan(plan, headroom=args.headroom)
    else:
        plan = evaluate_plan(plan, headroom=args.headroom)
    if args.json:
        print_json(plan.to_dict())
    else:
        print_plan(plan)
    return 0
