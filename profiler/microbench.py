"""Micro-benchmarks of one local device: matmul TFLOP/s per dtype and size, memory bandwidth,
and (profiler/collectives.py) collective bandwidth between local ranks.

On a CPU everything runs with one torch thread, as each executor rank does, timed by that
thread's CPU time (profiler.step_profile.step_clock), so the figures describe one `cpu`
worker of the cluster file (collectives: wall time, since waiting is their cost). Times are medians of repeats
after a warm-up; the results go to the profile store (planner.core.profiles.DeviceBench),
where the planner reads them.
"""
from __future__ import annotations

import datetime
import logging
import socket
import statistics
from typing import Callable, Sequence

import torch

from planner.core.profiles import DeviceBench, MatmulResult, StepProfile, save_device_bench
from profiler.collectives import DEFAULT_SIZES_BYTES, benchmark_collectives
from profiler.step_profile import executor_threads, local_device_type, step_clock

log = logging.getLogger(__name__)

Progress = Callable[[float, str], None]

TORCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
CPU_MATMUL_SIZES = (128, 256, 512)
GPU_MATMUL_SIZES = (1024, 4096, 8192)
CPU_DTYPES = ("fp32", "bf16")
GPU_DTYPES = ("fp32", "fp16", "bf16")
# Large enough to leave every cache (L3 of a server CPU ~ 32-256 MiB; a GPU's L2 ~ 50 MiB).
CPU_COPY_BYTES = 256 * 2**20
GPU_COPY_BYTES = 1 << 30
# Stop repeating a matmul once this much time was spent on one (dtype, size).
MATMUL_BUDGET_S = 0.5


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _median_time(fn: Callable[[], object], device: torch.device, repeats: int, warmup: int,
                 budget_s: float | None = None) -> float:
    clock = step_clock(device)  # a CPU: this thread's CPU time, as the step profiles
    for _ in range(warmup):
        fn()
    samples: list[float] = []
    spent = 0.0
    while len(samples) < repeats:
        _sync(device)
        t0 = clock()
        fn()
        _sync(device)
        samples.append(clock() - t0)
        spent += samples[-1]
        if budget_s is not None and spent > budget_s and len(samples) >= 3:
            break
    return statistics.median(samples)


def matmul_tflops(n: int, dtype: str, device: torch.device, repeats: int = 7) -> float:
    """TFLOP/s of an n×n @ n×n product: 2·n³ FLOPs over the median time."""
    a = torch.randn(n, n, device=device).to(TORCH_DTYPES[dtype])
    b = torch.randn(n, n, device=device).to(TORCH_DTYPES[dtype])
    t = _median_time(lambda: a @ b, device, repeats, warmup=2, budget_s=MATMUL_BUDGET_S)
    return 2.0 * n**3 / t / 1e12


def memory_gbps(device: torch.device, size_bytes: int | None = None, repeats: int = 5) -> float:
    """GB/s of a large device-to-device copy, read + write bytes counted (STREAM "copy")."""
    size = size_bytes or (GPU_COPY_BYTES if device.type == "cuda" else CPU_COPY_BYTES)
    src = torch.ones(size // 4, device=device)
    dst = torch.empty_like(src)
    t = _median_time(lambda: dst.copy_(src), device, repeats, warmup=1)
    return 2.0 * size / t / 1e9


def _noop(fraction: float, message: str) -> None:
    pass


def run_bench(device: str | None = None, dtypes: Sequence[str] | None = None,
              sizes: Sequence[int] | None = None, copy_bytes: int | None = None,
              collective_sizes_bytes: Sequence[int] | None = DEFAULT_SIZES_BYTES, world_size: int = 2,
              progress: Progress | None = None, store_dir: str | None = None, save: bool = True) -> DeviceBench:
    """Matmul TFLOP/s per dtype and size, memory GB/s and (unless `collective_sizes_bytes`
    is None) the collective fits between `world_size` local ranks; saved to the store."""
    progress = progress or _noop
    if collective_sizes_bytes and world_size < 2:  # fail before minutes of matmuls, not after
        raise ValueError(f"a collective benchmark needs at least 2 ranks, got {world_size}")
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    device_type, device_name = local_device_type(dev)
    gpu = dev.type == "cuda"
    dtypes = tuple(dtypes or (GPU_DTYPES if gpu else CPU_DTYPES))
    unknown = set(dtypes) - set(TORCH_DTYPES)
    if unknown:
        raise ValueError(f"unknown dtypes {sorted(unknown)}; known: {', '.join(TORCH_DTYPES)}")
    sizes = tuple(sizes or (GPU_MATMUL_SIZES if gpu else CPU_MATMUL_SIZES))
    results: list[MatmulResult] = []
    with executor_threads(dev):
        jobs = [(dt, n) for dt in dtypes for n in sizes]
        for i, (dt, n) in enumerate(jobs):
            progress(0.6 * i / len(jobs), f"matmul {dt} {n}×{n}")
            results.append(MatmulResult(dt, n, matmul_tflops(n, dt, dev)))
        progress(0.6, "memory bandwidth")
        mem = memory_gbps(dev, copy_bytes)
    collectives = None
    if collective_sizes_bytes:
        progress(0.7, f"collectives between {world_size} local ranks")
        collectives = benchmark_collectives(world_size, collective_sizes_bytes, device_type=device_type)
    now = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    bench = DeviceBench(device_type, device_name, 1 if not gpu else torch.get_num_threads(), tuple(results), mem,
                        collectives, socket.gethostname(), now)
    if save:
        save_device_bench(bench, store_dir)
    progress(1.0, "done")
    return bench


def profile_machine(model: str, seq: int, dtype: str = "fp32", collectives: bool = False,
                    progress: Progress | None = None, store_dir: str | None = None) -> tuple[DeviceBench, StepProfile]:
    """What the Inventory page's "Profile now" does: the micro-benchmarks (collectives only if asked:
    they spawn processes), then the step profile of `model` on this machine's devices as a run on
    them trains (profiler.run_profile.profile_devices, the one profiling path: on a CPU its workers
    all timed together); both saved to the store. Returns (DeviceBench, the first device's StepProfile)."""
    from profiler.inventory import build_local_cluster
    from profiler.run_profile import cluster_devices, profile_devices

    progress = progress or _noop
    bench = run_bench(collective_sizes_bytes=DEFAULT_SIZES_BYTES if collectives else None,
                      progress=lambda f, m: progress(0.4 * f, m), store_dir=store_dir)
    devices = cluster_devices(build_local_cluster())
    result = profile_devices(model, seq, dtype, devices, collectives=False, store_dir=store_dir,
                             progress=lambda f, m: progress(0.4 + 0.6 * f, m))
    return bench, result.profiles[0]
