"""Ports and processes of a test: a free localhost port, and every process a test started, found by
the GPUMIX_DATA_DIR in its environment (a server, and whatever it launched: torchrun and its ranks
inherit it), with their cleanup (SIGTERM, then SIGKILL)."""
from __future__ import annotations

import contextlib
import os
import socket
from typing import Any

from contracts.paths import ENV_DATA_DIR


def free_port() -> int:
    """A TCP port nothing listens on now (bound on localhost, then released)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def processes_with_data_dir(path: str) -> list[Any]:
    """Every live process of this user, this one excepted, whose environment has GPUMIX_DATA_DIR=path."""
    import psutil

    found = []
    for p in psutil.process_iter(["pid"]):
        if p.pid == os.getpid():
            continue
        try:
            if p.environ().get(ENV_DATA_DIR) == path:
                found.append(p)
        except (psutil.Error, OSError):
            continue
    return found


def kill_processes_with_data_dir(path: str, grace_s: float = 5.0) -> int:
    """SIGTERM, then SIGKILL after `grace_s`, every process started with this data dir.
    Returns how many there were."""
    import psutil

    procs = processes_with_data_dir(path)
    for p in procs:
        with contextlib.suppress(psutil.Error):
            p.terminate()
    _, alive = psutil.wait_procs(procs, timeout=grace_s)
    for p in alive:
        with contextlib.suppress(psutil.Error):
            p.kill()
    psutil.wait_procs(alive, timeout=grace_s)
    return len(procs)


def leave_rank() -> None:
    """End a spawned torch.distributed rank that finished cleanly without the interpreter's teardown:
    torch 2.13's gloo threads can abort in C++ static destructors at exit ("terminate called without
    an active exception"), which the spawning test reads as a crashed rank (executor.worker leaves
    the same way)."""
    import sys

    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def rank_result_path(out_dir: str, rank: int) -> str:
    return os.path.join(out_dir, f"rank{rank}.pt")


@contextlib.contextmanager
def gloo_rank(rank: int, port: int, world: int):
    """A spawned rank's gloo process group on 127.0.0.1:`port` (one torch thread): destroyed on the
    way out; after a body that returned, the rank leaves (`leave_rank`), an error propagates."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        yield
    finally:
        dist.destroy_process_group()
    leave_rank()


def save_rank_result(result: Any, out_dir: str, rank: int) -> None:
    """A spawned rank's results (torch.save), for `spawn_ranks` to read back."""
    import torch

    torch.save(result, rank_result_path(out_dir, rank))


def spawn_ranks(worker: Any, nprocs: int, out_dir: str) -> list[Any]:
    """Run `worker(rank, port, out_dir)` in `nprocs` spawned processes (a fresh free port for their
    process group), wait for all, and return what each saved with `save_rank_result`, by rank."""
    import torch
    import torch.multiprocessing as mp

    mp.start_processes(worker, args=(free_port(), out_dir), nprocs=nprocs, start_method="spawn")
    return [torch.load(rank_result_path(out_dir, r), weights_only=False) for r in range(nprocs)]


def kill_rank_and_wait_teardown(handle: Any, rank: int, data_dir: str) -> dict:
    """SIGKILL rank `rank` of the run `handle` (executor.launch.start_run) once it recorded 2 steps;
    assert the run fails within 30 s naming that rank and the signal, and that every process of it
    (the ranks, torchrun, the launcher) ends and none is left with the data folder. Returns the run's
    metrics (executor.store.read_metrics)."""
    import signal
    import time

    import psutil

    from executor.store import read_metrics
    from testkit.wait import wait_until

    m = wait_until(lambda: (lambda m: m if len(m["steps"]) >= 2 else None)(read_metrics(handle.run_dir)), 150,
                   "2 steps")
    pids = {r["rank"]: r["pid"] for r in m["ranks"]}
    with open(os.path.join(handle.run_dir, "torchrun.pid"), encoding="utf-8") as fh:
        torchrun_pid = int(fh.read())
    os.kill(pids[rank], signal.SIGKILL)
    t0 = time.monotonic()
    assert handle.wait(timeout_s=30) == "failed"
    assert time.monotonic() - t0 < 30
    m = read_metrics(handle.run_dir)
    assert m["failed_rank"] == rank and f"rank {rank}" in m["reason"] and "SIGKILL" in m["reason"], m["reason"]
    wait_until(lambda: not any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE
                               for p in [*pids.values(), torchrun_pid, handle.pid]), 30, "every process to end")
    assert processes_with_data_dir(data_dir) == []
    return m
