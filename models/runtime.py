"""What every rank of GPUMix's runtime shares: the uneven slices of a flat buffer and the loss.

The training runtime itself is models/sharded.py (ZeRO 1/2/3, uneven shards); this module holds
the two pieces it, the profiler and the tests agree on: `shard_bounds` (which slice of each unit a
plan position owns) and `micro_batch_loss` (the loss normalized by the GLOBAL token count).
"""
from __future__ import annotations

import math
from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from contracts.catalog import FP32_MATMULS_IN_TF32


def shard_bounds(numel: int, fractions: Sequence[float]) -> list[tuple[int, int]]:
    """Contiguous [start, end) slices covering [0, numel), one per fraction.

    Boundaries are round-half-up of numel * (cumulative fraction / total), so the result is
    deterministic, the last slice ends exactly at numel, and a fraction of 0 is an empty slice.
    """
    if numel < 0:
        raise ValueError(f"numel must be >= 0, got {numel}")
    if not fractions or any((not math.isfinite(f)) or f < 0 for f in fractions):
        raise ValueError(f"fractions must be a non-empty list of numbers >= 0, got {list(fractions)}")
    total = float(sum(fractions))
    if total <= 0:
        raise ValueError(f"fractions sum to {total}; at least one must be > 0")
    bounds, acc, start = [], 0.0, 0
    for i, f in enumerate(fractions):
        acc += f
        end = numel if i == len(fractions) - 1 else min(numel, int(math.floor(numel * acc / total + 0.5)))
        end = start if f == 0 else max(start, end)
        bounds.append((start, end))
        start = end
    return bounds


def micro_batch_loss(model: nn.Module, tokens: torch.Tensor, targets: torch.Tensor, token_normalizer: int,
                     autocast_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Summed next-token cross-entropy of one micro-batch divided by the GLOBAL token count of
    the step (all ranks, all micro-batches), so gradients from any split add up to the gradient
    of the global mean loss (torchtitan normalizes the same way)."""
    if token_normalizer <= 0:
        raise ValueError(f"token_normalizer must be > 0, got {token_normalizer}")
    with torch.autocast(tokens.device.type, dtype=autocast_dtype or torch.bfloat16,
                        enabled=autocast_dtype is not None):
        logits = model(tokens)  # (B, T, V), bf16 under autocast
    V = logits.shape[-1]
    # CE in fp32 (autocast would do the same); log_softmax keeps its (B*T, V) output for backward
    loss = F.cross_entropy(logits.float().view(-1, V), targets.reshape(-1), reduction="sum")
    return loss / token_normalizer


def use_tf32_as_priced() -> None:
    """fp32 matmuls and convolutions on the TF32 tensor cores of GPUs that have them, as the roofline
    prices fp32 steps (contracts.catalog.FP32_MATMULS_IN_TF32) and as Megatron-LM and DeepSpeed train;
    the worker and the step profiler call it on CUDA, so runs and their profiles agree."""
    torch.backends.cuda.matmul.allow_tf32 = FP32_MATMULS_IN_TF32
    torch.backends.cudnn.allow_tf32 = FP32_MATMULS_IN_TF32
