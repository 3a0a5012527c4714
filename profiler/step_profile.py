"""Step-time profiles, as Cephalo builds them: time forward+backward of one micro-batch at
several micro-batch sizes on a local device, fit `α + β·m`, time the optimizer step.

It measures exactly what an executor rank runs (the sharded runtime, one rank owning the whole
state, one torch thread on a CPU), timing sizes in interleaved rounds and fitting each size's
median. On a CPU the clock is the compute thread's CPU time (`step_clock`); with `workers=N`
companion processes run the same loop beside it and the clock is wall time. An emulated device
(`cpu_share`, `memory_gb`) is profiled in a child inside its own cgroups (profiler/cgroups.py)
and saved under its kind (contracts.cluster.profile_key). FLOPs per sample are counted with
FlopCounterMode under FakeTensorMode.

How the profile is used and stored: docs/models/cost.md ("Step profiles").
"""
from __future__ import annotations

import contextlib
import datetime
import json
import logging
import multiprocessing as mp
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Callable, Iterator, Sequence

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils.flop_counter import FlopCounterMode, sdpa_backward_flop_count, sdpa_flop_count

from profiler import cgroups
from models.collectives import LocalCollectives
from models.decoder import build_model
from models.runtime import micro_batch_loss, use_tf32_as_priced
from models.sharded import ShardedRuntime
from contracts.catalog import GIB
from contracts.cluster import profile_key
from contracts.constants import PROFILE_MICRO_BATCHES
from contracts.paths import PROJECT_ROOT
from planner.core.profiles import HOW_ALONE, HOW_TOGETHER, StepProfile, fit_line, peak_tflops, save_step_profile
from contracts.specs import ModelSpec, get_model, with_max_seq

log = logging.getLogger(__name__)

Progress = Callable[[float, str], None]

AUTOCAST = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}
# From 1 up: the fixed cost of a micro-batch (α: Python, kernel launches, a CPU quota's period)
# is what the smallest sizes resolve: timed from 4 up, α can fit to 0, and the planner then prices
# many micro-batches of 1 as cheaply as a few large ones (a run slower than predicted).
DEFAULT_MICRO_BATCHES = PROFILE_MICRO_BATCHES
DEFAULT_REPEATS = 5
DEFAULT_WARMUP = 2
MIN_FIT_POINTS = 4
# profile_together: a device done with its rounds times more, at most this many × repeats, while
# the others finish theirs; the control folder's files and the children's round counts
MAX_ROUNDS_FACTOR = 20
STOP_FILE, DONE_FILE, ROUNDS_SUFFIX = "stop", "done", ".rounds"
TOGETHER_POLL_S = 0.2

_aten = torch.ops.aten


def _sdpa_cpu_forward(query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs) -> int:
    return sdpa_flop_count(query_shape, key_shape, value_shape)


def _sdpa_cpu_backward(grad_out_shape, query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs) -> int:
    return sdpa_backward_flop_count(grad_out_shape, query_shape, key_shape, value_shape)


# FlopCounterMode knows the CUDA attention kernels but not the CPU one that
# F.scaled_dot_product_attention takes on a CPU (and under FakeTensorMode on CPU): without
# these the attention term (12·L·h·s per token) would be missing from the count.
_CPU_ATTENTION_FLOPS = {
    _aten._scaled_dot_product_flash_attention_for_cpu: _sdpa_cpu_forward,
    _aten._scaled_dot_product_flash_attention_for_cpu_backward: _sdpa_cpu_backward,
}


def flop_counter() -> FlopCounterMode:
    return FlopCounterMode(display=False, custom_mapping=dict(_CPU_ATTENTION_FLOPS))


def _noop(fraction: float, message: str) -> None:
    pass


def _model_for(spec: ModelSpec, seq: int) -> ModelSpec:
    if isinstance(seq, bool) or not isinstance(seq, int) or seq <= 0:
        raise ValueError(f"seq must be a positive integer, got {seq!r}")
    return with_max_seq(spec, seq)


def count_flops(spec: ModelSpec, seq: int, micro_batch: int = 1, recompute: str = "none",
                dtype: str = "fp32") -> float:
    """Training FLOPs (forward + backward) of one micro-batch, counted op by op on the
    runtime's code path under FakeTensorMode: no real memory, no real compute."""
    spec = _model_for(spec, seq)
    with FakeTensorMode():
        model = build_model(spec, recompute)
        tokens = torch.randint(0, spec.vocab_size, (micro_batch, seq))
        targets = torch.randint(0, spec.vocab_size, (micro_batch, seq))
        with flop_counter() as counter:
            loss = micro_batch_loss(model, tokens, targets, micro_batch * seq, AUTOCAST[dtype])
            loss.backward()
    return float(counter.get_total_flops())


@contextlib.contextmanager
def executor_threads(device: torch.device) -> Iterator[None]:
    """One torch thread on a CPU, as every executor rank runs; restored afterwards (the
    dashboard profiles inside its own process)."""
    if device.type != "cpu":
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def step_clock(device: torch.device, workers: int = 1, limited: bool = False) -> Callable[[], float]:
    """The clock a step is timed with. On a CPU: the CPU time of this thread. With one torch
    thread, forward, backward (autograd runs CPU work on the calling thread) and the optimizer
    all run on it, so this is the work of one dedicated core, which is what a cpu worker of
    the cluster file is; wall time on a shared machine would add whatever the neighbours ran
    meanwhile (up to 2x on a busy 2-core machine). On a GPU: wall time
    between synchronizations. `workers` > 1 (local CPU workers profiled concurrently, see
    `concurrent_workers`): wall time, since sharing the cores with the other workers is then
    what is being measured. `limited` (under a cgroup CPU quota): wall time, since the quota
    throttles wall time and leaves the CPU time of the work unchanged."""
    if device.type == "cpu" and workers <= 1 and not limited:
        return time.thread_time
    return time.perf_counter


def clock_name(device: torch.device, workers: int = 1, limited: bool = False) -> str:
    if device.type != "cpu":
        return "wall time"
    if workers <= 1:
        return "wall time" if limited else "thread CPU time"
    return f"wall time with {workers} concurrent workers"


def _companion(spec: ModelSpec, seq: int, micro_batches: Sequence[int], recompute: str, dtype: str,
               ready: "mp.synchronize.Event", stop: "mp.synchronize.Event",
               cgroup: cgroups.Cgroup | None = None) -> None:
    """One companion worker (a spawned process): the executor rank's loop — forward+backward of
    every profiled micro-batch size, then the optimizer step — on one torch thread, until `stop`,
    inside `cgroup` when given (another emulated rank's CPU quota).
    `ready` is set after the first (warm-up) round, so timing starts under full contention."""
    if cgroup is not None:
        cgroups.join(cgroup)
    torch.set_num_threads(1)
    compute_until(one_rank_runtime(spec, recompute, torch.device("cpu")), spec, seq, micro_batches, dtype,
                  stop.is_set, ready.set)


def compute_until(rt: ShardedRuntime, spec: ModelSpec, seq: int, micro_batches: Sequence[int], dtype: str,
                  stop: Callable[[], bool], after_round: Callable[[], None] = lambda: None) -> None:
    """A companion's work, until `stop()`: rounds of forward+backward of every micro-batch size (each
    twice in a row: a rank repeats its size), then the optimizer step (an executor rank's loop),
    `after_round()` after each."""
    gen = torch.Generator().manual_seed(1)
    batches = [(torch.randint(0, spec.vocab_size, (m, seq), generator=gen),
                torch.randint(0, spec.vocab_size, (m, seq), generator=gen)) for m in micro_batches]
    while not stop():
        for tokens, targets in batches:
            for _ in range(2):
                micro_batch_loss(rt.model, tokens, targets, tokens.numel(), AUTOCAST[dtype]).backward()
                if stop():
                    return
        rt.train_step([], 1, lr=1e-4)
        after_round()


def one_rank_runtime(spec: ModelSpec, recompute: str, device: torch.device) -> ShardedRuntime:
    """The runtime of a rank owning the whole state (ZeRO-1, one position)."""
    return ShardedRuntime(spec, zero=1, fractions=[1.0], position=0, comm=LocalCollectives(0, 1), device=device,
                          recompute=recompute, seed=0)


@contextlib.contextmanager
def concurrent_workers(device: torch.device, workers: int, spec: ModelSpec, seq: int,
                       micro_batches: Sequence[int], recompute: str, dtype: str,
                       companion_cpu_share: float | None = None) -> Iterator[None]:
    """Run `workers` − 1 companion processes (the other local CPU workers of a run) while the
    body times, each under a CPU quota of `companion_cpu_share` when given; nothing on a GPU
    or for one worker. Spawned, not forked: a fork of a process whose torch thread pools have
    started can hang."""
    if device.type != "cpu" or workers <= 1:
        yield
        return
    with contextlib.ExitStack() as stack:
        groups: list[cgroups.Cgroup | None] = [None] * (workers - 1)
        if companion_cpu_share is not None:
            groups = [stack.enter_context(cgroups.created(f"{cgroups.PREFIX}profile-{os.getpid()}-c{i}",
                                                          cgroups.Limits(cpu_share=companion_cpu_share)))
                      for i in range(workers - 1)]
        yield stack.enter_context(_companions(spec, seq, micro_batches, recompute, dtype, groups))


@contextlib.contextmanager
def _companions(spec: ModelSpec, seq: int, micro_batches: Sequence[int], recompute: str, dtype: str,
                groups: Sequence[cgroups.Cgroup | None]) -> Iterator[None]:
    ctx = mp.get_context("spawn")
    stop = ctx.Event()
    readies = [ctx.Event() for _ in groups]
    procs = [ctx.Process(target=_companion, args=(spec, seq, tuple(micro_batches), recompute, dtype, r, stop, g),
                         daemon=True, name=f"profile-companion-{i}") for i, (r, g) in enumerate(zip(readies, groups))]
    for p in procs:
        p.start()
    try:
        for p, r in zip(procs, readies):
            while not r.wait(1.0):
                if not p.is_alive():
                    raise RuntimeError(f"profiling companion worker exited with code {p.exitcode}")
        yield
    finally:
        stop.set()
        for p in procs:
            p.join(30.0)
            if p.is_alive():
                p.terminate()
                p.join(5.0)


def local_device_type(device: torch.device) -> tuple[str, str]:
    """(catalog type, device name) of a local torch device."""
    from profiler.inventory import detect_devices

    devices = detect_devices()
    if device.type == "cuda":
        d = next(d for d in devices if d.kind == "cuda" and d.index == (device.index or 0))
        return d.catalog_type, d.name
    return "cpu", next((d.name for d in devices if d.kind == "cpu"), "cpu")


def time_step_sizes(model: torch.nn.Module, spec: ModelSpec, seq: int,
                    micro_batches: Sequence[int], repeats: int, warmup: int, device: torch.device,
                    autocast: torch.dtype | None, progress: Progress, span: tuple[float, float],
                    workers: int = 1, limited: bool = False,
                    more: Callable[[int], bool] | None = None, pause_factor: float = 0.0) -> dict[int, list[float]]:
    """Seconds of forward+backward per micro-batch size: `repeats` interleaved rounds after
    `warmup` untimed ones, then more rounds while `more(rounds timed)` says so (at most
    MAX_ROUNDS_FACTOR × repeats). Gradients accumulate in the parameters' .grad, as in a real step.
    `pause_factor`: after each timed call, sleep that many times its duration (a device emulated by
    `slowdown` s sleeps s − 1 times its compute, as the worker does), so the machine carries the
    load the run will put on it."""
    clock = step_clock(device, workers, limited)
    gen = torch.Generator().manual_seed(0)
    batches = {m: (torch.randint(0, spec.vocab_size, (m, seq), generator=gen).to(device),
                   torch.randint(0, spec.vocab_size, (m, seq), generator=gen).to(device)) for m in micro_batches}
    times: dict[int, list[float]] = {m: [] for m in micro_batches}
    rounds = warmup + repeats
    lo, hi = span
    r = -1
    while True:
        r += 1
        if r >= rounds and (more is None or r - warmup >= MAX_ROUNDS_FACTOR * repeats or not more(r - warmup)):
            break
        # rotate the order each round: no size always runs first after a zero_grad
        order = list(micro_batches)[r % len(micro_batches):] + list(micro_batches)[:r % len(micro_batches)]
        for m in order:
            tokens, targets = batches[m]
            # a run repeats its micro-batch size (accumulation steps, steps), so its allocator has settled
            # on that size's buffers; the first call after another size faults them in again (thousands of
            # minor page faults, a slower call): one untimed call of the size first
            micro_batch_loss(model, tokens, targets, m * seq, autocast).backward()
            _sync(device)
            t0 = clock()
            micro_batch_loss(model, tokens, targets, m * seq, autocast).backward()
            _sync(device)
            elapsed = clock() - t0
            if r >= warmup:
                times[m].append(elapsed)
            if pause_factor > 0:
                time.sleep(pause_factor * elapsed)
        progress(lo + (hi - lo) * min(1.0, (r + 1) / rounds),
                 f"{'warm-up' if r < warmup else 'timing'} round {r + 1}/{rounds}")
    return times


def time_optimizer_step(rt: ShardedRuntime, repeats: int, device: torch.device, workers: int = 1,
                        limited: bool = False) -> float:
    """Median seconds of the runtime's optimizer phase over the whole model (one rank owning it
    all): `train_step` of no samples = the gradient reduction, the global norm, clipping, AdamW."""
    clock = step_clock(device, workers, limited)
    rt.train_step([], 1, lr=1e-4)  # warm-up: caches, and the moments' first touch
    samples = []
    for _ in range(repeats):
        _sync(device)
        t0 = clock()
        rt.train_step([], 1, lr=1e-4)
        _sync(device)
        samples.append(clock() - t0)
    return statistics.median(samples)


def _measure(run_spec: ModelSpec, seq: int, sizes: Sequence[int], recompute: str, dtype: str, repeats: int,
             warmup: int, dev: torch.device, progress: Progress, workers: int = 1,
             limited: bool = False, more: Callable[[int], bool] | None = None, pause_factor: float = 0.0,
             ) -> tuple[dict[int, list[float]], float, ShardedRuntime]:
    """(seconds of forward+backward per size, seconds of the optimizer step, the one-rank runtime timed)."""
    rt = one_rank_runtime(run_spec, recompute, dev)
    net = rt.model
    times = time_step_sizes(net, run_spec, seq, sizes, repeats, warmup, dev, AUTOCAST[dtype], progress, (0.1, 0.9),
                            workers, limited, more, pause_factor)
    progress(0.9, "timing the optimizer step")
    for p in net.parameters():  # the timed forward/backward left their gradients here
        p.grad = None
    return times, time_optimizer_step(rt, repeats, dev, workers, limited), rt


def _measure_limited(limits: cgroups.Limits, kind: str, run_spec: ModelSpec, seq: int, sizes: Sequence[int],
                     recompute: str, dtype: str, repeats: int, warmup: int) -> tuple[dict[int, list[float]], float]:
    """`_measure` in a child process inside the device's cgroups (docs/models/cost.md)."""
    with tempfile.TemporaryDirectory(prefix="gpumix-profile-") as tmp, \
            cgroups.created(f"{cgroups.PREFIX}profile-{os.getpid()}", limits) as cg:
        table, job, out = (os.path.join(tmp, n) for n in ("cgroups.json", "job.json", "out.json"))
        cgroups.save_table(table, "cgroup", f"profile of {kind}", {0: cg})
        with open(job, "w", encoding="utf-8") as fh:
            json.dump({"spec": run_spec.to_dict(), "seq": seq, "sizes": list(sizes), "recompute": recompute,
                       "dtype": dtype, "repeats": repeats, "warmup": warmup, "out": out}, fh)
        env = dict(os.environ, RANK="0", OMP_NUM_THREADS="1", **{cgroups.ENV_CGROUPS: table},
                   PYTHONPATH=os.pathsep.join(p for p in (PROJECT_ROOT, os.environ.get("PYTHONPATH")) if p))
        proc = subprocess.run([sys.executable, *cgroups.exec_command(["-m", "profiler.step_profile", job])],
                              cwd=PROJECT_ROOT, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE, text=True)
        if proc.returncode != 0:
            _child_failed(proc.stderr, proc.returncode, cg, limits, kind, sizes, seq)
        with open(out, encoding="utf-8") as fh:
            res = json.load(fh)
    return {int(m): t for m, t in res["times"].items()}, float(res["optimizer_s"])


def _limited_child(job_path: str) -> int:
    """`python -m profiler.cgroups exec -- -m profiler.step_profile JOB`: the timed loop inside
    the device's cgroups; the memory limit is set from this process's baseline first."""
    with open(job_path, encoding="utf-8") as fh:
        job = json.load(fh)
    cgroups.start_rank(0)
    torch.set_num_threads(1)
    spec = ModelSpec.from_dict(job["spec"])
    control = job.get("control")  # profiled together with other devices (profile_together)
    more = None
    if control is not None:
        parent = os.getppid()

        def gone() -> bool:  # the parent said so, or died
            return os.path.exists(os.path.join(control, DONE_FILE)) or os.getppid() != parent

        def more(timed: int) -> bool:
            _write_atomic(job["out"] + ROUNDS_SUFFIX, str(timed))
            return not (os.path.exists(os.path.join(control, STOP_FILE)) or gone())

    times, opt_s, rt = _measure(spec, job["seq"], job["sizes"], job["recompute"], job["dtype"], job["repeats"],
                                job["warmup"], torch.device("cpu"), _noop, limited=job.get("limited", True),
                                more=more, pause_factor=max(0.0, float(job.get("slowdown", 1.0)) - 1.0))
    _write_atomic(job["out"], json.dumps({"times": {str(m): t for m, t in times.items()}, "optimizer_s": opt_s}))
    if control is not None:  # the others may still be timing: go on loading the machine as a rank would
        compute_until(rt, spec, job["seq"], job["sizes"], job["dtype"], gone)
    return 0


def _write_atomic(path: str, text: str) -> None:
    with open(path + ".tmp", "w", encoding="utf-8") as fh:
        fh.write(text)
    os.replace(path + ".tmp", path)


def _checked_sizes(micro_batches: Sequence[int], dtype: str, repeats: int, warmup: int) -> list[int]:
    """The distinct micro-batch sizes, sorted; ValueError for inputs no profile can be timed with."""
    sizes = sorted({int(m) for m in micro_batches})
    if len(sizes) < MIN_FIT_POINTS or sizes[0] < 1:
        raise ValueError(f"need at least {MIN_FIT_POINTS} distinct positive micro-batch sizes, got {list(micro_batches)}")
    if dtype not in AUTOCAST:
        raise ValueError(f"dtype must be one of {sorted(AUTOCAST)}, got {dtype!r}")
    if repeats < 1 or warmup < 0:
        raise ValueError(f"repeats must be >= 1 and warmup >= 0, got {repeats}, {warmup}")
    return sizes


# a fit whose time per sample is not positive is noise, not a profile: time again with twice the
# rounds, this many times, then refuse (a negative slope would price more samples as faster)
NOISY_RETRIES = 2


def profile_local(model: str | ModelSpec, seq: int, dtype: str = "fp32",
                  micro_batches: Sequence[int] = DEFAULT_MICRO_BATCHES, recompute: str = "none",
                  repeats: int = DEFAULT_REPEATS, warmup: int = DEFAULT_WARMUP, device: str | None = None,
                  progress: Progress | None = None, store_dir: str | None = None, save: bool = True,
                  workers: int = 1, cpu_share: float | None = None, memory_gb: float | None = None,
                  companion_cpu_share: float | None = None, wall_clock: bool = False) -> StepProfile:
    """Measure the step profile of `model` on a local device and (by default) save it to the store.

    `workers`: how many local CPU workers will train at once on this machine; > 1 times under
    that many concurrent processes, by wall time (docs/models/cost.md). Ignored on a GPU.
    `wall_clock`: a CPU timed by wall time even alone, so the share of the cores the rest of the
    machine leaves it is in the profile (profiler.run_profile times a run's lone device so).
    `cpu_share` / `memory_gb`: profile an emulated CPU device under those cgroup limits, saved
    under its kind (docs/models/cost.md); `companion_cpu_share`: the companions' CPU quota.
    `progress(fraction, message)` is called as the work advances (fraction in [0, 1])."""
    spec = get_model(model) if isinstance(model, str) else model
    progress = progress or _noop
    sizes = _checked_sizes(micro_batches, dtype, repeats, warmup)
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise ValueError(f"workers must be a positive integer, got {workers!r}")
    run_spec = _model_for(spec, seq)
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if dev.type == "cuda":
        use_tf32_as_priced()  # as the worker trains
    workers = workers if dev.type == "cpu" else 1
    device_type, device_name = local_device_type(dev)
    limits = _limits(dev, cpu_share, memory_gb, companion_cpu_share if workers > 1 else None)
    kind = profile_key(device_type, cpu_share)

    load = machine_load()  # before this profile's own processes start
    progress(0.0, f"counting FLOPs of {spec.name}")
    flops_per_sample = count_flops(spec, seq, 1, recompute, dtype)
    progress(0.05, f"building {spec.name} on {device_name}")
    with executor_threads(dev):
        if workers > 1:
            progress(0.08, f"starting {workers - 1} concurrent companion worker(s)")
        with concurrent_workers(dev, workers, run_spec, seq, sizes, recompute, dtype, companion_cpu_share):
            for _ in range(1 + NOISY_RETRIES):
                if limits.any:
                    progress(0.1, f"timing in a child process under {limits.describe()}")
                    times, opt_s = _measure_limited(limits, kind, run_spec, seq, sizes, recompute, dtype, repeats,
                                                    warmup)
                else:
                    times, opt_s, _ = _measure(run_spec, seq, sizes, recompute, dtype, repeats, warmup, dev,
                                               progress, workers, limited=wall_clock)
                medians, alpha, beta, r2 = _fit(times, sizes)
                if beta > 0:
                    break
                log.warning("profile %s on %s: per-sample time %.3g s is not positive (R²=%.3f), timing again",
                            spec.name, kind, beta, r2)
                repeats *= 2  # more rounds per size: the medians steady
            else:
                raise RuntimeError(
                    f"profiling {spec.name} on {kind} failed: after {1 + NOISY_RETRIES} tries the time per sample "
                    f"is still not positive (medians {[f'{t * 1e3:.2f} ms' for t in medians]} at m={sizes}); "
                    "the timings are dominated by noise: profile larger micro-batches or on a quieter machine")
    under = f" under cgroup limits ({limits.describe()})" if limits.any else ""
    companions = f", companions at {companion_cpu_share:g} of a core" if companion_cpu_share and workers > 1 else ""
    how = f"{clock_name(dev, workers, limits.cpu_share is not None or wall_clock)}{companions}, medians of {repeats}"
    provenance = _provenance(HOW_ALONE, cpu_share, memory_gb, load, [times], sizes)
    return _build_profile(kind, spec, run_spec, seq, dtype, recompute, sizes, medians, alpha, beta, r2, opt_s,
                          flops_per_sample, dev, device_type, device_name, under, how, store_dir, save, progress,
                          provenance)


def _fit(times: dict[int, list[float]], sizes: Sequence[int]) -> tuple[list[float], float, float, float]:
    """(each size's median, α, β, R²) of `α + β·m` through the medians."""
    medians = [statistics.median(times[m]) for m in sizes]
    # α ≥ 0: a cache-bound CPU can look slightly superlinear in m, which would give α < 0
    alpha, beta, r2 = fit_line([float(m) for m in sizes], medians, nonnegative_intercept=True)
    return medians, alpha, beta, r2


def machine_load() -> tuple[float | None, int]:
    """(1-minute load average, CPU count) of this machine now; the load is None where the platform
    has none."""
    try:
        load = os.getloadavg()[0]
    except OSError:
        load = None
    return load, os.cpu_count() or 0


def round_spread(runs: Sequence[dict[int, list[float]]], sizes: Sequence[int]) -> tuple[float | None, float | None]:
    """How noisy the timing was: each device's round r (one time per size) fitted alone to α_r + β_r·m,
    then (IQR / median of the β_r, IQR of the α_r in seconds); (None, None) with fewer than 2 rounds."""
    xs = [float(m) for m in sizes]
    alphas, betas = [], []
    for times in runs:
        for r in range(min(len(times[m]) for m in sizes)):
            a, b, _ = fit_line(xs, [times[m][r] for m in sizes])
            alphas.append(a)
            betas.append(b)
    if len(betas) < 2:
        return None, None
    qa, qb, med = statistics.quantiles(alphas, n=4), statistics.quantiles(betas, n=4), statistics.median(betas)
    return ((qb[2] - qb[0]) / med if med > 0 else None), qa[2] - qa[0]


def _provenance(how: str, cpu_share: float | None, memory_gb: float | None, load: tuple[float | None, int],
                runs: Sequence[dict[int, list[float]]], sizes: Sequence[int],
                together_with: Sequence[str] = ()) -> dict:
    """The StepProfile provenance fields of a measurement (planner.core.profiles.StepProfile)."""
    noise, noise_alpha_s = round_spread(runs, sizes)
    return {"how": how, "cpu_share": cpu_share, "memory_gb": memory_gb, "load_avg": load[0], "num_cpus": load[1],
            "noise": noise, "noise_alpha_s": noise_alpha_s, "together_with": tuple(together_with)}


def _build_profile(kind: str, spec: ModelSpec, run_spec: ModelSpec, seq: int, dtype: str, recompute: str,
                   sizes: Sequence[int], medians: Sequence[float], alpha: float, beta: float, r2: float, opt_s: float,
                   flops_per_sample: float, dev: torch.device, device_type: str, device_name: str, under: str,
                   how: str, store_dir: str | None, save: bool, progress: Progress,
                   provenance: dict) -> StepProfile:
    """The measured StepProfile (`under`, `how`: its source's words for the limits and the clock;
    `provenance`: _provenance's fields), saved to the store unless `save` is False."""
    peak = peak_tflops(device_type, dtype, store_dir)  # the type's: a quota kind reaches a fraction of it
    efficiency = flops_per_sample / beta / 1e12 / peak if beta > 0 else None
    now = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    host = socket.gethostname()
    threads = "1 torch thread" if dev.type == "cpu" else str(dev)
    profile = StepProfile(
        kind, spec.name, seq, dtype, recompute, alpha, beta, opt_s / run_spec.num_params, r2, True,
        f"measured on {host} ({device_name}, {threads}){under} at {now}: {how} at m={list(sizes)}, R²={r2:.3f}",
        flops_per_sample, spec.num_params, spec.num_layers, tuple(sizes), tuple(medians), efficiency, peak, host,
        now, num_matmul_params=spec.matmul_params(), **provenance)
    log.info("profile %s on %s: alpha=%.4g s beta=%.4g s R2=%.4f", spec.name, kind, alpha, beta, r2)
    if save:
        save_step_profile(profile, store_dir)
    progress(1.0, f"done: α={alpha * 1e3:.2f} ms, β={beta * 1e3:.2f} ms/sample, R²={r2:.3f}")
    return profile


def profile_together(model: str | ModelSpec, seq: int, dtype: str = "fp32",
                     devices: Sequence[tuple[float | None, float | None]] = (),
                     micro_batches: Sequence[int] = DEFAULT_MICRO_BATCHES, recompute: str = "none",
                     repeats: int = DEFAULT_REPEATS, warmup: int = DEFAULT_WARMUP, progress: Progress | None = None,
                     store_dir: str | None = None, save: bool = True,
                     slowdowns: Sequence[float] | None = None) -> list[StepProfile]:
    """Profile the CPU devices of one run together, as they will train: one timed child per
    device (`devices`: (cpu_share, memory_gb) per rank), each inside its own cgroups, all at once.
    Either every device has a cpu_share (emulated devices, each under its quota) or none has (the
    machine's plain CPU workers sharing its cores, each child limited only by its memory_gb, if any);
    `slowdowns` (one per device, default 1): a device emulated by sleeping sleeps as its rank will. So
    each device is timed beside the others' real loops under their own limits (its companions are the
    run's other ranks, not stand-ins), at the same moment and under the same load from the rest of
    the machine: profiled one after the other, a load that came or went in between (another job, the
    dashboard drawing) skewed one kind against the other, and the plan balances on that ratio. A
    device done with its `repeats` rounds times more until every device has, so each median covers
    the same window of time; then it times its optimizer step and keeps computing until all are
    done. A CPU-quota device is timed by wall time (the quota stretches it); a plain worker by its
    thread's CPU time, the work of one core: a run's rank computes in bursts between collectives, and
    the kernel's scheduler runs a thread that slept at once, so the share of the cores other processes
    take shows in the rank's waits (priced by the collectives timed beside the same load,
    profiler.run_profile), not in its compute (docs/profiler.md). One profile per distinct kind, in
    the order of `devices` (devices of one kind pool their rounds), saved under the kind."""
    spec = get_model(model) if isinstance(model, str) else model
    progress = progress or _noop
    sizes = _checked_sizes(micro_batches, dtype, repeats, warmup)
    dev = torch.device("cpu")
    if len(devices) < 2:
        raise ValueError(f"profile_together needs the run's devices (two or more), got {list(devices)}")
    slowdowns = [1.0] * len(devices) if slowdowns is None else [float(x) for x in slowdowns]
    if len(slowdowns) != len(devices) or any(not x >= 1.0 for x in slowdowns):
        raise ValueError(f"slowdowns: one per device, each >= 1, got {slowdowns} for {len(devices)} devices")
    limits = [_limits(dev, share, memory_gb, None) for share, memory_gb in devices]
    if len({lim.cpu_share is None for lim in limits}) > 1:
        raise ValueError("profile_together times either CPU-quota devices (each its cpu_share) or plain CPU "
                         f"workers, not a mix of both: got cpu_shares {[lim.cpu_share for lim in limits]}")
    run_spec = _model_for(spec, seq)
    device_type, device_name = local_device_type(dev)
    kinds = [profile_key(device_type, share) for share, _ in devices]
    load = machine_load()  # before this profile's own processes start
    progress(0.0, f"counting FLOPs of {spec.name}")
    flops_per_sample = count_flops(spec, seq, 1, recompute, dtype)
    for _ in range(1 + NOISY_RETRIES):
        progress(0.05, f"timing {len(devices)} devices at once, each in a child process under its own limits")
        results = _measure_together(limits, kinds, run_spec, seq, sizes, recompute, dtype, repeats, warmup, progress,
                                    slowdowns)
        fits = {}
        for kind in dict.fromkeys(kinds):
            mine = [r for k, r in zip(kinds, results) if k == kind]
            times = {m: [t for r in mine for t in r[0][m]] for m in sizes}
            fits[kind] = (times, statistics.median(r[1] for r in mine), _fit(times, sizes), [r[0] for r in mine])
        noisy = [k for k, (_, _, (medians, _, beta, _), _) in fits.items() if beta <= 0]
        if not noisy:
            break
        log.warning("profile %s on %s: per-sample time not positive, timing again", spec.name, ", ".join(noisy))
        repeats *= 2
    else:
        raise RuntimeError(f"profiling {spec.name} on {', '.join(noisy)} failed: after {1 + NOISY_RETRIES} tries the "
                           "time per sample is still not positive; the timings are dominated by noise: profile "
                           "larger micro-batches or on a quieter machine")
    profiles = []
    together = " + ".join(f"{k}" for k in kinds)
    for kind, (times, opt_s, (medians, alpha, beta, r2), runs) in fits.items():
        at = kinds.index(kind)
        lim = limits[at]
        rounds = min(len(times[m]) for m in sizes)
        how = (f"{clock_name(dev, 1, lim.cpu_share is not None)}, profiled together with the run's devices "
               f"({together}, each under its limits), medians of {rounds}")
        under = f" under cgroup limits ({lim.describe()})" if lim.any else ""
        provenance = _provenance(HOW_TOGETHER, devices[at][0], devices[at][1], load, runs, sizes, kinds)
        profiles.append(_build_profile(kind, spec, run_spec, seq, dtype, recompute, sizes, medians, alpha, beta, r2,
                                       opt_s, flops_per_sample, dev, device_type, device_name,
                                       under, how, store_dir, save, _noop, provenance))
    progress(1.0, "done: " + "; ".join(f"{p.device_type} α={p.alpha_s * 1e3:.2f} ms, β={p.beta_s * 1e3:.2f} ms/sample"
                                        for p in profiles))
    return profiles


def _measure_together(limits: Sequence[cgroups.Limits], kinds: Sequence[str], run_spec: ModelSpec, seq: int,
                      sizes: Sequence[int], recompute: str, dtype: str, repeats: int, warmup: int,
                      progress: Progress, slowdowns: Sequence[float]) -> list[tuple[dict[int, list[float]], float]]:
    """Each device's (seconds of forward+backward per size, seconds of the optimizer step), timed by
    children started at once, each inside its cgroups where it has limits (profile_together)."""
    with tempfile.TemporaryDirectory(prefix="gpumix-profile-") as tmp, contextlib.ExitStack() as stack:
        control = os.path.join(tmp, "control")
        os.mkdir(control)
        procs, outs, groups = [], [], []
        try:
            for i, lim in enumerate(limits):
                table, job, out = (os.path.join(tmp, f"{n}{i}.json") for n in ("cgroups", "job", "out"))
                env = dict(os.environ, RANK="0", OMP_NUM_THREADS="1",
                           PYTHONPATH=os.pathsep.join(p for p in (PROJECT_ROOT, os.environ.get("PYTHONPATH")) if p))
                env.pop(cgroups.ENV_CGROUPS, None)
                argv = ["-m", "profiler.step_profile", job]
                cg = None
                if lim.any:  # a plain worker runs as a plain rank does: in no cgroup of its own
                    cg = stack.enter_context(cgroups.created(f"{cgroups.PREFIX}profile-{os.getpid()}-d{i}", lim))
                    cgroups.save_table(table, "cgroup", f"profile of {kinds[i]} (device {i})", {0: cg})
                    env[cgroups.ENV_CGROUPS] = table
                    argv = cgroups.exec_command(argv)
                with open(job, "w", encoding="utf-8") as fh:
                    json.dump({"spec": run_spec.to_dict(), "seq": seq, "sizes": list(sizes), "recompute": recompute,
                               "dtype": dtype, "repeats": repeats, "warmup": warmup, "out": out, "control": control,
                               "slowdown": slowdowns[i], "limited": lim.cpu_share is not None}, fh)
                with open(out + ".err", "w", encoding="utf-8") as err:  # a file: a pipe nobody reads can fill
                    procs.append(subprocess.Popen(
                        [sys.executable, *argv], cwd=PROJECT_ROOT,
                        env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=err))
                outs.append(out)
                groups.append(cg)
            said = None
            while not all(os.path.exists(o) for o in outs):
                for i, p in enumerate(procs):
                    if p.poll() is not None and not os.path.exists(outs[i]):
                        with open(outs[i] + ".err", encoding="utf-8", errors="replace") as fh:
                            _child_failed(fh.read(), p.returncode, groups[i], limits[i], kinds[i], sizes, seq)
                ready = [os.path.exists(o + ROUNDS_SUFFIX) for o in outs]
                if all(ready) and not os.path.exists(os.path.join(control, STOP_FILE)):
                    _write_atomic(os.path.join(control, STOP_FILE), "")
                if said != sum(ready):
                    said = sum(ready)
                    progress(0.1 + 0.8 * said / len(ready), f"{said} of {len(ready)} devices timed")
                time.sleep(TOGETHER_POLL_S)
        finally:
            _write_atomic(os.path.join(control, DONE_FILE), "")
            for p in procs:
                try:
                    p.wait(timeout=30.0)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
        results = []
        for out in outs:
            with open(out, encoding="utf-8") as fh:
                res = json.load(fh)
            results.append(({int(m): t for m, t in res["times"].items()}, float(res["optimizer_s"])))
    return results


def _child_failed(stderr: str, returncode: int, cg: cgroups.Cgroup | None, limits: cgroups.Limits, kind: str,
                  sizes: Sequence[int], seq: int) -> None:
    """Raise why a timed child ended without its result: the kernel's OOM killer (by name), or its last line."""
    if cg is not None and cgroups.oom_kills(cg):
        raise ValueError(f"profiling {kind} ran out of memory: the kernel's OOM killer ended it under "
                         f"{limits.describe()} (micro-batch {max(sizes)} at seq {seq} does not fit; "
                         "profile smaller micro-batches)")
    last = (stderr.strip().splitlines() or [f"exit code {returncode}"])[-1]
    raise RuntimeError(f"profiling {kind}{' under its cgroup limits' if cg is not None else ''} failed: {last}")


def _limits(dev: torch.device, cpu_share: float | None, memory_gb: float | None,
            companion_cpu_share: float | None) -> cgroups.Limits:
    """The emulated device's limits, checked: a CPU device, valid numbers, cgroups available."""
    from contracts.cluster import DeviceSpec

    d = {"type": "cpu"} | ({} if cpu_share is None else {"cpu_share": cpu_share}) | (
        {} if memory_gb is None else {"memory_gb": memory_gb})
    DeviceSpec.from_dict(d, "profile")  # the cluster file's checks of these numbers
    if companion_cpu_share is not None:
        DeviceSpec.from_dict({"type": "cpu", "cpu_share": companion_cpu_share}, "profile companions")
    limits = cgroups.Limits(cpu_share, None if memory_gb is None else int(memory_gb * GIB))
    if (limits.any or companion_cpu_share is not None) and dev.type != "cpu":
        raise ValueError("cpu_share / memory_gb emulate a CPU worker: profile them on the cpu device")
    if limits.any or companion_cpu_share is not None:
        why = cgroups.unavailable_reason()
        if why is not None:
            raise ValueError(f"cannot profile an emulated device under its limits: {why} (its profile must be "
                             "measured, not derived from the share)")
    return limits


if __name__ == "__main__":
    sys.exit(_limited_child(sys.argv[1]))
