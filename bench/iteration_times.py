"""pipeline_sim.iteration_times against whole simulations, side by side in one run.

Random 1F1B jobs (2-5 stages, 1-3 pipelines, dedicated / temporal / fair links, two channels shared
by several hops, the runtime step or not, tied embeddings) of --min to --max micro-batches: each is
simulated whole and priced by iteration_times. Prints how many were extrapolated, how many differ
from the whole simulation by more than 1e-8 (relative, iteration or any worker's last op) and by
how much, and the median time of each way and their ratio.

    python bench/iteration_times.py [--jobs 300] [--min 300] [--max 1500] [--seed 1]
"""
from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from planner.geo.pipeline_sim import (LINK_ORDERS, SHARING, Channel, PipelineJob, Stage, iteration_times,  # noqa: E402
                                      simulate_pipeline)


def random_job(rng: random.Random, num_microbatches: int) -> PipelineJob:
    S, d = rng.randint(2, 5), rng.randint(1, 3)
    stages = tuple(Stage(rng.uniform(0.5, 2), rng.uniform(1, 4), rng.choice([0, rng.uniform(0, 3)]), "",
                         rng.choice([0, rng.uniform(0, 1)])) for _ in range(S))
    channels, hops = {}, []
    for j in range(S - 1):
        name = f"c{j % 2}"
        channels.setdefault(name, Channel(name, rng.uniform(0, 0.2), rng.uniform(0.5, 5), rng.uniform(1, 8),
                                          rng.choice(SHARING)))
        hops.append(name)
    runtime = rng.random() < 0.5
    return PipelineJob(stages, tuple(hops), tuple(channels.values()), d, num_microbatches, rng.uniform(1e8, 2e9),
                       "1f1b", rng.choice(LINK_ORDERS), rng.choice([0, 0.5]), runtime,
                       rng.choice([0, 0.3]) if runtime else 0)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--jobs", type=int, default=300)
    ap.add_argument("--min", type=int, default=300)
    ap.add_argument("--max", type=int, default=1500)
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args()
    rng = random.Random(args.seed)
    whole_s, fast_s, differ, extrapolated = [], [], [], 0
    for k in range(args.jobs):
        job = random_job(rng, rng.randint(args.min, args.max))
        t0 = time.perf_counter()
        whole = simulate_pipeline(job)
        t1 = time.perf_counter()
        got = iteration_times(job)
        t2 = time.perf_counter()
        whole_s.append(t1 - t0)
        fast_s.append(t2 - t1)
        extrapolated += got.extrapolated
        ends = whole.worker_end_s()
        err = max([abs(got.iteration_s - whole.iteration_s)] +
                  [abs(got.worker_end_s[w] - e) for w, e in ends.items()]) / whole.iteration_s
        if err > 1e-8:
            differ.append((k, err, job))
    print(f"{args.jobs} random 1F1B jobs of {args.min}-{args.max} micro-batches (seed {args.seed})")
    print(f"extrapolated from bounded simulations: {extrapolated}; simulated whole: {args.jobs - extrapolated}")
    print(f"differ from the whole simulation by more than 1e-8: {len(differ)}")
    for k, err, job in differ:
        print(f"  job {k}: {err:.3g} relative ({job.num_stages} stages, {job.num_pipelines} pipelines, "
              f"{job.num_microbatches} micro-batches, links {sorted({c.sharing for c in job.channels})}, "
              f"order {job.link_order})")
    mw, mf = statistics.median(whole_s), statistics.median(fast_s)
    print(f"median per job: whole simulation {mw * 1e3:.1f} ms, iteration_times {mf * 1e3:.1f} ms "
          f"({mw / mf:.2f}x); totals {sum(whole_s):.1f} s against {sum(fast_s):.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
