"""Does the README's command-line path predict the step it then measures? Each run from an empty data folder.

    python bench/cli_prediction.py [--runs 3] [--steps 60] [--global-batch 8] [--model tiny]
                                   [--cluster FILE] [--no-busy] [--every-device] [--json]    (defaults shown)

One run is the README's command-line path, each command its own process, in a fresh
$GPUMIX_DATA_DIR: `profiler inventory --out cluster.json` (or the `--cluster` file), `planner plan`,
`profiler profile --plan plan.json` and `planner plan` again while the plan's notes ask for it (at most
MAX_PROFILES times),
`executor launch --steps N`, `executor metrics --json`. The prediction is the plan file's iteration (the
planner's cost model on the profile); the measurement is the median step time of the run's store
(steps 4 onwards, executor.compare.PREDICTION_SKIP_STEPS). `--runs` runs in a row on the machine as it is,
then as many with one extra busy process (a Python loop, started before the run's first command
and killed after its last; `--no-busy` skips them). Prints per run the load average, predicted and
measured iteration, the error and PASS/FAIL against 15 %, and where the step went (each rank's
measured compute and wait against the predicted ones). Exit 1 when a run fails the 15 %.

`--every-device` checks the prediction of a plan that trains on every device of the cluster (on this
machine: two CPU ranks), whatever the planner would pick: `planner plan`, `profiler profile --cluster`
at the plan's seq (every device together, then the collectives between them), the plan's assignments rewritten to an
even split of the batch and the state over every device at zero 3, `planner evaluate --json` (the cost
model re-prices that plan from the profiles; its file is what is launched), `executor launch
--rebalance off` (the split priced is the split run).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
from typing import Any, Iterator

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
from contracts.paths import ENV_DATA_DIR  # noqa: E402

TOLERANCE = 0.15
PROFILE_FIRST = "profiler profile --plan"  # what planner.core.profiles.profile_notes asks for
COMMAND_TIMEOUT_S = 900.0
# plan, profile what the plan asks, plan again: while the notes still ask (a re-plan on measured
# figures can train on other devices than the profile was timed beside), at most this many profiles
MAX_PROFILES = 3


def run_cmd(args: list[str], env: dict[str, str]) -> str:
    """One command of the path (an argument list, no shell); its stdout, or RuntimeError with its tail."""
    r = subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=COMMAND_TIMEOUT_S, stdin=subprocess.DEVNULL)
    if r.returncode != 0:
        raise RuntimeError(f"{' '.join(args)} exited {r.returncode}: {(r.stderr or r.stdout)[-1500:]}")
    return r.stdout


@contextlib.contextmanager
def busy_process(on: bool) -> Iterator[None]:
    """One extra CPU-bound process (a Python loop) for the body, killed after it."""
    if not on:
        yield
        return
    proc = subprocess.Popen([sys.executable, "-c", "while True: pass"], stdin=subprocess.DEVNULL,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        yield
    finally:
        proc.kill()
        proc.wait()


def even_split(plan_path: str, env: dict[str, str]) -> None:
    """Rewrite the plan file to train on every device of its cluster, the batch and the state split
    evenly at zero 3, one micro-batch each, priced again by `planner evaluate` (its plan file replaces
    the old one). ValueError where the global batch does not split evenly."""
    with open(plan_path, encoding="utf-8") as fh:
        plan = json.load(fh)
    k = len(plan["assignments"])
    if plan["global_batch"] % k:
        raise ValueError(f"--every-device: global batch {plan['global_batch']} does not split over {k} devices")
    m = plan["global_batch"] // k
    for a in plan["assignments"]:
        a.update(micro_batch=m, accum_steps=1, batch=m, shard_fraction=1.0 / k)
    plan["zero"] = 3
    with open(plan_path, "w", encoding="utf-8") as fh:
        json.dump(plan, fh)
    priced = run_cmd(["-m", "planner", "evaluate", "--plan", plan_path, "--json"], env)
    with open(plan_path, "w", encoding="utf-8") as fh:
        fh.write(priced)


def one_run(args: argparse.Namespace, busy: bool) -> dict[str, Any]:
    """The README's path from an empty data folder; the figures of its run."""
    with tempfile.TemporaryDirectory(prefix="gpumix-cli-") as data, busy_process(busy):
        env = dict(os.environ, **{ENV_DATA_DIR: data}, PYTHONPATH=ROOT)
        env.pop("GPUMIX_DB", None)
        cluster = args.cluster or os.path.join(data, "cluster.json")
        plan_path, run_dir = os.path.join(data, "plan.json"), os.path.join(data, "runs", "r1")
        load_before = os.getloadavg()[0]
        if not args.cluster:
            run_cmd(["-m", "profiler", "inventory", "--out", cluster], env)
        plan_cmd = ["-m", "planner", "plan", "--cluster", cluster, "--model", args.model, "--global-batch",
                    str(args.global_batch), "--out", plan_path]
        profiled = 0
        launch = ["-m", "executor", "launch", "--plan", plan_path, "--steps", str(args.steps), "--run-dir", run_dir]
        if args.every_device:
            run_cmd(plan_cmd, env)
            with open(plan_path, encoding="utf-8") as fh:
                seq = json.load(fh)["seq"]
            run_cmd(["-m", "profiler", "profile", "--cluster", cluster, "--model", args.model, "--seq", str(seq)], env)
            profiled = 1
            even_split(plan_path, env)
            launch += ["--rebalance", "off"]
        else:
            while PROFILE_FIRST in run_cmd(plan_cmd, env) and profiled < MAX_PROFILES:
                run_cmd(["-m", "profiler", "profile", "--plan", plan_path], env)
                profiled += 1
        run_cmd(launch, env)
        m = json.loads(run_cmd(["-m", "executor", "metrics", "--run-dir", run_dir, "--json"], env))
        with open(plan_path, encoding="utf-8") as fh:
            notes = json.load(fh).get("notes", [])
        load_after = os.getloadavg()[0]  # the busy process still there
    it = m["predicted"]["iteration"]
    return {"busy": busy, "load_before": load_before, "load_after": load_after, "profiled": profiled,
            "predicted_s": it["predicted_s"], "measured_s": it["measured_s"], "error": it["error"],
            "pass": it["error"] is not None and abs(it["error"]) <= TOLERANCE,
            "ranks": [{"rank": r["rank"], "compute_s": r["median_compute_s"],
                       "predicted_compute_s": r["median_predicted_compute_s"], "wait_s": r["median_wait_s"],
                       "predicted_wait_s": r["median_predicted_wait_s"]} for r in m["ranks"]],
            "rebalances": sum(1 for e in m["events"] if e["kind"] == "rebalance"),
            "profiles": [n for n in notes if n.startswith("profile ")]}


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1e3:.1f} ms"


def report(i: int, r: dict[str, Any]) -> None:
    if "failed" in r:
        print(f"run {i} ({'one busy process beside it' if r['busy'] else 'machine as it is'}): FAIL, a command "
              f"failed: {r['failed'].splitlines()[-1] if r['failed'] else ''}")
        return
    err = "-" if r["error"] is None else f"{r['error']:+.1%}"
    print(f"run {i} ({'one busy process beside it' if r['busy'] else 'machine as it is'}, load {r['load_before']:.2f} "
          f"before, {r['load_after']:.2f} after): predicted {_ms(r['predicted_s'])}, measured median {_ms(r['measured_s'])}, error {err} "
          f"{'PASS' if r['pass'] else 'FAIL'} (15 %), {r['profiled']} profile(s)"
          + (f", {r['rebalances']} rebalance(s)" if r["rebalances"] else ""))
    for k in r["ranks"]:
        print(f"    rank {k['rank']}: compute {_ms(k['compute_s'])} (predicted {_ms(k['predicted_compute_s'])}), "
              f"wait {_ms(k['wait_s'])} (predicted {_ms(k['predicted_wait_s'])})")
    for n in r["profiles"]:
        print(f"    {n}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=3, help="runs in a row, quiet and then busy (default 3)")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--global-batch", type=int, default=8)
    p.add_argument("--model", default="tiny")
    p.add_argument("--cluster", default=None, help="a cluster file instead of `profiler inventory --out`")
    p.add_argument("--no-busy", action="store_true", help="skip the runs with a busy process beside them")
    p.add_argument("--every-device", action="store_true",
                   help="launch an even split over every device of the cluster, priced by planner evaluate")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # killed: the busy process is still ended (finally)
    if args.runs < 1 or args.steps < 10:
        p.error("--runs must be >= 1 and --steps >= 10")
    results = []
    for busy in (False,) if args.no_busy else (False, True):
        for _ in range(args.runs):
            try:
                results.append(one_run(args, busy))
            except (RuntimeError, ValueError, subprocess.TimeoutExpired) as e:  # a command failed: this run fails, the next runs
                results.append({"busy": busy, "load_before": os.getloadavg()[0], "failed": str(e), "error": None,
                                "pass": False})
            if not args.json:
                report(len(results), results[-1])
    passed = sum(r["pass"] for r in results)
    errors = [abs(r["error"]) for r in results if r["error"] is not None]
    if args.json:
        print(json.dumps({"runs": results, "passed": passed}, indent=2))
    else:
        print(f"{passed}/{len(results)} runs within 15 % of their prediction; median |error| "
              f"{statistics.median(errors):.1%}" if errors else "no run measured")
    return 0 if passed == len(results) else 1


if __name__ == "__main__":
    sys.exit(main())
