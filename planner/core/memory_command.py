"""`python -m planner memory`: the predicted per-GPU peak memory of a training step.

The same flags serve `python -m profiler memory` (the traced figure), so the two print
comparable tables and JSON objects.
"""
from __future__ import annotations

import argparse
from typing import Any

from contracts.cli import float_arg, int_arg, print_json, print_table
from contracts.constants import DTYPES, MODELLED_ZERO_STAGES, RECOMPUTE
from planner.core.memory import MemoryBreakdown, MemoryConfig, estimate_memory, estimate_startup_bytes
from contracts.specs import ModelSpec, get_model
from contracts.constants import GIB

HELP = "predict the per-GPU peak memory of one training step (params, grads, AdamW, activations)"
# Bounds at the door (not the model's limits, which config_from_args checks with the spec):
# past these no GPU or cluster exists, and the arithmetic would only describe a typo.
MAX_MICRO_BATCH_ARG = 10**6
MAX_ACCUM_STEPS = 10**6
MAX_SEQ = 10**7
MAX_DEGREE = 10**6
KEYS = ("params_bytes", "grads_bytes", "optimizer_bytes", "activations_bytes", "other_bytes", "peak_bytes")


def add_memory_arguments(p: argparse.ArgumentParser) -> None:
    """The model and step flags shared with `python -m profiler memory`."""
    p.add_argument("--model", required=True, help="preset name or path to a Hugging Face config.json")
    p.add_argument("--micro-batch", type=int_arg(1, MAX_MICRO_BATCH_ARG), default=1, help="samples per micro-batch on this GPU")
    p.add_argument("--accum-steps", type=int_arg(1, MAX_ACCUM_STEPS), default=1,
                   help="micro-batches per optimizer step (at zero 2/3 their unit boundaries are all held)")
    p.add_argument("--seq", type=int_arg(1, MAX_SEQ), default=None, help="sequence length (default: the model's max_seq)")
    p.add_argument("--dtype", choices=DTYPES, default="fp32", help="fp32, or bf16/fp16 autocast with fp32 master weights")
    p.add_argument("--recompute", choices=RECOMPUTE, default="none", help="full: recompute every block in backward")
    p.add_argument("--dp", type=int_arg(1, MAX_DEGREE), default=1, help="data-parallel degree (world size)")
    p.add_argument("--tp", type=int_arg(1, MAX_DEGREE), default=1, help="tensor-parallel degree (analytic)")
    p.add_argument("--pp", type=int_arg(1, MAX_DEGREE), default=1, help="pipeline-parallel degree (analytic)")
    p.add_argument("--zero", type=int, choices=MODELLED_ZERO_STAGES, default=None,
                   help="ZeRO stage (default: 1 when dp > 1 or --shard-fraction is given, the runtime's; else 0)")
    p.add_argument("--shard-fraction", type=float_arg(0.0, 1.0, low_open=True), default=None,
                   help="share of the sharded state on this GPU, in (0, 1] (default 1/dp)")
    p.add_argument("--json", action="store_true", help="print one JSON object")


add_arguments = add_memory_arguments  # contracts/cli.py's sub-command interface


def config_from_args(args: argparse.Namespace, spec: ModelSpec | None = None) -> MemoryConfig:
    """The MemoryConfig the flags describe; ValueError (one line naming the flag) for a
    combination no real run has. With `spec`, also the limits the model sets (heads, layers,
    positions)."""
    f = args.shard_fraction
    if f is not None and not (0.0 < f <= 1.0):
        raise ValueError(f"--shard-fraction must be in (0, 1], got {f}")
    zero = args.zero
    if zero is None:
        zero = 1 if (args.dp > 1 or (f is not None and f < 1.0)) else 0
    if args.dp == 1 and f is not None and f < 1.0:
        raise ValueError(f"--shard-fraction {f} with --dp 1: a lone GPU holds the whole state (give --dp)")
    if f is not None and zero == 0:
        raise ValueError(f"--shard-fraction {f} with --zero 0: zero 0 keeps the whole state on every GPU")
    if args.micro_batch < 1:
        raise ValueError(f"--micro-batch must be >= 1, got {args.micro_batch}")
    if spec is not None:
        _check_against_model(args, spec)
    return MemoryConfig(micro_batch=args.micro_batch, accum_steps=args.accum_steps, seq=args.seq, dtype=args.dtype,
                        recompute=args.recompute, dp=args.dp, tp=args.tp, pp=args.pp, zero=zero, shard_fraction=f)


def _check_against_model(args: argparse.Namespace, spec: ModelSpec) -> None:
    """Parallel degrees and a length the model cannot have: tp splits the attention heads (and
    the KV heads), pp the layers; learned positions stop at max_seq."""
    if spec.num_heads % args.tp or spec.num_kv_heads % args.tp:
        raise ValueError(f"--tp {args.tp} must divide {spec.name}'s {spec.num_heads} attention heads "
                         f"and {spec.num_kv_heads} KV heads")
    if args.pp > spec.num_layers:
        raise ValueError(f"--pp {args.pp} exceeds {spec.name}'s {spec.num_layers} layers (one stage needs a layer)")
    if args.seq is not None and args.seq > spec.max_seq and spec.positional == "learned":
        raise ValueError(f"--seq {args.seq} exceeds {spec.name}'s {spec.max_seq} learned positions")


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
    cfg = config_from_args(args, spec)
    result = breakdown_dict(spec.name, cfg, estimate_memory(spec, cfg))
    if cfg.tp == 1 and cfg.pp == 1:
        result["startup_peak_bytes"] = estimate_startup_bytes(spec, cfg)
    result["measured"] = False
    if args.json:
        print_json(result)
    else:
        print_breakdown(result, "predicted")
    return 0
