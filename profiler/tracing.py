"""Trace the memory of one real training step of this project's runtime.

One step as a rank of the executor runs it (models/runtime.py): forward and backward of
`micro_batch` samples through `micro_batch_loss`, then `FlatShardedState.step()` on a slice of
`shard_fraction` of the parameters; the gradient all-reduce and the parameter broadcast are
skipped (one process: they work in place on flat_grads / flat_params and allocate nothing
here). Everything runs under torch.distributed._tools.mem_tracker.MemTracker, which counts
every tensor storage by category as ops allocate and free them; with `fake=True` the step
runs under FakeTensorMode (no data, shapes only), so 7B models trace on a laptop.

This is the measurement that planner/memory.py's prediction is checked against: the two
share no code beyond the config dataclass.
"""
from __future__ import annotations

import contextlib
import logging
from typing import Any

import torch
from torch.distributed._tools.mem_tracker import MemTracker
from torch._subclasses.fake_tensor import FakeTensorMode

from models.decoder import build_model
from models.runtime import FlatShardedState, micro_batch_loss
from planner.memory import MemoryConfig, validate_for
from planner.specs import ModelSpec

log = logging.getLogger(__name__)

_AUTOCAST = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}

# MemTracker's categories -> our breakdown keys. Autocast weight copies and saved tensors
# are "Activation" (made in forward); gradients of activations are "Temp" (made in backward).
_CATEGORY_KEY = {
    "Parameter": "params_bytes",
    "Gradient": "grads_bytes",
    "Optstate": "optimizer_bytes",
    "Activation": "activations_bytes",
}


def check_traceable(cfg: MemoryConfig) -> None:
    """The runtime runs data parallelism with the AdamW state sharded (ZeRO-1); the rest is analytic."""
    if cfg.tp != 1 or cfg.pp != 1:
        raise ValueError(f"tp={cfg.tp}, pp={cfg.pp}: the runtime has no tensor/pipeline parallelism to trace "
                         "(use `python -m planner memory` for the analytic figure)")
    if cfg.zero >= 2:
        raise ValueError(f"zero={cfg.zero}: the runtime keeps full gradients (ZeRO-1); stages 2-3 are analytic "
                         "only (use `python -m planner memory`)")


def trace_memory(spec: ModelSpec, cfg: MemoryConfig, fake: bool = False, seed: int = 0) -> dict[str, Any]:
    """The traced peak of one training step, as the breakdown keys of planner.memory plus `measured: true`."""
    validate_for(spec, cfg)
    check_traceable(cfg)
    seq = cfg.seq or spec.max_seq
    mode = FakeTensorMode() if fake else contextlib.nullcontext()
    with mode:
        torch.manual_seed(seed)
        model = build_model(spec, cfg.recompute)
        n = spec.num_params
        shard = n if cfg.zero == 0 else int(round(cfg.fraction * n))
        state = FlatShardedState(model, 0, shard)
        tokens = torch.randint(0, spec.vocab_size, (cfg.micro_batch, seq))  # (B, T)
        targets = torch.randint(0, spec.vocab_size, (cfg.micro_batch, seq))  # (B, T)
        tracker = MemTracker()
        # tensors made before the tracker must be named to it; the rest it sees being allocated
        tracker.track_external(model, state.optimizer, tokens, targets)
        with tracker:
            state.zero_grad()
            if cfg.micro_batch > 0:
                loss = micro_batch_loss(model, tokens, targets, tokens.numel(), _AUTOCAST[cfg.dtype])
                loss.backward()
                del loss
            state.step()  # the all-reduce before it and the broadcast after it allocate nothing
        peak = tracker.get_tracker_snapshot("peak")
    snap = next(iter(peak.values())) if peak else {}
    out = dict.fromkeys(("params_bytes", "grads_bytes", "optimizer_bytes", "activations_bytes", "other_bytes"), 0)
    for category, nbytes in snap.items():
        if category == "Total":
            continue
        key = _CATEGORY_KEY.get(str(getattr(category, "value", category)), "other_bytes")
        out[key] += int(nbytes)
    result = {"num_params": spec.num_params, **out, "peak_bytes": int(snap.get("Total", 0)),
              "measured": True, "fake": fake}
    log.debug("traced %s %s: %s", spec.name, cfg, result)
    return result
