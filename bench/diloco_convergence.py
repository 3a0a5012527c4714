"""Fit the DiLoCo convergence multiplier k(H, G) from measured runs (planner/geo/convergence.py).

    python bench/diloco_convergence.py [--steps 500] [--inner-steps 5,10,25,50,100] [--groups 2,3]
                                       [--compress fp32,bf16] [--merge] [--out PATH] [--json]

For each G: one synchronous data-parallel run and one DiLoCo run per H, each on G CPU ranks of this
machine (one per group, `executor launch`, gloo), the `tiny` model on the default corpus, the same
seed, global batch, learning-rate schedule and steps; each DiLoCo run once per --compress wire dtype of
its outer deltas (models/diloco.py), the DP run shared. The runs record their validation loss every
VAL_EVERY steps (executor/worker.py); a DiLoCo run's points are kept only at steps that are multiples
of H (every H divides VAL_EVERY or is a multiple of it), just after an outer step, when the first
group's model (the one validated) is the synced one. k at each
DiLoCo point = its tokens over the tokens DP's measured validation curve took to the same loss
(planner/geo/convergence.measure_multiplier); the fit and its provenance go to --out (default: the
file the planner reads). --merge keeps the measurements of the file already at --out whose (H, G,
compress) this run does not measure, its provenance under "merged_from". Sized for a 2-core machine:
about 1-2 minutes per run.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

MODEL = "tiny"
SEQ = 64
BATCH_PER_GROUP = 4
from contracts.run import VAL_EVERY  # noqa: E402  the runs' validation points (executor launch --val-every default)
NODE_NAMES = ("localhost", "127.0.0.1", "local")  # names of this machine: a plain local launch
LR = 3e-3
SEED = 0


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def dp_plan(num_groups: int):
    """Synchronous data parallelism over `num_groups` local nodes of one CPU rank each (ZeRO-1)."""
    from contracts.cluster import ClusterSpec, DeviceSpec, NodeSpec
    from contracts.plan import Assignment, Plan

    if not 2 <= num_groups <= len(NODE_NAMES):
        raise ValueError(f"--groups: each G must be within 2-{len(NODE_NAMES)}, got {num_groups}")
    names = NODE_NAMES[:num_groups]
    nodes = tuple(NodeSpec(n, f"dc-{i}", (DeviceSpec("cpu"),)) for i, n in enumerate(names))
    shares = [1.0 / num_groups] * (num_groups - 1) + [1.0 - (num_groups - 1) / num_groups]
    asg = tuple(Assignment(i, n, "cpu", BATCH_PER_GROUP, 1, BATCH_PER_GROUP, shares[i], 0, 0.0)
                for i, n in enumerate(names))
    return Plan(ClusterSpec(f"convergence-{num_groups}", nodes), MODEL, BATCH_PER_GROUP * num_groups, SEQ, "fp32",
                "none", asg, 0.0, 0.0, zero=1, rebalance="off")


def val_curve(run_dir: str, tokens_per_step: int, every: int = 1) -> list[tuple[float, float]]:
    """(tokens trained, validation loss) at every step the run validated whose number `every` divides."""
    from executor.store import read_metrics

    steps = read_metrics(run_dir)["steps"]
    return [(s["step"] * tokens_per_step, s["val_loss"]) for s in steps
            if s.get("val_loss") is not None and s["step"] % every == 0]


def run(plan, steps: int, run_dir: str, every: int = 1) -> list[tuple[float, float]]:
    from executor.launch import launch_run
    from executor.store import read_metrics
    from models.optim import OptimConfig

    optim = OptimConfig(lr=LR, warmup_steps=max(1, steps // 20))
    t0 = time.perf_counter()
    status = launch_run(plan, steps, run_dir, seed=SEED, optim=optim)
    if status != "done":
        raise RuntimeError(f"{run_dir}: run ended {status}: {read_metrics(run_dir).get('reason')}")
    curve = val_curve(run_dir, plan.global_batch * plan.seq, every)
    log(f"  {os.path.basename(run_dir)}: {time.perf_counter() - t0:.0f} s, validation "
        + ", ".join(f"{t:.0f} tok {l:.4f}" for t, l in curve))
    return curve


def measure(steps: int, inner_steps: list[int], groups: list[int], work: str,
            compresses: tuple[str, ...] = ("fp32",)) -> dict:
    from planner.geo.convergence import measure_multiplier
    from planner.geo.diloco_plan import to_diloco_plan

    curves, measured = {}, []
    for g in groups:
        dp = dp_plan(g)
        log(f"G={g}: synchronous data parallelism ...")
        dp_curve = run(dp, steps, os.path.join(work, f"dp-g{g}"))
        curves[f"dp_g{g}"] = dp_curve
        for c in compresses:
            for h in inner_steps:
                name = f"diloco_g{g}_h{h}" + ("" if c == "fp32" else f"_{c}")
                log(f"G={g}: DiLoCo H={h} {c} ...")
                curve = run(to_diloco_plan(dp, h, compress=c), steps, os.path.join(work, name), h)
                curves[name] = curve
                m = measure_multiplier(dp_curve, curve, h, g, c)
                if m is None:
                    log(f"  H={h} {c}: no validation point inside DP's measured curve; not fitted")
                else:
                    measured.append(m)
                    log(f"  H={h} {c}: k = {m.multiplier:.3f} over {m.num_points} point(s)")
    return {"curves": curves, "measured": measured}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=500, help=f"steps per run (a multiple of {VAL_EVERY})")
    ap.add_argument("--inner-steps", default="5,10,25,50,100",
                    help=f"H values, each dividing {VAL_EVERY} or a multiple of it")
    ap.add_argument("--groups", default="2,3", help="G values (2 or 3), comma separated")
    ap.add_argument("--compress", default="fp32", help="outer-delta wire dtypes (fp32, bf16, int8), comma separated")
    ap.add_argument("--merge", action="store_true", help="keep --out's measurements this run does not remeasure")
    ap.add_argument("--out", default=None, help="where the fit goes (default: planner/geo/convergence_fit.json)")
    ap.add_argument("--json", action="store_true", help="print the fit and the curves as one JSON object")
    ap.add_argument("--keep", metavar="DIR", help="keep the run folders in DIR")
    args = ap.parse_args()
    try:
        hs = [int(x) for x in args.inner_steps.split(",")]
        gs = [int(x) for x in args.groups.split(",")]
    except ValueError:
        print("--inner-steps and --groups are comma-separated integers", file=sys.stderr)
        return 2
    bad = [h for h in hs if h < 1 or (VAL_EVERY % h and h % VAL_EVERY) or h > args.steps // 2]
    if bad or args.steps < 2 * VAL_EVERY or args.steps % VAL_EVERY:
        print(f"every H must divide {VAL_EVERY} or be a multiple of it, at most half of --steps (got {bad}), "
              f"and --steps be a multiple of {VAL_EVERY}, at least {2 * VAL_EVERY}", file=sys.stderr)
        return 2
    from planner.geo.convergence import FIT_PATH, WIRE_DTYPES, fit_multipliers, load_fit

    cs = tuple(args.compress.split(","))
    if not cs or any(c not in WIRE_DTYPES for c in cs):
        print(f"--compress: comma-separated values of {', '.join(WIRE_DTYPES)}, got {args.compress!r}", file=sys.stderr)
        return 2
    old = load_fit(args.out or FIT_PATH) if args.merge else None

    work = args.keep or tempfile.mkdtemp(prefix="gpumix-diloco-conv-")
    os.makedirs(work, exist_ok=True)
    os.environ.setdefault("GPUMIX_DATA_DIR", os.path.join(work, "data"))
    t0 = time.perf_counter()
    try:
        r = measure(args.steps, hs, gs, work, cs)
        redone = {(m.inner_steps, m.num_groups, m.compress) for m in r["measured"]}
        kept = [m for m in (old.measured if old else ()) if (m.inner_steps, m.num_groups, m.compress) not in redone]
        fit = fit_multipliers(kept + r["measured"], {
            "command": "python bench/diloco_convergence.py " + " ".join(sys.argv[1:]),
            "written_at_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "model": MODEL, "seq": SEQ, "global_batch_per_group": BATCH_PER_GROUP, "steps": args.steps,
            "lr": LR, "seed": SEED, "inner_steps_measured": hs, "groups_measured": gs, "compress_measured": list(cs),
            **({"merged_from": old.provenance} if old else {}),
            "tokens_per_run": {str(g): args.steps * BATCH_PER_GROUP * g * SEQ for g in gs},
            "validation_every_steps": VAL_EVERY, "machine": f"{os.cpu_count()} CPU cores, gloo ranks"})
    except (RuntimeError, ValueError) as e:
        print(f"diloco_convergence: {e}", file=sys.stderr)
        return 1
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    fit.save(args.out or FIT_PATH)
    out = {**fit.to_dict(), "curves": r["curves"], "wall_s": time.perf_counter() - t0}
    if args.json:
        print(json.dumps(out, indent=1))
    else:
        for m in fit.measured:
            print(f"H={m.inner_steps:3d} G={m.num_groups} {m.compress}: k measured {m.multiplier:.3f} ({m.num_points} "
                  f"point(s)), fitted {fit.multiplier(m.inner_steps, m.num_groups, m.compress):.3f}")
        print(f"fit: k interpolated over the measured H (planner/geo/convergence.py), written to {args.out or FIT_PATH}; "
              f"{out['wall_s']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
