"""Geo plans run for real on emulated datacenters, measured beside their predictions.

    sudo python bench/geo_real.py [--part cuts|steps|both] [--link-mbit 10,50,200] [--wall-s 40]
                                  [--scenario S] [--dcs 2|3] [--gbps 0.1] [--steps 20] [--repeats 3]
                                  [--json] [--keep DIR]

CPU ranks, gloo, root for the network namespaces (docs/emulated_wan.md). First the model is
profiled on this machine. Then two parts:

* cuts (DESIGN.md "Geo with low-communication training"): at every --link-mbit rate, `planner geo`
  chooses the kind of the datacenters' cut (pipeline, DiLoCo with its H, or synchronous DP) by
  predicted time to a target loss, and writes the best plan of each kind (`--cut-kind`). Each of the
  three runs with `executor launch --emulate-wan` (a plan Atlas keeps in one datacenter runs as a
  local launch on "localhost", nothing on the WAN) once, for the steps its prediction fits in
  STRETCH x --wall-s, with a validation loss about every 1/VAL_POINTS of --wall-s (`--val-every`;
  DiLoCo's right after an outer step), at a constant learning rate (CONSTANT_LR: the loss at a time
  does not depend on how long the run goes on). The training time W every candidate is judged at,
  measured on the runs' own clock (their recorded step times summed), is one of the coarsest
  candidate's validation times (a DP step over a slow link, DiLoCo's H steps) at or after --wall-s,
  where the other candidates' nearest validation times lie closest (equal_time_points), chosen as if
  every run went on to the latest end; a run that ended before its point nearest that W trains
  again, for the steps its measured step time fits (steps_to_reach). Recorded per candidate:
  the validation loss at its point nearest W, that point's training seconds, and the TCP payload its
  ranks put on the emulated WAN links (the links' interface counters, read inside the namespaces
  while it runs) per token of the whole run. Checks: the planner's
  choice has the lowest measured loss or is within 3 % of it, DiLoCo's WAN bytes per token are at
  most 1/50 of DP's, and the training seconds' longest over shortest is at most 1.1. Output:
  {"links": [{"mbit", "loss_at_equal_time": {"dp", "pipeline", "diloco"}, "chosen",
  "wan_bytes_per_token": {...}, "train_s", "wall_s_common", ...}]}.
* steps: plan a 2- or 3-datacenter scenario at --gbps with `planner geo --cut-kind pipeline --out`;
  then --repeats times, as the README's command-line path profiles it: `profiler profile --plan` (the
  plan's devices timed together, then its stages run as they will), the same plan file simulated on
  that newest profile (planner/geo/emulated.py: what `planner geo --out` writes for it; the bench does
  not plan again, so every round judges one plan), the geo plan launched, and the geo plan with `--prefill` (ABAB); last the
  data-parallel plan over the same links, priced on the newest profile. Prints every geo run's
  measured median step against the prediction made right before it (target: each within 15 %), the
  geo plan's measured speedup over DP (target: > 1), the step with prefill over without (target:
  <= 1.05), and prefill tokens/s and TTFT beside BubbleTea's simulated figure.

Sized for 2 cores (at most 3 ranks, an 8-layer width-256 GPT-2 style model): cuts ~50 min, steps ~6 min.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
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


def profile_plan(plan_path: str, env: dict) -> dict:
    """`profiler profile --plan`: the plan's devices timed together, then its stages run as they will
    (docs/profiler.md), into env's data dir; its JSON."""
    return json.loads(run_cmd([sys.executable, "-m", "profiler", "profile", "--plan", plan_path, "--json"], env,
                              "profile --plan", timeout_s=300))


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



def read_metrics_in(run_dir: str, data_dir: str) -> dict:
    """executor.store.read_metrics of a run whose store lives under the data folder `data_dir`."""
    from executor.store import read_metrics

    old = os.environ.get("GPUMIX_DATA_DIR")
    os.environ["GPUMIX_DATA_DIR"] = data_dir
    try:
        return read_metrics(run_dir)
    finally:
        if old is None:
            os.environ.pop("GPUMIX_DATA_DIR", None)
        else:
            os.environ["GPUMIX_DATA_DIR"] = old


def measured_run(plan_path: str, run_dir: str, steps: int, env: dict, prefill_path: str | None = None) -> dict:
    """Launch one emulated run; its median step after the warm-up and its prefill summaries."""
    args = [sys.executable, "-m", "executor", "launch", "--plan", plan_path, "--steps", str(steps),
            "--run-dir", run_dir, "--emulate-wan"]
    if prefill_path is not None:
        args += ["--prefill", prefill_path]
    t0 = time.perf_counter()
    run_cmd(args, env, f"launch {os.path.basename(run_dir)}")
    wall = time.perf_counter() - t0
    metrics = read_metrics_in(run_dir, env["GPUMIX_DATA_DIR"])
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


def bench_env(work: str) -> dict:
    """The runs' environment: a data dir of the bench's own (profiles, runs' store) under `work`."""
    data = os.path.join(work, "data")
    os.makedirs(data, exist_ok=True)
    os.environ["GPUMIX_DATA_DIR"] = data  # the in-process predictions read the same profile store
    return {**os.environ, "GPUMIX_DATA_DIR": data, "PYTHONPATH": ROOT}


def profiled_model(dcs: int, work: str, env: dict) -> tuple[str, int]:
    """The training model written and profiled: (its config path, the profile's workers)."""
    workers = 1 if dcs <= (os.cpu_count() or 1) else dcs
    model = write_model(work)
    log(f"profiling {MODEL_NAME} (seq {SEQ}) with {workers} worker(s) ...")
    profile(model, workers, env)
    return model, workers


def bench(dcs: int, gbps: float, steps: int, work: str, repeats: int, env: dict, model: str, workers: int) -> dict:
    from executor.wan import probe_netem
    from contracts.plan import Plan
    from planner.geo.emulated import simulate_plan

    load_before = os.getloadavg()[0]
    scn = scenario(dcs, gbps, model)
    scn_path, geo_path = os.path.join(work, "scenario.json"), os.path.join(work, "geo_plan.json")
    with open(scn_path, "w", encoding="utf-8") as fh:
        json.dump(scn, fh, indent=1)
    report = json.loads(run_cmd([sys.executable, "-m", "planner", "geo", "--scenario", scn_path, "--out", geo_path,
                                 "--cut-kind", "pipeline", "--json"], env, "planner geo"))
    geo = Plan.load(geo_path)
    if geo.pipeline is None:
        raise RuntimeError(f"planner geo chose a one-stage plan for {scn['name']}: nothing to pipeline")
    netem = probe_netem()  # None: the kernel adds the RTT, so the prediction counts it
    rtt = netem is None
    prefill_path = os.path.join(work, "prefill.json")
    with open(prefill_path, "w", encoding="utf-8") as fh:
        json.dump({**INFERENCE, "max_chunk_s": MAX_CHUNK_S}, fh)

    # every run as the README's command-line path takes it: `profiler profile --plan` (the plan's devices
    # timed together, as the run trains them), the plan file simulated on that newest profile, then the
    # launch; each plain run is judged against the prediction made right before it
    runs = os.path.join(work, "runs")
    plain, with_prefill, geo_sims = [], [], []
    for k in range(repeats):  # ABAB: without and with prefill side by side
        log(f"run {k + 1}/{repeats}: profiler profile --plan (the plan's devices together) ...")
        stage_run = [st.get("run_step_s") for st in profile_plan(geo_path, env).get("stages") or []]
        geo_sims.append(simulate_plan(geo, rtt=rtt))
        log(f"run {k + 1}/{repeats}: geo plan without prefill (predicted {geo_sims[-1].iteration_s:.3f} s) ...")
        plain.append(measured_run(geo_path, os.path.join(runs, f"geo-{k}"), steps, env))
        plain[-1]["predicted_s"] = geo_sims[-1].iteration_s
        plain[-1]["stage_run_step_s"] = stage_run[0] if stage_run else None
        log(f"run {k + 1}/{repeats}: geo plan with prefill ...")
        with_prefill.append(measured_run(geo_path, os.path.join(runs, f"geo-prefill-{k}"), steps, env, prefill_path))
    geo_sim = geo_sims[0]
    geo_pred = statistics.median(r["predicted_s"] for r in plain)
    dp = dp_plan(geo, rtt)  # priced on the newest profile, like the geo runs
    dp_pred = dp.predicted_iteration_s
    dp_path = os.path.join(work, "dp_plan.json")
    dp.save(dp_path)
    log("data-parallel plan across the same links ...")
    dp_run = measured_run(dp_path, os.path.join(runs, "dp"), DP_STEPS, env)
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
        "geo_measured_s": geo_meas, "geo_error": (geo_meas - geo_pred) / geo_pred,
        "geo_runs": [{"predicted_s": r["predicted_s"], "measured_s": r["median_step_s"],
                      "stage_run_step_s": r["stage_run_step_s"],
                      "error": (r["median_step_s"] - r["predicted_s"]) / r["predicted_s"]} for r in plain],
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
        "geo_every_run_within_15pct_of_its_prediction": all(abs(g["error"]) <= TARGET_ERROR for g in out["geo_runs"]),
        "geo_faster_than_dp_measured": out["geo_speedup_vs_dp_measured"] > 1.0,
        "step_with_prefill_le_1.05x": out["prefill_slowdown"] <= TARGET_PREFILL_SLOWDOWN,
        "prefill_served_requests": (pre.get("requests_done") or 0) > 0,
    }
    return out


# ---- the cuts part: pipeline, DiLoCo and DP at equal wall time ------------------------------------
KINDS = ("dp", "pipeline", "diloco")
TARGET_LOSS_MARGIN = 0.03  # the choice's measured loss within 3 % of the best
TARGET_BYTES_RATIO = 1 / 50  # DiLoCo's WAN bytes per token at most 1/50 of DP's
POLL_S = 0.1  # how often the WAN links' counters are read while a run trains
MIN_STEPS = 1
VAL_POINTS = 20  # validation points per asked wall time: a candidate's loss is read every ~1/20 of it
STRETCH = 3.0  # every candidate trains for the steps its prediction fits in STRETCH x the asked wall time
TARGET_TIME_RATIO = 1.1  # the candidates' training seconds at the points compared, longest over shortest
# the learning rate constant from the first step: a candidate's loss at W then does not depend on how
# long its run goes on past W (a cosine schedule would still be higher in a longer run)
CONSTANT_LR = ("--warmup-steps", "0", "--min-lr-ratio", "1")
RUN_TIMEOUT_STRETCH = 5.0  # a cuts run is stopped after this many times its predicted training time


def read_wan_counters(setup) -> dict[str, tuple[int, int]]:
    """(tx_bytes, tx_packets) of every WAN interface of every namespace of `setup`, read inside it
    (/proc/net/dev follows the reader's namespace); an interface already gone is left out."""
    out = {}
    for i, node in enumerate(setup.nodes):
        try:
            r = subprocess.run(setup.exec_prefix(i) + ["cat", "/proc/net/dev"], capture_output=True, text=True,
                               timeout=5)
        except subprocess.TimeoutExpired:
            continue
        if r.returncode != 0:
            continue
        for line in r.stdout.splitlines()[2:]:
            name, _, rest = line.partition(":")
            if name.strip().startswith("wan"):
                f = rest.split()
                out[f"{node}/{name.strip()}"] = (int(f[8]), int(f[9]))
    return out


def one_datacenter_here(plan):
    """A plan whose used devices sit in one datacenter, as a plan for this machine: its node named
    "localhost" (a local launch; nothing crosses a WAN), or None when it uses several nodes."""
    used = {a.node for a in plan.assignments if a.used}
    if len(used) != 1:
        return None
    [dc] = used
    nodes = tuple(dataclasses.replace(n, name="localhost") for n in plan.cluster.nodes if n.name == dc)
    if len(nodes) != len(plan.cluster.nodes):
        raise ValueError(f"one-datacenter plan: its cluster has nodes besides {dc!r}")
    pipe = plan.pipeline
    if pipe is not None:
        pipe = dataclasses.replace(pipe, stages=tuple(dataclasses.replace(st, datacenter="localhost")
                                                      for st in pipe.stages))
    return dataclasses.replace(plan, cluster=dataclasses.replace(plan.cluster, nodes=nodes), pipeline=pipe,
                               assignments=tuple(dataclasses.replace(a, node="localhost") for a in plan.assignments),
                               wan=(), connections={}, cuts=())


def counted_run(plan_path: str, run_dir: str, steps: int, env: dict, emulate: bool = True,
                val_every: int | None = None, timeout_s: float = RUN_TIMEOUT_S, extra_args: tuple = ()) -> dict:
    """Launch one emulated run and read its WAN links' counters every POLL_S until it ends: the TCP
    payload its ranks sent over the WAN (netns.payload_bytes of the last reading), whether the
    counters had stopped moving before the links were removed (`counters_settled`), its steps and
    its validation points (`executor launch --val-every`; default: the launcher's).
    Without `emulate` (a one-datacenter plan) a plain local launch: no WAN, 0 bytes on it."""
    from executor import netns
    from executor.wan import WAN_FILE, WanSetup

    args = [sys.executable, "-m", "executor", "launch", "--plan", plan_path, "--steps", str(steps),
            "--run-dir", run_dir] + (["--emulate-wan"] if emulate else []) + (
        ["--val-every", str(val_every)] if val_every is not None else []) + list(extra_args)
    proc = subprocess.Popen(args, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    t0, setup, last, prev = time.perf_counter(), None, {}, {}
    try:
        while proc.poll() is None:
            if time.perf_counter() - t0 > timeout_s:
                os.killpg(proc.pid, signal.SIGTERM)
                proc.wait(timeout=30)
                raise RuntimeError(f"launch {os.path.basename(run_dir)}: still running after {timeout_s:.0f} s, stopped")
            if setup is None and os.path.exists(os.path.join(run_dir, WAN_FILE)):
                with contextlib.suppress(ValueError, KeyError, OSError):
                    setup = WanSetup.load(os.path.join(run_dir, WAN_FILE))
            if setup is not None:
                now = read_wan_counters(setup)
                if now:
                    prev, last = last, {**last, **now}
            time.sleep(POLL_S)
        out, err = proc.communicate()
    except BaseException:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        raise
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"launch {os.path.basename(run_dir)}: exit code {proc.returncode}: {(err or out)[-1500:]}")
    metrics = read_metrics_in(run_dir, env["GPUMIX_DATA_DIR"])
    if emulate and not last:
        raise RuntimeError(f"{run_dir}: the WAN links' counters were never read (no {WAN_FILE}?)")
    steps_rec = metrics["steps"]
    vals = [s["val_loss"] for s in steps_rec if s.get("val_loss") is not None]
    return {"run_dir": run_dir, "status": metrics["status"], "steps": len(steps_rec),
            "step_s": [s["step_s"] for s in steps_rec if s.get("step_s") is not None],
            "train_s": sum(s["step_s"] for s in steps_rec if s.get("step_s") is not None),
            "val_loss": vals[-1] if vals else None,
            "val_points": val_points(steps_rec),
            "loss_curve": loss_curve(steps_rec),
            "wan_payload_bytes": sum(netns.payload_bytes(b, p) for b, p in last.values()),
            "counters_settled": (bool(prev) and all(prev.get(k) == v for k, v in last.items())) if emulate else None,
            "launch_wall_s": wall}


def loss_curve(steps: list[dict]) -> list[list[float]]:
    """[training seconds so far (the steps' step_s summed), step, training loss] per recorded step."""
    out, t = [], 0.0
    for s in steps:
        t += s.get("step_s") or 0.0
        out.append([t, s["step"], s["loss"]])
    return out


def val_points(steps: list[dict]) -> list[tuple[float, int, float]]:
    """(training seconds through the step: its and the earlier steps' step_s summed, step, validation
    loss) of every recorded step that took a validation loss."""
    out, t = [], 0.0
    for s in steps:
        t += s.get("step_s") or 0.0
        if s.get("val_loss") is not None:
            out.append((t, s["step"], s["val_loss"]))
    return out


def steps_for(plan, wall_s: float) -> int:
    """The steps the plan's prediction fits in `wall_s`, rounded up; a DiLoCo plan's up to whole H, at
    least one round (its validation then follows an outer step, whose time the run measures)."""
    n = max(MIN_STEPS, math.ceil(wall_s / plan.predicted_iteration_s))
    if plan.diloco is not None:
        n = plan.diloco.inner_steps * max(1, math.ceil(n / plan.diloco.inner_steps))
    return n


def val_every_for(plan, wall_s: float) -> int:
    """Steps between validation points: about VAL_POINTS per `wall_s` by the plan's prediction; a
    DiLoCo plan's a whole number of rounds (each point just after an outer step)."""
    k = max(1, round(wall_s / VAL_POINTS / plan.predicted_iteration_s))
    if plan.diloco is not None:
        h = plan.diloco.inner_steps
        k = h * max(1, round(k / h))
    return k


def extended(points: dict[str, list[tuple[float, int, float]]]) -> dict[str, list[tuple]]:
    """Every candidate's points, continued past its last at its median gap (as (time, None, None))
    up to the latest last point of any candidate: where a run that ended early would have its
    points had it trained on (the time W is then chosen as if every run reached it)."""
    until = max(p[-1][0] for p in points.values() if p)
    out = {}
    for k, p in points.items():
        p = list(p)
        if p:
            g = statistics.median(b[0] - a[0] for a, b in zip(p, p[1:])) if len(p) > 1 else p[0][0]
            while g > 0 and p[-1][0] + g <= until * (1 + 1e-9):
                p.append((p[-1][0] + g, None, None))
        out[k] = p
    return out


def steps_to_reach(run: dict, t: float, inner_steps: int | None) -> int:
    """The steps that train `t` seconds (and 5 % more) at the run's measured mean step time; DiLoCo's
    up to whole rounds of H."""
    mean = run["train_s"] / max(1, run["steps"])
    n = max(run["steps"] + 1, math.ceil(1.05 * t / mean))
    if inner_steps:
        n = inner_steps * math.ceil(n / inner_steps)
    return n


def equal_time_points(points: dict[str, list[tuple[float, int, float]]], wall_s: float) -> tuple[float, dict]:
    """The common training time W and, per candidate, its validation point nearest W. W is one of the
    coarsest candidate's point times (the widest median gap between points: a DP step over a slow
    link, DiLoCo's H steps), at or after `wall_s` where one lies no later than every candidate's last
    point; of those, the one where the chosen points' times lie closest together (longest over
    shortest, to 1 %), the earliest of equals. ValueError naming a candidate without a point."""
    empty = [k for k, p in points.items() if not p]
    if empty:
        raise ValueError(f"no validation point recorded by {', '.join(empty)}")

    def gap(p):
        return statistics.median(b[0] - a[0] for a, b in zip(p, p[1:])) if len(p) > 1 else p[0][0]

    coarsest = max(points, key=lambda k: gap(points[k]))
    last = min(p[-1][0] for p in points.values())
    times = [t for t, _, _ in points[coarsest] if t <= last * (1 + 1e-9)] or [points[coarsest][0][0]]
    later = [t for t in times if t >= wall_s]
    times = later or times

    def nearest(t: float) -> dict:
        return {k: min(p, key=lambda x: abs(x[0] - t)) for k, p in points.items()}

    def spread(t: float) -> float:
        ts = [x[0] for x in nearest(t).values()]
        return max(ts) / min(ts)

    w = min(times, key=lambda t: (round(spread(t), 2), t))
    return w, nearest(w)


def link_comparison(mbit: float, template: dict, wall_s: float, work: str, env: dict) -> dict:
    """At `mbit` Mbit/s: the planner's choice, and the best plan of every kind run for `wall_s`."""
    from contracts.plan import Plan

    scn = {**template, "name": f"{template.get('name', 'geo')}-{mbit:g}mbit",
           "wan": [{**l, "gbps": mbit / 1e3} for l in template["wan"]]}
    folder = os.path.join(work, f"link-{mbit:g}")
    os.makedirs(folder, exist_ok=True)
    scn_path = os.path.join(folder, "scenario.json")
    with open(scn_path, "w", encoding="utf-8") as fh:
        json.dump(scn, fh, indent=1)
    geo = [sys.executable, "-m", "planner", "geo", "--scenario", scn_path, "--no-baselines", "--json"]
    auto = json.loads(run_cmd(geo + ["--out", os.path.join(folder, "chosen.json")], env, "planner geo"))
    choice = auto["cut_choice"]
    chosen = next(c for c in choice["candidates"] if c["name"] == choice["chosen"])
    chosen_key = chosen["kind"]
    runs, plans, paths, emulated, every = {}, {}, {}, {}, {}
    timeout_s = max(RUN_TIMEOUT_S, RUN_TIMEOUT_STRETCH * STRETCH * wall_s)
    for kind in KINDS:  # each for the steps its prediction fits in STRETCH x wall_s, validated on the way
        path = os.path.join(folder, f"{kind}.json")
        run_cmd(geo + ["--cut-kind", kind, "--out", path], env, f"planner geo --cut-kind {kind}")
        plans[kind] = Plan.load(path)
        n, every[kind] = steps_for(plans[kind], STRETCH * wall_s), val_every_for(plans[kind], wall_s)
        here = one_datacenter_here(plans[kind])
        if here is not None:
            path = os.path.join(folder, f"{kind}-localhost.json")
            here.save(path)
        paths[kind], emulated[kind] = path, here is None
        log(f"{mbit:g} Mbit/s: {kind} for {n} steps, validated every {every[kind]} (predicted "
            f"{plans[kind].predicted_iteration_s:.3f} s each" + (", one datacenter: a local launch" if here is not None
                                                                 else "") + ") ...")
        runs[kind] = counted_run(path, os.path.join(folder, "runs", kind), n, env, emulate=here is None,
                                 val_every=every[kind], timeout_s=timeout_s, extra_args=CONSTANT_LR)
    # W as if every run reached the latest end; a run that ended before its point nearest W trains
    # again, long enough by its measured step time, then W is chosen on the points measured
    _, wanted = equal_time_points(extended({k: runs[k]["val_points"] for k in KINDS}), wall_s)
    for kind in KINDS:
        if wanted[kind][1] is not None:
            continue
        inner = plans[kind].diloco.inner_steps if plans[kind].diloco else None
        n = steps_to_reach(runs[kind], wanted[kind][0], inner)
        log(f"{mbit:g} Mbit/s: {kind} ended at {runs[kind]['train_s']:.1f} s, before {wanted[kind][0]:.1f} s: "
            f"again for {n} steps ...")
        runs[kind] = counted_run(paths[kind], os.path.join(folder, "runs", f"{kind}-2"), n, env,
                                 emulate=emulated[kind], val_every=every[kind], timeout_s=timeout_s,
                                 extra_args=CONSTANT_LR)
    common, at = equal_time_points({k: runs[k]["val_points"] for k in KINDS}, wall_s)
    tokens = {k: at[k][1] * plans[k].global_batch * plans[k].seq for k in KINDS}  # trained by the point
    loss = {k: at[k][2] for k in KINDS}
    run_tokens = {k: r["steps"] * plans[k].global_batch * plans[k].seq for k, r in runs.items()}
    per_token = {k: runs[k]["wan_payload_bytes"] / run_tokens[k] for k in KINDS}  # the whole run's
    best = min(loss, key=lambda k: loss[k])
    train_s = {k: at[k][0] for k in KINDS}
    ratio = max(train_s.values()) / min(train_s.values())
    dl = plans["diloco"].diloco
    pipe = plans["pipeline"].pipeline
    return {
        "mbit": mbit, "chosen": chosen_key, "chosen_plan": chosen["name"],
        "predicted_time_to_target_s": {c["name"]: c["time_to_target_s"] for c in choice["candidates"]},
        "diloco_inner_steps": dl.inner_steps if dl else None,
        "pipeline_plan": ([f"{st.datacenter}:{st.num_layers}L" for st in pipe.stages] if pipe else
                          "one datacenter (Atlas kept the model in one)"),
        "loss_at_equal_time": loss, "measured_best": best,
        "wan_bytes_per_token": per_token,
        "diloco_over_dp_wan_bytes_per_token": per_token["diloco"] / per_token["dp"] if per_token["dp"] else None,
        "wan_bytes_per_step": {k: runs[k]["wan_payload_bytes"] / runs[k]["steps"]
                                                                 for k in KINDS},
        "steps": {k: at[k][1] for k in KINDS}, "tokens": tokens, "run_steps": {k: r["steps"] for k, r in runs.items()},
        "train_s": train_s, "wall_s_asked": wall_s, "wall_s_common": common,
        "val_points": {k: r["val_points"] for k, r in runs.items()},
        "train_s_max_over_min": ratio,
        "predicted_iteration_s": {k: p.predicted_iteration_s for k, p in plans.items()},
        "counters_settled": {k: r["counters_settled"] for k, r in runs.items()},
        "loss_curves": {k: r["loss_curve"] for k, r in runs.items()},
        "status": {k: r["status"] for k, r in runs.items()},
        "notes": choice.get("notes", []),
        "checks": {
            "choice_best_or_within_3pct": loss[chosen_key] is not None and loss[best] is not None
            and loss[chosen_key] <= loss[best] * (1 + TARGET_LOSS_MARGIN),
            "diloco_wan_bytes_per_token_le_dp_over_50": per_token["diloco"] <= per_token["dp"] * TARGET_BYTES_RATIO,
            "train_s_max_over_min_le_1.1": ratio <= TARGET_TIME_RATIO},
    }


def two_dc_template(model: str, dcs: int) -> dict:
    """The cuts part's default scenario: the steps part's, its link rate set per --link-mbit."""
    return scenario(dcs, 0.1, model)


def print_links(links: list[dict]) -> None:
    print("Per-cut choice against measured loss at equal wall time (emulated WAN, CPU ranks)")
    print(f"{'Mbit/s':>7} {'chosen':>9} {'measured best':>14}  " + "  ".join(f"{k + ' loss':>14}" for k in KINDS)
          + "  " + "  ".join(f"{k + ' B/token':>16}" for k in KINDS))
    for l in links:
        print(f"{l['mbit']:>7g} {l['chosen']:>9} {l['measured_best']:>14}  "
              + "  ".join(f"{l['loss_at_equal_time'][k]:>14.4f}" for k in KINDS) + "  "
              + "  ".join(f"{l['wan_bytes_per_token'][k]:>16.1f}" for k in KINDS))
        print(f"        steps {l['steps']}, training seconds "
              + ", ".join(f"{k} {v:.1f}" for k, v in l["train_s"].items())
              + f" (asked {l['wall_s_asked']:g}, common {l['wall_s_common']:.1f}, max/min {l['train_s_max_over_min']:.2f}); "
              f"DiLoCo H={l['diloco_inner_steps']}")
        for name, ok in l["checks"].items():
            print(f"        {'PASS' if ok else 'FAIL'}  {name}")


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
    for k, g in enumerate(r["geo_runs"]):
        print(f"  geo run {k + 1}: measured {fmt_s(g['measured_s'])}, predicted {fmt_s(g['predicted_s'])} from the "
              f"profile taken right before it: {100 * g['error']:+.1f} % (that profile's stages' run measured "
              f"{fmt_s(g.get('stage_run_step_s'))} a step)")
    print(f"load average {r['load_average_before']:.1f} before, {r['load_average_after']:.1f} after")
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
    ap.add_argument("--part", choices=("cuts", "steps", "both"), default="both",
                    help="cuts: pipeline/DiLoCo/DP at equal wall time per link rate; steps: the geo plan's step checks")
    ap.add_argument("--link-mbit", default="10,50,200", help="cuts part: WAN link rates in Mbit/s, comma separated")
    ap.add_argument("--wall-s", type=float, default=40.0, help="cuts part: the wall time every candidate trains")
    ap.add_argument("--scenario", metavar="S", help="cuts part: a geo scenario JSON whose links take each rate "
                    "(default: the bench's own, --dcs datacenters of one CPU rank)")
    ap.add_argument("--dcs", type=int, choices=(2, 3), default=2, help="datacenters, one CPU rank each")
    ap.add_argument("--gbps", type=float, default=0.1, help="steps part: WAN link rate in Gbit/s (0.02-0.2)")
    ap.add_argument("--steps", type=int, default=20, help=f"steps per geo run ({WARMUP_STEPS} of warm-up)")
    ap.add_argument("--repeats", type=int, default=3,
                    help="steps part: rounds of profile --plan, geo run without prefill, geo run with prefill")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--keep", metavar="DIR", help="keep the plans and run folders in DIR (default: a temp folder)")
    args = ap.parse_args()
    if not 0.02 <= args.gbps <= 0.2:
        print("--gbps must be within 0.02-0.2 (20-200 Mbit/s)", file=sys.stderr)
        return 2
    if args.steps <= WARMUP_STEPS + 1 or args.repeats < 1:
        print(f"--steps must exceed {WARMUP_STEPS + 1} and --repeats be >= 1", file=sys.stderr)
        return 2
    try:
        rates = [float(x) for x in args.link_mbit.split(",")]
    except ValueError:
        rates = []
    if not rates or any(not 1 <= r <= 10_000 for r in rates) or args.wall_s <= 0:
        print("--link-mbit: comma-separated rates within 1-10000 Mbit/s; --wall-s > 0", file=sys.stderr)
        return 2
    template = None
    if args.scenario:
        try:
            with open(args.scenario, encoding="utf-8") as fh:
                template = json.load(fh)
            if not isinstance(template, dict) or not template.get("wan"):
                raise ValueError("a scenario object with wan links")
        except (OSError, ValueError) as e:
            print(f"--scenario {args.scenario}: {e}", file=sys.stderr)
            return 2
    work = args.keep or tempfile.mkdtemp(prefix="gpumix-geo-real-")
    os.makedirs(work, exist_ok=True)
    t0 = time.perf_counter()
    r: dict = {}
    try:
        env = bench_env(work)
        model, workers = profiled_model(args.dcs, work, env)
        if args.part in ("cuts", "both"):
            tpl = template or two_dc_template(model, args.dcs)
            r["links"] = [link_comparison(m, tpl, args.wall_s, work, env) for m in rates]
        if args.part in ("steps", "both"):
            r.update(bench(args.dcs, args.gbps, args.steps, work, args.repeats, env, model, workers))
    except (RuntimeError, ValueError) as e:
        print(f"geo_real: {e}", file=sys.stderr)
        return 1
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    r["bench_wall_s"] = time.perf_counter() - t0
    checks = dict(r.get("checks", {}))
    for l in r.get("links", []):
        checks.update({f"{l['mbit']:g}mbit_{k}": v for k, v in l["checks"].items()})
    if args.json:
        print(json.dumps(r, indent=2))
    else:
        if "links" in r:
            print_links(r["links"])
        if "checks" in r:
            print_report(r)
        print(f"bench wall time {r['bench_wall_s']:.0f} s")
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
