"""Geo plans run for real on emulated datacenters, measured beside their predictions.

    sudo python bench/geo_real.py [--dcs 2|3] [--gbps 0.1] [--steps 12] [--repeats 2] [--json] [--keep DIR]

One run (CPU ranks, gloo, root for the network namespaces, docs/emulated_wan.md): profile the
model on this machine; plan a 2- or 3-datacenter scenario with `python -m planner geo --out`;
predict that plan file (planner/geo/emulated.py) and the data-parallel plan over the same links;
then launch the geo plan, the geo plan with `--prefill` (alternating, ABAB) and the DP plan with
`executor launch --emulate-wan`. Prints the measured median step against the prediction (target:
within 15 %), the geo plan's measured speedup over DP (target: > 1), the step with prefill over
without (target: <= 1.05), and prefill tokens/s and TTFT beside BubbleTea's simulated figure.
Sized for a 2-core machine (at most 3 ranks, an 8-layer width-256 GPT-2 style model, short runs;
about 3-5 minutes); every figure is a median or a ratio of runs made side by side.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

# The training model: GPT-2 style, 8 layers of width 256 (6.4 M parameters), written as a config.json
# into the work folder. Why not a preset: a pipeline beats one datacenter only when a stage's compute
# per micro-batch exceeds its activation's time on the link, and that ratio grows with width x depth
# (compute per token ~ 12·h²·L, bytes per token 4·h): `small` (4 x 128) computes a token about as
# fast as 50 Mbit/s carries its 512 bytes, and the planner rightly kept it in one datacenter.
MODEL_CONFIG = {"model_type": "gpt2", "n_embd": 256, "n_layer": 8, "n_head": 4, "vocab_size": 256,
                "n_positions": 64, "tie_word_embeddings": True}
MODEL_NAME = "geo-real-8x256"
SEQ = 64
DP_STEPS = 6  # the DP run's steps: its gradient collectives cross the WAN every step (seconds each)
GLOBAL_BATCH = {2: 8, 3: 12}  # per number of datacenters: splits evenly over the DP plan's 2 or 3 ranks
MICRO_BATCH = 1
RTT_MS = 2.0
PROFILE_SIZES = "1,2,4,8"
INFERENCE = {"model": "tiny", "prompt_tokens": [32, 64], "requests_per_s": 40.0}
MAX_CHUNK_S = 0.001  # the prefill time box: the most a receive's completion waits behind one chunk
WARMUP_STEPS = 2
TARGET_ERROR = 0.15
TARGET_PREFILL_SLOWDOWN = 1.05
RUN_TIMEOUT_S = 240  # one launch; a hung run is stopped (the launcher tears its namespaces down)


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def write_model(work: str) -> str:
    """The training model's config.json (MODEL_CONFIG) in `work`; its path is the plan's model."""
    folder = os.path.join(work, MODEL_NAME)
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, "config.json")
    with open(path, "w", encoding="utf-8") as fh:
        json.dump(MODEL_CONFIG, fh)
    return path


def scenario(dcs: int, gbps: float, model: str) -> dict:
    names = [f"dc-{c}" for c in "abc"[:dcs]]
    return {"name": f"emulated-{dcs}dc-{gbps * 1e3:g}mbit",
            "datacenters": [{"name": n, "gpus": {"cpu": 1}} for n in names],
            "wan": [{"a": a, "b": b, "gbps": gbps, "rtt_ms": RTT_MS} for i, a in enumerate(names) for b in names[i + 1:]],
            "model": model, "global_batch": GLOBAL_BATCH[dcs], "micro_batch": MICRO_BATCH, "seq": SEQ, "dtype": "fp32",
            "inference": INFERENCE}


def run_cmd(args: list[str], env: dict, what: str, timeout_s: float = RUN_TIMEOUT_S) -> str:
    """Run a command (an argument list, no shell) in its own session; its stdout, or RuntimeError with
    the tail of its output. Past the timeout it gets SIGTERM (the launcher tears down), then SIGKILL."""
    proc = subprocess.Popen(args, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            out, err = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, err = proc.communicate()
        raise RuntimeError(f"{what}: still running after {timeout_s:.0f} s, stopped; last output: {err[-800:]}")
    if proc.returncode != 0:
        raise RuntimeError(f"{what}: exit code {proc.returncode}: {(err or out)[-1500:]}")
    return out


def profile(model: str, workers: int, env: dict) -> None:
    """`profiler profile` of the training model with `workers` concurrent processes, into env's data dir."""
    run_cmd([sys.executable, "-m", "profiler", "profile", "--model", model, "--seq", str(SEQ), "--micro-batches",
             PROFILE_SIZES, "--workers", str(workers), "--json"], env, "profile", timeout_s=300)


def dp_plan(geo, rtt: bool):
    """Data parallelism over the geo plan's devices and links: the global batch split evenly
    (micro-batches of MICRO_BATCH), ZeRO-1 with even shards, predicted by predict_dp_plan."""
    from planner.core.memory import MemoryConfig, estimate_memory
    from contracts.plan import Assignment, Plan
    from planner.geo.emulated import model_spec, predict_dp_plan

    devices = geo.cluster.devices()
    n = len(devices)
    if geo.global_batch % (n * MICRO_BATCH):
        raise ValueError(f"global batch {geo.global_batch} does not split evenly over {n} ranks")
    accum = geo.global_batch // (n * MICRO_BATCH)
    spec = model_spec(geo)
    mem = estimate_memory(spec, MemoryConfig(micro_batch=MICRO_BATCH, seq=SEQ, accum_steps=accum, dp=n, zero=1,
                                             shard_fraction=1.0 / n)).peak_bytes
    shares = [1.0 / n] * (n - 1) + [1.0 - (n - 1) / n]
    asg = tuple(Assignment(i, node.name, dev.type, MICRO_BATCH, accum, MICRO_BATCH * accum, shares[i], mem, 0.0,
                           dev.emulated, dev.slowdown, dev.memory_gb) for i, (node, dev) in enumerate(devices))
    draft = Plan(geo.cluster, geo.model, geo.global_batch, geo.seq, geo.dtype, geo.recompute, asg, 0.0, 0.0,
                 zero=1, wan=geo.wan, connections=geo.connections,
                 notes=("bench/geo_real.py: data parallelism over the geo plan's devices and links",))
    it, steps = predict_dp_plan(draft, rtt=rtt)
    return dataclasses.replace(draft, predicted_iteration_s=it, predicted_samples_per_s=geo.global_batch / it,
                               assignments=tuple(dataclasses.replace(a, predicted_step_s=steps[a.device_index])
                                                 for a in asg))


def measured_run(plan_path: str, run_dir: str, steps: int, env: dict, prefill_path: str | None = None) -> dict:
    """Launch one emulated run; its median step after the warm-up and its prefill summaries."""
    from executor.store import read_metrics

    args = [sys.executable, "-m", "executor", "launch", "--plan", plan_path, "--steps", str(steps),
            "--run-dir", run_dir, "--emulate-wan"]
    if prefill_path is not None:
        args += ["--prefill", prefill_path]
    t0 = time.perf_counter()
    run_cmd(args, env, f"launch {os.path.basename(run_dir)}")
    wall = time.perf_counter() - t0
    old = os.environ.get("GPUMIX_DATA_DIR")
    os.environ["GPUMIX_DATA_DIR"] = env["GPUMIX_DATA_DIR"]
    try:
        metrics = read_metrics(run_dir)
    finally:
        if old is None:
            os.environ.pop("GPUMIX_DATA_DIR", None)
        else:
            os.environ["GPUMIX_DATA_DIR"] = old
    step_s = [s["step_s"] for s in metrics["steps"] if s.get("step_s") is not None]
    if len(step_s) <= WARMUP_STEPS:
        raise RuntimeError(f"{run_dir}: {len(step_s)} steps recorded, need more than the {WARMUP_STEPS} of warm-up")
    prefill = []
    for name in sorted(os.listdir(run_dir)):
        if name.startswith("prefill_rank") and name.endswith(".json"):
            with open(os.path.join(run_dir, name), encoding="utf-8") as fh:
                prefill.append(json.load(fh))
    compute = [r["median_compute_s"] for r in metrics.get("ranks") or [] if r.get("median_compute_s") is not None]
    return {"run_dir": run_dir, "status": metrics["status"], "steps": step_s,
            "compute_s": statistics.fmean(compute) if compute else None,
            "median_step_s": statistics.median(step_s[WARMUP_STEPS:]), "launch_wall_s": wall, "prefill": prefill}


def op_totals(plan_sim_ops, run_dir: str) -> list[dict]:
    """Per stage and op: seconds in the step, measured (the run's timeline.json, mean over a stage's
    replicas) beside simulated (the plan's simulation): where a prediction error comes from."""
    with open(os.path.join(run_dir, "timeline.json"), encoding="utf-8") as fh:
        timeline = json.load(fh)
    def totals(rows):
        out, reps = {}, {}
        for r in rows:
            key = (r["stage"], r["op"])
            out[key] = out.get(key, 0.0) + r["end_s"] - r["start_s"]
            reps.setdefault(r["stage"], set()).add(r["replica"])
        return {k: v / len(reps[k[0]]) for k, v in out.items()}
    meas = totals([{"stage": r["stage"], "replica": r["dp_index"], **o} for r in timeline["ranks"] for o in r["ops"]])
    sim = totals(plan_sim_ops)
    span = max(o["end_s"] for r in timeline["ranks"] for o in r["ops"])
    return [{"stage": s, "op": op, "measured_s": meas.get((s, op)), "simulated_s": sim.get((s, op)),
             "step": timeline.get("step"), "measured_span_s": span}
            for s, op in sorted(set(meas) | set(sim))]


def prefill_figures(runs: list[dict]) -> dict:
    """Over the prefill runs: tokens/s (every rank's tokens over its wall time, summed over ranks, the
    median over runs), TTFT mean and p99 (the worst rank's, the median over runs), requests done."""
    def med(xs):
        xs = [x for x in xs if x is not None]
        return statistics.median(xs) if xs else None

    per_run = []
    for r in runs:
        s = r["prefill"]
        per_run.append({
            "tokens_per_s": sum(p["prefill_tokens_per_s"] or 0.0 for p in s) if s else None,
            "tokens_per_busy_s": med([p["prefill_tokens_per_busy_s"] for p in s]),
            "ttft_mean_s": max((p["ttft_mean_s"] for p in s if p["ttft_mean_s"] is not None), default=None),
            "ttft_p99_s": max((p["ttft_p99_s"] for p in s if p["ttft_p99_s"] is not None), default=None),
            "requests_done": sum(p["requests_done"] for p in s),
            "requests_arrived": sum(p["requests_arrived"] for p in s),
            "chunk_max_s": max((p["chunk_max_s"] for p in s if p["chunk_max_s"] is not None), default=None),
            "chunks_over_box": sum(p["chunks_over_box"] for p in s), "num_chunks": sum(p["num_chunks"] for p in s),
            "chunks_over_box_cpu_time": sum(p.get("chunks_over_box_cpu_time") or 0 for p in s),
            "ranks": len(s)})
    return {k: med([p[k] for p in per_run]) for k in per_run[0]} if per_run else {}


def bench(dcs: int, gbps: float, steps: int, work: str, repeats: int) -> dict:
    data = os.path.join(work, "data")
    os.makedirs(data, exist_ok=True)
    env = {**os.environ, "GPUMIX_DATA_DIR": data, "PYTHONPATH": ROOT}
    os.environ["GPUMIX_DATA_DIR"] = data  # the in-process predictions read the same profile store
    from executor.wan import probe_netem
    from contracts.plan import Plan
    from planner.geo.emulated import simulate_plan

    load_before = os.getloadavg()[0]
    workers = 1 if dcs <= (os.cpu_count() or 1) else dcs
    model = write_model(work)
    log(f"profiling {MODEL_NAME} (seq {SEQ}) with {workers} worker(s) ...")
    profile(model, workers, env)
    scn = scenario(dcs, gbps, model)
    scn_path, geo_path = os.path.join(work, "scenario.json"), os.path.join(work, "geo_plan.json")
    with open(scn_path, "w", encoding="utf-8") as fh:
        json.dump(scn, fh, indent=1)
    report = json.loads(run_cmd([sys.executable, "-m", "planner", "geo", "--scenario", scn_path, "--out", geo_path,
                                 "--json"], env, "planner geo"))
    geo = Plan.load(geo_path)
    if geo.pipeline is None:
        raise RuntimeError(f"planner geo chose a one-stage plan for {scn['name']}: nothing to pipeline")
    netem = probe_netem()  # None: the kernel adds the RTT, so the prediction counts it
    rtt = netem is None
    geo_sim = simulate_plan(geo, rtt=rtt)
    geo_pred = geo_sim.iteration_s
    dp = dp_plan(geo, rtt)
    dp_pred = dp.predicted_iteration_s
    dp_path = os.path.join(work, "dp_plan.json")
    dp.save(dp_path)
    prefill_path = os.path.join(work, "prefill.json")
    with open(prefill_path, "w", encoding="utf-8") as fh:
        json.dump({**INFERENCE, "max_chunk_s": MAX_CHUNK_S}, fh)

    runs = os.path.join(work, "runs")
    plain, with_prefill = [], []
    for k in range(repeats):  # ABAB: without and with prefill side by side
        log(f"geo plan, run {k + 1}/{repeats}: without prefill ...")
        plain.append(measured_run(geo_path, os.path.join(runs, f"geo-{k}"), steps, env))
        log(f"geo plan, run {k + 1}/{repeats}: with prefill ...")
        with_prefill.append(measured_run(geo_path, os.path.join(runs, f"geo-prefill-{k}"), steps, env, prefill_path))
    log("data-parallel plan across the same links ...")
    dp_run = measured_run(dp_path, os.path.join(runs, "dp"), DP_STEPS, env)

    # the same profile once more after the runs, into a store of its own: how far the machine's speed
    # drifted while they ran (the prediction above used the profile taken before them)
    after = os.path.join(work, "data-after")
    log("profiling again after the runs ...")
    profile(model, workers, {**env, "GPUMIX_DATA_DIR": after})
    geo_pred_after = simulate_plan(geo, os.path.join(after, "profiles"), rtt=rtt).iteration_s
    load_after = os.getloadavg()[0]

    geo_meas = statistics.median(r["median_step_s"] for r in plain)
    pre_meas = statistics.median(r["median_step_s"] for r in with_prefill)
    stages = [f"{st.datacenter}:{st.num_layers}L" for st in geo.pipeline.stages]
    pre = prefill_figures(with_prefill)
    out = {
        "scenario": scn["name"], "kind": "measured on emulated datacenters (CPU ranks, tc tbf links)",
        "rtt": "added (netem)" if rtt else f"not emulated and left out of the prediction ({netem})",
        "geo_plan": {"stages": stages, "schedule": geo.pipeline.schedule,
                     "num_microbatches": geo.pipeline.num_microbatches, "connections": geo.connections},
        "load_average_before": load_before, "load_average_after": load_after,
        "geo_predicted_s": geo_pred, "geo_predicted_in_plan_file_s": geo.predicted_iteration_s,
        "geo_predicted_after_runs_s": geo_pred_after,
        "geo_measured_s": geo_meas, "geo_error": (geo_meas - geo_pred) / geo_pred,
        "dp_predicted_s": dp_pred, "dp_measured_s": dp_run["median_step_s"],
        "dp_error": (dp_run["median_step_s"] - dp_pred) / dp_pred,
        "geo_speedup_vs_dp_measured": dp_run["median_step_s"] / geo_meas,
        "geo_speedup_vs_dp_predicted": dp_pred / geo_pred,
        "geo_with_prefill_measured_s": pre_meas, "prefill_slowdown": pre_meas / geo_meas,
        "prefill": pre,
        "ops_by_stage": op_totals(geo_sim.ops, plain[0]["run_dir"]),
        # the machine's speed in each run: the ranks' compute per step (their threads' CPU time, the
        # median over steps, the mean over ranks) against the prediction's forward + backward per rank
        "compute_per_step_s": {os.path.basename(r["run_dir"]): r["compute_s"] for r in [*plain, *with_prefill]},
        "compute_per_step_predicted_s": statistics.fmean(
            sum(o["end_s"] - o["start_s"] for o in geo_sim.ops if o["op"] in ("forward", "backward")
                and (o["stage"], o["replica"]) == key)
            for key in {(o["stage"], o["replica"]) for o in geo_sim.ops}),
        "prefill_simulated": {"tokens_per_s": report.get("prefill_tokens_per_s"),
                              "gpu_utilization": report.get("gpu_utilization"),
                              "gpu_utilization_with_prefill": report.get("gpu_utilization_with_prefill")},
        "runs": {"geo": [r["steps"] for r in plain], "geo_prefill": [r["steps"] for r in with_prefill],
                 "dp": dp_run["steps"]},
        "status": {os.path.basename(r["run_dir"]): r["status"] for r in [*plain, *with_prefill, dp_run]},
    }
    out["checks"] = {
        "geo_within_15pct_of_prediction": abs(out["geo_error"]) <= TARGET_ERROR,
        "geo_faster_than_dp_measured": out["geo_speedup_vs_dp_measured"] > 1.0,
        "step_with_prefill_le_1.05x": out["prefill_slowdown"] <= TARGET_PREFILL_SLOWDOWN,
        "prefill_served_requests": (pre.get("requests_done") or 0) > 0,
    }
    return out


def fmt_s(x) -> str:
    return "-" if x is None else f"{x:.3f} s"


def print_report(r: dict) -> None:
    print(f"Geo plan on emulated datacenters — {r['scenario']} ({r['kind']}); RTT {r['rtt']}")
    g = r["geo_plan"]
    print(f"geo plan: stages {' -> '.join(g['stages'])}, {g['schedule']}, {g['num_microbatches']} micro-batches, "
          f"connections {g['connections']}")
    rows = [("geo plan", r["geo_measured_s"], r["geo_predicted_s"], r["geo_error"]),
            ("data parallel, same links", r["dp_measured_s"], r["dp_predicted_s"], r["dp_error"]),
            ("geo plan + prefill", r["geo_with_prefill_measured_s"], None, None)]
    print(f"{'plan':28} {'measured (median step)':>24} {'predicted':>12} {'error':>8}")
    for name, m, p, e in rows:
        print(f"{name:28} {fmt_s(m):>24} {fmt_s(p):>12} {('-' if e is None else f'{100 * e:+.1f} %'):>8}")
    print(f"geo plan predicted from the profile taken after the runs: {fmt_s(r['geo_predicted_after_runs_s'])} "
          f"(the machine's drift while they ran); load average {r['load_average_before']:.1f} before, "
          f"{r['load_average_after']:.1f} after")
    print(f"geo vs DP: {r['geo_speedup_vs_dp_measured']:.2f}x faster measured "
          f"({r['geo_speedup_vs_dp_predicted']:.2f}x predicted)")
    print(f"training step with prefill / without: {r['prefill_slowdown']:.3f}x (measured, ABAB)")
    ops = r["ops_by_stage"]
    if ops:
        print(f"per stage and op, seconds in step {ops[0]['step']} of the first geo run (span "
              f"{ops[0]['measured_span_s']:.3f} s measured) against the plan's simulated iteration:")
        for o in ops:
            print(f"  stage {o['stage']} {o['op']:10} measured {fmt_s(o['measured_s']):>9}  "
                  f"simulated {fmt_s(o['simulated_s']):>9}")
    cps = ", ".join(f"{k} {fmt_s(v)}" for k, v in r["compute_per_step_s"].items())
    print(f"ranks' compute per step (CPU time, measured): {cps}; predicted {fmt_s(r['compute_per_step_predicted_s'])}")
    p, s = r["prefill"], r["prefill_simulated"]
    if p:
        print(f"prefill (measured): {p['tokens_per_s']:.0f} tokens/s over the run ({p['tokens_per_busy_s']:.0f} per busy "
              f"second), {p['requests_done']} of {p['requests_arrived']} requests done on {p['ranks']} ranks, "
              f"TTFT mean {fmt_s(p['ttft_mean_s'])}, p99 {fmt_s(p['ttft_p99_s'])}; longest chunk "
              f"{fmt_s(p['chunk_max_s'])}, {p['chunks_over_box']:g} of {p['num_chunks']:g} chunks over the "
              f"{MAX_CHUNK_S * 1e3:g} ms box by wall time, {p['chunks_over_box_cpu_time']:g} by CPU time")
    if s.get("tokens_per_s") is not None:
        print(f"prefill (BubbleTea, simulated for the scenario): {s['tokens_per_s']:.0f} tokens/s; utilization "
              f"{100 * s['gpu_utilization']:.1f} % training only, {100 * s['gpu_utilization_with_prefill']:.1f} % "
              "with prefill")
    for name, ok in r["checks"].items():
        print(f"{'PASS' if ok else 'FAIL'}  {name}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dcs", type=int, choices=(2, 3), default=2, help="datacenters, one CPU rank each")
    ap.add_argument("--gbps", type=float, default=0.1, help="WAN link rate in Gbit/s (0.02-0.2)")
    ap.add_argument("--steps", type=int, default=10, help=f"steps per geo run ({WARMUP_STEPS} of warm-up)")
    ap.add_argument("--repeats", type=int, default=2, help="geo runs without/with prefill, alternated")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--keep", metavar="DIR", help="keep the plans and run folders in DIR (default: a temp folder)")
    args = ap.parse_args()
    if not 0.02 <= args.gbps <= 0.2:
        print("--gbps must be within 0.02-0.2 (20-200 Mbit/s)", file=sys.stderr)
        return 2
    if args.steps <= WARMUP_STEPS + 1 or args.repeats < 1:
        print(f"--steps must exceed {WARMUP_STEPS + 1} and --repeats be >= 1", file=sys.stderr)
        return 2
    work = args.keep or tempfile.mkdtemp(prefix="gpumix-geo-real-")
    os.makedirs(work, exist_ok=True)
    t0 = time.perf_counter()
    try:
        r = bench(args.dcs, args.gbps, args.steps, work, args.repeats)
    except (RuntimeError, ValueError) as e:
        print(f"geo_real: {e}", file=sys.stderr)
        return 1
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    r["bench_wall_s"] = time.perf_counter() - t0
    if args.json:
        print(json.dumps(r, indent=2))
    else:
        print_report(r)
        print(f"bench wall time {r['bench_wall_s']:.0f} s")
    return 0 if all(r["checks"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
