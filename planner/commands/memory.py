"""`python -m planner memory`: the predicted per-GPU peak memory of a training step (issue 2).

The same flags serve `python -m profiler memory` (the traced figure), so the two print
comparable tables and JSON objects.
"""
from __future__ import annotations

import argparse
from typing import Any

from planner.cli import print_json, print_table
from planner.memory import DTYPES, RECOMPUTE, ZERO_STAGES, MemoryBreakdown, MemoryConfig, estimate_memory, estimate_startup_bytes
from planner.specs import get_model

HELP = "predict the per-GPU peak memory of one training step (params, grads, AdamW, activations)"
GIB = 2**30
KEYS = ("params_bytes", "grads_bytes", "optimizer_bytes", "activations_bytes", "other_bytes", "peak_bytes")


def add_memory_arguments(p: argparse.ArgumentParser) -> None:
    """The model and step flags shared with `python -m profiler memory`."""
    p.add_argument("--model", required=True, help="preset name or path to a Hugging Face config.json")
    p.add_argument("--micro-batch", type=int, default=1, help="samples per micro-batch on this GPU")
    p.add_argument("--accum-steps", type=int, default=1,
                   help="micro-batches per optimizer step (at zero 2/3 their unit boundaries are all held)")
    p.add_argument("--seq", type=int, default=None, help="sequence length (default: the model's max_seq)")
    p.add_argument("--dtype", choices=DTYPES, default="fp32", help="fp32, or bf16/fp16 autocast with fp32 master weights")
    p.add_argument("--recompute", choices=RECOMPUTE, default="none", help="full: recompute every block in backward")
    p.add_argument("--dp", type=int, default=1, help="data-parallel degree (world size)")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel degree (analytic)")
    p.add_argument("--pp", type=int, default=1, help="pipeline-parallel degree (analytic)")
    p.add_argument("--zero", type=int, choices=ZERO_STAGES, default=None,
                   help="ZeRO stage (default: 1 when dp > 1 or --shard-fraction is given, the runtime's; else 0)")
    p.add_argument("--shard-fraction", type=float, default=None,
                   help="share of the sharded state on this GPU, in (0, 1] (default 1/dp)")
    p.add_argument("--json", action="store_true", help="print one JSON object")


add_arguments = add_memory_arguments  # planner/cli.py's sub-command interface


def config_from_args(args: argparse.Namespace) -> MemoryConfig:
    f = args.shard_fraction
    if f is not None and not (0.0 < f <= 1.0):
        raise ValueError(f"--shard-fraction must be in (0, 1], got {f}")
    zero = args.zero
    if zero is None:
        zero = 1 if (args.dp > 1 or (f is not None and f < 1.0)) else 0
    if args.dp == 1 and f is not None and f < 1.0:
        raise ValueError(f"--shard-fraction {f} with --dp 1: a lone GPU holds the whole state (give --dp)")
    if args.micro_batch < 1:
        raise ValueError(f"--micro-batch must be >= 1, got {args.micro_batch}")
    return MemoryConfig(micro_batch=args.micro_batch, accum_steps=args.accum_steps, seq=args.seq, dtype=args.dtype,
                        recompute=args.recompute, dp=args.dp, tp=args.tp, pp=args.pp, zero=zero, shard_fraction=f)


def print_breakdown(result: dict[str, Any], kind: str) -> None:
    """The human-readable table: one row per component, bytes and GiB."""
    print(f"{result['model']}: {result['num_params']:,} parameters, {kind} per-GPU peak of one training step")
    print_table([{"component": k.removesuffix("_bytes"), "bytes": result[k], "GiB": round(result[k] / GIB, 4)}
                 for k in KEYS])


def breakdown_dict(model: str, cfg: MemoryConfig, b: MemoryBreakdown | dict[str, Any]) -> dict[str, Any]:
    d = b.to_dict() if isinstance(b, MemoryBreakdown) else dict(b)
    return {"model": model, **d, "config": cfg.to_dict()}


def run(args: argparse.Namespace) -> int:
    spec = get_model(args.model)
    cfg = config_from_args(args)
    result = breakdown_dict(spec.name, cfg, estimate_memory(spec, cfg))
    if cfg.tp == 1 and cfg.pp == 1:
        result["startup_peak_bytes"] = estimate_startup_bytes(spec, cfg)
    result["measured"] = False
    if args.json:
        print_json(result)
    else:
        print_breakdown(result, "predicted")
    return 0
