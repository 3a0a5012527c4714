"""How steady is this machine's own speed? The same forward+backward, timed again and again.

    python bench/machine_drift.py [--seconds 120] [--window 10] [--model tiny] [--seq 128]
                                  [--micro-batch 32] [--json]    (defaults shown)

A prediction of a step is made from a profile taken minutes before the run it predicts. Where the
machine itself computes the same work faster one minute than the next (a shared virtual machine:
other tenants on the host's cores, caches and memory bandwidth), no cost model can predict a run
closer than that drift. This bench measures it, apart from the profiler, the planner and the
executor: one process, one torch thread, forward+backward of `--model` at `--micro-batch` samples of
`--seq` tokens, each call timed by its thread's CPU time (time spent waiting for a core is not
counted: what is left is how fast the core ran the work), for `--seconds`. Beside each window: the
median wall time over the median CPU time of its calls (1.0: the thread was never kept from a core),
and the hypervisor's steal share of the machine's CPU time in it (/proc/stat): a window slower in
CPU time with neither is the host's cores running the same work slower, which nothing in this guest
sees but a yardstick like this one.

Printed: per window of `--window` seconds its median call and the load average; then over the whole
run the median call, the spread of single calls (IQR / median), and the slowest window's median over
the fastest's (the drift a profile taken in one window and a run in another can see).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import torch  # noqa: E402

from contracts.specs import get_model, with_max_seq  # noqa: E402
from models.decoder import build_model  # noqa: E402


def cpu_jiffies() -> tuple[int, int] | None:
    """(steal, all) jiffies of the machine's CPUs so far (/proc/stat's first line), None where unreadable:
    steal is the time the hypervisor ran something else while this guest's vCPUs wanted to run."""
    try:
        with open("/proc/stat", encoding="ascii") as fh:
            fields = [int(x) for x in fh.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    return (fields[7], sum(fields[:8])) if len(fields) >= 8 else None


def measure(model: str, seq: int, micro_batch: int, seconds: float, window: float) -> dict:
    torch.set_num_threads(1)
    spec = with_max_seq(get_model(model), seq)
    torch.manual_seed(0)
    net = build_model(spec)
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, spec.vocab_size, (micro_batch, seq), generator=gen)
    targets = torch.randint(0, spec.vocab_size, (micro_batch, seq), generator=gen)

    walls: list[float] = []

    def call() -> float:
        w, t0 = time.perf_counter(), time.thread_time()
        logits = net(tokens)
        torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten()).backward()
        walls.append(time.perf_counter() - w)
        return time.thread_time() - t0

    call()  # untimed: first-touch of the buffers
    windows: list[dict] = []
    start = time.monotonic()
    while time.monotonic() - start < seconds:
        w0, times, j0 = time.monotonic(), [], cpu_jiffies()
        walls.clear()
        while time.monotonic() - w0 < window:
            times.append(call())
        j1 = cpu_jiffies()
        steal = (j1[0] - j0[0]) / (j1[1] - j0[1]) if j0 and j1 and j1[1] > j0[1] else None
        windows.append({"start_s": round(w0 - start, 1), "calls": len(times), "median_s": statistics.median(times),
                        "wall_over_cpu": statistics.median(walls) / statistics.median(times),
                        "steal_share": steal, "load_avg": os.getloadavg()[0], "times_s": times})
    every = [t for w in windows for t in w["times_s"]]
    q = statistics.quantiles(every, n=4)
    medians = [w["median_s"] for w in windows]
    return {"model": model, "seq": seq, "micro_batch": micro_batch, "seconds": seconds, "window_s": window,
            "windows": [{k: v for k, v in w.items() if k != "times_s"} for w in windows],
            "median_s": statistics.median(every), "calls": len(every),
            "iqr_over_median": (q[2] - q[0]) / statistics.median(every),
            "slowest_over_fastest_window": max(medians) / min(medians)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seconds", type=float, default=120.0)
    p.add_argument("--window", type=float, default=10.0)
    p.add_argument("--model", default="tiny")
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--micro-batch", type=int, default=32)
    p.add_argument("--json", action="store_true")
    a = p.parse_args(argv)
    if a.seconds <= 0 or a.window <= 0 or a.window > a.seconds or a.micro_batch < 1 or a.seq < 1:
        p.error("need --seconds >= --window > 0, --micro-batch >= 1, --seq >= 1")
    r = measure(a.model, a.seq, a.micro_batch, a.seconds, a.window)
    if a.json:
        print(json.dumps(r, indent=1))
        return 0
    print(f"forward+backward of {a.model}, {a.micro_batch} x {a.seq} tokens, one torch thread, thread CPU time "
          f"(measured):")
    for w in r["windows"]:
        steal = "-" if w["steal_share"] is None else f"{w['steal_share']:.1%}"
        print(f"  {w['start_s']:6.1f} s  median {w['median_s'] * 1e3:7.1f} ms over {w['calls']:3d} calls  "
              f"(wall / CPU time {w['wall_over_cpu']:.2f}, steal {steal}, load {w['load_avg']:.2f})")
    print(f"all {r['calls']} calls: median {r['median_s'] * 1e3:.1f} ms, IQR/median {r['iqr_over_median']:.1%}; "
          f"slowest window's median / fastest's {r['slowest_over_fastest_window']:.3f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
