"""Checkpoints with torch.distributed.checkpoint (DCP): `<run_dir>/checkpoints/step_NNNNNN/`.

What a checkpoint holds: the flat fp32 parameters (the same on every rank after the
broadcast, so DCP writes them once) and each rank's AdamW slice under its own key
(`optim_<plan position>`: bounds, step count, exp_avg, exp_avg_sq). The data order needs
no state: the global sampler is a function of (seed, step). So a resumed run repeats
exactly the steps it would have taken. `latest.json` names the newest complete
checkpoint; rank 0 writes it (atomically) only after every rank's save returned.
Resuming needs the same plan (model, global batch, shard fractions): the slices must match.
"""
from __future__ import annotations

import json
import logging
import os
from typing import Any

from planner.plan import Plan

log = logging.getLogger(__name__)

CKPT_DIR = "checkpoints"
LATEST = "latest.json"


def checkpoint_meta(plan: Plan, step: int, path: str) -> dict[str, Any]:
    return {"step": step, "path": path, "model": plan.model, "global_batch": plan.global_batch, "seq": plan.seq,
            "shard_fractions": [a.shard_fraction for a in plan.used]}


def latest(run_dir: str) -> dict[str, Any] | None:
    """The newest complete checkpoint's metadata, or None."""
    try:
        with open(os.path.join(run_dir, CKPT_DIR, LATEST), encoding="utf-8") as fh:
            return json.load(fh)
    except (OSError, json.JSONDecodeError):
        return None


def check_resumable(run_dir: str, plan: Plan) -> dict[str, Any]:
    """The checkpoint to resume from; ValueError when there is none or it belongs to another plan."""
    meta = latest(run_dir)
    if meta is None:
        raise ValueError(f"cannot resume: no checkpoint in {os.path.join(run_dir, CKPT_DIR)}")
    want = checkpoint_meta(plan, meta["step"], meta["path"])
    for key in ("model", "global_batch", "seq", "shard_fractions"):
        if meta.get(key) != want[key]:
            raise ValueError(f"cannot resume: the checkpoint's {key} {meta.get(key)!r} differs from the plan's "
                             f"{want[key]!r}")
    return meta


def _state_dict(state: Any, position: int) -> dict[str, Any]:
    optim: dict[str, Any] = {"start": state.start, "end": state.end, "step": state.step_count}
    if state.end > state.start:  # an empty slice has no tensors to save
        optim["exp_avg"], optim["exp_avg_sq"] = state.exp_avg, state.exp_avg_sq
    return {"flat_params": state.flat_params, f"optim_{position}": optim}


def save(run_dir: str, state: Any, position: int, step: int, plan: Plan) -> str:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    path = os.path.join(os.path.abspath(run_dir), CKPT_DIR, f"step_{step:06d}")
    dcp.save(_state_dict(state, position), checkpoint_id=path)
    if dist.get_rank() == 0:
        tmp = os.path.join(run_dir, CKPT_DIR, f"{LATEST}.tmp")
        with open(tmp, "w", encoding="utf-8") as fh:
            json.dump(checkpoint_meta(plan, step, path), fh)
        os.replace(tmp, os.path.join(run_dir, CKPT_DIR, LATEST))
    dist.barrier()  # nobody goes on (and maybe dies) before latest.json names this checkpoint
    log.info("checkpoint of step %d saved to %s", step, path)
    return path


def load(run_dir: str, state: Any, position: int) -> int:
    """Load the newest checkpoint into `state` in place; return its step."""
    import torch
    import torch.distributed.checkpoint as dcp

    meta = latest(run_dir)
    if meta is None:
        raise ValueError(f"cannot resume: no checkpoint in {os.path.join(run_dir, CKPT_DIR)}")
    sd = _state_dict(state, position)
    dcp.load(sd, checkpoint_id=meta["path"])
    optim = sd[f"optim_{position}"]
    if "exp_avg" not in optim:
        optim["exp_avg"] = optim["exp_avg_sq"] = torch.zeros(0)
    state.load_state_dict(optim)
    return int(meta["step"])
