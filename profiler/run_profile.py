"""The one profiling path of a run's devices: what `profiler profile --plan/--cluster`, the Plan
page's "Profile now" and the Inventory page all run.

A run's step is priced from each device kind's step profile and from the collectives between its
ranks, so both are measured as the run will meet them: the CPU devices of the run all at once
(profiler.step_profile.profile_together: one timed child per device, each under its own limits —
cgroup CPU quota, memory, or a `slowdown` sleep — in one window of time, under one load from the
rest of the machine, each size's call repeated once untimed so the allocator has settled), then the
collectives between them, one rank per device under the same limits (profiler.collectives). A GPU
type, or a lone device, is timed by itself (profile_local; a CPU by wall time, as together: the
share of the cores the rest of the machine leaves it is part of what the run will meet). Every
profile records when and how it was taken (planner.core.profiles.StepProfile: how, limits, load,
noise). docs/profiler.md has the commands and the fields.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable, Sequence

from contracts.catalog import CPU_TYPE, GIB
from contracts.cluster import ClusterSpec, DeviceSpec
from contracts.plan import Plan
from planner.core.profiles import StepProfile

log = logging.getLogger(__name__)

Progress = Callable[[float, str], None]

# collectives between the run's ranks: 1 KiB .. 16 MiB, the gradient buffers of the models a CPU trains
COLLECTIVE_SIZES = tuple(1024 * 4**i for i in range(8))
COLLECTIVE_REPEATS = 5  # medians of this many samples per size (profiler.collectives' default)
# a fit whose time does not grow with size is noise: time again with twice the repeats, this many times
NOISY_COLLECTIVE_RETRIES = 2


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
        key = _profile_collectives(cpus, _part(progress, parts - 1, parts), store_dir, save)
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


def _profile_collectives(cpus: Sequence[DeviceSpec], progress: Progress, store_dir: str | None, save: bool) -> str:
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
    if save:
        save_collective_profile(profile, store_dir)
    progress(1.0, "collectives timed")
    return key
