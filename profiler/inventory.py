"""The local inventory: which devices this machine has, as a cluster file the planner takes.

With CUDA: one device per GPU, its type mapped to the catalog by the name the
driver reports (`contracts.catalog.match_gpu_type`). Without CUDA: one `cpu`
worker per usable core, but at least 2, so a 2-rank data-parallel run is
always possible (each executor rank uses one torch thread).
"""
from __future__ import annotations

import logging
import os
import platform
import socket
import sys
from dataclasses import asdict, dataclass
from typing import Any

from contracts.catalog import CATALOG, CPU_TYPE, match_gpu_type
from contracts.cluster import ClusterSpec, DeviceSpec, NodeSpec

log = logging.getLogger(__name__)

LOCAL_NODE = "localhost"
LOCAL_DATACENTER = "local"
MIN_CPU_WORKERS = 2  # a data-parallel run needs two ranks


@dataclass(frozen=True)
class LocalDevice:
    """One device of this machine as the hardware reports it."""

    kind: str  # "cuda" | "cpu"
    index: int
    name: str  # driver / CPU model name
    catalog_type: str  # the planner's type name ("H200", "cpu", ...)
    memory_bytes: int
    compute_capability: str | None = None  # CUDA only, "9.0"
    num_sms: int | None = None  # CUDA only
    num_cores: int | None = None  # CPU only: usable logical cores
    type_guessed: bool = False  # True: the name is not in the catalog, the closest type was taken

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def usable_cores() -> int:
    """Logical cores this process may run on (affinity-aware, e.g. in a container)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def cpu_model_name() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as fh:
            for line in fh:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "cpu"


def host_memory_bytes() -> int:
    try:
        import psutil

        return int(psutil.virtual_memory().total)
    except ImportError:  # psutil is pinned, but the inventory should not die without it
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def _closest_catalog_type(memory_bytes: int) -> str:
    gpus = [g for g in CATALOG.values() if g.name != CPU_TYPE]
    return min(gpus, key=lambda g: abs(g.memory_bytes - memory_bytes)).name


# Device files a CUDA (or ROCm, or WSL) driver creates: without any of them there is no GPU,
# and the dashboard's landing page need not pay for importing torch to learn that.
_GPU_DRIVER_PATHS = ("/proc/driver/nvidia", "/dev/nvidiactl", "/dev/kfd", "/dev/dxg")


def _gpu_driver_present() -> bool:
    return "torch" in sys.modules or any(os.path.exists(p) for p in _GPU_DRIVER_PATHS)


def _cuda_devices() -> list[LocalDevice]:
    if not _gpu_driver_present():
        return []
    try:
        import torch
    except ImportError:
        return []
    if not torch.cuda.is_available():
        return []
    out = []
    for i in range(torch.cuda.device_count()):
        p = torch.cuda.get_device_properties(i)
        mem = int(p.total_memory)
        t = match_gpu_type(p.name, mem)
        guessed = t is None
        if guessed:
            t = _closest_catalog_type(mem)
            log.warning("GPU %r is not in the catalog; planning with the closest by memory, %s", p.name, t)
        out.append(LocalDevice("cuda", i, p.name, t, mem, f"{p.major}.{p.minor}", int(p.multi_processor_count),
                               type_guessed=guessed))
    return out


def detect_devices() -> list[LocalDevice]:
    """CUDA devices (name, memory, compute capability, SM count) when present, else the CPU."""
    gpus = _cuda_devices()
    if gpus:
        return gpus
    return [LocalDevice("cpu", 0, cpu_model_name(), CPU_TYPE, host_memory_bytes(), num_cores=usable_cores())]


def cpu_worker_count(num_cores: int | None = None) -> int:
    return max(MIN_CPU_WORKERS, num_cores if num_cores is not None else usable_cores())


def build_local_cluster(devices: list[LocalDevice] | None = None) -> ClusterSpec:
    """This machine as a cluster file: one node, one device per GPU or per CPU core (≥ 2)."""
    devices = detect_devices() if devices is None else devices
    gpus = [d for d in devices if d.kind == "cuda"]
    if gpus:
        node = socket.gethostname() or LOCAL_NODE
        specs = tuple(DeviceSpec(d.catalog_type) for d in gpus)
        return ClusterSpec(f"local-{node}", (NodeSpec(node, LOCAL_DATACENTER, specs),))
    cores = sum(d.num_cores or 1 for d in devices if d.kind == "cpu") or None
    specs = (DeviceSpec(CPU_TYPE),) * cpu_worker_count(cores)
    return ClusterSpec("local", (NodeSpec(LOCAL_NODE, LOCAL_DATACENTER, specs),))
