"""`python -m executor metrics --run-dir R [--json]`: the run's status, steps and ranks, each rank's
measured compute and wait beside its predicted ones, the straggler (executor/straggler.py) and the
run's timeline of splits (rebalance events, executor/rebalance.py); then measured against predicted
(executor.compare.predicted_vs_measured, from the plan.json in the run folder): the iteration, each
rank and each pipeline stage, with the step profile each prediction came from. `--json` adds that
as its `predicted` block (null when the folder has no plan.json)."""
from __future__ import annotations

import argparse
import os

HELP = "show a run's metrics (status, loss, throughput, per-rank memory and wait time)"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--run-dir", required=True)
    p.add_argument("--json", action="store_true", help="one JSON object: status, steps, ranks, ...")
    p.add_argument("--last", type=int, default=20, help="table mode: show the last N steps")


def _straggler_line(s: dict) -> str:
    return (f"rank {s['rank']} on {s['device']}, {s['slowdown']:.2f}x slower than its profile (against the other "
            f"ranks) since step {s['since_step']}, costing the step {s.get('cost_s', 0.0):.3f} s (measured)")


def run(args: argparse.Namespace) -> int:
    from executor.store import TIMELINE_KINDS, read_metrics
    from contracts.cli import print_json, print_table

    if args.last < 1:
        raise ValueError(f"--last must be >= 1, got {args.last}")
    m = read_metrics(args.run_dir)
    predicted = _predicted(m, args.run_dir)
    if args.json:
        print_json(dict(m, predicted=predicted))
        return 0
    emulated = " [emulated devices]" if m["emulated"] else ""
    print(f"run {m['run_dir']}: {m['status']}{emulated}" + (f" — {m['reason']}" if m["reason"] else ""))
    print(f"model {m['model']}, global batch {m['global_batch']}, seq {m['seq']}, {m['world_size']} ranks, "
          f"{len(m['steps'])}/{m['steps_target']} steps")
    print_table(m["steps"][-args.last:], ["step", "loss", "val_loss", "samples_per_s", "tokens_per_s", "step_s"])
    print()
    print_table(m["ranks"], ["rank", "type", "emulated", "micro_batch", "accum_steps", "shard_fraction",
                             "peak_memory_bytes", "predicted_memory_bytes", "median_compute_s",
                             "median_predicted_compute_s", "median_wait_s", "median_predicted_wait_s",
                             "compute_vs_profile", "comm_wait_s", "predicted_step_s"])
    s = m["straggler"]
    print(f"straggler: {'none' if s is None else _straggler_line(s)}")
    for e in m["events"]:
        if e["kind"] in TIMELINE_KINDS:
            print(f"step {e['step'] if e['step'] is not None else '?'}: {e['kind']}: {e['message']}")
    _print_predicted(predicted)
    if m["links"] is not None:
        gbps, sent = m["links"]["gbps"], m["links"]["bytes_per_step"]
        print(f"emulated links: {'?' if gbps is None else f'{gbps:g}'} Gbit/s each way per rank; "
              + ("no step measured" if sent is None else f"{sent:,.0f} bytes of TCP payload per step, all ranks "
                 "(measured)"))
    return 0


def _predicted(m: dict, run_dir: str) -> dict | None:
    """predicted_vs_measured against the run folder's plan.json; None without one."""
    from contracts.plan import Plan
    from executor.compare import predicted_vs_measured

    path = os.path.join(run_dir, "plan.json")
    if not os.path.isfile(path):
        return None
    return predicted_vs_measured(m, Plan.load(path))


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1e3:.1f}"


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x:+.1%}"


def _print_predicted(p: dict | None) -> None:
    """Measured against predicted: the iteration, per rank, per stage, and the profiles."""
    from contracts.cli import print_table

    print()
    if p is None:
        print("measured vs predicted: no plan.json in the run folder")
        return
    it = p["iteration"]
    print(f"measured vs predicted (medians of steps {p['skip_steps'] + 1}+, {p['steps']} steps): iteration "
          f"{_ms(it['measured_s'])} ms measured, {_ms(it['predicted_s'])} ms predicted, error {_pct(it['error'])}")
    print_table([{"rank": r["rank"], "device": r["device"], "kind": r["kind"],
                  "measured_step_ms": _ms(r["measured_step_s"]), "predicted_step_ms": _ms(r["predicted_step_s"]),
                  "error": _pct(r["error"])} for r in p["ranks"]])
    if p["stages"]:
        print_table([{"stage": s["stage"], "layers": s["layers"], "ranks": ",".join(map(str, s["ranks"])),
                      "measured_step_ms": _ms(s["measured_step_s"]), "predicted_step_ms": _ms(s["predicted_step_s"]),
                      "error": _pct(s["error"])} for s in p["stages"]])
    for profile in dict.fromkeys(r["profile"] for r in p["ranks"]):
        print(f"predicted from profile {profile}")
    for s in p["stages"]:
        if s.get("priced_from"):
            print(f"stage {s['stage']} priced from {s['priced_from']}")
