"""`python -m profiler profile --model M --seq S [--json]`: measure the step-time profile
(forward+backward at several micro-batch sizes, fitted to α + β·m, and the optimizer step)
of a model on a local device, with the executor's code path, and save it to the store.

`--plan P` (model, seq, dtype and recompute from the plan) or `--cluster C --model M`: the devices
that run will train on, profiled as it will train them, through the one path the Plan page uses
too (profiler/run_profile.py): the CPU devices all at once, each under its own limits, then the
collectives between them. `--cpu-share S [--memory-gb G]` with `--workers N`: the same for N
devices, one at S and N − 1 at `--companion-cpu-share` (default S); `--workers N` alone: N plain
CPU workers together. One device (the default): timed by itself.

`--plan` of a pipeline on CPU devices whose ranks run on this machine (`profiler.stage_run.stages_run_here`)
then runs the plan's stages together here and saves a stage profile per stage and replica kind
(profiler/stage_run.profile_plan_stages, what the Plan page's "Profile now" runs too; `--no-stages` skips
it, `--stage-steps N` sets its steps).

`--json` prints the profile object (StepProfile.to_dict() plus `store_path`) when one kind was
profiled, else `{"profiles": [...], "collectives_key"}`, with `"stages": [StageProfile.to_dict()]`
where the stages were profiled."""
from __future__ import annotations

import argparse
import logging

from contracts.cli import device_arg, float_arg, int_arg, print_json, print_table
from contracts.constants import PROFILE_MICRO_BATCHES
from planner.core.memory_command import MAX_SEQ

HELP = "measure forward+backward time vs micro-batch (alpha + beta*m) on a local device or a plan's devices"

log = logging.getLogger(__name__)


MAX_MICRO_BATCH = 4096  # one timed step of more samples than this is not a profile, it is a hang
MAX_SIZES = 16
MAX_REPEATS = 1000
MAX_WORKERS = 256
DEFAULT_SEQ = 128


def _sizes(text: str) -> tuple[int, ...]:
    try:
        sizes = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not sizes or len(sizes) > MAX_SIZES or any(not 1 <= m <= MAX_MICRO_BATCH for m in sizes):
        raise argparse.ArgumentTypeError(f"expected 1 to {MAX_SIZES} sizes in [1, {MAX_MICRO_BATCH}], got {text!r}")
    return sizes


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None,
                   help="preset name or path to a config.json (with --plan: the plan's)")
    p.add_argument("--plan", default=None, metavar="P",
                   help="a plan file: profile the devices it trains on, together, at its model, seq, dtype and "
                        "recompute")
    p.add_argument("--cluster", default=None, metavar="C",
                   help="a cluster file: profile all its devices together (a plan not made yet)")
    p.add_argument("--seq", type=int_arg(1, MAX_SEQ), default=None,
                   help=f"sequence length (default {DEFAULT_SEQ}; with --plan the plan's)")
    p.add_argument("--dtype", choices=("fp32", "bf16", "fp16"), default=None, help="default fp32 (--plan: the plan's)")
    p.add_argument("--recompute", choices=("none", "full"), default=None, help="default none (--plan: the plan's)")
    p.add_argument("--micro-batches", type=_sizes, default=PROFILE_MICRO_BATCHES, metavar="M1,M2,...",
                   help="micro-batch sizes to time (at least 4; default 1,2,4,8,16,32)")
    p.add_argument("--repeats", type=int_arg(1, MAX_REPEATS), default=5,
                   help="timed repeats per size (median; default 5)")
    p.add_argument("--device", type=device_arg, help="torch device (default: cuda if present, else cpu)")
    p.add_argument("--workers", type=int_arg(1, MAX_WORKERS), default=1,
                   help="local CPU workers that will train at once on this machine: time that many together, "
                        "each in its own process, by wall time (default 1: one process, thread CPU time)")
    p.add_argument("--cpu-share", type=float_arg(0.0, 1.0, low_open=True), default=None, metavar="S",
                   help="emulated CPU device: profile under a CPU quota of S cores (0 < S <= 1, cgroup v1)")
    p.add_argument("--memory-gb", type=float_arg(0.0, 1e6, low_open=True), default=None, metavar="G",
                   help="emulated CPU device: profile under a memory limit of baseline + G GiB (cgroup v1)")
    p.add_argument("--companion-cpu-share", type=float_arg(0.0, 1.0, low_open=True), default=None, metavar="S",
                   help="with --cpu-share and --workers > 1: the other workers each under a CPU quota of S cores")
    p.add_argument("--no-collectives", action="store_true",
                   help="several devices: do not time the collectives between them")
    p.add_argument("--no-stages", action="store_true",
                   help="--plan of a pipeline on CPU devices: do not run its stages here to profile each stage")
    p.add_argument("--stage-steps", type=int_arg(5, 1000), default=None, metavar="N",
                   help="steps of the stages' run (default 20, the first 2 not counted)")
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


def _resolve(args: argparse.Namespace) -> list | None:
    """Fill the model settings from --plan (checked against any given), and return the devices to
    profile together (DeviceSpec list), or None for one local device."""
    from contracts.cluster import ClusterSpec, DeviceSpec
    from contracts.plan import Plan
    from profiler.run_profile import cluster_devices, plan_devices

    if args.plan and args.cluster:
        raise ValueError("give --plan or --cluster, not both (a plan file holds its cluster)")
    if (args.plan or args.cluster) and (args.cpu_share is not None or args.memory_gb is not None
                                        or args.companion_cpu_share is not None or args.workers != 1):
        raise ValueError("--plan/--cluster profile the devices the file names: --cpu-share, --memory-gb, "
                         "--companion-cpu-share and --workers do not go with them")
    if args.plan:
        plan = Plan.load(args.plan)
        for flag, mine in (("model", plan.model), ("seq", plan.seq), ("dtype", plan.dtype),
                           ("recompute", plan.recompute)):
            given = getattr(args, flag)
            if given is not None and given != mine:
                raise ValueError(f"--{flag} {given} differs from the plan's {mine} ({args.plan}): leave it out")
            setattr(args, flag, mine)
        return plan_devices(plan)
    if args.model is None:
        raise ValueError("--model is required (or --plan, which names it)")
    args.seq, args.dtype, args.recompute = args.seq or DEFAULT_SEQ, args.dtype or "fp32", args.recompute or "none"
    if args.cluster:
        return cluster_devices(ClusterSpec.load(args.cluster))
    if args.companion_cpu_share is not None and (args.cpu_share is None or args.workers < 2):
        raise ValueError("--companion-cpu-share goes with --cpu-share and --workers > 1")
    if args.workers < 2 or (args.device or "cpu") != "cpu":
        return None
    first = DeviceSpec("cpu", memory_gb=args.memory_gb, cpu_share=args.cpu_share)
    other_share = args.companion_cpu_share if args.companion_cpu_share is not None else args.cpu_share
    return [first] + [DeviceSpec("cpu", cpu_share=other_share)] * (args.workers - 1)


def run(args: argparse.Namespace) -> int:
    devices = _resolve(args)
    _check(args)
    from profiler.commands._checks import require_device

    require_device(args.device)

    def progress(fraction: float, message: str) -> None:
        log.info("%3.0f%% %s", 100 * fraction, message)

    collectives_key = None
    if devices is None:
        from profiler.step_profile import profile_local  # torch: only when the command runs

        profiles = [profile_local(args.model, args.seq, args.dtype, args.micro_batches, args.recompute,
                                  repeats=args.repeats, device=args.device, progress=progress,
                                  save=not args.no_save, cpu_share=args.cpu_share, memory_gb=args.memory_gb)]
    else:
        from profiler.run_profile import profile_devices

        result = profile_devices(args.model, args.seq, args.dtype, devices, recompute=args.recompute,
                                 micro_batches=args.micro_batches, repeats=args.repeats,
                                 collectives=not args.no_collectives, progress=progress, save=not args.no_save)
        profiles, collectives_key = list(result.profiles), result.collectives_key
    stages = _stages(args, progress)
    _print(profiles, collectives_key, args, stages)
    return 0


def _stages(args: argparse.Namespace, progress) -> list | None:
    """--plan of a pipeline whose devices are all CPUs and whose ranks run here: its stages run here,
    each profiled as it runs (profiler/stage_run.profile_plan_stages); None where that does not apply."""
    if not args.plan or args.no_stages:
        return None
    from contracts.plan import Plan
    from profiler.stage_run import DEFAULT_STEPS, profile_plan_stages

    return profile_plan_stages(Plan.load(args.plan), steps=args.stage_steps or DEFAULT_STEPS,
                               save=not args.no_save, progress=progress)


def _print(profiles: list, collectives_key: str | None, args: argparse.Namespace, stages: list | None = None) -> None:
    from planner.core.profiles import collectives_path, step_profile_path

    def path(p) -> str | None:
        return None if args.no_save else step_profile_path(p.device_type, p.model, p.seq, p.dtype, p.recompute)

    if args.json:
        rows = [dict(p.to_dict(), store_path=path(p), taken_at=p.taken_at) for p in profiles]
        out = (rows[0] if len(rows) == 1 and collectives_key is None and stages is None else
               {"profiles": rows, "collectives_key": collectives_key})
        if stages is not None:
            out["stages"] = [s.to_dict() for s in stages]
        print_json(out)
        return
    for p in profiles:
        print(f"{p.model} on {p.device_type}, seq {p.seq}, {p.dtype}, recompute {p.recompute} — {p.kind}")
        print_table([{"micro_batch": m, "measured_s": t, "fit_s": p.step_time_s(m)}
                     for m, t in zip(p.micro_batches, p.step_times_s)])
        print(f"alpha = {p.alpha_s * 1e3:.3f} ms, beta = {p.beta_s * 1e3:.3f} ms/sample, R² = {p.r2:.4f}")
        print(f"FLOPs/sample (counted) = {p.flops_per_sample:.4g}, achieved {p.achieved_tflops:.3g} TFLOP/s"
              + _of_peak(p))
        print(f"optimizer step: {p.optimizer_s_per_param * 1e9:.3f} ns/parameter")
        print(f"profile {p.describe()}")
        if path(p):
            print(f"saved to {path(p)}")
        print()
    if collectives_key and not args.no_save:
        print(f"collectives between {collectives_key} saved to {collectives_path(collectives_key)}")
    if stages:
        print("\nthe plan's stages, run together here (one micro-batch, wall time):")
        print_table([{"stage": j, "device": s.device_type, "layers": f"{s.first_layer}-{s.first_layer + s.num_layers - 1}",
                      "rows": s.rows, "forward_s": s.forward_s, "backward_s": s.backward_s,
                      "send_s": s.send_s, "noise": s.noise} for j, s in enumerate(stages)])
        for s in stages:
            print(f"stage profile {s.describe()}")
        if stages[0].run_step_s is not None:
            print(f"the stages' run: median step {stages[0].run_step_s:.4f} s")


def _of_peak(p) -> str:
    """The achieved rate as a share of the type's catalogue peak; where it is above that peak, the peak is
    no datasheet ceiling (the catalogue's CPU figure is nominal) and no share is printed."""
    if not p.efficiency or not p.peak_tflops:
        return ""
    if p.efficiency > 1.0:
        return (f", above the catalogue's nominal {p.peak_tflops:.3g} TFLOP/s for {p.device_type.split('@')[0]} "
                "(not a measured peak: no share of it is given)")
    return f" = {p.efficiency:.2f} of peak {p.peak_tflops:.3g}"
