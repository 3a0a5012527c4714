"""Pipeline stages profiled as they run: a pipeline plan's stages trained together on this machine.

`profiler profile --plan P` of a pipeline plan runs this after timing the plan's device kinds together
(profiler/run_profile.py): the plan's stages launched as a real run (`python -m executor launch`, no
shell, one rank per device, the runtime of models/pipeline.py: the stage's layers, its rows of every
micro-batch, its sends and receives between the stages' ranks) for `steps` steps. A plan with WAN links
runs on them where this machine can emulate them (`--emulate-wan`: root, ip, tc, nsenter), as the plan's
own run will; otherwise on this machine without them (`local_stage_plan`: every device on one node
"localhost", in the plan's order, each under its own limits; the WAN links, cuts and DiLoCo section
dropped). From the run's store and its timeline, per stage:

* forward + backward of one micro-batch: the median over the steps after `warmup` of the rank's compute
  seconds (forward and backward only, wall time) ÷ its micro-batches, split into forward and backward
  by the two's shares of the timeline's recorded step; one profile per kind and rows of the stage's
  replicas (a stage of mixed kinds or uneven rows is priced replica by replica), the slowest where
  several replicas share both;
* the optimizer step per parameter: the median AdamW seconds ÷ the rank's shard numel;
* a send's own time on the rank (the call, not the wire), the timeline's mean;
* the run's own median step (`run_step_s`, the same for every stage): what the stages' run measured
  as a whole, beside which the plan's simulation from these stage times can be read.

Each is saved as a StageProfile (planner/core/stage_profiles.py), with when, the load, and the noise
(IQR / median of the per-step compute). The run's figures are read with `python -m executor metrics
--json` (the profiler sits below the executor: it runs it, never imports it); a run that fails is
reported with its last output and nothing is saved.
"""
from __future__ import annotations

import dataclasses
import datetime as dt
import json
import logging
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
from typing import Callable, Sequence

from contracts.catalog import CPU_TYPE, device_dtype
from contracts.cluster import ClusterSpec, NodeSpec, split_profile_key
from contracts.plan import Plan
from contracts.specs import ModelSpec
from planner.core.stage_profiles import HOW_ON_LINKS, HOW_STAGE_RUN, StageProfile, save_stage_profile

log = logging.getLogger(__name__)

LOCAL_NODE = "localhost"
DEFAULT_STEPS = 20
DEFAULT_WARMUP = 2
RUN_TIMEOUT_S = 600


def local_stage_plan(plan: Plan) -> Plan:
    """The pipeline plan with every device on this machine, in the plan's device order (ValueError:
    not a pipeline plan, or a device order a plan file of one node cannot keep)."""
    if plan.pipeline is None:
        raise ValueError("plan: not a pipeline plan (no 'pipeline' section): nothing to profile by stage")
    devices = plan.cluster.devices()
    node = NodeSpec(LOCAL_NODE, devices[0][0].datacenter, tuple(d for _, d in devices))
    cluster = ClusterSpec(f"{plan.cluster.name}-stages-here", (node,), plan.cluster.network)
    pipeline = dataclasses.replace(plan.pipeline, stages=tuple(dataclasses.replace(st, datacenter="")
                                                               for st in plan.pipeline.stages),
                                   simulated_ops=())
    local = dataclasses.replace(plan, cluster=cluster, pipeline=pipeline, wan=(), connections={}, cuts=(),
                                diloco=None, assignments=tuple(dataclasses.replace(a, node=LOCAL_NODE)
                                                               for a in plan.assignments))
    here = ClusterSpec.from_dict(cluster.to_dict()).devices()
    if [d for _, d in here] != [d for _, d in devices]:
        raise ValueError("plan: its devices interleave kinds in an order one node's cluster entry cannot keep; "
                         "profile its kinds with --cluster instead")
    return local


def stages_run_here(plan: Plan) -> bool:
    """Whether every rank of the plan runs on this machine: its nodes are this host, its devices are
    emulated, or it is CPU datacenters joined by WAN links that `executor launch --emulate-wan` builds
    here (docs/emulated_wan.md)."""
    local = {"localhost", "127.0.0.1", "::1", socket.gethostname()}
    return (all(n.name in local for n in plan.cluster.nodes) or plan.cluster.emulated
            or plan.cluster.emulate_links_gbps is not None or bool(plan.wan))


def profile_plan_stages(plan: Plan, steps: int = DEFAULT_STEPS, save: bool = True,
                        progress: Callable[[float, str], None] | None = None) -> list[StageProfile] | None:
    """The one stage-profiling step of `profiler profile --plan` and the Plan page's "Profile now": a
    synchronous pipeline plan whose devices are all CPUs and whose ranks run on this machine
    (`stages_run_here`) has its stages run here and profiled (`measure_stages`); None (and a log line
    saying why) otherwise."""
    from contracts.specs import get_model

    if plan.pipeline is None or plan.diloco is not None:
        return None
    if any(d.type != CPU_TYPE for _, d in plan.cluster.devices()):
        log.info("stage profiles: the plan's stages run on GPUs of other nodes; only CPU-device pipelines are run here")
        return None
    if not stages_run_here(plan):
        log.info("stage profiles: the plan's ranks run on other machines (%s); their stages are not run here",
                 ", ".join(n.name for n in plan.cluster.nodes))
        return None
    if progress is not None:
        progress(0.95, "the plan's stages, run together here")
    return measure_stages(plan, get_model(plan.model), steps=steps, save=save)


def can_emulate_links() -> bool:
    """Whether `executor launch --emulate-wan` can build the plan's links here (root, ip, tc, nsenter:
    docs/emulated_wan.md)."""
    return os.geteuid() == 0 and all(shutil.which(b) for b in ("ip", "tc", "nsenter"))


def _iqr_over_median(xs: Sequence[float]) -> float | None:
    if len(xs) < 4:
        return None
    q = statistics.quantiles(xs, n=4)
    med = statistics.median(xs)
    return (q[2] - q[0]) / med if med > 0 else None


def _executor(args: list[str], what: str) -> str:
    """`python -m executor ARGS` (no shell), its metrics in the run folder's own SQLite file, never in a
    shared GPUMIX_DB store (the stages' run is no run of the user's: nothing lists it); its stdout."""
    try:
        proc = subprocess.run([sys.executable, "-m", "executor", *args], capture_output=True, text=True,
                              timeout=RUN_TIMEOUT_S, env={k: v for k, v in os.environ.items() if k != "GPUMIX_DB"})
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"{what} did not finish within {RUN_TIMEOUT_S} s") from None
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip()[-1500:]
        raise RuntimeError(f"{what} failed (exit code {proc.returncode}): {tail}")
    return proc.stdout


def measure_stages(plan: Plan, spec: ModelSpec, steps: int = DEFAULT_STEPS, warmup: int = DEFAULT_WARMUP,
                   store_dir: str | None = None, save: bool = True, links: bool | None = None) -> list[StageProfile]:
    """Run the plan's stages for `steps` steps and return (and save) one StageProfile per stage and kind
    and rows of its replicas (module docstring). `links`:
    on the plan's emulated WAN links (True), here without them (False), or where they can be had (None)."""
    if steps < warmup + 3:
        raise ValueError(f"stage profile: need at least {warmup + 3} steps, got {steps}")
    local = local_stage_plan(plan)  # checks the plan; the run itself on the plan's links where they can be had
    emulate = bool(plan.wan) and (can_emulate_links() if links is None else links)
    p = local.pipeline
    load = os.getloadavg()[0]
    created = dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")
    with tempfile.TemporaryDirectory(prefix="gpumix-stage-run-") as work:
        plan_path, run_dir = os.path.join(work, "plan.json"), os.path.join(work, "run")
        (plan if emulate else local).save(plan_path)
        _executor(["launch", "--plan", plan_path, "--steps", str(steps), "--run-dir", run_dir,
                   "--checkpoint-every", "0", *(["--emulate-wan"] if emulate else [])], "the stages' run")
        metrics = json.loads(_executor(["metrics", "--run-dir", run_dir, "--json"], "reading the stages' run"))
        with open(os.path.join(run_dir, "timeline.json"), encoding="utf-8") as fh:
            timeline = json.load(fh)
    run_steps = [x["step_s"] for x in metrics["steps"] if x["step"] > warmup and x.get("step_s") is not None]
    device_of = {r["rank"]: r["device_index"] for r in metrics["ranks"]}
    per_rank: dict[int, list[tuple[float, float | None]]] = {}
    for row in metrics["rank_steps"]:
        if row["step"] > warmup and row.get("compute_s") is not None:
            per_rank.setdefault(device_of[row["rank"]], []).append((row["compute_s"], row.get("optimizer_s")))
    devices = local.cluster.devices()
    run = _StagesRun(plan, local, spec, {r["device_index"]: r["ops"] for r in timeline["ranks"]},
                     {r["device_index"]: r.get("shard_numel") for r in metrics["ranks"]},
                     tuple(devices[i][1].profile_key for i in sorted(device_of.values())), created, load, emulate,
                     statistics.median(run_steps) if run_steps else None)
    out = []
    for j, st in enumerate(p.stages):
        # one profile per (kind, rows) of the stage's replicas: a stage of mixed kinds or uneven rows is
        # priced replica by replica; replicas of one kind and rows keep the slowest
        slowest: dict[tuple[str, int], tuple[int, float, list[float], list[float]]] = {}
        for dev, asg_rows in zip(st.devices, st.rows):
            rows = per_rank.get(dev)
            if not rows or len(rows) < 3:
                raise RuntimeError(f"the stages' run recorded {len(rows or [])} steps after the warm-up "
                                   f"for device {dev}")
            compute = [c for c, _ in rows]
            med = statistics.median(compute)
            key = (devices[dev][1].profile_key, asg_rows)
            if key not in slowest or med > slowest[key][1]:
                slowest[key] = (dev, med, compute, [o for _, o in rows if o is not None])
        for dev, _, compute, opt in slowest.values():
            sp = _stage_profile(run, j, dev, compute, opt)
            if save:
                save_stage_profile(sp, store_dir)
            out.append(sp)
    return out


@dataclasses.dataclass(frozen=True)
class _StagesRun:
    """What every stage profile of one stages' run shares."""
    plan: Plan
    local: Plan
    spec: ModelSpec
    ops: dict[int, list[dict]]  # device index -> its rank's timeline ops (the recorded step)
    numel: dict[int, int | None]  # device index -> its rank's shard numel
    kinds: tuple[str, ...]  # every rank's kind, in device order
    created: str
    load: float
    emulate: bool
    run_step_s: float | None


def _stage_profile(run: _StagesRun, j: int, dev: int, compute: list[float], opt: list[float]) -> StageProfile:
    """Stage j's profile on device `dev` from its rank's per-step compute seconds, AdamW seconds and ops."""
    p, devices = run.local.pipeline, run.local.cluster.devices()
    st, mine = p.stages[j], run.ops.get(dev, [])
    fwd = sum(o["end_s"] - o["start_s"] for o in mine if o["op"] == "forward")
    bwd = sum(o["end_s"] - o["start_s"] for o in mine if o["op"] == "backward")
    if fwd <= 0 or bwd <= 0:
        raise RuntimeError(f"the stages' timeline has no forward or backward of stage {j} on device {dev}")
    per_mb = statistics.median(compute) / p.num_microbatches
    sends = [o["end_s"] - o["start_s"] for o in mine if o["op"].startswith("send")]
    numel = run.numel.get(dev)
    kind = devices[dev][1].profile_key
    return StageProfile(
        device_type=kind, model=run.spec.name, num_matmul_params=run.spec.matmul_params(), seq=run.plan.seq,
        dtype=device_dtype(split_profile_key(kind)[0], run.plan.dtype), recompute=run.plan.recompute,
        first_layer=st.first_layer, num_layers=st.num_layers, first=j == 0, last=j == len(p.stages) - 1,
        rows={a.device_index: a for a in run.local.assignments}[dev].micro_batch,
        forward_s=per_mb * fwd / (fwd + bwd), backward_s=per_mb * bwd / (fwd + bwd),
        optimizer_s_per_param=(statistics.median(opt) / numel if opt and numel else None),
        send_s=statistics.fmean(sends) if sends else None, num_microbatches=p.num_microbatches,
        schedule=p.schedule, steps=len(compute), noise=_iqr_over_median(compute), created=run.created,
        host=socket.gethostname(), load_avg=run.load, num_cpus=os.cpu_count() or 0, together_with=run.kinds,
        how=HOW_ON_LINKS if run.emulate else HOW_STAGE_RUN, run_step_s=run.run_step_s)


__all__ = ["local_stage_plan", "measure_stages", "profile_plan_stages", "stages_run_here", "DEFAULT_STEPS",
           "DEFAULT_WARMUP"]
