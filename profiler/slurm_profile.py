"""Profiling a remote node type: `python -m profiler profile` as a SLURM job on that type.

    srun --nodes=1 --ntasks=1 --gres=<gres name>:<SLURM type>:1 [--partition P] \
        python -m profiler profile --model M --seq S ... --json --no-save

runs on a node SLURM picks among those with that GRES type; the measured profile comes back
as JSON on srun's stdout and is saved in the profile store here (planner.core.profiles), so the
planner uses it like a local measurement. The profiled node must report the asked type:
a profile of another device is refused, never stored under the wrong name.
"""
from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from typing import Sequence

from contracts.paths import PROJECT_ROOT
from planner.core.profiles import StepProfile, save_step_profile, step_profile_path
from profiler.slurm_inventory import SlurmNode, catalog_type, check_name, read_nodes

log = logging.getLogger(__name__)

PROFILE_TIMEOUT_S = 3600.0


def gres_type_for(device_type: str, nodes: list[SlurmNode], type_map: dict[str, str] | None = None) -> str:
    """The SLURM GRES type of the usable nodes that names `device_type` (ValueError if none)."""
    for n in nodes:
        if not n.usable:
            continue
        for t in n.gres:
            try:
                if catalog_type(t, type_map) == device_type:
                    return t
            except ValueError:
                continue
    have = sorted({t for n in nodes if n.usable for t in n.gres})
    raise ValueError(f"no usable SLURM node has a GRES of type {device_type} (GRES types: {', '.join(have) or 'none'})")


def srun_profile_command(gres_name: str, gres_type: str, profile_args: Sequence[str],
                         partition: str | None = None) -> list[str]:
    cmd = ["srun", "--nodes=1", "--ntasks=1", f"--gres={check_name(gres_name, 'GRES name')}:"
           f"{check_name(gres_type, 'GRES type')}:1", f"--job-name=gpumix-profile-{gres_type}", "--export=ALL"]
    cmd += [f"--partition={check_name(partition, 'partition')}"] if partition else []
    return cmd + [sys.executable, "-m", "profiler", "profile", *profile_args, "--json", "--no-save"]


def profile_on_slurm(device_type: str, profile_args: Sequence[str], gres_name: str,
                     partition: str | None = None, type_map: dict[str, str] | None = None,
                     timeout_s: float = PROFILE_TIMEOUT_S) -> tuple[StepProfile, str]:
    """Profile `device_type` on a SLURM node that has it; (the profile, where it was stored)."""
    nodes = read_nodes(gres_name)
    cmd = srun_profile_command(gres_name, gres_type_for(device_type, nodes, type_map), profile_args, partition)
    env = dict(os.environ, PYTHONUNBUFFERED="1",
               PYTHONPATH=os.pathsep.join(p for p in (PROJECT_ROOT, os.environ.get("PYTHONPATH")) if p))
    log.info("profiling %s as a SLURM job: %s", device_type, " ".join(cmd))
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, env=env, cwd=PROJECT_ROOT,
                           stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        raise ValueError(f"the profile of {device_type} did not finish within {timeout_s:.0f} s") from None
    if r.returncode != 0:
        last = (r.stderr or r.stdout).strip().splitlines()
        raise ValueError(f"the profile job on {device_type} failed: {last[-1] if last else f'exit {r.returncode}'}")
    try:
        profile = StepProfile.from_dict(json.loads(r.stdout))
    except (ValueError, TypeError) as e:
        raise ValueError(f"the profile job on {device_type} printed no profile: {e}") from None
    if profile.device_type != device_type:
        raise ValueError(f"the SLURM node given for {device_type} measured a {profile.device_type}: not stored")
    save_step_profile(profile)
    return profile, step_profile_path(profile.device_type, profile.model, profile.seq, profile.dtype,
                                      profile.recompute)
