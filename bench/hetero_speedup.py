"""Does the heterogeneous plan pay off on physically different devices? Measured side by side.

    python bench/hetero_speedup.py [--steps 20] [--rounds 5] [--global-batch 192] [--seq 128]
                                   [--shares 1,0.333] [--no-ddp] [--json]    (defaults shown)

Two emulated CPU devices, each a real cgroup CPU quota (profiler/cgroups.py; refused, exit 2, where
cgroups are unavailable), each profiled under its own limits before every round (a check says no
profile was estimated). Then, launched in rotating order: the planner's split (solve_plan) against
the `even` and `proportional` baselines (planner.hetero.baselines). Checks: planned / even
samples/s >= 1.6; the planned run's measured iteration within 15 % of its prediction; unless
--no-ddp, this runtime against DistributedDataParallel on two whole cores (ours / DDP >= 0.9); every
rank's measured peak memory within 10 % of planner.core.memory's prediction. Times are medians over
steps 3.. of each run, pooled over rounds; ratios are of runs taken alternately. The model (`tiny`,
seq 128, batch 192) makes a step of about half a second: many 10 ms quota periods.
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
from bench._common import hetero_cluster, parse_shares, profile_devices, profile_rows  # noqa: E402
from contracts.specs import get_model, with_max_seq  # noqa: E402
from executor.compare import SKIP_STEPS, prediction_gap  # noqa: E402  (torch-free)

MODEL = "tiny"
SPEEDUP_MIN = 1.6
PREDICTION_TOL = 0.15
DDP_RATIO_MIN = 0.9
MEMORY_TOL = 0.10
# The micro-batches the planner may choose, and the profile measures: from 4 up, where a
# micro-batch's time is the line α + β·m the profile fits (at m = 1 and 2 per-call overhead makes
# it 15-25 % slower than the line on this machine, so a plan of 77 micro-batches of 1 would be
# priced 25 % too fast); every batch a multiple of 4.
MICRO_BATCHES = (4, 8, 16, 32)
PROFILE_REPEATS = 5
HETERO = ("planned", "even", "proportional")
RECOMPUTES = ("none", "full")  # the profiles the cost model reads: full for the layerwise ZeRO >= 2
# the homogeneous comparison's ranks: one whole core each, in cgroups of the raised weight, so
# the neighbours' load on this shared machine hits this runtime and DDP alike
HOMOGENEOUS_SHARE = 1.0


# ---- plans ---------------------------------------------------------------------------------


def homogeneous_cluster() -> Any:
    """Two devices of one whole core each: this runtime's ranks and DDP's get the same cgroups."""
    from contracts.cluster import ClusterSpec

    return ClusterSpec.from_dict({"name": "bench-homogeneous", "nodes": [{"name": "localhost", "gpus": [
        {"type": "cpu", "cpu_share": HOMOGENEOUS_SHARE}] * 2}]})


def baseline_plan(cluster: Any, name: str, global_batch: int, seq: int, zero: int) -> Any:
    """The planner's `even` or `proportional` baseline as a launchable plan (planner.entry, the
    Launch page's even split too), the batch in multiples of the smallest micro-batch as a
    practitioner would round it (an odd batch would force micro-batches of 1)."""
    from planner.entry import baseline_plan as launchable_baseline

    return launchable_baseline(cluster, name, MODEL, global_batch, seq, "fp32", "none", zero, unit=MICRO_BATCHES[0])


# ---- measuring -----------------------------------------------------------------------------


def profile_machine(seq: int, shares: tuple[float, ...], collectives: bool) -> None:
    """Each emulated device's step profile under its own limits, a companion under the other's
    share (the run's other rank); once, the gloo collectives (bench/_common.py)."""
    # recompute full too: at ZeRO >= 2 the cost model prices the layerwise runtime from that profile
    profile_devices(MODEL, seq, shares, MICRO_BATCHES, recomputes=RECOMPUTES, repeats=PROFILE_REPEATS,
                    collectives=collectives)


def launch(plan: Any, steps: int, root: str, name: str) -> dict[str, Any]:
    from executor.compare import step_times
    from executor.launch import EMULATION_FILE, launch_run
    from executor.store import read_metrics

    run_dir = os.path.join(root, name)
    # each split as planned: live rebalancing would move the baselines toward the plan mid-run
    status = launch_run(plan, steps, run_dir, seed=0, rebalance="off")
    m = read_metrics(run_dir)
    if status != "done":
        raise RuntimeError(f"{name}: run {status}: {m['reason']}")
    steps_s = step_times(m)  # steps 3..: step 1 warms up and tracks memory, step 2 the allocator
    mode = "none"
    with contextlib.suppress(OSError, ValueError, KeyError):
        with open(os.path.join(run_dir, EMULATION_FILE), encoding="utf-8") as fh:
            mode = json.load(fh)["mode"]
    return {"name": name, "step_s": steps_s, "losses": [s["loss"] for s in m["steps"]], "ranks": m["ranks"],
            "global_batch": m["global_batch"], "emulation": mode,
            "predicted_iteration_s": plan.predicted_iteration_s,
            "split": [(a.micro_batch, a.accum_steps, round(a.shard_fraction, 4)) for a in plan.used]}


def ddp_launch(global_batch: int, seq: int, micro_batch: int, steps: int, root: str, name: str) -> dict[str, Any]:
    """This file under torchrun as the DDP baseline (2 ranks, gloo, 1 thread each), each rank in a
    cgroup of one whole core, as this runtime's homogeneous ranks (HOMOGENEOUS_SHARE)."""
    from profiler import cgroups
    from executor.launch import free_port, local_torchrun_command

    out = os.path.join(root, f"{name}.json")
    wargs = [os.path.abspath(__file__), "--ddp-worker", "--out", out, "--global-batch", str(global_batch),
             "--seq", str(seq), "--micro-batch", str(micro_batch), "--steps", str(steps)]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
    with contextlib.ExitStack() as stack, open(os.path.join(root, f"{name}.log"), "wb") as log:
        ranks = {r: stack.enter_context(cgroups.created(f"{cgroups.PREFIX}bench-{os.getpid()}-ddp-r{r}",
                                                        cgroups.Limits(cpu_share=HOMOGENEOUS_SHARE)))
                 for r in range(2)}
        env[cgroups.ENV_CGROUPS] = os.path.join(root, f"{name}.cgroups.json")
        cgroups.save_table(env[cgroups.ENV_CGROUPS], "cgroup", "DDP baseline", ranks)
        cmd = local_torchrun_command(2, free_port(), cgroups.exec_command(wargs))
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
    from contracts.specs import get_model, with_max_seq

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
    """Per rank of the planned runs: its measured compute (thread CPU time: the work, not the
    throttling), its wait in collectives, its predicted step."""
    rows = []
    for rank in range(len(runs[0]["ranks"])):
        rs = [r["ranks"][rank] for r in runs]
        rows.append({"rank": rank, "compute_cpu_s": median([x["median_compute_s"] for x in rs]),
                     "wait_s": median([x["median_wait_s"] for x in rs]),
                     "predicted_step_s": median([x["predicted_step_s"] for x in rs])})
    return rows


def run_bench(steps: int, rounds: int, global_batch: int, seq: int, shares: tuple[float, ...], root: str,
              profile: bool = True, ddp: bool = True) -> dict[str, Any]:
    from planner.hetero.solve import solve_plan

    t_start = time.monotonic()
    hetero = hetero_cluster(shares)
    keys = HETERO + (("ours", "ddp") if ddp else ())
    runs: dict[str, list[dict[str, Any]]] = {k: [] for k in keys}
    profiles: list[list[dict[str, Any]]] = []
    zeros: list[int] = []
    for i in range(rounds):  # alternate, so load from other processes hits every side alike
        if profile:  # re-profile each round: the plan prices this machine as it is now
            profile_machine(seq, shares, collectives=i == 0)
        planned = solve_plan(hetero, MODEL, global_batch, seq=seq, dtype="fp32", micro_batches=MICRO_BATCHES).plan
        zeros.append(planned.zero)
        plans = {"planned": planned, "even": baseline_plan(hetero, "even", global_batch, seq, planned.zero),
                 "proportional": baseline_plan(hetero, "proportional", global_batch, seq, planned.zero)}
        profiles.append(profile_rows(hetero, with_max_seq(get_model(MODEL), seq), seq, recomputes=RECOMPUTES))
        jobs = {k: (lambda k=k: launch(plans[k], steps, root, f"{k}-{i}")) for k in HETERO}
        if ddp:
            homo = baseline_plan(homogeneous_cluster(), "even", global_batch, seq, 1)
            jobs["ours"] = lambda: launch(homo, steps, root, f"homogeneous-ours-{i}")
            jobs["ddp"] = lambda: ddp_launch(global_batch, seq, homo.used[0].micro_batch, steps, root,
                                             f"homogeneous-ddp-{i}")
        # rotate the order every round: a load that drifts during the bench hits each side alike
        order = list(HETERO[i % 3:] + HETERO[:i % 3]) + (["ours", "ddp"] if i % 2 == 0 else ["ddp", "ours"])[
            :2 if ddp else 0]
        for key in order:
            runs[key].append(jobs[key]())
    med = {k: median(pooled(v)) for k, v in runs.items()}
    rate = {k: global_batch / v for k, v in med.items()}
    per_round = {f"planned_vs_{b}": [median(x["step_s"]) / median(p["step_s"]) for p, x in
                                     zip(runs["planned"], runs[b])] for b in ("even", "proportional")}
    # each round's runs against their own plan's prediction; the median of those errors
    # (the homogeneous runs' error too: how far this machine's load drifts between profile and run)
    per_round_err = {k: [prediction_gap(median(r["step_s"]), r["predicted_iteration_s"]) for r in runs[k]]
                     for k in HETERO + (("ours",) if ddp else ())}
    pred_err = {k: median(v) for k, v in per_round_err.items()}
    speedup = {b: rate["planned"] / rate[b] for b in ("even", "proportional")}
    mem = memory_rows([runs[k][0] for k in keys if k != "ddp"])
    mem_ok = all(r["error"] is not None and abs(r["error"]) <= MEMORY_TOL for r in mem)
    checks = {
        "planned_vs_even_speedup": {"value": speedup["even"], "min": SPEEDUP_MIN, "ok": speedup["even"] >= SPEEDUP_MIN},
        "planned_iteration_vs_prediction": {"value": pred_err["planned"], "tol": PREDICTION_TOL,
                                            "ok": abs(pred_err["planned"]) <= PREDICTION_TOL},
        "memory_within_10pct": {"value": max(abs(r["error"] or 1.0) for r in mem), "tol": MEMORY_TOL, "ok": mem_ok},
        # the prediction is the measured profiles' only if every profile the cost model read was measured
        "every_profile_measured": {"value": all(p["measured"] for rows in profiles for p in rows), "ok": all(
            p["measured"] for rows in profiles for p in rows)},
    }
    out: dict[str, Any] = {
        "config": {"model": MODEL, "global_batch": global_batch, "seq": seq, "steps": steps, "rounds": rounds,
                   "cpu_shares": list(shares), "median_over": f"steps {SKIP_STEPS + 1}..{steps} of every run"},
        "emulation": sorted({r["emulation"] for k in HETERO for r in runs[k]}),
        "splits": {k: [r["split"] for r in runs[k]] for k in HETERO}, "zero_per_round": zeros,
        "profiles": profiles,
        "median_step_s": med, "samples_per_s": rate,
        "predicted_iteration_s": {k: median([r["predicted_iteration_s"] for r in runs[k]]) for k in keys if k != "ddp"},
        "prediction_error": pred_err,
        "planned_vs_proportional_speedup": speedup["proportional"],
        "planned_breakdown": breakdown(runs["planned"]),
        "checks": checks, "per_round_ratios": per_round, "per_round_prediction_error": per_round_err, "memory": mem,
    }
    if ddp:
        ddp_ratio = rate["ours"] / rate["ddp"]
        checks["ours_vs_ddp_throughput"] = {"value": ddp_ratio, "min": DDP_RATIO_MIN, "ok": ddp_ratio >= DDP_RATIO_MIN}
        per_round["ours_vs_ddp"] = [median(d["step_s"]) / median(o["step_s"]) for o, d in zip(runs["ours"], runs["ddp"])]
        out["ours_vs_ddp_max_loss_rel_diff"] = max(abs(a - b) / abs(a) for a, b in zip(runs["ours"][0]["losses"],
                                                                                     runs["ddp"][0]["losses"]))
    out["bench_wall_s"] = time.monotonic() - t_start
    return out


def print_report(r: dict[str, Any]) -> None:
    c = r["config"]
    print(f"hetero_speedup: {c['model']}, global batch {c['global_batch']}, seq {c['seq']}, {c['steps']} steps x "
          f"{c['rounds']} rounds per configuration, medians over {c['median_over']}")
    print(f"  devices: cpu under cgroup CPU quotas of {', '.join(f'{s:g}' for s in c['cpu_shares'])} core "
          f"(emulation used by the runs: {', '.join(r['emulation'])})")
    print("  profiles the planner priced with (last round; beta = seconds per sample):")
    for p in r["profiles"][-1]:
        print(f"    {p['kind']:<16} recompute {p['recompute']:<5} {'measured' if p['measured'] else 'ESTIMATED':<9} "
              f"alpha {p['alpha_s'] * 1e3:7.2f} ms  beta {p['beta_s'] * 1e3:7.2f} ms  "
              f"optimizer {p['optimizer_s'] * 1e3:6.2f} ms")
    kinds = [p for p in r["profiles"][-1] if p["recompute"] == "none"]
    if len(kinds) == 2:
        print(f"    measured speed ratio {kinds[0]['beta_s'] / kinds[1]['beta_s']:.2f}x "
              f"({kinds[0]['kind']} beta / {kinds[1]['kind']} beta)")
    print(f"  ZeRO stage the planner chose (baselines priced at it), per round: {r['zero_per_round']}")
    for k in HETERO:
        print(f"  {k:<13} split (micro_batch, accum, shard) per round: {r['splits'][k]}")
    print(f"  {'configuration':<36}{'median step (s)':>16}{'samples/s':>12}{'predicted (s)':>15}{'error':>9}")
    labels = {"planned": "planned (ILP)", "even": "even baseline", "proportional": "proportional baseline",
              "ours": "homogeneous 2 ranks, this runtime", "ddp": "homogeneous 2 ranks, torch DDP"}
    for key, label in labels.items():
        if key not in r["median_step_s"]:
            continue
        p = r["predicted_iteration_s"].get(key)
        err = r["prediction_error"].get(key)
        print(f"  {label:<36}{r['median_step_s'][key]:>16.4f}{r['samples_per_s'][key]:>12.1f}"
              f"{(f'{p:.4f}' if p is not None else '—'):>15}{(f'{err:+.1%}' if err is not None else ''):>9}")
    print("  planned runs, per rank (medians): compute (thread CPU time) and wait in collectives vs predicted step")
    for b in r["planned_breakdown"]:
        print(f"    rank {b['rank']}: compute {b['compute_cpu_s']:.4f} s, wait {b['wait_s']:.4f} s, "
              f"predicted step {b['predicted_step_s']:.4f} s")
    ch = r["checks"]
    print(f"  planned / even samples/s         = {ch['planned_vs_even_speedup']['value']:.2f}x  (>= {SPEEDUP_MIN}x) "
          f"{'PASS' if ch['planned_vs_even_speedup']['ok'] else 'FAIL'}")
    print(f"  planned / proportional samples/s = {r['planned_vs_proportional_speedup']:.2f}x  (printed)")
    print(f"  planned measured vs predicted    = {ch['planned_iteration_vs_prediction']['value']:+.1%}  "
          f"(within {PREDICTION_TOL:.0%}) {'PASS' if ch['planned_iteration_vs_prediction']['ok'] else 'FAIL'}")
    if "ours_vs_ddp_throughput" in ch:
        print(f"  this runtime / DDP samples/s     = {ch['ours_vs_ddp_throughput']['value']:.2f}x  (>= {DDP_RATIO_MIN}x) "
              f"{'PASS' if ch['ours_vs_ddp_throughput']['ok'] else 'FAIL'}   "
              f"(loss curves differ by <= {r['ours_vs_ddp_max_loss_rel_diff']:.1e} relative)")
    print("  per round: " + "; ".join(f"{k} {', '.join(f'{x:.2f}x' for x in v)}" for k, v in r["per_round_ratios"].items()))
    print("  per round, measured vs predicted: " + "; ".join(
        f"{k} {', '.join(f'{x:+.0%}' for x in v)}" for k, v in r["per_round_prediction_error"].items()))
    print("  per-rank peak memory: measured (live tensor bytes, first step) vs predicted (planner.core.memory)")
    for m in r["memory"]:
        print(f"    {m['run']:<22} rank {m['rank']} (m={m['micro_batch']}, shard {m['shard_fraction']:.3f}): "
              f"{m['measured_peak_bytes'] / 2**20:8.2f} MiB vs {m['predicted_bytes'] / 2**20:8.2f} MiB  {m['error']:+.1%}")
    print(f"  memory within {MEMORY_TOL:.0%}: {'PASS' if ch['memory_within_10pct']['ok'] else 'FAIL'}")
    print(f"  every profile the planner read was measured under its limits: "
          f"{'PASS' if ch['every_profile_measured']['ok'] else 'FAIL'}")
    print(f"  bench wall time {r['bench_wall_s']:.0f} s")


def _shares(text: str) -> tuple[float, ...]:
    return parse_shares(text, count=2)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--global-batch", type=int, default=192)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--shares", type=_shares, default=(1.0, 0.333), help="the two devices' CPU shares (default 1,0.333)")
    p.add_argument("--no-ddp", action="store_true", help="skip the homogeneous this-runtime vs DDP comparison")
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
    from profiler.cgroups import unavailable_reason

    why = unavailable_reason()
    if why is not None:
        print(f"hetero_speedup: needs cgroup v1 CPU quotas for its emulated devices: {why}", file=sys.stderr)
        return 2
    data_dir = args.data_dir or tempfile.mkdtemp(prefix="gpumix-bench-")
    os.environ["GPUMIX_DATA_DIR"] = data_dir
    root = os.path.join(data_dir, "bench-runs")
    os.makedirs(root, exist_ok=True)
    r = run_bench(args.steps, args.rounds, args.global_batch, args.seq, args.shares, root, not args.no_profile,
                  not args.no_ddp)
    r["data_dir"] = data_dir
    if args.json:
        print(json.dumps(r, indent=2, default=str))
    else:
        print_report(r)
        print(f"  runs and profiles in {data_dir}")
    return 0 if all(c["ok"] for c in r["checks"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
