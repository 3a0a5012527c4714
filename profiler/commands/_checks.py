"""Checks the profiler's commands run before they allocate: a device that exists, and a
step that fits in this machine's memory (a real trace or profile of a huge batch would
otherwise die in the allocator, with a traceback, after minutes)."""
from __future__ import annotations

import psutil

from planner.core.memory import MemoryConfig, estimate_memory
from contracts.constants import GIB
from contracts.specs import ModelSpec

# a profile's predicted peak may use at most this share of the memory available NOW (other processes
# hold the rest; stricter than a plan's MEMORY_HEADROOM of a whole device)
PROFILE_MEMORY_SHARE = 0.8


def require_device(device: str | None) -> None:
    """ValueError when `device` (already a well-formed name, contracts.cli.device_arg) is absent here."""
    if device is None or device.startswith("cpu"):
        return
    import torch

    if device.startswith("mps"):
        if not torch.backends.mps.is_available():
            raise ValueError(f"--device {device}: no MPS device on this machine")
        return
    if not torch.cuda.is_available():
        raise ValueError(f"--device {device}: no CUDA device on this machine (use cpu)")
    index = int(device.split(":")[1]) if ":" in device else 0
    if index >= torch.cuda.device_count():
        raise ValueError(f"--device {device}: this machine has {torch.cuda.device_count()} CUDA device(s)")


def require_fits_in_memory(spec: ModelSpec, cfg: MemoryConfig, flags: str, hint: str = "") -> None:
    """ValueError naming `flags` when the predicted peak of one real step exceeds the memory
    available on this machine (the planner's estimate: the same model the trace checks)."""
    peak = estimate_memory(spec, cfg).peak_bytes
    avail = psutil.virtual_memory().available
    if peak > PROFILE_MEMORY_SHARE * avail:
        raise ValueError(f"{flags}: one step of {spec.name} is predicted to peak at {peak / GIB:.1f} GiB, more than "
                         f"{PROFILE_MEMORY_SHARE:.0%} of the {avail / GIB:.1f} GiB available here{hint}")
