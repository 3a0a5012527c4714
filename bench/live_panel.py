"""The Launch page's live panel: CPU seconds and bytes per one-second refresh at 100, 10k and 100k steps.

    python bench/live_panel.py [--rounds 15] [--ranks 4]

For each size a running run of `--ranks` ranks is written through the store's writer
(MetricsStore.record_history, one transaction). Each round then appends one step, as a live run
does, and runs one refresh of the panel as its fragment does: ui.launch's live_metrics (this
session's RunFollower) and every render_* call of the fragment, Streamlit in bare mode (no browser).
CPU: time.process_time of that refresh. Bytes: what the refresh sends a tab, serialized as
Streamlit does: the four figures' JSON and the ranks table's Arrow IPC bytes (the few lines of
text beside them are left out). Prints medians over the rounds, the first refresh of a new session
apart (it reads the older steps once, bucketed in SQL), and the ratios 100k/100: PASS when both
are within 2x.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

SIZES = (100, 10_000, 100_000)
MAX_RATIO = 2.0


def make_run(root: str, n_steps: int, n_ranks: int) -> tuple[str, object, object]:
    """A running run of `n_steps` steps (its launcher: this process) and its open writer."""
    from executor.store import MetricsStore, RankStep
    from testkit.runs import small_plan

    plan = small_plan(tuple(1.0 + 0.5 * r for r in range(n_ranks)))
    run_dir = os.path.join(root, f"run-{n_steps}")
    os.makedirs(run_dir)
    plan.save(os.path.join(run_dir, "plan.json"))
    store = MetricsStore(run_dir)
    store.init_run(plan, steps_target=10 * n_steps, seed=0, backend="gloo")
    store.record_history([step_row(step, n_ranks, RankStep) for step in range(1, n_steps + 1)],
                         plan.global_batch, plan.seq)
    return run_dir, store, plan


def step_row(step: int, n_ranks: int, rank_step) -> tuple:
    # figures with full float precision, as a run's are (their JSON is as long as a real run's)
    ranks = [rank_step(r, 0.2 + 0.013 * r + 1e-7 * step, 0.01 * r, 0.011, 0.02 + 0.0017 * (step % 7) / (r + 1),
                       5_000_000 + 1000 * r + step % 13) for r in range(n_ranks)]
    return step, ranks, 4.0 / (1 + 0.001 * step) + 0.01 * ((step * 7919) % 11), 0.25 + 0.001 * (step % 5) / 3


def refresh(run_dir: str) -> dict:
    """One run of the fragment's body (ui/launch.py render_monitor.panel, the Stop button aside)."""
    from ui import launch

    m = launch.live_metrics(run_dir)
    launch.render_status(m)
    launch.render_numbers(m)
    launch.render_gap(m)
    launch.render_compare(run_dir, m)
    launch.render_charts(m)
    return m


def sent_bytes(m: dict) -> int:
    """The refresh's figures (JSON) and ranks table (Arrow IPC), as they go to the browser."""
    import pyarrow as pa

    from ui import launch

    figures = sum(len(json.dumps(f)) for f in launch.chart_figures(m))
    table = pa.Table.from_pandas(launch.ranks_frame(m), preserve_index=False)
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    return figures + sink.getvalue().size


def measure(n_steps: int, rounds: int, n_ranks: int, root: str) -> dict:
    from executor.store import RankStep

    run_dir, store, plan = make_run(root, n_steps, n_ranks)
    try:
        start = time.process_time()
        refresh(run_dir)
        first_s = time.process_time() - start
        cpu, sent = [], []
        for k in range(rounds):
            step = n_steps + 1 + k
            store.record_history([step_row(step, n_ranks, RankStep)], plan.global_batch, plan.seq)
            start = time.process_time()
            m = refresh(run_dir)
            cpu.append(time.process_time() - start)
            sent.append(sent_bytes(m))
            assert m["steps_recorded"] == step, (m["steps_recorded"], step)
    finally:
        store.close()
    return {"steps": n_steps, "first_s": first_s, "cpu_s": statistics.median(cpu), "bytes": statistics.median(sent)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--ranks", type=int, default=4)
    args = ap.parse_args()
    logging.disable(logging.WARNING)  # Streamlit's bare mode warns on every call
    with tempfile.TemporaryDirectory() as root:
        os.environ["GPUMIX_DATA_DIR"] = os.path.join(root, "data")
        os.environ.pop("GPUMIX_DB", None)
        rows = [measure(n, args.rounds, args.ranks, root) for n in SIZES]
    print(f"live panel refresh, {args.ranks} ranks, median of {args.rounds} rounds (one new step each)")
    print(f"{'steps':>8} {'CPU/refresh':>12} {'bytes/refresh':>14} {'first refresh CPU':>18}")
    for r in rows:
        print(f"{r['steps']:>8,} {r['cpu_s'] * 1e3:>9.1f} ms {r['bytes']:>14,.0f} {r['first_s'] * 1e3:>15.1f} ms")
    cpu_ratio = rows[-1]["cpu_s"] / rows[0]["cpu_s"]
    bytes_ratio = rows[-1]["bytes"] / rows[0]["bytes"]
    ok = cpu_ratio <= MAX_RATIO and bytes_ratio <= MAX_RATIO
    print(f"ratio {SIZES[-1]:,}/{SIZES[0]:,} steps: CPU {cpu_ratio:.2f}x, bytes {bytes_ratio:.2f}x "
          f"(limit {MAX_RATIO:g}x): {'PASS' if ok else 'FAIL'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
