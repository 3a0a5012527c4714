"""Trace the memory of one real training step of this project's runtime (models/sharded.py).

One rank as the executor runs it (`ShardedRuntime` at the config's ZeRO stage and shard fraction,
`accum_steps` micro-batches through forward, backward, reduction, clipping and AdamW), with
`models.collectives.LocalCollectives` standing in for the other ranks and allocating what the real
collectives allocate. The counter is profiler.memtrack.LiveTensorBytes; `fake=True` runs in
FakeTensorMode, so 7B models trace on a laptop. Two moments are traced: start-up and one step.

This is the measurement planner/core/memory.py is checked against; the two share no code beyond
the config dataclass and the unit layout (docs/models/memory.md).
"""
from __future__ import annotations

import contextlib
import logging
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from profiler.memtrack import LiveTensorBytes
from models.collectives import LocalCollectives
from models.sharded import ShardedRuntime
from planner.core.memory import MemoryConfig, validate_for
from contracts.specs import ModelSpec

log = logging.getLogger(__name__)

_AUTOCAST = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}
_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


class _TracedRank(LocalCollectives):
    """LocalCollectives whose gathers zero the other ranks' slices first (in place: no allocation),
    so a real-tensor trace computes on finite numbers where a real run would have their values."""

    def all_gather(self, full, shard, bounds, async_op=False):
        full.zero_()
        return super().all_gather(full, shard, bounds, async_op)


def check_traceable(cfg: MemoryConfig) -> None:
    """The runtime runs (uneven) sharded data parallelism; tensor/pipeline parallelism is analytic."""
    if cfg.tp != 1 or cfg.pp != 1:
        raise ValueError(f"tp={cfg.tp}, pp={cfg.pp}: the runtime has no tensor/pipeline parallelism to trace "
                         "(use `python -m planner memory` for the analytic figure)")


def rank_fractions(cfg: MemoryConfig) -> list[float]:
    """The world's shard fractions with the traced rank first holding cfg.fraction."""
    f = cfg.fraction
    if f >= 1.0:
        return [1.0] + [0.0] * (cfg.dp - 1)
    others = max(cfg.dp - 1, 1)
    return [f] + [(1.0 - f) / others] * others


def runtime_options(cfg: MemoryConfig) -> dict[str, Any]:
    """The config's gather/reduce options as ShardedRuntime keyword arguments (param_dtype,
    reduce_dtype, prefetch, reduce_in_flight); the defaults are left out, so a runtime without them traces as before."""
    out: dict[str, Any] = {}
    if cfg.param_dtype != "fp32":
        out["param_dtype"] = _DTYPES[cfg.param_dtype]
    if cfg.reduce_dtype != "fp32":
        out["reduce_dtype"] = _DTYPES[cfg.reduce_dtype]
    if cfg.prefetch != 1:
        out["prefetch"] = cfg.prefetch
    if cfg.reduce_in_flight != 0:
        out["reduce_in_flight"] = cfg.reduce_in_flight
    return out


def trace_memory(spec: ModelSpec, cfg: MemoryConfig, fake: bool = False, seed: int = 0) -> dict[str, Any]:
    """The traced peak of one training step, as the breakdown keys of planner.core.memory plus
    `measured: true`, `startup_peak_bytes` (building the runtime) and `max_in_flight_bytes`."""
    seq = validate_for(spec, cfg)
    check_traceable(cfg)
    zero = max(cfg.zero, 1)
    fractions = rank_fractions(cfg)
    mode = FakeTensorMode() if fake else contextlib.nullcontext()
    cpu = torch.device("cpu")
    with mode:
        torch.manual_seed(seed)
        with LiveTensorBytes() as startup:
            rt = ShardedRuntime(spec, zero=zero, fractions=fractions, position=0,
                                comm=_TracedRank(0, len(fractions)), device=cpu, recompute=cfg.recompute,
                                autocast_dtype=_AUTOCAST[cfg.dtype], seed=seed, materialize=not fake,
                                **runtime_options(cfg))
        n = cfg.accum_steps if cfg.micro_batch > 0 else 0
        if cfg.step_tokens and zero >= 2:  # the other positions' samples: the rest of the step, anywhere
            mine = n * cfg.micro_batch
            total, left = divmod(cfg.step_tokens, seq)
            if left or total < mine:
                raise ValueError(f"step_tokens {cfg.step_tokens} is not a whole number of samples of {seq} "
                                 f"tokens holding this rank's {mine}")
            rest = [(total - mine) // max(len(fractions) - 1, 1)] * (len(fractions) - 1)
            if rest:
                rest[0] += total - mine - sum(rest)
            rt.set_batch_split([mine, *rest], seq)
        batches = [(torch.randint(0, spec.vocab_size, (cfg.micro_batch, seq)),  # (B, T) tokens
                    torch.randint(0, spec.vocab_size, (cfg.micro_batch, seq)))  # (B, T) targets
                   for _ in range(n)]
        resident = rt.resident_tensors()
        with LiveTensorBytes([*resident, *[t for b in batches for t in b]]) as step:
            rt.train_step(batches, max(1, n * cfg.micro_batch * seq), lr=1e-4)
    params = sum(u.master.nbytes for u in rt.units if zero == 3) + sum(
        u.full.nbytes for u in rt.units if zero < 3)
    grads = 0  # gradients live only within the step: part of what the counter sees on top
    optimizer = sum(u.exp_avg.nbytes + u.exp_avg_sq.nbytes for u in rt.units)
    peak = int(step.peak_bytes)
    result = {"num_params": spec.num_params, "params_bytes": params, "grads_bytes": grads,
              "optimizer_bytes": optimizer, "activations_bytes": 0,
              # everything the step allocates on top of the state: activations and boundaries,
              # gathered units, in-flight gradients, the loss, temporaries (not split by the counter)
              "other_bytes": peak - params - grads - optimizer, "peak_bytes": peak,
              "startup_peak_bytes": int(startup.peak_bytes), "measured": True, "fake": fake, "zero": zero}
    log.debug("traced %s %s: %s", spec.name, cfg, result)
    return result


def cuda_step_peak(spec: ModelSpec, cfg: MemoryConfig, device: torch.device, seed: int = 0) -> dict[str, int]:
    """The same rank's step on a CUDA device (LocalCollectives standing in for the others): the
    allocator's peak (`torch.cuda.max_memory_allocated`) over a second step, less what the device held
    at its start beyond the runtime's state and the batches (the CUDA context's cuBLAS workspace and
    the like, which the memory model leaves out). Returns `peak_bytes` and that `overhead_bytes`."""
    seq = validate_for(spec, cfg)
    check_traceable(cfg)
    fractions = rank_fractions(cfg)
    torch.manual_seed(seed)
    rt = ShardedRuntime(spec, zero=max(cfg.zero, 1), fractions=fractions, position=0,
                        comm=_TracedRank(0, len(fractions)), device=device, recompute=cfg.recompute,
                        autocast_dtype=_AUTOCAST[cfg.dtype], seed=seed, **runtime_options(cfg))
    n = cfg.accum_steps if cfg.micro_batch > 0 else 0
    batches = [(torch.randint(0, spec.vocab_size, (cfg.micro_batch, seq), device=device),
                torch.randint(0, spec.vocab_size, (cfg.micro_batch, seq), device=device)) for _ in range(n)]
    normalizer = max(1, n * cfg.micro_batch * seq)
    rt.train_step(batches, normalizer, lr=1e-4)  # warm: cuBLAS handles and workspaces exist from here on
    torch.cuda.synchronize(device)
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                for t in [*rt.resident_tensors(), *[t for b in batches for t in b]]}
    overhead = torch.cuda.memory_allocated(device) - sum(storages.values())
    torch.cuda.reset_peak_memory_stats(device)
    rt.train_step(batches, normalizer, lr=1e-4)
    torch.cuda.synchronize(device)
    return {"peak_bytes": int(torch.cuda.max_memory_allocated(device)) - overhead, "overhead_bytes": overhead}
