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
