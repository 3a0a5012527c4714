"""A device slows down mid-run: static plan, live rebalancing, stop-replan-resume, side by side.

    python bench/adaptive.py [--steps 40] [--change-at 10] [--rounds 3] [--global-batch 32] [--seq 128]
                             [--shares 1,0.9] [--slow-share 0.333] [--json]    (defaults shown)

Two CPU ranks in cgroups of `--shares` (profiler/cgroups.py; exit 2 where cgroups are unavailable),
an even split, `tiny` at seq 128. Once step `--change-at` is recorded, rank 0's quota drops to
`--slow-share` of a core (cpu.cfs_quota_us, found through the run's emulation.json). Three ways to
train the `--steps` steps, in rotating order each round, each in a data folder whose profiles are
reset to the planner's estimates:

- static: the plan's split throughout (`--rebalance off`);
- rebalance: live rebalancing (`--rebalance auto`, executor/rebalance.py);
- replan: stop once the straggler is named (executor/straggler.py, which runs in every run), write
  each kind's measured rate (compute / profile, median of the steps since the change) to the
  profile store, re-plan with `planner.entry.plan_job` on the same cluster, resume from the last
  checkpoint (`--resume`, a checkpoint every step) under the same slowed quota.

Printed per way (medians over rounds): the wall time from step 1's start to step N's end (a
resume's stop, re-plan and restart included), the median step after the change. Then the ratio
static / rebalance of the time of the steps after the change (target >= 1.3) and, for the last
rebalance of each auto run, its predicted step (the event's `predicted_step_s`: measured rates in the
cost model's compute, plus the measured overhead) against the median measured step after it
(target within 15 %). A step of ~0.1 s is several 10 ms quota periods; about 3 minutes in all.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
from bench._common import hetero_cluster, parse_shares  # noqa: E402

MODEL = "tiny"
RATIO_MIN = 1.3
PREDICTION_TOL = 0.15
WAYS = ("static", "rebalance", "replan")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="bench/adaptive.py", description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--change-at", type=int, default=10, help="the quota drops once this step is recorded")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--global-batch", type=int, default=32)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--shares", type=lambda t: parse_shares(t, 2), default=(1.0, 0.9))
    p.add_argument("--slow-share", type=float, default=1 / 3)
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    if not (2 <= args.change_at <= args.steps - 10):
        p.error(f"--change-at must be in [2, steps - 10], got {args.change_at} with --steps {args.steps}")
    if not 0 < args.slow_share <= 1 or args.rounds < 1:
        p.error("--slow-share must be in (0, 1] and --rounds >= 1")
    if args.global_batch < 4 or args.global_batch % 2:
        p.error(f"--global-batch must be even and >= 4, got {args.global_batch}")
    return args


def even_plan(args: argparse.Namespace):
    from contracts.plan import Assignment, Plan

    cluster = hetero_cluster(args.shares, name="bench-adaptive")
    half = args.global_batch // 2
    m = 1 << (min(half, 8).bit_length() - 1)
    while half % m:
        m //= 2
    asg = tuple(Assignment(i, "localhost", "cpu", m, half // m, half, 0.5, 0, 0.0, True) for i in range(2))
    return Plan(cluster, MODEL, args.global_batch, args.seq, "fp32", "none", asg, 0.0, 0.0)


def set_share(run_dir: str, rank: int, share: float) -> None:
    """Rank `rank`'s CPU quota to `share` of a core, its cgroup found through emulation.json
    (`{"ranks": [{"rank", "cpu_cgroup", ...}]}`)."""
    from executor.launch import EMULATION_FILE

    with open(os.path.join(run_dir, EMULATION_FILE), encoding="utf-8") as fh:
        d = next(r["cpu_cgroup"] for r in json.load(fh)["ranks"] if r["rank"] == rank)
    with open(os.path.join(d, "cpu.cfs_period_us"), encoding="utf-8") as fh:
        period = int(fh.read())
    with open(os.path.join(d, "cpu.cfs_quota_us"), "w", encoding="utf-8") as fh:
        fh.write(str(max(1000, round(period * share))))


def reset_profiles() -> None:
    """The data folder's profiles back to none (the planner's estimates): no run's learned rates."""
    from contracts.paths import profiles_dir

    shutil.rmtree(profiles_dir(), ignore_errors=True)


def wait_for(pred, timeout_s: float, what: str, interval_s: float = 0.05) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        got = pred()
        if got:
            return got
        time.sleep(interval_s)
    raise RuntimeError(f"timed out waiting for {what}")


def last_step(run_dir: str) -> int:
    from executor.store import read_metrics

    steps = read_metrics(run_dir)["steps"]
    return steps[-1]["step"] if steps else 0


def slowed_run(plan, args: argparse.Namespace, run_dir: str, rebalance: str, checkpoint_every: int = 0,
               stop_when_named: bool = False) -> int:
    """Start the run, drop rank 0's quota once step --change-at is recorded; wait for its end (or,
    `stop_when_named`, stop it once the straggler is named). Returns the first step run (partly)
    slowed."""
    from executor.launch import start_run, stop_run
    from executor.store import read_metrics

    h = start_run(plan, args.steps, run_dir, seed=1, rebalance=rebalance, checkpoint_every=checkpoint_every)
    wait_for(lambda: last_step(run_dir) >= args.change_at or read_metrics(run_dir)["status"] != "running", 300,
             f"step {args.change_at}")
    set_share(run_dir, 0, args.slow_share)
    changed = last_step(run_dir) + 1
    if stop_when_named:  # rank 0 named, on steps after the change (noise may have named it before)
        def named() -> bool:
            m = read_metrics(run_dir)
            s = m["straggler"]
            return m["status"] != "running" or (s is not None and s["rank"] == 0 and m["steps"][-1]["step"] > changed)

        wait_for(named, 300, "the straggler to be named")
        stop_run(h.run_dir)
    wait_for(lambda: read_metrics(run_dir)["status"] != "running", 600, "the run to end", 0.5)
    return changed


def learn_rates(run_dir: str, since: int) -> dict[str, float]:
    """Each kind's measured rate (compute / profile, median over the steps from `since`) written to
    the profile store, labelled measured in the run, as a live rebalance writes it."""
    from contracts.plan import Plan
    from contracts.specs import get_model, with_max_seq
    from executor.rebalance import kind_rates, learned_profile
    from executor.store import read_metrics
    from planner.core.profiles import get_step_profile, save_step_profile

    m = read_metrics(run_dir)
    plan = Plan.load(os.path.join(run_dir, "plan.json"))
    devices = plan.cluster.devices()
    kinds = [devices[a.device_index][1].profile_key for a in plan.used]
    rates = []
    since = min(since, m["steps"][-1]["step"])  # the straggler named at once: its last step
    for r in range(len(plan.used)):
        rows = [x for x in m["rank_steps"] if x["rank"] == r and x["step"] >= since and x["predicted_compute_s"]]
        rates.append(statistics.median((x["compute_s"] + (x["emulated_delay_s"] or 0)) / x["predicted_compute_s"]
                                       for x in rows))
    spec = with_max_seq(get_model(plan.model), plan.seq)
    learned = kind_rates(kinds, rates)
    for kind, rate in learned.items():
        base = get_step_profile(kind, spec, plan.seq, plan.dtype, plan.recompute)
        save_step_profile(learned_profile(base, rate, run_dir, f"{since}-{m['steps'][-1]['step']}"))
    return learned


def replan_run(plan, args: argparse.Namespace, run_dir: str) -> tuple[int, Any]:
    """Stop at the straggler, re-plan on the measured rates, resume under the same slowed quota."""
    from executor.launch import start_run
    from executor.store import read_metrics
    from planner.entry import plan_job

    changed = slowed_run(plan, args, run_dir, "off", checkpoint_every=1, stop_when_named=True)
    learn_rates(run_dir, changed + 1)
    new = plan_job(plan.cluster, MODEL, args.global_batch, seq=args.seq, zero=plan.zero, pipeline=False,
                   time_limit_s=5.0).plan
    from executor.launch import EMULATION_FILE

    os.remove(os.path.join(run_dir, EMULATION_FILE))  # the stopped launch's: its cgroups are gone
    h = start_run(new, args.steps, run_dir, seed=1, resume=True, rebalance="off", checkpoint_every=1)

    def cgroups_made() -> bool:
        try:
            set_share(run_dir, 0, args.slow_share)  # the device is still slow after the restart
            return True
        except (OSError, ValueError, KeyError):  # not written yet, or half written
            return read_metrics(run_dir)["status"] != "running"

    wait_for(cgroups_made, 120, "the resumed run's cgroups", 0.01)
    wait_for(lambda: read_metrics(run_dir)["status"] != "running", 600, "the resumed run to end", 0.5)
    return changed, new


def figures(run_dir: str, changed: int) -> dict[str, Any]:
    """Wall time of the N steps (step 1's start to step N's end), time and median of the steps after
    the change, and each rebalance's predicted step against the measured median after it."""
    from executor.store import read_metrics

    m = read_metrics(run_dir)
    if m["status"] != "done":
        raise RuntimeError(f"run {run_dir}: {m['status']} ({m['reason']})")
    steps = {s["step"]: s for s in m["steps"]}
    first, last = steps[1], steps[max(steps)]
    after = [steps[k]["step_s"] for k in sorted(steps) if k >= changed]
    moves = [e for e in m["events"] if e["kind"] == "rebalance" and e["step"] is not None]
    checks = []
    for i, e in enumerate(moves):
        end = moves[i + 1]["step"] - 1 if i + 1 < len(moves) else max(steps)
        measured = [steps[k]["step_s"] for k in range(e["step"] + 1, end + 1) if k in steps]
        if len(measured) >= 3:
            checks.append({"step": e["step"], "predicted_step_s": e["detail"]["predicted_step_s"],
                           "measured_step_s": statistics.median(measured)})
    return {"wall_s": last["time_s"] - first["time_s"] + first["step_s"], "after_s": sum(after),
            "median_after_s": statistics.median(after), "rebalances": checks,
            "straggler_named_at": next((e["step"] for e in m["events"] if e["kind"] == "straggler"
                                        and e["step"] is not None and e["step"] >= changed), None),
            "changed_at": changed}


def run_round(args: argparse.Namespace, k: int, root: str) -> dict[str, dict[str, Any]]:
    plan = even_plan(args)
    out = {}
    for way in WAYS[k % 3:] + WAYS[:k % 3]:  # rotating order
        reset_profiles()
        run_dir = os.path.join(root, f"round{k}-{way}")
        if way == "replan":
            changed, new = replan_run(plan, args, run_dir)
            out[way] = dict(figures(run_dir, changed),
                            new_split=[a.batch for a in new.used])
        else:
            changed = slowed_run(plan, args, run_dir, "off" if way == "static" else "auto")
            out[way] = figures(run_dir, changed)
        print(f"round {k + 1} {way:9s}: {args.steps} steps in {out[way]['wall_s']:.2f} s, median step after the "
              f"change {out[way]['median_after_s']:.4f} s", file=sys.stderr)
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from profiler import cgroups

    why = cgroups.unavailable_reason()
    if why is not None:
        print(f"bench/adaptive.py: needs cgroups: {why}", file=sys.stderr)
        return 2
    root = tempfile.mkdtemp(prefix="gpumix-adaptive-")
    os.environ["GPUMIX_DATA_DIR"] = os.path.join(root, "data")  # its own profiles and run history
    os.environ.pop("GPUMIX_DB", None)
    try:
        rounds = [run_round(args, k, root) for k in range(args.rounds)]
    finally:
        shutil.rmtree(root, ignore_errors=True)
    med = {w: {key: statistics.median(r[w][key] for r in rounds) for key in ("wall_s", "after_s", "median_after_s")}
           for w in WAYS}
    ratio = statistics.median(r["static"]["after_s"] / r["rebalance"]["after_s"] for r in rounds)
    checks = [c for r in rounds for c in r["rebalance"]["rebalances"][-1:]]
    errors = [abs(c["predicted_step_s"] - c["measured_step_s"]) / c["measured_step_s"] for c in checks]
    error = statistics.median(errors) if errors else None
    named = [r["rebalance"]["straggler_named_at"] - r["rebalance"]["changed_at"] for r in rounds
             if r["rebalance"]["straggler_named_at"] is not None]
    result = {"steps": args.steps, "change_at": args.change_at, "rounds": args.rounds, "shares": list(args.shares),
              "slow_share": args.slow_share, "ways": med, "ratio_rebalance_vs_static_after_change": ratio,
              "ratio_pass": ratio >= RATIO_MIN, "prediction_error_after_rebalance": error,
              "prediction_pass": error is not None and error <= PREDICTION_TOL, "prediction_checks": checks,
              "straggler_named_steps_after_change": named,
              "replan_new_splits": [r["replan"]["new_split"] for r in rounds]}
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    print(f"{args.steps} steps, rank 0 from {args.shares[0]:g} to {args.slow_share:.3g} of a core after step "
          f"{args.change_at}; medians of {args.rounds} rounds (measured)")
    print(f"{'way':10s} {'N steps (s)':>12s} {'after change (s)':>17s} {'median step after (s)':>22s}")
    for w in WAYS:
        print(f"{w:10s} {med[w]['wall_s']:12.2f} {med[w]['after_s']:17.2f} {med[w]['median_after_s']:22.4f}")
    print(f"static / rebalance over the steps after the change: {ratio:.2f}x "
          f"({'PASS' if ratio >= RATIO_MIN else 'FAIL'}, target >= {RATIO_MIN}x)")
    if error is None:
        print("predicted against measured step after the rebalance: no rebalance with 3 steps after it (FAIL)")
    else:
        detail = ", ".join(f"{c['predicted_step_s']:.4f} vs {c['measured_step_s']:.4f} s" for c in checks)
        print(f"predicted against measured step after the last rebalance: median error {100 * error:.1f} % "
              f"({detail}) ({'PASS' if error <= PREDICTION_TOL else 'FAIL'}, target <= {100 * PREDICTION_TOL:.0f} %)")
    print(f"straggler named {named} steps after the change; replan splits {result['replan_new_splits']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
