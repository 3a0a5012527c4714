"""`python -m executor metrics --run-dir R [--json]`: the run's status, steps and ranks, each rank's
measured compute and wait beside its predicted ones, the straggler (executor/straggler.py) and the
run's timeline of splits (rebalance events, executor/rebalance.py)."""
from __future__ import annotations

import argparse

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
    if args.json:
        print_json(m)
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
    if m["links"] is not None:
        gbps, sent = m["links"]["gbps"], m["links"]["bytes_per_step"]
        print(f"emulated links: {'?' if gbps is None else f'{gbps:g}'} Gbit/s each way per rank; "
              + ("no step measured" if sent is None else f"{sent:,.0f} bytes of TCP payload per step, all ranks "
                 "(measured)"))
    return 0
