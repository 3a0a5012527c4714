"""Does the heterogeneous plan pay off on real processes? Measured side by side in one run.

    python bench/hetero_speedup.py [--steps 30] [--rounds 2] [--global-batch 48] [--seq 128] [--json]

1. Profiles this machine with the profiler before each round (step profile of `tiny` at the seq,
   timed with 2 concurrent workers by wall time, as the runs' two ranks compute; gloo
   collectives), into a private GPUMIX_DATA_DIR, so the planner prices with what this
   machine does now.
2. Emulated heterogeneity: two CPU ranks, one with slowdown 3 (the cluster file's
   emulation; executor.worker sleeps 2x each micro-batch's and optimizer step's measured
   compute). The planner's split (planner.hetero.solve.solve_plan) against the even split (the
   planner's own `even` baseline: half the batch and half the state each), same global
   batch, launched alternately `--rounds` times. Checks: planned / even samples/s >= 1.6;
   the planned run's measured iteration time within 15 % of the plan's prediction.
3. Two homogeneous CPU ranks, even split: this runtime (executor, uneven-capable ZeRO
   sharding) against torch.nn.parallel.DistributedDataParallel with torch.optim.AdamW on
   the same model, micro-batches and samples, alternately. Check: ours / DDP >= 0.9.
4. Memory: every rank's measured peak (executor.memtrack, live tensor bytes over the first
   step) against planner.core.memory's prediction in the plan. Check: within 10 %.

Times are medians over steps 3.. of each run (step 1 carries warm-up and the memory
tracker, step 2 allocator warm-up), pooled over rounds. The machine is shared: the ratios
of runs taken alternately are the figures to read, not absolute seconds. On a 2-core machine
that other processes keep busy, the two ranks contend for the cores while both compute; the
profile is taken under the same contention (two concurrent processes), but the load of other
processes drifts between profile and run: the per-rank breakdown printed for the planned runs
shows where the time went.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

MODEL = "tiny"
SKIP_STEPS = 2  # warm-up + the memory-tracked first step
SPEEDUP_MIN = 1.6
PREDICTION_TOL = 0.15
DDP_RATIO_MIN = 0.9
MEMORY_TOL = 0.10


# ---- plans ---------------------------------------------------------------------------------


def emulated_cluster(slowdown: float) -> Any:
    from planner.core.cluster import ClusterSpec

    gpus = [{"type": "cpu"}, {"type": "cpu", "slowdown": slowdown}] if slowdown != 1.0 else [{"type": "cpu"}] * 2
    return ClusterSpec.from_dict({"name": f"bench-slowdown-{slowdown:g}", "nodes": [{"name": "localhost",
                                                                                      "gpus": gpus}]})


def even_plan(cluster: Any, global_batch: int, seq: int) -> Any:
    """The planner's `even` baseline as a plan file: same batch and shard on each device, the
    largest power-of-two micro-batch dividing it (planner.hetero.baselines), re-priced by the planner."""
    from planner.hetero.baselines import split_by_weights
    from planner.hetero.solve import evaluate_plan
    from planner.core.plan import Assignment, Plan

    n = cluster.num_devices
    asg = []
    for i, ((node, dev), b) in enumerate(zip(cluster.devices(), split_by_weights(global_batch, [1.0] * n))):
        m = 1 << (min(b, 64).bit_length() - 1)
        while b % m:
            m //= 2
        asg.append(Assignment(i, node.name, dev.type, m, b // m, b, 1.0 / n, 0, 0.0, dev.emulated, dev.slowdown,
                              dev.memory_gb))
    plan = Plan(cluster, MODEL, global_batch, seq, "fp32", "none", tuple(asg), 0.0, 0.0)
    return evaluate_plan(plan)


# ---- measuring -----------------------------------------------------------------------------


def profile_machine(seq: int, collectives: bool) -> None:
    """The step profile of `tiny` at `seq` (and, once, the gloo collectives) into the store."""
    env = dict(os.environ, PYTHONPATH=ROOT)
    # --workers 2: the runs' two CPU ranks compute at once on this machine's cores, so the profile
    # is timed that way too (two concurrent processes, wall time), as the ranks report their compute
    cmds = [["-m", "profiler", "profile", "--model", MODEL, "--seq", str(seq), "--micro-batches", "1,2,4,8,16",
             "--repeats", "7", "--workers", "2"]]
    if collectives:
        cmds.append(["-m", "profiler", "bench", "--quick"])
    for cmd in cmds:
        subprocess.run([sys.executable, *cmd], cwd=ROOT, env=env, check=True, stdout=subprocess.DEVNULL)


def launch(plan: Any, steps: int, root: str, name: str) -> dict[str, Any]:
    from executor.launch import launch_run
    from executor.store import read_metrics

    run_dir = os.path.join(root, name)
    status = launch_run(plan, steps, run_dir, seed=0)
    m = read_metrics(run_dir)
    if status != "done":
        raise RuntimeError(f"{name}: run {status}: {m['reason']}")
    steps_s = [s["step_s"] for s in m["steps"][SKIP_STEPS:]]
    return {"name": name, "step_s": steps_s, "losses": [s["loss"] for s in m["steps"]], "ranks": m["ranks"],
            "global_batch": m["global_batch"]}


def ddp_launch(global_batch: int, seq: int, micro_batch: int, steps: int, root: str, name: str) -> dict[str, Any]:
    """This file under torchrun as the DDP baseline (2 ranks, gloo, 1 thread each)."""
    from executor.launch import free_port, local_torchrun_command

    out = os.path.join(root, f"{name}.json")
    wargs = [os.path.abspath(__file__), "--ddp-worker", "--out", out, "--global-batch", str(global_batch),
             "--seq", str(seq), "--micro-batch", str(micro_batch), "--steps", str(steps)]
    cmd = local_torchrun_command(2, free_port(), wargs)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
    with open(os.path.join(root, f"{name}.log"), "wb") as log:
        subprocess.run(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, check=True, timeout=600)
    with open(out, encoding="utf-8") as fh:
        res = json.load(fh)
    return {"name": name, "step_s": res["step_s"][SKIP_STEPS:], "losses": res["losses"], "global_batch": global_batch}


def ddp_worker(args: argparse.Namespace) -> int:
    """One DDP rank: the same model, loss, samples and micro-batches as the executor's even plan."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from executor.corpus import Corpus, GlobalSampler, batch_slices, build_corpus, windows
    from models.decoder import build_model
    from models.runtime import micro_batch_loss
    from planner.core.specs import get_model, with_max_seq

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = build_model(with_max_seq(get_model(MODEL), args.seq))
    ddp = DDP(model)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    train = Corpus.load(build_corpus()).train
    sampler = GlobalSampler(int(train.size), args.seq, args.global_batch, 0)
    batches = [args.global_batch // world] * world
    slices = batch_slices(batches, rank, args.micro_batch)
    # DDP averages gradients over ranks: normalize by the rank's share of the global tokens so
    # the averaged gradient is the global mean loss's, as in the executor
    normalizer = args.global_batch * args.seq // world
    step_s, losses = [], []
    for step in range(1, args.steps + 1):
        starts = sampler.starts(step)
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=False)
        local = 0.0
        for i, sl in enumerate(slices):
            x, y = (torch.from_numpy(a) for a in windows(train, starts[sl], args.seq))
            ctx = ddp.no_sync() if i < len(slices) - 1 else contextlib.nullcontext()
            with ctx:
                loss = micro_batch_loss(ddp, x, y, normalizer)
                loss.backward()
            local += float(loss.detach())
        opt.step()
        total = torch.tensor([local / world], dtype=torch.float64)
        dist.all_reduce(total)
        step_s.append(time.perf_counter() - t0)
        losses.append(float(total))
    if rank == 0:
        with open(args.out, "w", encoding="utf-8") as fh:
            json.dump({"step_s": step_s, "losses": losses}, fh)
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)  # as executor.worker: skip the teardown where torch's gloo threads sometimes abort


# ---- the benchmark -----------------------------------------------------------------------


def median(xs: list[float]) -> float:
    return statistics.median(xs)


def pooled(runs: list[dict[str, Any]]) -> list[float]:
    return [t for r in runs for t in r["step_s"]]


def memory_rows(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    rows = []
    for r in runs:
        for rank in r["ranks"]:
            meas, pred = rank["peak_memory_bytes"], rank["predicted_memory_bytes"]
            rows.append({"run": r["name"], "rank": rank["rank"], "slowdown": rank["slowdown"],
                         "micro_batch": rank["micro_batch"], "shard_fraction": round(rank["shard_fraction"], 4),
                         "measured_peak_bytes": meas, "predicted_bytes": pred,
                         "error": (meas - pred) / pred if meas and pred else None})
    return rows


def breakdown(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per rank of the planned runs: where the measured step went, beside the predicted step."""
    rows = []
    for rank in range(len(runs[0]["ranks"])):
        rs = [r["ranks"][rank] for r in runs]
        rows.append({"rank": rank, "slowdown": rs[0]["slowdown"],
                     "compute_s": median([x["median_compute_s"] for x in rs]),
                     "emulated_delay_s": median([x["median_emulated_delay_s"] for x in rs]),
                     "wait_s": median([x["median_wait_s"] for x in rs]),
                     "predicted_step_s": median([x["predicted_step_s"] for x in rs])})
    return rows


def run_bench(steps: int, rounds: int, global_batch: int, seq: int, slowdown: float, root: str,
              profile: bool = True) -> dict[str, Any]:
    from planner.hetero.solve import solve_plan

    t_start = time.monotonic()
    hetero = emulated_cluster(slowdown)
    runs: dict[str, list[dict[str, Any]]] = {"planned": [], "even": [], "ours": [], "ddp": []}
    predicted: dict[str, list[float]] = {"planned": [], "even": [], "homogeneous": []}
    for i in range(rounds):  # alternate, so load from other processes hits every side alike
        if profile:  # re-profile each round: the plan prices this machine as it is now
            profile_machine(seq, collectives=i == 0)
        planned = solve_plan(hetero, MODEL, global_batch, seq=seq, dtype="fp32").plan
        even = even_plan(hetero, global_batch, seq)
        homo = even_plan(emulated_cluster(1.0), global_batch, seq)
        for key, plan in (("planned", planned), ("even", even), ("homogeneous", homo)):
            predicted[key].append(plan.predicted_iteration_s)
        jobs = {
            "planned": lambda: dict(launch(planned, steps, root, f"planned-{i}"),
                                    predicted_iteration_s=planned.predicted_iteration_s),
            "even": lambda: launch(even, steps, root, f"even-{i}"),
            "ours": lambda: launch(homo, steps, root, f"homogeneous-ours-{i}"),
            "ddp": lambda: ddp_launch(global_batch, seq, homo.used[0].micro_batch, steps, root,
                                      f"homogeneous-ddp-{i}"),
        }
        # each pair swaps its order every round (AB, BA): a load that drifts during the bench hits
        # both sides alike; the planned run stays within one run of the profile it was priced with
        order = ("planned", "even", "ours", "ddp") if i % 2 == 0 else ("even", "planned", "ddp", "ours")
        for key in order:
            runs[key].append(jobs[key]())
    med = {k: median(pooled(v)) for k, v in runs.items()}
    per_round = {"planned_vs_even": [median(e["step_s"]) / median(p["step_s"]) for p, e in zip(runs["planned"],
                                                                                               runs["even"])],
                 "ours_vs_ddp": [median(d["step_s"]) / median(o["step_s"]) for o, d in zip(runs["ours"], runs["ddp"])]}
    rate = {k: global_batch / v for k, v in med.items()}
    speedup = rate["planned"] / rate["even"]
    # each round's planned run against its own plan's prediction; the median of those errors
    pred_err = median([(median(r["step_s"]) - r["predicted_iteration_s"]) / r["predicted_iteration_s"]
                       for r in runs["planned"]])
    ddp_ratio = rate["ours"] / rate["ddp"]
    mem = memory_rows(runs["planned"][:1] + runs["even"][:1] + runs["ours"][:1])
    mem_ok = all(r["error"] is not None and abs(r["error"]) <= MEMORY_TOL for r in mem)
    loss_gap = max(abs(a - b) / abs(a) for a, b in zip(runs["ours"][0]["losses"], runs["ddp"][0]["losses"]))
    return {
        "config": {"model": MODEL, "global_batch": global_batch, "seq": seq, "steps": steps, "rounds": rounds,
                   "slowdown": slowdown, "median_over": f"steps {SKIP_STEPS + 1}..{steps} of every run"},
        "planned_split": [(a.micro_batch, a.accum_steps, round(a.shard_fraction, 4)) for a in planned.used],
        "planned_splits_per_round": [[(x["micro_batch"], x["accum_steps"]) for x in r["ranks"]]
                                     for r in runs["planned"]],
        "even_split": [(a.micro_batch, a.accum_steps, round(a.shard_fraction, 4)) for a in even.used],
        "median_step_s": med, "samples_per_s": rate,
        "predicted_iteration_s": {k: median(v) for k, v in predicted.items()},
        "planned_breakdown": breakdown(runs["planned"]),
        "checks": {
            "planned_vs_even_speedup": {"value": speedup, "min": SPEEDUP_MIN, "ok": speedup >= SPEEDUP_MIN},
            "planned_iteration_vs_prediction": {"value": pred_err, "tol": PREDICTION_TOL,
                                                "ok": abs(pred_err) <= PREDICTION_TOL},
            "ours_vs_ddp_throughput": {"value": ddp_ratio, "min": DDP_RATIO_MIN, "ok": ddp_ratio >= DDP_RATIO_MIN},
            "memory_within_10pct": {"value": max(abs(r["error"] or 1.0) for r in mem), "tol": MEMORY_TOL,
                                    "ok": mem_ok},
        },
        "ours_vs_ddp_max_loss_rel_diff": loss_gap,
        "per_round_ratios": per_round,
        "memory": mem,
        "bench_wall_s": time.monotonic() - t_start,
    }


def print_report(r: dict[str, Any]) -> None:
    c = r["config"]
    print(f"hetero_speedup: {c['model']}, global batch {c['global_batch']}, seq {c['seq']}, {c['steps']} steps x "
          f"{c['rounds']} rounds per configuration, medians over {c['median_over']}")
    print(f"  planned split (micro_batch, accum, shard) {r['planned_split']}   even split {r['even_split']}")
    print(f"  {'configuration':<34}{'median step (s)':>16}{'samples/s':>12}{'predicted (s)':>15}")
    pred = r["predicted_iteration_s"]
    rows = [("planned, slowdown 1 + 3 (emulated)", "planned", pred["planned"]),
            ("even,    slowdown 1 + 3 (emulated)", "even", pred["even"]),
            ("homogeneous 2 ranks, this runtime", "ours", pred["homogeneous"]),
            ("homogeneous 2 ranks, torch DDP", "ddp", None)]
    for label, key, p in rows:
        ps = f"{p:.4f}" if p is not None else "—"
        print(f"  {label:<34}{r['median_step_s'][key]:>16.4f}{r['samples_per_s'][key]:>12.1f}{ps:>15}")
    print("  planned runs, per rank (medians): compute + emulated delay + wait in collectives vs predicted step")
    for b in r["planned_breakdown"]:
        print(f"    rank {b['rank']} (slowdown {b['slowdown']:g}): {b['compute_s']:.4f} + {b['emulated_delay_s']:.4f} + "
              f"{b['wait_s']:.4f} s  vs {b['predicted_step_s']:.4f} s predicted")
    ch = r["checks"]
    print(f"  planned / even samples/s      = {ch['planned_vs_even_speedup']['value']:.2f}x  (>= {SPEEDUP_MIN}x) "
          f"{'PASS' if ch['planned_vs_even_speedup']['ok'] else 'FAIL'}")
    print(f"  planned measured vs predicted = {ch['planned_iteration_vs_prediction']['value']:+.1%}  "
          f"(within {PREDICTION_TOL:.0%}) {'PASS' if ch['planned_iteration_vs_prediction']['ok'] else 'FAIL'}")
    print(f"  this runtime / DDP samples/s  = {ch['ours_vs_ddp_throughput']['value']:.2f}x  (>= {DDP_RATIO_MIN}x) "
          f"{'PASS' if ch['ours_vs_ddp_throughput']['ok'] else 'FAIL'}   "
          f"(loss curves differ by <= {r['ours_vs_ddp_max_loss_rel_diff']:.1e} relative)")
    print(f"  per round: planned/even {', '.join(f'{x:.2f}x' for x in r['per_round_ratios']['planned_vs_even'])}; "
          f"ours/DDP {', '.join(f'{x:.2f}x' for x in r['per_round_ratios']['ours_vs_ddp'])}")
    print("  per-rank peak memory: measured (live tensor bytes, first step) vs predicted (planner.core.memory)")
    for m in r["memory"]:
        print(f"    {m['run']:<22} rank {m['rank']} (slowdown {m['slowdown']:g}, m={m['micro_batch']}, "
              f"shard {m['shard_fraction']:.3f}): {m['measured_peak_bytes'] / 2**20:8.2f} MiB vs "
              f"{m['predicted_bytes'] / 2**20:8.2f} MiB  {m['error']:+.1%}")
    print(f"  memory within {MEMORY_TOL:.0%}: {'PASS' if ch['memory_within_10pct']['ok'] else 'FAIL'}")
    print(f"  bench wall time {r['bench_wall_s']:.0f} s")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--global-batch", type=int, default=48)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--slowdown", type=float, default=3.0)
    p.add_argument("--data-dir", help="GPUMIX_DATA_DIR for profiles and runs (default: a new temporary folder)")
    p.add_argument("--no-profile", action="store_true", help="reuse the profiles already in --data-dir")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    # internal: one DDP rank under torchrun
    p.add_argument("--ddp-worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    p.add_argument("--micro-batch", type=int, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.ddp_worker:
        return ddp_worker(args)
    data_dir = args.data_dir or tempfile.mkdtemp(prefix="gpumix-bench-")
    os.environ["GPUMIX_DATA_DIR"] = data_dir
    root = os.path.join(data_dir, "bench-runs")
    os.makedirs(root, exist_ok=True)
    r = run_bench(args.steps, args.rounds, args.global_batch, args.seq, args.slowdown, root, not args.no_profile)
    r["data_dir"] = data_dir
    if args.json:
        print(json.dumps(r, indent=2, default=str))
    else:
        print_report(r)
        print(f"  runs and profiles in {data_dir}")
    return 0 if all(c["ok"] for c in r["checks"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
