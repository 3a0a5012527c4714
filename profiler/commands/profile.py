"""`python -m profiler profile --model M --seq S [--json]`: measure the step-time profile
(forward+backward at several micro-batch sizes, fitted to α + β·m, and the optimizer step)
of a model on a local device, with the executor's code path, and save it to the store.

`--cpu-share S [--memory-gb G]`: profile an emulated CPU device of the cluster file under its
own cgroup limits (profiler/step_profile.py), saved under its kind (`cpu@shareS`)."""
from __future__ import annotations

import argparse
import logging

from contracts.cli import device_arg, float_arg, int_arg, print_json, print_table
from contracts.constants import PROFILE_MICRO_BATCHES
from planner.core.memory_command import MAX_SEQ

HELP = "measure forward+backward time vs micro-batch (alpha + beta*m) on a local device"

log = logging.getLogger(__name__)


MAX_MICRO_BATCH = 4096  # one timed step of more samples than this is not a profile, it is a hang
MAX_SIZES = 16
MAX_REPEATS = 1000
MAX_WORKERS = 256


def _sizes(text: str) -> tuple[int, ...]:
    try:
        sizes = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not sizes or len(sizes) > MAX_SIZES or any(not 1 <= m <= MAX_MICRO_BATCH for m in sizes):
        raise argparse.ArgumentTypeError(f"expected 1 to {MAX_SIZES} sizes in [1, {MAX_MICRO_BATCH}], got {text!r}")
    return sizes


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="preset name or path to a config.json")
    p.add_argument("--seq", type=int_arg(1, MAX_SEQ), default=128, help="sequence length (default 128)")
    p.add_argument("--dtype", choices=("fp32", "bf16", "fp16"), default="fp32")
    p.add_argument("--recompute", choices=("none", "full"), default="none")
    p.add_argument("--micro-batches", type=_sizes, default=PROFILE_MICRO_BATCHES, metavar="M1,M2,...",
                   help="micro-batch sizes to time (at least 4; default 4,8,16,32)")
    p.add_argument("--repeats", type=int_arg(1, MAX_REPEATS), default=5, help="timed repeats per size (median; default 5)")
    p.add_argument("--device", type=device_arg, help="torch device (default: cuda if present, else cpu)")
    p.add_argument("--workers", type=int_arg(1, MAX_WORKERS), default=1,
                   help="local CPU workers that will train at once on this machine: time with that many "
                        "concurrent processes, by wall time (default 1: one process, thread CPU time)")
    p.add_argument("--cpu-share", type=float_arg(0.0, 1.0, low_open=True), default=None, metavar="S",
                   help="emulated CPU device: profile under a CPU quota of S cores (0 < S <= 1, cgroup v1)")
    p.add_argument("--memory-gb", type=float_arg(0.0, 1e6, low_open=True), default=None, metavar="G",
                   help="emulated CPU device: profile under a memory limit of baseline + G GiB (cgroup v1)")
    p.add_argument("--companion-cpu-share", type=float_arg(0.0, 1.0, low_open=True), default=None, metavar="S",
                   help="with --workers > 1: each companion worker under a CPU quota of S cores")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--no-save", action="store_true", help="do not write the profile store")


def _check(args: argparse.Namespace) -> None:
    """Before torch: the model, its positions, distinct sizes, and memory for the largest size."""
    from planner.core.memory import MemoryConfig
    from contracts.specs import get_model
    from profiler.commands._checks import require_fits_in_memory

    spec = get_model(args.model)
    if args.seq > spec.max_seq and spec.positional == "learned":
        raise ValueError(f"--seq {args.seq} exceeds {spec.name}'s {spec.max_seq} learned positions")
    if len(set(args.micro_batches)) < 4:
        raise ValueError(f"--micro-batches needs at least 4 distinct sizes, got {list(args.micro_batches)}")
    cfg = MemoryConfig(micro_batch=max(args.micro_batches), seq=args.seq, dtype=args.dtype, recompute=args.recompute)
    require_fits_in_memory(spec, cfg, "--micro-batches/--seq")


def run(args: argparse.Namespace) -> int:
    _check(args)
    from planner.core.profiles import step_profile_path
    from profiler.commands._checks import require_device
    from profiler.step_profile import profile_local  # torch: only when the command runs

    require_device(args.device)

    def progress(fraction: float, message: str) -> None:
        log.info("%3.0f%% %s", 100 * fraction, message)

    p = profile_local(args.model, args.seq, args.dtype, args.micro_batches, args.recompute, repeats=args.repeats,
                      device=args.device, progress=progress, save=not args.no_save, workers=args.workers,
                      cpu_share=args.cpu_share, memory_gb=args.memory_gb,
                      companion_cpu_share=args.companion_cpu_share)
    path = None if args.no_save else step_profile_path(p.device_type, p.model, p.seq, p.dtype, p.recompute)
    if args.json:
        out = p.to_dict()
        out["store_path"] = path
        print_json(out)
        return 0
    print(f"{p.model} on {p.device_type}, seq {p.seq}, {p.dtype}, recompute {p.recompute} — {p.kind}")
    print_table([{"micro_batch": m, "measured_s": t, "fit_s": p.step_time_s(m)}
                 for m, t in zip(p.micro_batches, p.step_times_s)])
    print(f"alpha = {p.alpha_s * 1e3:.3f} ms, beta = {p.beta_s * 1e3:.3f} ms/sample, R² = {p.r2:.4f}")
    print(f"FLOPs/sample (counted) = {p.flops_per_sample:.4g}, achieved {p.achieved_tflops:.3g} TFLOP/s"
          + (f" = {p.efficiency:.2f} of peak {p.peak_tflops:.3g}" if p.efficiency else ""))
    print(f"optimizer step: {p.optimizer_s_per_param * 1e9:.3f} ns/parameter")
    if path:
        print(f"saved to {path}")
    return 0
