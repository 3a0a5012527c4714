"""GPUMix's sharded runtime against FSDP2 (`torch.distributed.fsdp.fully_shard`) on ranks joined by
emulated links, homogeneous and mixed, side by side.

    python bench/sharded_runtime.py [--model bench-gpt2] [--shares 1,0.333] [--link-gbps 1]
                                    [--steps 6] [--warmup 2] [--global-batch 16] [--micro-batch 6]
                                    [--seq 128] [--dtype bf16] [--cases homogeneous,mixed] [--json]

Every rank is a process (bench/_sharded_rank.py) started inside its own network namespace
(executor/links.py: a veth per rank to a bridge, tc tbf at --link-gbps of TCP payload each way;
0: loopback), in its own cgroup (profiler/cgroups.py: a real CPU quota; the small mixed rank also a
memory limit).

homogeneous: 2 ranks of one core each, one launch: ours (ShardedRuntime, zero 3, even shards,
gathers in the compute dtype, gradients reduced in fp32, its default prefetch) and FSDP2
(MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32), its default prefetching) on the same
weights and token windows, steps alternating AB/BA. Ratios of median step times (slowest rank) and
of peak live tensor bytes (profiler.memtrack, worst rank). The communication left exposed is ours'
measured StepResult.comm_wait_s over the step.

mixed: ranks under CPU quotas of --shares. FSDP2's even configurations (even shards and batch;
micro-batch x accumulation, recompute none/full, reduce-scatter after every micro-batch or only the
last) are each launched under those quotas, the smallest rank's peak memory charge over its
baseline measured by its memory cgroup (every rank allocates with glibc's fixed mmap threshold, so
that charge follows its live tensors). That rank's memory limit is set midway between FSDP2's even
shard with the even batch in one micro-batch and in micro-batches of half of it (so the first
exceeds it); the fastest FSDP2 configuration under the limit is the baseline (the next one where
the kernel OOM-kills it under the real limit). GPUMix's plan comes from planner.entry.plan_job on a
cluster of these devices (quotas; the limit less the charge measured beyond live tensors; the link
rate), profiled together under their quotas (profiler.step_profile.profile_together, bench/_common.py);
its predicted step (the plan's) is checked against the step the ranks time. GPUMix (only the ranks
of the devices its plan uses) and the FSDP2 baseline then run in A B B A launches under the limits,
medians pooled.

Prints one readable table with PASS/FAIL per target, or (--json) one object whose contract keys are
{"homogeneous": {"throughput_ratio", "memory_ratio"}, "mixed": {"throughput_ratio", "fsdp2_config"},
"exposed_comm_share", "step_error"} (ratios GPUMix / FSDP2; step_error = measured / predicted - 1 of
GPUMix's mixed step), with everything measured beside them, and the bench's own duration.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
from bench._common import (emulated_links, hetero_cluster, parse_shares, profile_devices_together,  # noqa: E402
                           profile_rows, write_gpt2_config)
from contracts.specs import ModelSpec, get_model, with_max_seq  # noqa: E402

RANK_SCRIPT = os.path.join(ROOT, "bench", "_sharded_rank.py")
MIB, GIB = 2**20, 2**30
# the targets
HOMOGENEOUS_THROUGHPUT_MIN = 0.95  # GPUMix / FSDP2 samples/s, at least
HOMOGENEOUS_MEMORY_MAX = 1.05  # GPUMix / FSDP2 peak, at most
MIXED_THROUGHPUT_MIN = 1.5  # GPUMix's plan / FSDP2's best even configuration that fits, at least
EXPOSED_COMM_MAX = 0.15  # share of the step, at most, where communication <= compute
STEP_ERROR_MAX = 0.15  # |measured / predicted - 1|, at most
LOSS_REL_MAX = 1e-5  # fp32 only: ours and FSDP2 on the same weights and windows give the same losses
LAUNCH_TIMEOUT_S = 900
# glibc with a fixed mmap threshold (no dynamic raise), for every rank and the profiles alike: a
# freed large tensor goes back to the kernel at once, so a rank's memory charge (what the cgroup
# limit bounds) follows its live tensors plus a steady overhead, not the heap's high-water mark
# (without it the charge of one configuration varied by +-20 MiB around 250 MiB of overhead; with
# it, 90 MiB). It slows every system's compute alike (page faults), the profiles' too.
MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": str(256 * 1024), "MALLOC_TRIM_THRESHOLD_": str(1024 * 1024)}
SCREEN_STEPS = 3  # timed steps of each FSDP2 configuration tried in the mixed case
PROFILE_MICRO_BATCHES = (1, 2, 4, 8)
PROFILE_REPEATS = 2

BENCH_SPECS = {
    # 13.8 M parameters: a step of micro-batch 2 x 128 tokens takes a CPU core about as long as
    # zero 3's bf16 gathers and fp32 reduce-scatter take on a 1 Gbit/s link
    "bench-gpt2": ModelSpec("bench-gpt2", "gpt2", 6, 384, 6, 6, 4 * 384, 8192, 128,
                            tied_embeddings=True, linear_bias=True),
}


def resolve_spec(name: str) -> ModelSpec:
    return BENCH_SPECS[name] if name in BENCH_SPECS else get_model(name)


def median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


# ---- launching ranks ------------------------------------------------------------------------------


class Launcher:
    """Starts one job's ranks inside their namespaces and cgroups; collects what they wrote."""

    def __init__(self, net: Any, root: str):
        self.net, self.root, self.count = net, root, 0

    def run(self, job: dict, limits: list[Any], name: str) -> dict:
        """Run `job` on len(limits) ranks, rank r in namespace r under `limits[r]` (profiler.cgroups.Limits
        or None).
        Returns {"status": "done", "ranks": [...]} or {"status": "oom" | "failed", "reason": ...}."""
        from profiler import cgroups

        self.count += 1
        world = len(limits)
        tag = f"{os.getpid()}-{self.count}"
        job = dict(job, out=os.path.join(self.root, name))
        job_path = os.path.join(self.root, f"{name}.job.json")
        with open(job_path, "w", encoding="utf-8") as fh:
            json.dump(job, fh)
        with contextlib.ExitStack() as stack:
            groups = {r: stack.enter_context(cgroups.created(f"{cgroups.PREFIX}bench-{tag}-r{r}", lim))
                      for r, lim in enumerate(limits) if lim is not None}
            table = os.path.join(self.root, f"{name}.cgroups.json")
            cgroups.save_table(table, "cgroup", "bench/sharded_runtime.py", groups)
            port = 29500 + self.count if self.net.gloo_ifname else _free_port()
            procs = []
            for r in range(world):
                env = dict(os.environ, RANK=str(r), WORLD_SIZE=str(world), MASTER_ADDR=self.net.addrs[0],
                           MASTER_PORT=str(port), OMP_NUM_THREADS="1", PYTHONPATH=ROOT, **MALLOC_ENV)
                env[cgroups.ENV_CGROUPS] = table
                if self.net.gloo_ifname:
                    from executor.links import ENV_LINK_IF
                    env.update(GLOO_SOCKET_IFNAME=self.net.gloo_ifname, **{ENV_LINK_IF: self.net.gloo_ifname})
                log = open(os.path.join(self.root, f"{name}.rank{r}.log"), "wb")
                stack.callback(log.close)
                procs.append(subprocess.Popen([*self.net.exec_prefix(r), sys.executable, RANK_SCRIPT, job_path],
                                              cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT))
            codes = self._wait(procs)
            ooms = {r: cgroups.oom_kills(cg) for r, cg in groups.items()}
        if any(ooms.values()):
            return {"status": "oom", "reason": "OOM-killed: rank(s) " + ", ".join(str(r) for r, k in ooms.items() if k)}
        if any(codes):
            tail = open(os.path.join(self.root, f"{name}.rank{codes.index(next(c for c in codes if c))}.log"),
                        errors="replace").read()[-2000:]
            return {"status": "failed", "reason": f"exit codes {codes}: {tail}"}
        ranks = []
        for r in range(world):
            with open(f"{job['out']}.rank{r}.json", encoding="utf-8") as fh:
                ranks.append(json.load(fh))
        return {"status": "done", "ranks": ranks}

    @staticmethod
    def _wait(procs: list[subprocess.Popen]) -> list[int]:
        """Wait for every rank; when one fails, end the others (they would wait in a collective)."""
        deadline = time.monotonic() + LAUNCH_TIMEOUT_S
        while any(p.poll() is None for p in procs):
            if any(p.poll() not in (None, 0) for p in procs) or time.monotonic() > deadline:
                for p in procs:
                    if p.poll() is None:
                        p.kill()
                for p in procs:
                    p.wait()
                break
            time.sleep(0.2)
        return [p.returncode for p in procs]


def _free_port() -> int:
    from executor.rank_commands import free_port

    return free_port()


def system_figures(ranks: list[dict], name: str, global_batch: int) -> dict:
    """One system's figures from every rank: the step is the slowest rank's; memory per rank."""
    per = [r["systems"][name] for r in ranks]
    n = min(len(p["step_s"]) for p in per)
    step_s = [max(p["step_s"][i] for p in per) for i in range(n)]
    out = {"per_rank": [{k: median([x for x in p[k] if x is not None]) if any(x is not None for x in p.get(k, []))
                         else None for k in ("step_s", "compute_s", "comm_wait_s")} for p in per],
           "step_s": step_s, "median_step_s": median(step_s), "samples_per_s": global_batch / median(step_s),
           "peak_bytes_per_rank": [p["peak_bytes"] for p in per], "losses": per[0]["losses"],
           "cgroup_peak_bytes_per_rank": [r.get("cgroup_peak_bytes") for r in ranks],
           "memory_limit_bytes_per_rank": [r.get("memory_limit_bytes") for r in ranks],
           "peak_over_baseline_bytes_per_rank": [peak_over_baseline(r) for r in ranks],
           "runtime_lacks": per[0].get("runtime_lacks", [])}
    waits = [[p["comm_wait_s"][i] for p in per] for i in range(n)]
    if n and all(w is not None for ws in waits for w in ws):
        # the exposed communication of a step: the most any rank's compute waited on it
        out["comm_wait_s"] = [max(ws) for ws in waits]
        out["exposed_share"] = median([w / s for w, s in zip(out["comm_wait_s"], step_s)])
        out["median_comm_wait_s"] = median(out["comm_wait_s"])
        by = [[p["comm_wait_by"][i] for p in per] for i in range(n)] if all(p.get("comm_wait_by") for p in per) else []
        if by and all(b for bs in by for b in bs):
            # where the exposed wait was: the sites of the rank that waited most in each step
            most = [bs[max(range(len(ws)), key=lambda r: ws[r])] for bs, ws in zip(by, waits)]
            out["comm_wait_by_site_s"] = {k: median([b[k] for b in most]) for k in most[0]}
    comp = [[p["compute_s"][i] for p in per] for i in range(n)] if all("compute_s" in p for p in per) else []
    if comp and all(c is not None for cs in comp for c in cs):
        out["median_compute_s"] = median([max(cs) for cs in comp])  # the busiest rank's compute
    wire = [[p["wire_bytes"][i] for p in per] for i in range(n)] if all("wire_bytes" in p for p in per) else []
    if wire and all(b is not None for ws in wire for b in ws):
        out["wire_bytes_per_step"] = median([sum(ws) for ws in wire])  # every rank's sends together
        out["max_rank_wire_bytes_per_step"] = median([max(ws) for ws in wire])
    return out


def pooled(runs: list[dict], global_batch: int) -> dict:
    steps = [s for r in runs for s in r["step_s"]]
    return {"median_step_s": median(steps), "samples_per_s": global_batch / median(steps), "num_steps": len(steps),
            "per_launch_median_step_s": [r["median_step_s"] for r in runs]}


# ---- homogeneous ----------------------------------------------------------------------------------


def run_homogeneous(args: argparse.Namespace, launcher: Launcher, spec: ModelSpec) -> dict:
    from profiler.cgroups import Limits

    world, m = 2, args.micro_batch
    batches = [m] * world
    common = {"batches": batches, "micro_batch": [m] * world, "recompute": "none", "reduce_dtype": args.reduce_dtype}
    job = {"model": spec.to_dict(), "seq": args.seq, "seed": args.seed, "warmup": args.warmup, "steps": args.steps,
           "dtype": args.dtype, "global_batch": sum(batches), "compare_params": args.dtype == "fp32",
           "systems": [dict(common, name="gpumix", kind="ours", zero=3, fractions=[1 / world] * world,
                            reduce_in_flight=args.reduce_in_flight),
                       dict(common, name="fsdp2", kind="fsdp2", sync="every")]}
    limits = [Limits(cpu_share=1.0) if args.cgroups else None] * world
    res = launcher.run(job, limits, "homogeneous")
    if res["status"] != "done":
        raise RuntimeError(f"homogeneous run {res['status']}: {res['reason']}")
    ours, fsdp = (system_figures(res["ranks"], k, sum(batches)) for k in ("gpumix", "fsdp2"))
    out = {"ranks": world, "cpu_share": 1.0 if args.cgroups else None, "micro_batch": m, "global_batch": sum(batches),
           "gpumix": ours, "fsdp2": fsdp,
           "throughput_ratio": ours["samples_per_s"] / fsdp["samples_per_s"],
           "memory_ratio": max(a / b for a, b in zip(ours["peak_bytes_per_rank"], fsdp["peak_bytes_per_rank"])),
           "max_loss_rel_diff": max(abs(a - b) / max(abs(b), 1e-30) for a, b in zip(ours["losses"], fsdp["losses"])),
           "param_max_abs_diff": max((r["param_max_abs_diff"] or 0.0) for r in res["ranks"])
           if args.dtype == "fp32" else None}
    if args.link_gbps:  # communication against compute: the link's wire time of the busiest rank's sends
        rate = args.link_gbps * 1e9 / 8
        if "max_rank_wire_bytes_per_step" in ours:
            out["comm_s_on_link"] = ours["max_rank_wire_bytes_per_step"] / rate
            compute = ours.get("median_compute_s", ours["median_step_s"] - ours.get("median_comm_wait_s", 0.0))
            out["compute_s"] = compute
            out["comm_over_compute"] = out["comm_s_on_link"] / compute
    return out


# ---- mixed ----------------------------------------------------------------------------------------


UNLIMITED_BYTES = 64 * GIB  # a memory cgroup that only measures: its peak charge, no limit in reach


def fsdp2_candidates(per_rank: int, num_micro_batches: int) -> list[dict]:
    """FSDP2's even configurations: the even batch in micro-batches of per_rank, per_rank/2, ...
    (`num_micro_batches` sizes), recompute none and full; at accumulation > 1 reduce-scatter after
    every micro-batch (its default) or only after the last."""
    out, m = [], per_rank
    while m >= 1 and len({c["micro_batch"] for c in out}) < num_micro_batches:
        if per_rank % m == 0:
            for rec in ("none", "full"):
                for sync in (("every", "last") if per_rank // m > 1 else ("every",)):
                    out.append({"micro_batch": m, "accum": per_rank // m, "recompute": rec, "sync": sync})
        m //= 2
    return out


def describe_fsdp2(c: dict) -> str:
    return (f"even shards, micro-batch {c['micro_batch']} x {c['accum']} per rank, recompute {c['recompute']}"
            + (f", reduce-scatter {'every micro-batch' if c['sync'] == 'every' else 'last micro-batch only'}"
               if c["accum"] > 1 else ""))


@contextlib.contextmanager
def _environ(extra: dict[str, str]):
    saved = {k: os.environ.get(k) for k in extra}
    os.environ.update(extra)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def peak_over_baseline(rank: dict) -> int | None:
    """A rank's peak memory charge over its baseline (what the cgroup limit bounds)."""
    if rank.get("cgroup_peak_bytes") is None or rank.get("memory_baseline_bytes") is None:
        return None
    return rank["cgroup_peak_bytes"] - rank["memory_baseline_bytes"]


def run_mixed(args: argparse.Namespace, launcher: Launcher, spec: ModelSpec, data_dir: str) -> dict:
    from planner.entry import plan_job
    from profiler.cgroups import Limits

    shares, world, B = args.shares, len(args.shares), args.global_batch
    if B % world:
        raise ValueError(f"--global-batch {B} does not split evenly over {world} ranks")
    per_rank = B // world
    small = min(range(world), key=lambda i: shares[i])
    base = {"model": spec.to_dict(), "seq": args.seq, "seed": args.seed, "dtype": args.dtype, "global_batch": B}

    def limits_at(memory_bytes: int) -> list[Any]:
        return [Limits(cpu_share=s, memory_bytes=memory_bytes if i == small else None) for i, s in enumerate(shares)]

    def fsdp2_system(c: dict) -> dict:
        return {"name": "fsdp2", "kind": "fsdp2", "batches": [per_rank] * world,
                "micro_batch": [c["micro_batch"]] * world, "recompute": c["recompute"], "sync": c["sync"]}

    # 1. FSDP2's even configurations under the CPU quotas, the small rank's memory charge measured
    # (a memory cgroup without a limit in reach): recompute none first
    candidates = fsdp2_candidates(per_rank, args.fsdp2_micro_batches)
    tried: list[dict] = []

    def screen(c: dict) -> dict:
        name = f"mixed-fsdp2-m{c['micro_batch']}-{c['recompute']}-{c['sync']}"
        res = launcher.run(dict(base, warmup=1, steps=SCREEN_STEPS, systems=[fsdp2_system(c)]),
                           limits_at(UNLIMITED_BYTES), name)
        if res["status"] != "done":
            raise RuntimeError(f"{name}: {res['status']}: {res['reason']}")
        row = dict(c, config=describe_fsdp2(c), system=fsdp2_system(c),
                   median_step_s=system_figures(res["ranks"], "fsdp2", B)["median_step_s"],
                   peak_over_baseline_bytes=peak_over_baseline(res["ranks"][small]),
                   live_peak_bytes=res["ranks"][small]["systems"]["fsdp2"]["peak_bytes"])
        tried.append(row)
        return row

    plain = [screen(c) for c in candidates if c["recompute"] == "none"]
    # 2. the small rank's memory limit: midway between FSDP2's even shard with the even batch in
    # one micro-batch and in micro-batches of half of it (measured), so that the first exceeds it
    top = [r for r in plain if r["sync"] == "every"][:2]
    if args.memory_bytes:
        memory_bytes, basis = args.memory_bytes, "--memory-mib"
    elif len(top) == 2 and all(r["peak_over_baseline_bytes"] for r in top):
        memory_bytes = (top[0]["peak_over_baseline_bytes"] + top[1]["peak_over_baseline_bytes"]) // 2
        basis = (f"midway between FSDP2's even shard at micro-batch {top[0]['micro_batch']} "
                 f"({top[0]['peak_over_baseline_bytes'] / MIB:.1f} MiB over baseline, measured) and "
                 f"{top[1]['micro_batch']} x {top[1]['accum']} ({top[1]['peak_over_baseline_bytes'] / MIB:.1f} MiB)")
    else:
        raise RuntimeError("cannot choose the memory limit: need two FSDP2 micro-batch sizes measured "
                           "(--global-batch >= 2 x ranks) or --memory-mib")
    fits = {id(r): r["peak_over_baseline_bytes"] <= memory_bytes for r in plain}
    # recompute full only where recompute none does not fit (the same work and more is never faster)
    for c in candidates:
        if c["recompute"] == "full" and not any(fits[id(r)] for r in plain
                                                 if (r["micro_batch"], r["sync"]) == (c["micro_batch"], c["sync"])):
            r = screen(c)
            fits[id(r)] = r["peak_over_baseline_bytes"] <= memory_bytes
    for r in tried:
        r["fits"] = fits[id(r)]
    # the device memory the planner sees: the limit less the rank's charge beyond its live tensors
    # (interpreter, gloo, allocator), the most measured beside FSDP2; the planner's memory model
    # counts live tensors (profiler.memtrack measures the same)
    overhead = max(r["peak_over_baseline_bytes"] - r["live_peak_bytes"] for r in tried)
    memory_gb = [(memory_bytes - overhead) / GIB if i == small else None for i in range(world)]

    # 3. GPUMix's plan: the planner on these devices, measured under their limits, and the link
    model = args.model if args.model not in BENCH_SPECS else write_gpt2_config(spec, os.path.join(data_dir, "models"))
    cluster = hetero_cluster(shares, memory_gb=memory_gb, link_gbps=args.link_gbps or None)
    with _environ(MALLOC_ENV):  # the profiled loops allocate as the ranks do
        profile_s = 0.0 if args.no_profile else profile_devices_together(
            model, args.seq, shares, PROFILE_MICRO_BATCHES, dtype=args.dtype, repeats=PROFILE_REPEATS)
    plan = plan_job(cluster, model, B, seq=args.seq, dtype=args.dtype, pipeline=False).plan
    # the ranks of the devices the plan uses, in its order (the executor launches no others)
    used = [a for a in plan.assignments if a.used]
    gpumix_limits = [limits_at(memory_bytes)[a.device_index] for a in used]
    gpumix_sys = {"name": "gpumix", "kind": "ours", "zero": plan.zero, "recompute": plan.recompute,
                  "fractions": [a.shard_fraction for a in used], "batches": [a.batch for a in used],
                  "micro_batch": [max(1, a.micro_batch) for a in used],
                  "param_dtype": getattr(plan, "param_dtype", None), "reduce_dtype": getattr(plan, "reduce_dtype", None),
                  "prefetch": getattr(plan, "prefetch", None),
                  "reduce_in_flight": getattr(plan, "reduce_in_flight", args.reduce_in_flight)}

    # 4. A B B A under the limits: GPUMix's plan and FSDP2's fastest configuration that fits (the
    # next one where the kernel OOM-kills it), medians pooled
    half = max(1, args.steps // 2)
    ranked = sorted((r for r in tried if r["fits"]), key=lambda r: r["median_step_s"])
    if not ranked:
        raise RuntimeError("no even FSDP2 configuration fits the memory limit")
    runs: dict[str, list[dict]] = {"gpumix": [], "fsdp2": []}
    best = ranked.pop(0)
    i = 0
    for key in ("gpumix", "fsdp2", "fsdp2", "gpumix"):
        while True:
            sysc, lim = (gpumix_sys, gpumix_limits) if key == "gpumix" else (best["system"], limits_at(memory_bytes))
            res = launcher.run(dict(base, warmup=args.warmup, steps=half, systems=[sysc]), lim, f"mixed-{key}-{i}")
            i += 1
            if res["status"] == "oom" and key == "fsdp2" and ranked:
                best["fits"], best["reason"] = False, f"{res['reason']} under the limit"
                best, runs["fsdp2"] = ranked.pop(0), []
                continue
            if res["status"] != "done":
                raise RuntimeError(f"mixed {key}: {res['status']}: {res['reason']}")
            break
        runs[key].append(system_figures(res["ranks"], sysc["name"], B))
    g, f = pooled(runs["gpumix"], B), pooled(runs["fsdp2"], B)
    return {
        "ranks": world, "cpu_shares": list(shares), "global_batch": B, "small_rank": small,
        "memory_limit_bytes": memory_bytes, "memory_limit_basis": basis, "process_overhead_bytes": overhead,
        "planner_memory_bytes": memory_bytes - overhead,
        "profile_s": profile_s, "profiles": profile_rows(cluster, with_max_seq(get_model(model), args.seq), args.seq,
                                                         args.dtype),
        "plan": {"zero": plan.zero, "recompute": plan.recompute, "param_dtype": getattr(plan, "param_dtype", None),
                 "prefetch": getattr(plan, "prefetch", None), "predicted_iteration_s": plan.predicted_iteration_s,
                 "predicted_exposed_comm_s": getattr(plan, "predicted_exposed_comm_s", None),
                 "predicted_wire_bytes_per_step": getattr(plan, "predicted_wire_bytes_per_step", None),
                 "assignments": [{"device_index": a.device_index, "cpu_share": shares[a.device_index],
                                  "used": a.used, "micro_batch": a.micro_batch, "accum_steps": a.accum_steps,
                                  "batch": a.batch,
                                  "shard_fraction": a.shard_fraction, "predicted_memory_bytes": a.predicted_memory_bytes,
                                  "predicted_step_s": a.predicted_step_s} for a in plan.assignments]},
        "fsdp2_tried": [{k: v for k, v in t.items() if k != "system"} for t in tried],
        "fsdp2_config": best["config"],
        "gpumix_small_rank": next((r for r, a in enumerate(used) if a.device_index == small), None),
        "gpumix": dict(g, launches=runs["gpumix"]), "fsdp2": dict(f, launches=runs["fsdp2"]),
        "throughput_ratio": g["samples_per_s"] / f["samples_per_s"],
        "step_error": g["median_step_s"] / plan.predicted_iteration_s - 1,
    }


# ---- the bench ------------------------------------------------------------------------------------


def run_bench(args: argparse.Namespace) -> dict:
    t_start = time.monotonic()
    spec = with_max_seq(resolve_spec(args.model), args.seq)
    data_dir = args.data_dir or tempfile.mkdtemp(prefix="gpumix-bench-sharded-")
    os.environ["GPUMIX_DATA_DIR"] = data_dir
    root = os.path.join(data_dir, "runs")
    os.makedirs(root, exist_ok=True)
    out: dict[str, Any] = {"model": spec.name, "num_params": spec.num_params, "seq": args.seq, "dtype": args.dtype,
                           "link_gbps": args.link_gbps or None, "warmup_steps": args.warmup, "timed_steps": args.steps,
                           "data_dir": data_dir}
    try:
        for case in args.cases:
            world = 2 if case == "homogeneous" else len(args.shares)
            with emulated_links(world, args.link_gbps or None, f"bsr{os.getpid()}{case[0]}") as net:
                out.setdefault("links", list(net.describe))
                launcher = Launcher(net, root)
                if case == "homogeneous":
                    out["homogeneous"] = run_homogeneous(args, launcher, spec)
                else:
                    out["mixed"] = run_mixed(args, launcher, spec, data_dir)
    finally:
        if not args.data_dir and not args.keep:
            shutil.rmtree(data_dir, ignore_errors=True)
            out["data_dir"] = None
    h, m = out.get("homogeneous"), out.get("mixed")
    out["exposed_comm_share"] = h["gpumix"].get("exposed_share") if h else None
    out["step_error"] = m["step_error"] if m else None
    out["checks"] = checks(out, args)
    out["bench_wall_s"] = time.monotonic() - t_start
    if out["data_dir"]:  # kept: the figures beside the runs they come from
        with open(os.path.join(out["data_dir"], "result.json"), "w", encoding="utf-8") as fh:
            json.dump(out, fh, indent=2, default=str)
    return out


def checks(r: dict, args: argparse.Namespace) -> dict:
    c: dict[str, dict] = {}
    h, m = r.get("homogeneous"), r.get("mixed")
    if h:
        c["homogeneous_throughput"] = {"value": h["throughput_ratio"], "target": f">= {HOMOGENEOUS_THROUGHPUT_MIN}",
                                       "ok": h["throughput_ratio"] >= HOMOGENEOUS_THROUGHPUT_MIN}
        c["homogeneous_memory"] = {"value": h["memory_ratio"], "target": f"<= {HOMOGENEOUS_MEMORY_MAX}",
                                   "ok": h["memory_ratio"] <= HOMOGENEOUS_MEMORY_MAX}
        share = r["exposed_comm_share"]
        applies = h.get("comm_over_compute") is None or h["comm_over_compute"] <= 1.0
        c["exposed_comm_share"] = {"value": share, "target": f"<= {EXPOSED_COMM_MAX} where comm <= compute",
                                   "applies": applies,
                                   "ok": share is not None and (share <= EXPOSED_COMM_MAX or not applies)}
        if args.dtype == "fp32":
            c["losses_equal"] = {"value": h["max_loss_rel_diff"], "target": f"<= {LOSS_REL_MAX:g}",
                                 "ok": h["max_loss_rel_diff"] <= LOSS_REL_MAX}
    if m:
        c["mixed_throughput"] = {"value": m["throughput_ratio"], "target": f">= {MIXED_THROUGHPUT_MIN}",
                                 "ok": m["throughput_ratio"] >= MIXED_THROUGHPUT_MIN}
        c["step_error"] = {"value": m["step_error"], "target": f"|x| <= {STEP_ERROR_MAX}",
                           "ok": abs(m["step_error"]) <= STEP_ERROR_MAX}
        measured = all(p["measured"] for p in m["profiles"] if p["recompute"] == m["plan"]["recompute"])
        c["profiles_measured"] = {"value": measured, "target": "every profile the plan read measured under its limits",
                                  "ok": measured}
    return c


def contract(r: dict) -> dict:
    """The issue's JSON keys first, everything measured after them."""
    h, m = r.get("homogeneous"), r.get("mixed")
    return {"homogeneous": {"throughput_ratio": h["throughput_ratio"], "memory_ratio": h["memory_ratio"]} if h else None,
            "mixed": {"throughput_ratio": m["throughput_ratio"], "fsdp2_config": m["fsdp2_config"]} if m else None,
            "exposed_comm_share": r["exposed_comm_share"], "step_error": r["step_error"], "detail": r}


def _verdict(c: dict) -> str:
    return "PASS" if c["ok"] else "FAIL"


def print_report(r: dict) -> None:
    print(f"sharded_runtime: {r['model']} ({r['num_params'] / 1e6:.1f} M params), seq {r['seq']}, {r['dtype']}, "
          f"{r['warmup_steps']} warm-up + {r['timed_steps']} timed steps per system, medians of the slowest rank's step")
    for line in r.get("links", []):
        print(f"  {line}")
    c = r["checks"]
    h = r.get("homogeneous")
    if h:
        print(f"\nhomogeneous: {h['ranks']} ranks x {h['cpu_share'] or 'unlimited'} core, micro-batch {h['micro_batch']} "
              f"per rank, one launch, systems alternating AB/BA every step")
        print(f"  {'system':<8}{'median step s':>14}{'samples/s':>11}{'peak MiB per rank':>22}{'comm wait s':>13}"
              f"{'wire MB/step':>14}")
        for name in ("gpumix", "fsdp2"):
            s = h[name]
            peaks = " / ".join(f"{p / MIB:.1f}" for p in s["peak_bytes_per_rank"])
            wait = s.get("median_comm_wait_s")
            wire = s.get("wire_bytes_per_step")
            print(f"  {name:<8}{s['median_step_s']:>14.4f}{s['samples_per_s']:>11.2f}{peaks:>22}"
                  f"{(f'{wait:.4f}' if wait is not None else '—'):>13}{(f'{wire / 1e6:.1f}' if wire else '—'):>14}")
        if h["gpumix"]["runtime_lacks"]:
            print(f"  NOTE: models.sharded.ShardedRuntime does not take {', '.join(h['gpumix']['runtime_lacks'])} yet: "
                  "ours ran without them")
        print(f"  throughput GPUMix/FSDP2 {h['throughput_ratio']:.3f} (target >= {HOMOGENEOUS_THROUGHPUT_MIN}) "
              f"{_verdict(c['homogeneous_throughput'])}")
        print(f"  peak memory GPUMix/FSDP2 {h['memory_ratio']:.3f} (target <= {HOMOGENEOUS_MEMORY_MAX}, worst rank) "
              f"{_verdict(c['homogeneous_memory'])}")
        if "comm_over_compute" in h:
            print(f"  communication on the link {h['comm_s_on_link']:.4f} s (busiest rank's sends at the link rate) vs "
                  f"compute {h['compute_s']:.4f} s: ratio {h['comm_over_compute']:.2f}")
        ec = c["exposed_comm_share"]
        val = f"{ec['value']:.1%}" if ec["value"] is not None else "not measured (the runtime reports no comm_wait_s)"
        print(f"  communication left exposed (GPUMix, measured): {val} of the step (target <= {EXPOSED_COMM_MAX:.0%}"
              f"{'' if ec['applies'] else '; n/a: communication exceeds compute'}) {_verdict(ec)}")
        sites = h["gpumix"].get("comm_wait_by_site_s")
        if sites:
            print("    where (median s per step, the rank that waited most): "
                  + ", ".join(f"{k} {v:.4f}" for k, v in sites.items()))
        if "losses_equal" in c:
            print(f"  fp32 losses GPUMix vs FSDP2: max rel diff {h['max_loss_rel_diff']:.2e} (target <= {LOSS_REL_MAX:g}) "
                  f"{_verdict(c['losses_equal'])}; final parameters max |diff| {h['param_max_abs_diff']:.2e}")
    m = r.get("mixed")
    if m:
        print(f"\nmixed: {m['ranks']} ranks under CPU quotas {', '.join(f'{s:g}' for s in m['cpu_shares'])} of a core, "
              f"global batch {m['global_batch']}; rank {m['small_rank']} memory limit baseline + "
              f"{m['memory_limit_bytes'] / MIB:.1f} MiB ({m['memory_limit_basis']}); the planner sees "
              f"{m['planner_memory_bytes'] / MIB:.1f} MiB (less {m['process_overhead_bytes'] / MIB:.1f} MiB charged beyond "
              "live tensors, the most measured beside FSDP2)")
        print(f"  FSDP2 even configurations (each launched under the CPU quotas, {SCREEN_STEPS} timed steps; "
              f"rank {m['small_rank']}'s peak memory charge over its baseline):")
        for t in m["fsdp2_tried"]:
            fit = "fits" if t["fits"] else "DOES NOT FIT"
            why = f" ({t['reason']})" if t.get("reason") else ""
            print(f"    {t['config']:<78} step {t['median_step_s']:7.3f} s  peak "
                  f"{t['peak_over_baseline_bytes'] / MIB:7.1f} MiB (live tensors {t['live_peak_bytes'] / MIB:6.1f})  {fit}{why}")
        print(f"  FSDP2 best that fits: {m['fsdp2_config']}")
        print(f"  profiles (measured under the limits in {m['profile_s']:.0f} s; beta = s per sample):")
        for p in m["profiles"]:
            print(f"    {p['kind']:<16} recompute {p['recompute']:<5} {'measured' if p['measured'] else 'ESTIMATED':<9} "
                  f"alpha {p['alpha_s'] * 1e3:8.2f} ms  beta {p['beta_s'] * 1e3:8.2f} ms")
        pl = m["plan"]
        print(f"  GPUMix plan (planner.entry.plan_job): zero {pl['zero']}, recompute {pl['recompute']}, gathers "
              f"{pl['param_dtype']}, prefetch {pl['prefetch']}; per device (micro-batch x accum, shard): "
              + "; ".join(f"{a['cpu_share']:g} core: " + (f"{a['micro_batch']} x {a['accum_steps']}, {a['shard_fraction']:.3f}"
                                                          if a["used"] else "not used") for a in pl["assignments"]))
        print(f"  {'system':<8}{'median step s':>14}{'samples/s':>11}{'predicted s':>13}{'per launch (A B B A)':>24}"
              f"{'small rank peak MiB':>21}")
        for name in ("gpumix", "fsdp2"):
            s = m[name]
            pred = f"{pl['predicted_iteration_s']:.4f}" if name == "gpumix" else "—"
            per = ", ".join(f"{x:.3f}" for x in s["per_launch_median_step_s"])
            sr = m["small_rank"] if name == "fsdp2" else m["gpumix_small_rank"]
            peaks = [x["peak_over_baseline_bytes_per_rank"][sr] if sr is not None else None for x in s["launches"]]
            peak = f"{max(peaks) / MIB:.1f}" if all(p is not None for p in peaks) else "—"
            print(f"  {name:<8}{s['median_step_s']:>14.4f}{s['samples_per_s']:>11.2f}{pred:>13}{per:>24}{peak:>21}")
        print("  GPUMix per rank (medians over its launches: step, compute, compute's wait on communication) vs the plan:")
        for rank, a in enumerate(a for a in pl["assignments"] if a["used"]):
            rows = [x["per_rank"][rank] for x in m["gpumix"]["launches"]]
            val = {k: median([x[k] for x in rows if x[k] is not None]) for k in ("step_s", "compute_s", "comm_wait_s")}
            print(f"    rank {rank} ({a['cpu_share']:g} core): step {val['step_s']:.3f} s, compute {val['compute_s']:.3f} s, "
                  f"wait {val['comm_wait_s']:.3f} s; predicted step {a['predicted_step_s']:.3f} s")
        if pl.get("predicted_exposed_comm_s") is not None:
            print(f"    plan: predicted exposed communication {pl['predicted_exposed_comm_s']:.3f} s, wire "
                  f"{(pl['predicted_wire_bytes_per_step'] or 0) / 1e6:.1f} MB per step; measured wire "
                  f"{median([x.get('wire_bytes_per_step', 0) for x in m['gpumix']['launches']]) / 1e6:.1f} MB")
        print(f"  throughput GPUMix plan / FSDP2 best even {m['throughput_ratio']:.3f} (target >= {MIXED_THROUGHPUT_MIN}) "
              f"{_verdict(c['mixed_throughput'])}")
        print(f"  GPUMix step measured / predicted - 1 = {m['step_error']:+.1%} (target within {STEP_ERROR_MAX:.0%}) "
              f"{_verdict(c['step_error'])}")
        print(f"  every profile the plan read measured under its limits: {_verdict(c['profiles_measured'])}")
    print(f"\nbench wall time {r['bench_wall_s']:.0f} s")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="bench-gpt2", help=f"{sorted(BENCH_SPECS)} or a planner preset / config.json")
    p.add_argument("--shares", type=parse_shares, default=(1.0, 0.333), help="the mixed ranks' CPU shares (default 1,0.333)")
    p.add_argument("--link-gbps", type=float, default=1.0, help="emulated link rate per rank; 0: loopback (default 1)")
    p.add_argument("--steps", type=int, default=6, help="timed steps per system (mixed: split over 2 launches)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps; the last one measures memory (>= 1)")
    p.add_argument("--global-batch", type=int, default=16, help="mixed: samples per step (default 16)")
    p.add_argument("--micro-batch", type=int, default=6,
                   help="homogeneous: samples per rank (default 6: compute above zero 3's wire time at 1 Gbit/s)")
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16",
                   help="compute and gather dtype (bf16: mixed precision, gradients reduced in fp32)")
    p.add_argument("--reduce-dtype", choices=("fp32", "bf16"), default="fp32",
                   help="homogeneous: both systems reduce gradients in this dtype (FSDP2: MixedPrecisionPolicy's "
                        "reduce_dtype; default fp32)")
    p.add_argument("--reduce-in-flight", type=int, choices=(0, 1), default=1,
                   help="GPUMix: reduce-scatters left in flight while compute goes on, as FSDP2 does (default 1)")
    p.add_argument("--cases", default="homogeneous,mixed", help="which comparisons (default homogeneous,mixed)")
    p.add_argument("--memory-mib", type=float, help="mixed: the small rank's memory limit over its baseline "
                                                     "(default: from FSDP2's measured peaks, see above)")
    p.add_argument("--fsdp2-micro-batches", type=int, default=2,
                   help="mixed: FSDP2's micro-batch sizes tried: the even batch, its half, ... (default 2)")
    p.add_argument("--no-profile", action="store_true", help="mixed: reuse the profiles in --data-dir")
    p.add_argument("--data-dir", help="profiles, plans and rank logs (default: a temporary folder, removed)")
    p.add_argument("--keep", action="store_true", help="keep the temporary folder")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    args = p.parse_args(argv)
    args.cases = [c.strip() for c in args.cases.split(",") if c.strip()]
    if not args.cases or any(c not in ("homogeneous", "mixed") for c in args.cases):
        p.error("--cases takes homogeneous and/or mixed")
    if args.warmup < 1 or args.steps < 1 or args.micro_batch < 1 or args.global_batch < 1 or args.link_gbps < 0:
        p.error("need --warmup >= 1, --steps >= 1, --micro-batch >= 1, --global-batch >= 1, --link-gbps >= 0")
    try:
        spec = resolve_spec(args.model)
    except ValueError as e:
        p.error(str(e))
    if args.seq > spec.max_seq:
        p.error(f"--seq {args.seq} exceeds the model's max_seq {spec.max_seq}")
    args.memory_bytes = int(args.memory_mib * MIB) if args.memory_mib else None
    from profiler.cgroups import unavailable_reason

    why = unavailable_reason()
    args.cgroups = why is None
    if why is not None and "mixed" in args.cases:
        print(f"sharded_runtime: the mixed case needs cgroup v1 CPU quotas and memory limits: {why}", file=sys.stderr)
        return 2
    if args.link_gbps and os.geteuid() != 0:
        print("sharded_runtime: emulated links need root (ip netns, tc); --link-gbps 0 runs on loopback", file=sys.stderr)
        return 2
    try:
        r = run_bench(args)
    except (RuntimeError, ValueError, subprocess.CalledProcessError) as e:
        print(f"sharded_runtime: {e}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(contract(r), default=str))
    else:
        print_report(r)
    return 0 if all(c["ok"] for c in r["checks"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
