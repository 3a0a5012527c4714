"""The one profiling path of a run's devices: what `profiler profile --plan/--cluster`, the Plan
page's "Profile now" and the Inventory page all run.

A run's step is priced from each device kind's step profile and from the collectives between its
ranks, so both are measured as the run will meet them: the CPU devices of the run all at once
(profiler.step_profile.profile_together: one timed child per device, each under its own limits —
cgroup CPU quota, memory, or a `slowdown` sleep — in one window of time, under one load from the
rest of the machine, each size's call repeated once untimed so the allocator has settled), then the
collectives between them, one rank per device under the same limits (profiler.collectives), and on
the same ranks the calls as a step issues them: after compute, and beside it (`_probe_rank`). A GPU
type, or a lone device, is timed by itself (profile_local; a CPU by wall time, as together: the
share of the cores the rest of the machine leaves it is part of what the run will meet). Every
profile records when and how it was taken (planner.core.profiles.StepProfile: how, limits, load,
noise). docs/profiler.md has the commands and the fields.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Callable, Sequence

from contracts.catalog import CPU_TYPE, GIB
from contracts.cluster import ClusterSpec, DeviceSpec
from contracts.plan import Plan
from planner.core.profiles import CollectiveFit, StepProfile
from planner.costmodel.collectives import ASYNC_BESIDE_COMPUTE, BESIDE_COMPUTE

log = logging.getLogger(__name__)

Progress = Callable[[float, str], None]

# collectives between the run's ranks: 1 KiB .. 16 MiB, the gradient buffers of the models a CPU trains
COLLECTIVE_SIZES = tuple(1024 * 4**i for i in range(8))
COLLECTIVE_REPEATS = 5  # medians of this many samples per size (profiler.collectives' default)
# a fit whose time does not grow with size is noise: time again with twice the repeats, this many times
NOISY_COLLECTIVE_RETRIES = 2


# ---- the collectives as a run issues them: between compute, and beside it -----------------------------------
# A run's rank computes a unit, then waits on a collective, or leaves one in flight beside the next unit's
# compute. profiler.collectives times ops right after the ranks computed, one op at a time; a step issues
# many small calls, each after a burst of compute, and each pays the other ranks' skew and the scheduler's
# wake-up of the rank and of gloo's thread. The probe times those per call, and how much an async
# all-gather adds to compute running beside it (on CPU ranks gloo's thread needs a core the compute holds).
# The compute between two calls (thread CPU time): a call's time grows with it (two ranks' bursts end
# further apart; measured on this 2-core machine at load 2: 0.9 ms a call after 0.5-1 ms, 1.5 ms after
# 2 ms, 2.4 ms after 5 ms), so the probe computes what a step computes between two of its calls:
# probe_chunk_s, within these bounds; PROBE_CHUNK_S where no step profile says
PROBE_CHUNK_S = 1e-3
PROBE_CHUNK_BOUNDS_S = (2e-4, 2e-2)
PROBE_SMALL_BYTES = 4 * 1024  # a call whose time is its latency
PROBE_LARGE_BYTES = 1024 * 1024  # a call whose time is mostly bytes
PROBE_ROUNDS = 16  # of 8 calls each: a call's time is heavy-tailed, and the step sums its mean
PROBE_CALLS_PER_ROUND = 8
PROBE_TIMEOUT_S = 300.0


@dataclass(frozen=True)
class RunProfile:
    """What profile_devices measured: a step profile per distinct kind, and the store key of the
    collectives between the devices (None when not measured)."""

    profiles: tuple[StepProfile, ...]
    collectives_key: str | None


def plan_devices(plan: Plan) -> list[DeviceSpec]:
    """The devices a plan trains on, in rank order (its used assignments)."""
    devices = plan.cluster.devices()
    return [devices[a.device_index][1] for a in plan.assignments if a.used]


def cluster_devices(cluster: ClusterSpec) -> list[DeviceSpec]:
    """Every device of a cluster file, in order (a plan not yet made uses them all)."""
    return [d for _, d in cluster.devices()]


def _noop(fraction: float, message: str) -> None:
    pass


def profile_devices(model: str, seq: int, dtype: str, devices: Sequence[DeviceSpec], *, recompute: str = "none",
                    micro_batches: Sequence[int] | None = None, repeats: int | None = None,
                    collectives: bool = True, progress: Progress | None = None,
                    store_dir: str | None = None, save: bool = True) -> RunProfile:
    """Profile the devices of one run (`devices`, one per rank) as it will train them (module
    docstring) and save each kind's profile; the collectives between them too when `collectives`
    and there are two or more CPU devices. ValueError naming the problem for devices it cannot time
    here (a GPU type this machine does not have is refused by profile_local)."""
    from profiler.step_profile import DEFAULT_MICRO_BATCHES, DEFAULT_REPEATS  # torch: only when asked

    if not devices:
        raise ValueError("no devices to profile")
    progress = progress or _noop
    common = {"micro_batches": tuple(micro_batches or DEFAULT_MICRO_BATCHES), "recompute": recompute,
              "repeats": repeats or DEFAULT_REPEATS, "store_dir": store_dir, "save": save}
    cpus = [d for d in devices if d.type == CPU_TYPE]
    groups = _together_groups(cpus)
    others = list(dict.fromkeys(d.type for d in devices if d.type != CPU_TYPE))
    parts = len(groups) + len(others) + (1 if collectives and len(cpus) > 1 else 0)
    profiles: list[StepProfile] = []
    for i, group in enumerate(groups):
        part = _part(progress, i, parts)
        profiles += _profile_group(model, seq, dtype, group, common, part)
    for j, device_type in enumerate(others):
        part = _part(progress, len(groups) + j, parts)
        profiles.append(_profile_gpu(model, seq, dtype, device_type, common, part))
    key = None
    if collectives and len(cpus) > 1:
        chunk_s = probe_chunk_s(model, [p for p in profiles if p.device_type in {d.profile_key for d in cpus}])
        key = _profile_collectives(cpus, _part(progress, parts - 1, parts), store_dir, save, chunk_s)
    progress(1.0, "done: " + "; ".join(f"{p.device_type} α={p.alpha_s * 1e3:.2f} ms, β={p.beta_s * 1e3:.2f} ms/sample"
                                        for p in profiles))
    return RunProfile(tuple(profiles), key)


def _part(progress: Progress, i: int, n: int) -> Progress:
    return lambda f, m: progress((i + f) / n, m)


def _together_groups(cpus: Sequence[DeviceSpec]) -> list[list[DeviceSpec]]:
    """The CPU devices in the windows they are timed in: all at once, except that CPU-quota devices
    and plain workers (profile_together times one sort at a time) take a window each."""
    quota = [d for d in cpus if d.cpu_share is not None]
    plain = [d for d in cpus if d.cpu_share is None]
    return [g for g in (quota, plain) if g]


def _profile_group(model: str, seq: int, dtype: str, group: Sequence[DeviceSpec], common: dict,
                   progress: Progress) -> list[StepProfile]:
    """One window: two or more devices together, a lone device by itself under its limits."""
    from profiler.step_profile import profile_local, profile_together

    if len(group) == 1:
        d = group[0]
        return [profile_local(model, seq, dtype, device="cpu", progress=progress, cpu_share=d.cpu_share,
                              memory_gb=d.memory_gb, wall_clock=True, **common)]
    return profile_together(model, seq, dtype, [(d.cpu_share, d.memory_gb) for d in group], progress=progress,
                            slowdowns=[d.slowdown for d in group], **common)


def _profile_gpu(model: str, seq: int, dtype: str, device_type: str, common: dict,
                 progress: Progress) -> StepProfile:
    """A GPU type timed by itself on this machine's GPU, which must be of that type."""
    import torch

    from profiler.step_profile import local_device_type, profile_local

    here = local_device_type(torch.device("cuda"))[0] if torch.cuda.is_available() else None
    if here != device_type:
        raise ValueError(f"cannot profile {device_type} here: this machine has {here or 'no GPU'}; profile it where "
                         "it is (python -m profiler profile there, or inventory --slurm --profile) and copy the "
                         "profile store here")
    return profile_local(model, seq, dtype, device="cuda", progress=progress, **common)


def probe_chunk_s(model: str, profiles: Sequence[StepProfile]) -> float:
    """The compute a step of `model` does between two of its waits: a profiled kind's t(m) = α + β·m
    at the lower middle of its profiled micro-batches (4 of 1..32), over one forward and one
    backward pass per runtime unit (contracts.units: each pass ends waiting on a gather or a
    reduce); the least over the kinds (the fastest rank waits for the others at every call), within
    PROBE_CHUNK_BOUNDS_S; PROBE_CHUNK_S without a measured profile."""
    from contracts.specs import get_model
    from contracts.units import runtime_units

    passes = 2 * len(runtime_units(get_model(model)))
    chunks = []
    for p in profiles:
        sizes = sorted(p.micro_batches) or [1]
        chunks.append((p.alpha_s + p.beta_s * sizes[(len(sizes) - 1) // 2]) / passes)
    if not chunks:
        return PROBE_CHUNK_S
    lo, hi = PROBE_CHUNK_BOUNDS_S
    return min(max(min(chunks), lo), hi)


def _profile_collectives(cpus: Sequence[DeviceSpec], progress: Progress, store_dir: str | None, save: bool,
                         chunk_s: float = PROBE_CHUNK_S) -> str:
    """All-reduce and all-gather between the run's CPU devices, one rank per device, each under its
    CPU quota and memory limit as the run's ranks will be (a throttled rank slows every collective it
    takes part in), each op issued after the ranks computed; saved under collective_set_key of their
    kinds, which the cost model prices the run's collectives by (planner/costmodel/training.py)."""
    from planner.core.profiles import collective_set_key, save_collective_profile
    from profiler import cgroups
    from profiler.collectives import benchmark_collectives

    key = collective_set_key(d.profile_key for d in cpus)
    progress(0.0, f"timing all-reduce and all-gather between the {len(cpus)} devices, each under its limits")
    limits = None
    if cgroups.unavailable_reason() is None:  # plain workers too: each op after the ranks computed, as in a run
        limits = [cgroups.Limits(d.cpu_share, None if d.memory_gb is None else int(d.memory_gb * GIB)) for d in cpus]
    elif any(d.cpu_share is not None or d.memory_gb is not None for d in cpus):
        raise ValueError(f"cannot time collectives under the devices' limits: {cgroups.unavailable_reason()}")
    repeats = COLLECTIVE_REPEATS
    for attempt in range(1 + NOISY_COLLECTIVE_RETRIES):
        try:
            profile = benchmark_collectives(len(cpus), COLLECTIVE_SIZES, ops=("all_reduce", "all_gather"),
                                            device_type=key, limits=limits, repeats=repeats)
            break
        except ValueError as e:  # a fit the noise left without a bandwidth: time again, with more repeats
            if attempt == NOISY_COLLECTIVE_RETRIES:
                raise ValueError(f"collectives between {key}: {e} after {attempt + 1} tries; the machine is too "
                                 "busy to time them, profile on a quieter one") from None
            log.warning("collectives between %s: %s; timing again", key, e)
            repeats *= 2
    # the same ranks again, the calls issued as a run issues them (the cost model's per-call latency and
    # overlap on CPU ranks: planner/costmodel/training.py build_comm_model)
    progress(0.8, "timing collectives between compute and beside it, as a step issues them")
    profile = dataclasses.replace(profile, fits=profile.fits + _probe_collectives_in_step(cpus, limits, chunk_s))
    if save:
        save_collective_profile(profile, store_dir)
    progress(1.0, "collectives timed")
    return key




def _probe_collectives_in_step(cpus: Sequence[DeviceSpec], limits: list | None,
                               chunk_s: float = PROBE_CHUNK_S) -> tuple[CollectiveFit, CollectiveFit]:
    """Start one probe rank per device (each inside its cgroups when `limits`), time the calls as a run
    issues them, `chunk_s` of compute (thread CPU time) before each (_probe_rank), and return
    (BESIDE_COMPUTE fit, ASYNC_BESIDE_COMPUTE record)."""
    from profiler import cgroups
    from profiler.collectives import PROJECT_ROOT, free_port

    with tempfile.TemporaryDirectory(prefix="gpumix-probe-") as tmp, contextlib.ExitStack() as stack:
        env = {**os.environ, "OMP_NUM_THREADS": "1",
               "PYTHONPATH": os.pathsep.join(p for p in (PROJECT_ROOT, os.environ.get("PYTHONPATH")) if p)}
        env.pop(cgroups.ENV_CGROUPS, None)
        if limits is not None:
            env[cgroups.ENV_CGROUPS] = os.path.join(tmp, "cgroups.json")
            groups = {r: stack.enter_context(cgroups.created(f"{cgroups.PREFIX}probe-{os.getpid()}-r{r}", lim))
                      for r, lim in enumerate(limits)}
            cgroups.save_table(env[cgroups.ENV_CGROUPS], "cgroup", "probe of collectives beside compute", groups)
        config = {"world": len(cpus), "port": free_port(), "out_path": os.path.join(tmp, "probe.json"),
                  "chunk_s": chunk_s}
        argvs = [["-m", "profiler.run_profile", json.dumps({**config, "rank": r})] for r in range(len(cpus))]
        _run_probe_ranks([cgroups.exec_command(a) if limits is not None else a for a in argvs], env, PROJECT_ROOT, tmp)
        with open(config["out_path"], encoding="utf-8") as fh:
            t = json.load(fh)
    return _probe_fits(t["small_s"], t["large_s"], t["compute_s"], t["both_s"])


def _run_probe_ranks(argvs: Sequence[list[str]], env: dict[str, str], cwd: str, log_dir: str) -> None:
    """One Python process per rank (argument lists, no shell), its output in log_dir, until all end;
    RuntimeError naming the first rank that failed, with its log's tail, or TimeoutError after
    PROBE_TIMEOUT_S."""
    from profiler.collectives import stop_ranks, wait_ranks

    logs = [os.path.join(log_dir, f"probe-rank{r}.log") for r in range(len(argvs))]
    procs = []
    for r, argv in enumerate(argvs):
        with open(logs[r], "w", encoding="utf-8") as fh:
            procs.append(subprocess.Popen([sys.executable, *argv], cwd=cwd, env={**env, "RANK": str(r)},
                                          stdout=fh, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL))
    try:
        timed_out = wait_ranks(procs, PROBE_TIMEOUT_S)
    finally:
        stop_ranks(procs)
    if timed_out:
        raise TimeoutError(f"probe of collectives beside compute did not finish in {PROBE_TIMEOUT_S:.0f} s")
    failed = [(r, p.returncode) for r, p in enumerate(procs) if p.returncode != 0]
    if failed:
        r, code = failed[0]
        with open(logs[r], encoding="utf-8", errors="replace") as fh:
            tail = fh.read()[-800:]
        raise RuntimeError(f"probe of collectives beside compute: rank {r} exited {code}: {tail}")


def _probe_fits(small_s: float, large_s: float, compute_s: float, both_s: float) -> tuple[CollectiveFit, CollectiveFit]:
    """The probe's mean times as profile records: a line through the two blocking calls (latency, and
    bandwidth where the large call took longer), and the async gather's three times."""
    extra = large_s - small_s
    # the large call no slower than the small one (noise): its bytes priced at its whole time
    bandwidth = (PROBE_LARGE_BYTES - PROBE_SMALL_BYTES) / extra if extra > 0 else PROBE_LARGE_BYTES / max(large_s, 1e-9)
    latency = max(small_s - PROBE_SMALL_BYTES / bandwidth, 0.0)  # the line's value at 0 bytes
    fit = CollectiveFit(BESIDE_COMPUTE, latency, bandwidth, 1.0, (PROBE_SMALL_BYTES, PROBE_LARGE_BYTES),
                        (small_s, large_s))
    beside = CollectiveFit(ASYNC_BESIDE_COMPUTE, 0.0, bandwidth, 1.0, (0, PROBE_LARGE_BYTES, PROBE_LARGE_BYTES),
                           (compute_s, large_s, both_s))
    return fit, beside


def _probe_rank(cfg: dict) -> None:
    """One probe rank: compute chunks (a 1-thread matmul loop of about cfg["chunk_s"]) with, in rotation,
    nothing, a blocking small all-gather after it, a blocking large one after it, and a large async one
    issued before it and waited after it. Rank 0 writes the mean times (the slowest rank's, per call)."""
    import torch
    import torch.distributed as dist

    from profiler import cgroups

    rank, world = cfg["rank"], cfg["world"]
    cgroups.start_rank(rank)
    torch.set_num_threads(1)  # as every executor rank
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{cfg['port']}", rank=rank, world_size=world)
    try:
        a = torch.randn(96, 96)
        t0 = time.thread_time()
        for _ in range(50):
            a @ a
        per = torch.tensor([(time.thread_time() - t0) / 50])
        dist.all_reduce(per, op=dist.ReduceOp.MIN)  # every rank the same work per chunk
        reps = max(1, round(cfg["chunk_s"] / max(per.item(), 1e-7)))

        def chunk() -> None:
            for _ in range(reps):
                a @ a

        bufs = {}
        for size in (PROBE_SMALL_BYTES, PROBE_LARGE_BYTES):
            n = size // 4 // world
            bufs[size] = (torch.ones(n), torch.empty(n * world))
        times: dict[str, list[float]] = {"small_s": [], "large_s": [], "compute_s": [], "both_s": []}
        for r in range(PROBE_ROUNDS + 1):  # the first round warms up, untimed
            for _ in range(PROBE_CALLS_PER_ROUND):
                for what in times:
                    w0 = time.perf_counter()
                    if what == "both_s":
                        shard, full = bufs[PROBE_LARGE_BYTES]
                        work = dist.all_gather_into_tensor(full, shard, async_op=True)
                        chunk()
                        work.wait()
                    else:
                        chunk()
                        if what != "compute_s":
                            shard, full = bufs[PROBE_SMALL_BYTES if what == "small_s" else PROBE_LARGE_BYTES]
                            w0 = time.perf_counter()
                            dist.all_gather_into_tensor(full, shard)
                    if r:
                        times[what].append(time.perf_counter() - w0)
        means = torch.tensor([sum(v) / len(v) for v in times.values()], dtype=torch.float64)
        dist.all_reduce(means, op=dist.ReduceOp.MAX)  # a collective ends when its slowest rank does
        if rank == 0:
            with open(cfg["out_path"], "w", encoding="utf-8") as fh:
                json.dump(dict(zip(times, means.tolist())), fh)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":  # one probe rank, started by _probe_collectives_in_step
    _probe_rank(json.loads(sys.argv[1]))
