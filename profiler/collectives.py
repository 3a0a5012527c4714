"""Collective benchmarks between local ranks: all-reduce, all-gather, broadcast.

Starts `world_size` fresh Python processes (`python -m profiler.collectives`: plain
subprocesses, so the caller's `__main__` — a Streamlit script, pytest — is never
re-imported as multiprocessing's "spawn" would), joins them with torch.distributed (gloo on CPU, NCCL on GPU: one GPU per rank), times each
collective at sizes from 1 KiB to 64 MiB and fits `t = latency + size / bandwidth`.
Each timing is the slowest rank's (a collective ends when its last rank ends), the
median over repeats. `size` is the whole tensor: the all-reduced or broadcast buffer,
the gathered output of an all-gather (planner.core.profiles.CollectiveFit).
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Sequence

import torch
import torch.distributed as dist

from profiler import cgroups
from planner.core.profiles import CollectiveFit, CollectiveProfile, fit_line

log = logging.getLogger(__name__)

PROJECT_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

KIB = 1024
MIB = 1024 * KIB
DEFAULT_SIZES_BYTES = tuple(KIB * 4**i for i in range(9))  # 1 KiB, 4 KiB, ..., 64 MiB
OPS = ("all_reduce", "all_gather", "broadcast")
FLOAT_BYTES = 4
# Fewer repeats for big transfers (a 64 MiB all-reduce over gloo takes ~0.1 s), more for small
# ones: their ~0.3 ms is easily doubled by one scheduler hiccup on a shared machine.
LARGE_TRANSFER_BYTES = 4 * MIB
SMALL_TRANSFER_BYTES = 256 * KIB
# A sample times several back-to-back ops (then divides): the ranks leave the barrier before a
# sample up to a few ms apart on a busy CPU, a skew larger than a small op itself; back to back,
# as the executor issues them, that skew is paid once per sample, not once per op.
SMALL_OPS_PER_SAMPLE = 16
MEDIUM_OPS_PER_SAMPLE = 4
# Under CPU quotas (an emulated device) each sample is one op issued as a run issues its collectives:
# after the ranks computed for three CFS periods, so a throttled rank has spent its quota and the op
# waits for the next period. Timed back to back, the ops shared the quota left over and came out
# about 7x faster per call than the waits a run on those quotas measures.
BUSY_BEFORE_OP_S = 3 * cgroups.CFS_PERIOD_US / 1e6


def ops_per_sample(size_bytes: int) -> int:
    if size_bytes <= SMALL_TRANSFER_BYTES:
        return SMALL_OPS_PER_SAMPLE
    return MEDIUM_OPS_PER_SAMPLE if size_bytes < LARGE_TRANSFER_BYTES else 1


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def default_backend() -> str:
    return "nccl" if torch.cuda.is_available() and torch.cuda.device_count() >= 2 else "gloo"


def _run_op(op: str, buf: torch.Tensor, out: torch.Tensor | None) -> None:
    if op == "all_reduce":
        dist.all_reduce(buf)
    elif op == "all_gather":
        dist.all_gather_single(out, buf)
    else:
        dist.broadcast(buf, src=0)


def _spin(seconds: float) -> None:
    """Busy for `seconds` of wall time, as a rank computing its micro-batches is."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def _time_op(op: str, size_bytes: int, repeats: int, warmup: int, device: torch.device, world: int,
             busy_s: float = 0.0) -> list[float]:
    numel = max(world, size_bytes // FLOAT_BYTES)
    numel -= numel % world  # all-gather: the output splits evenly between ranks
    if op == "all_gather":
        buf = torch.ones(numel // world, device=device)
        out = torch.empty(numel, device=device)
    else:
        buf, out = torch.ones(numel, device=device), None
    per_sample = 1 if busy_s > 0 else ops_per_sample(size_bytes)
    samples = []
    for i in range(warmup + repeats):
        dist.barrier()
        if busy_s > 0:
            _spin(busy_s)  # the ranks compute first: one under a CPU quota has spent it when the op starts
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        for _ in range(per_sample):
            _run_op(op, buf, out)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if i >= warmup:
            samples.append((time.perf_counter() - t0) / per_sample)
    # the slowest rank's time of each repeat
    t = torch.tensor(samples, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.cpu().tolist()


def _worker(rank: int, world: int, port: int, backend: str, ops: Sequence[str], sizes: Sequence[int],
            repeats: int, warmup: int, out_path: str, busy_s: float = 0.0) -> None:
    cgroups.start_rank(rank)  # inside its cgroups where the caller gave limits (checked), else nothing
    torch.set_num_threads(1)  # as every executor rank
    device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        result: dict[str, dict[str, float]] = {}
        for op in ops:  # connections and buffers are set up lazily: pay for that untimed
            _time_op(op, min(sizes), 1, 3, device, world)
        for op in ops:
            result[op] = {}
            for size in sizes:
                n = (max(2, repeats // 3) if size >= LARGE_TRANSFER_BYTES else
                     3 * repeats if size <= SMALL_TRANSFER_BYTES else repeats)
                result[op][str(size)] = statistics.median(_time_op(op, size, n, warmup, device, world, busy_s))
        if rank == 0:
            with open(out_path, "w", encoding="utf-8") as fh:
                json.dump(result, fh)
    finally:
        dist.destroy_process_group()



def stop_ranks(procs: list) -> None:
    """Kill the rank processes still running and reap them."""
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait()


def wait_ranks(procs: list, timeout_s: float) -> bool:
    """Wait for rank processes to end; stop early when one fails (the others would wait for it
    forever). True when `timeout_s` passed first. The caller kills what is left."""
    deadline = time.monotonic() + timeout_s
    while any(p.poll() is None for p in procs):
        if any(p.returncode not in (None, 0) for p in procs):
            return False
        if time.monotonic() > deadline:
            return True
        time.sleep(0.05)
    return False

def _run_ranks(config: dict, tmp: str, timeout_s: float, cgroup_table: str | None = None) -> dict:
    """Run one `python -m profiler.collectives` per rank (each inside its cgroups from
    `cgroup_table`, when given); the timings rank 0 wrote."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (PROJECT_ROOT, os.environ.get("PYTHONPATH")) if p)}
    env.pop(cgroups.ENV_CGROUPS, None)
    if cgroup_table:
        env[cgroups.ENV_CGROUPS] = cgroup_table
    procs, logs = [], []
    try:
        for rank in range(config["world"]):
            log_path = os.path.join(tmp, f"rank{rank}.log")
            logs.append(log_path)
            argv = ["-m", "profiler.collectives", json.dumps({**config, "rank": rank})]
            with open(log_path, "w", encoding="utf-8") as fh:
                procs.append(subprocess.Popen(
                    [sys.executable, *(cgroups.exec_command(argv) if cgroup_table else argv)],
                    cwd=PROJECT_ROOT, env={**env, "RANK": str(rank), "OMP_NUM_THREADS": "1"},
                    stdout=fh, stderr=subprocess.STDOUT))
        timed_out = wait_ranks(procs, timeout_s)
    finally:
        stop_ranks(procs)
    if timed_out:
        raise TimeoutError(f"collective benchmark did not finish in {timeout_s:.0f} s")
    # the rank that failed by itself first, not one we killed after it
    failed = sorted(((p.returncode < 0, r, p.returncode) for r, p in enumerate(procs) if p.returncode != 0))
    if failed:
        _, rank, code = failed[0]
        with open(logs[rank], encoding="utf-8", errors="replace") as fh:
            tail = fh.read()[-1500:]
        raise RuntimeError(f"collective benchmark rank {rank} exited with code {code}:\n{tail}")
    with open(config["out_path"], encoding="utf-8") as fh:
        return json.load(fh)


def fit_collective(op: str, sizes_bytes: Sequence[int], times_s: Sequence[float]) -> CollectiveFit:
    """`t = latency + size / bandwidth`, weighted by 1/t² (relative errors), so the small sizes
    fix the latency and the large ones the bandwidth instead of the largest drowning the rest."""
    weights = [1.0 / (t * t) for t in times_s]
    latency, inv_bw, r2 = fit_line([float(s) for s in sizes_bytes], list(times_s), weights,
                                   nonnegative_intercept=True)
    if inv_bw <= 0:
        raise ValueError(f"{op}: time does not grow with size ({list(times_s)}); cannot fit a bandwidth")
    return CollectiveFit(op, latency, 1.0 / inv_bw, r2, tuple(int(s) for s in sizes_bytes), tuple(times_s))


def benchmark_collectives(world_size: int = 2, sizes_bytes: Sequence[int] = DEFAULT_SIZES_BYTES,
                          ops: Sequence[str] = OPS, repeats: int = 5, warmup: int = 1, backend: str | None = None,
                          device_type: str = "cpu", timeout_s: float = 300.0,
                          limits: Sequence[cgroups.Limits] | None = None) -> CollectiveProfile:
    """Start `world_size` local ranks, time `ops` at `sizes_bytes`, fit each op. `limits` (one per
    rank: an emulated device's CPU quota and memory): each rank runs inside its own cgroups, as the
    run's ranks will, and each op is timed right after BUSY_BEFORE_OP_S of computing, so a throttled
    rank's part of every collective is timed as a run meets it."""
    if limits is not None and len(limits) != world_size:
        raise ValueError(f"limits: one per rank, {world_size} ranks, got {len(limits)}")
    if limits is not None and (why := cgroups.unavailable_reason()) is not None:
        raise ValueError(f"collectives under CPU quotas need cgroups: {why}")
    if world_size < 2:
        raise ValueError(f"a collective benchmark needs at least 2 ranks, got {world_size}")
    unknown = set(ops) - set(OPS)
    if unknown or not ops:
        raise ValueError(f"unknown collectives {sorted(unknown)}; known: {', '.join(OPS)}")
    if len(set(sizes_bytes)) < 2:
        raise ValueError("need at least 2 distinct sizes to fit latency and bandwidth")
    backend = backend or default_backend()
    if backend == "nccl" and torch.cuda.device_count() < world_size:
        raise ValueError(f"NCCL needs one GPU per rank: {world_size} ranks, {torch.cuda.device_count()} GPUs")
    config = {"world": world_size, "port": free_port(), "backend": backend, "ops": list(ops),
              "sizes": [int(x) for x in sizes_bytes], "repeats": repeats, "warmup": warmup,
              "busy_s": BUSY_BEFORE_OP_S if limits is not None else 0.0}
    with tempfile.TemporaryDirectory(prefix="gpumix-coll-") as tmp, contextlib.ExitStack() as stack:
        config["out_path"] = os.path.join(tmp, "result.json")
        table = None
        if limits is not None:
            table = os.path.join(tmp, "cgroups.json")
            groups = {r: stack.enter_context(cgroups.created(f"{cgroups.PREFIX}coll-{os.getpid()}-r{r}", lim))
                      for r, lim in enumerate(limits)}
            cgroups.save_table(table, "cgroup", f"collective benchmark of {device_type}", groups)
        raw = _run_ranks(config, tmp, timeout_s, table)
    fits = []
    for op in ops:
        sizes = sorted(int(s) for s in raw[op])
        fits.append(fit_collective(op, sizes, [raw[op][str(s)] for s in sizes]))
    return CollectiveProfile(device_type, backend, world_size, tuple(fits), True, socket.gethostname())


if __name__ == "__main__":  # one rank, started by _run_ranks
    cfg = json.loads(sys.argv[1])
    _worker(cfg["rank"], cfg["world"], cfg["port"], cfg["backend"], cfg["ops"], cfg["sizes"], cfg["repeats"],
            cfg["warmup"], cfg["out_path"], cfg["busy_s"])
