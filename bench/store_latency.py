"""Metric row written by rank 0 -> visible to a reader in another process: SQLite (the embedded
default, the run folder's metrics.sqlite) and PostgreSQL (a real server) side by side.

    python bench/store_latency.py [--steps 1000] [--ranks 3] [--interval-ms 5] [--pg-url URL]

For each store, this process is rank 0 as the runtime runs it (executor.worker): every step it
writes all ranks' figures and the step row in one transaction
(MetricsStore.record_steps_of_all_ranks), `--interval-ms` apart; a reader process follows the
run through executor.store.StepReader, polling every POLL_S, and notes when each step first
shows. Latency = the time the reader first sees the step - the time rank 0 began writing it
(one machine, one clock), so it holds the whole write, its commit and the reader's poll.
Afterwards the rows are counted: `--steps` step rows and `--steps` x `--ranks` rank rows, and
every step seen by the reader, or the bench fails. Without --pg-url a PostgreSQL server is
started for the run (testkit/postgres.py) with PostgreSQL's default durability (every commit
flushed); SQLite runs as the store runs it (WAL, synchronous=NORMAL).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from executor import db  # noqa: E402
from executor.store import MetricsStore, RankStep, StepReader  # noqa: E402
from testkit.runs import small_plan  # noqa: E402

POLL_S = 0.0005  # the reader's poll period: what a live page could afford at best
READER_TIMEOUT_S = 120.0

READER = """
import json, sys, time
from executor.store import StepReader
run_dir, steps, poll_s, timeout_s = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), float(sys.argv[4])
reader = StepReader(run_dir)
print("ready", flush=True)
seen, last, deadline = {}, 0, time.time() + timeout_s
while last < steps and time.time() < deadline:
    rows = reader.steps_after(last)
    now = time.time()
    for step, _ in rows:
        seen[step] = now
    if rows:
        last = rows[-1][0]
    else:
        time.sleep(poll_s)
reader.close()
print(json.dumps(seen))
"""


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def run_backend(name: str, env_db: str | None, steps: int, ranks: int, interval_s: float) -> dict:
    """One store: rank 0 writes, a reader process follows. Returns the figures and the counts."""
    if env_db is None:
        os.environ.pop(db.ENV_DB, None)
    else:
        os.environ[db.ENV_DB] = env_db
    run_dir = tempfile.mkdtemp(prefix=f"store-latency-{name}-")
    store = MetricsStore(run_dir)
    store.init_run(small_plan(tuple([1.0] * ranks)), steps_target=steps, seed=0, backend="gloo")
    reader = subprocess.Popen([sys.executable, "-c", READER, run_dir, str(steps), str(POLL_S), str(READER_TIMEOUT_S)],
                              cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT), stdout=subprocess.PIPE, text=True)
    assert reader.stdout is not None
    if reader.stdout.readline().strip() != "ready":
        raise RuntimeError(f"{name}: the reader did not start")
    write_s, began_s = [], {}
    for step in range(1, steps + 1):
        rows = [RankStep(r, 0.1, 0.0, 0.01, 0.02, 5_000_000 + r) for r in range(ranks)]
        began_s[step] = time.time()
        t0 = time.perf_counter()
        store.record_steps_of_all_ranks(step, rows, loss=4.0 / step, step_s=0.5, global_batch=4, seq=16)
        write_s.append(time.perf_counter() - t0)
        time.sleep(interval_s)
    out, _ = reader.communicate(timeout=READER_TIMEOUT_S + 30)
    store.close()
    seen = {int(k): v for k, v in json.loads(out.strip().splitlines()[-1]).items()}
    check = StepReader(run_dir)
    n_steps, n_rank_steps = check.counts()
    check.close()
    latency = [seen_s - began_s[step] for step, seen_s in seen.items()]
    return {
        "backend": name, "steps_written": steps, "rank_rows_written": steps * ranks,
        "step_rows": n_steps, "rank_rows": n_rank_steps, "steps_seen_by_reader": len(seen),
        "lost_rows": (steps - n_steps) + (steps * ranks - n_rank_steps), "unseen_steps": steps - len(seen),
        "write_median_ms": 1e3 * statistics.median(write_s), "write_p99_ms": 1e3 * pct(write_s, 0.99),
        "visible_median_ms": 1e3 * statistics.median(latency) if latency else float("nan"),
        "visible_p99_ms": 1e3 * pct(latency, 0.99) if latency else float("nan"),
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--ranks", type=int, default=3)
    p.add_argument("--interval-ms", type=float, default=5.0, help="rank 0's time between two steps' writes")
    p.add_argument("--pg-url", help="an existing PostgreSQL database with the GPUMix schema (default: start one)")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    if args.steps < 1 or args.ranks < 1 or not args.interval_ms >= 0:
        print("store_latency: --steps and --ranks must be >= 1, --interval-ms >= 0", file=sys.stderr)
        return 2
    interval_s = args.interval_ms / 1e3
    results = [run_backend("sqlite", None, args.steps, args.ranks, interval_s)]
    if args.pg_url:
        results.append(run_backend("postgresql", args.pg_url, args.steps, args.ranks, interval_s))
        pg_note = "the given server"
    else:
        from testkit.postgres import running_postgres, unavailable

        reason = unavailable()
        if reason is not None:
            print(f"store_latency: cannot run PostgreSQL here: {reason}", file=sys.stderr)
            return 2
        with running_postgres(durable=True) as server:
            url = server.create_database()
            os.environ[db.ENV_DB] = url
            from executor.commands.db import init_all

            init_all()
            results.append(run_backend("postgresql", url, args.steps, args.ranks, interval_s))
            # where PostgreSQL's time goes: the same server, commits not waiting for the WAL flush
            # (a crash of the server may lose the last commits, never corrupt; set per connection)
            results.append(run_backend("pg-async-commit", url + "?options=-csynchronous_commit%3Doff", args.steps,
                                       args.ranks, interval_s))
        pg_note = ("a local server started for the bench, default durability (fsync on); pg-async-commit: "
                   "the same server, synchronous_commit=off")
    if args.json:
        print(json.dumps(results, indent=1))
    else:
        print(f"store latency: rank 0 writes {args.ranks} ranks x {args.steps} steps, one transaction a step, "
              f"{args.interval_ms:g} ms apart; a reader process polls every {POLL_S * 1e3:g} ms")
        print(f"PostgreSQL: {pg_note}; SQLite: the run folder's file, WAL, synchronous=NORMAL")
        head = ("backend", "write median ms", "write p99 ms", "visible median ms", "visible p99 ms", "step rows",
                "rank rows", "seen", "lost")
        print("  ".join(f"{h:>17}" for h in head))
        for r in results:
            cells = (r["backend"], f"{r['write_median_ms']:.3f}", f"{r['write_p99_ms']:.3f}",
                     f"{r['visible_median_ms']:.3f}", f"{r['visible_p99_ms']:.3f}", r["step_rows"], r["rank_rows"],
                     r["steps_seen_by_reader"], r["lost_rows"])
            print("  ".join(f"{c:>17}" for c in cells))
        sq = results[0]
        for pg in results[1:]:
            print(f"{pg['backend']} / sqlite: visible median x{pg['visible_median_ms'] / sq['visible_median_ms']:.2f}, "
                  f"p99 x{pg['visible_p99_ms'] / sq['visible_p99_ms']:.2f}, "
                  f"write median x{pg['write_median_ms'] / sq['write_median_ms']:.2f}")
    bad = [r["backend"] for r in results if r["lost_rows"] or r["unseen_steps"]]
    if bad:
        print(f"store_latency: rows lost or never seen on {', '.join(bad)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
