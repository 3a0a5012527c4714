"""`python -m planner plan`: the fastest heterogeneous plan of a model on a cluster (planner/entry.py).

The `--json` output is itself a plan file (Plan.to_dict()); `--out P` also writes it there.
On a cluster of two or more nodes pipeline stages are priced beside the ILP's data-parallel plan
(planner/geo/cluster_plan.py) and the faster is written; its notes and baselines say both times,
and a chosen pipeline plan carries its `pipeline` section. `--no-pipeline` keeps data parallelism.
Every other caller (dashboard, queue) plans through the same `planner.entry.plan_job`.
"""
from __future__ import annotations

import argparse

from contracts.cli import print_json, print_table
from contracts.cluster import ClusterSpec
from contracts.constants import DTYPES, GIB, MEMORY_HEADROOM, RECOMPUTE
from contracts.plan import REDUCE_DTYPES, Plan
from contracts.jsonio import save_json_file
from planner.entry import DEFAULT_TIME_LIMIT_S, plan_job
from planner.geo.scale.job import DEFAULT_MAX_TP
from planner.geo.scale.search import TP_DEGREES
from planner.hetero.solve import PARAM_DTYPE_CHOICES, ZERO_AUTO, ZERO_CHOICES

HELP = "choose per-device micro-batch, accumulation steps and state shard (Cephalo's ILP)"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--cluster", required=True, help="cluster JSON file")
    p.add_argument("--model", required=True, help="preset name or path to a Hugging Face config.json")
    p.add_argument("--global-batch", type=int, required=True, help="samples per optimizer step")
    p.add_argument("--seq", type=int, default=None, help="sequence length (default: the model's, at most 2048)")
    p.add_argument("--dtype", choices=DTYPES, default="fp32")
    p.add_argument("--recompute", choices=RECOMPUTE, default="none")
    p.add_argument("--zero", choices=[str(z) for z in ZERO_CHOICES], default=ZERO_AUTO,
                   help="ZeRO stage the runtime runs: 1 optimizer state sharded, 2 + gradients, 3 + parameters; "
                        "auto (default): the fastest predicted stage that fits")
    p.add_argument("--param-dtype", choices=PARAM_DTYPE_CHOICES, default=PARAM_DTYPE_CHOICES[0],
                   help="dtype zero 3 gathers parameters in (master shards and AdamW state stay fp32); auto "
                        "(default): the compute dtype at zero 3, fp32 at zero 1/2; fp16 needs --dtype fp16")
    p.add_argument("--reduce-dtype", choices=REDUCE_DTYPES, default=REDUCE_DTYPES[0],
                   help="dtype gradients are reduce-scattered in: fp32 (default), or bf16 allowed (the planner "
                        "takes it unless fp32 is faster)")
    p.add_argument("--headroom", type=float, default=MEMORY_HEADROOM,
                   help="use at most this share of each device's memory")
    p.add_argument("--time-limit", type=float, default=DEFAULT_TIME_LIMIT_S, help="solver time limit (s)")
    p.add_argument("--no-pipeline", action="store_true",
                   help="do not price pipeline stages on a multi-node cluster (pure data parallelism)")
    p.add_argument("--max-tp", type=int, choices=TP_DEGREES, default=DEFAULT_MAX_TP,
                   help="the largest tensor-parallel degree the joint search of large clusters (7+ nodes) tries "
                        f"(default {DEFAULT_MAX_TP}: plans that checkpoint and resume; a faster tp > 1 plan is "
                        "written as the plan file, marked tensor_parallel: executor launch runs it at zero 1, "
                        "without checkpoints)")
    p.add_argument("--json", action="store_true", help="print the plan file as one JSON object")
    p.add_argument("--out", metavar="P", help="also write the plan file here")


def print_plan(plan: Plan) -> None:
    """The per-device table (predicted figures) and the summary lines."""
    print(f"plan for {plan.model} on {plan.cluster.name}: global batch {plan.global_batch}, seq {plan.seq}, "
          f"{plan.dtype}, recompute {plan.recompute}, zero {plan.zero}, parameters gathered in {plan.param_dtype}, "
          f"gradients reduced in {plan.reduce_dtype}, prefetch {plan.prefetch}, {plan.reduce_in_flight} reduce-scatter "
          "left in flight (all figures predicted)")
    devices = plan.cluster.devices()
    stage_of = {}
    if plan.pipeline is not None:
        stage_of = {d: s for s, st in enumerate(plan.pipeline.stages) for d in st.devices}
    rows = [{"device": a.device_index, "node": a.node, "type": devices[a.device_index][1].label,
             **({"stage": stage_of.get(a.device_index, "-")} if stage_of else {}),
             "micro_batch": a.micro_batch, "accum_steps": a.accum_steps, "batch": a.batch,
             "shard_fraction": round(a.shard_fraction, 4),
             "memory_GiB": round(a.predicted_memory_bytes / GIB, 2),
             "capacity_GiB": round(devices[a.device_index][1].memory_bytes / GIB, 2),
             "step_s": a.predicted_step_s if a.used else "unused"} for a in plan.assignments]
    print_table(rows)
    print(f"predicted iteration: {plan.predicted_iteration_s:.4g} s, {plan.predicted_samples_per_s:.4g} samples/s "
          f"(solved in {plan.solve_s:.3f} s)")
    if plan.predicted_wire_bytes_per_step is not None:
        print(f"predicted network: {plan.predicted_wire_bytes_per_step / GIB:.4g} GiB per step (all ranks), "
              f"{plan.predicted_exposed_comm_s:.4g} s of it not hidden by compute on the slowest rank")
    for z, c in sorted(plan.zero_candidates.items()):
        t = "-" if c.predicted_iteration_s is None else f"{c.predicted_iteration_s:.4g} s/iteration"
        print(f"  zero {z}: {t}{f' ({c.note})' if c.note else ''}")
    for name, b in plan.baselines.items():
        if b.oom:
            print(f"  {name}: out of memory ({b.note})")
        else:
            print(f"  {name}: {b.predicted_iteration_s:.4g} s/iteration, "
                  f"plan is {b.predicted_iteration_s / plan.predicted_iteration_s:.2f}x faster ({b.note})")
    for note in plan.notes:
        print(f"note: {note}")


def run(args: argparse.Namespace) -> int:
    cluster = ClusterSpec.load(args.cluster)
    result = plan_job(cluster, args.model, args.global_batch, seq=args.seq, dtype=args.dtype,
                      recompute=args.recompute, headroom=args.headroom, time_limit_s=args.time_limit,
                      zero=args.zero if args.zero == ZERO_AUTO else int(args.zero), pipeline=not args.no_pipeline,
                      param_dtype=args.param_dtype, reduce_dtype=args.reduce_dtype, max_tp=args.max_tp)
    plan = result.plan
    if args.out:
        save_json_file(args.out, result.plan_dict())
    if args.json:
        print_json(result.plan_dict())
    else:
        print_plan(plan)
        if result.plan_file is not None and result.plan_file.get("tensor_parallel"):
            print(f"note: a plan with tensor parallelism is faster "
                  f"({result.plan_file['predicted_iteration_s']:.4g} s/iteration); it is the plan file written "
                  "(--out / --json), marked tensor_parallel: executor launch runs it (zero 1, no checkpoints)")
        if result.status != "optimal":
            print(f"note: the plan is feasible, {result.reason}")
        if args.out:
            print(f"plan written to {args.out}")
    return 0
