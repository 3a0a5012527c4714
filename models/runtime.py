"""GPUMix's training runtime: the one code path the executor trains with and the profiler traces.

A step on one rank (Cephalo's decoupled batch split and state sharding):
1. `zero_grad()`; for each of the rank's micro-batches, `micro_batch_loss(...).backward()`:
   autograd accumulates into `flat_grads` (one fp32 buffer, full size on every rank).
2. The executor all-reduces `flat_grads` with SUM. Each loss was divided by the GLOBAL
   token count of the step, so the sum is the gradient of the global mean loss, however
   unevenly the batch was split between ranks and micro-batches.
3. `step()`: AdamW on this rank's slice [start, end) only; the optimizer state exists only
   for that slice (ZeRO-1 style; the slice size is the rank's shard fraction, which may be
   uneven). The executor then broadcasts each slice of `flat_params` from its owner.

Memory held per rank (planner/memory.py models these exactly): fp32 params (4 B/param),
fp32 grads (4 B/param), AdamW exp_avg + exp_avg_sq on the slice (8 B/param of the slice).
"""
from __future__ import annotations

import math
from typing import Any, Sequence

import torch
import torch.nn.functional as F
from torch import nn

# The step walks the slice in chunks so its temporaries (torch's single-tensor AdamW makes
# two: sqrt(v) and sqrt(v)/c) are bounded by 2 * STEP_CHUNK_NUMEL * 4 bytes, not 8 B/param.
STEP_CHUNK_NUMEL = 1 << 24


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


class FlatShardedState:
    """All parameters in one flat fp32 buffer, all gradients in another, AdamW state on a slice.

    Module parameters become views into `flat_params` and their `.grad` views into
    `flat_grads`, so autograd accumulates micro-batches in place (AccumulateGrad adds into an
    existing .grad) and one collective moves the whole gradient. The AdamW update is
    torch.optim.AdamW itself (foreach=False, the same math and the same temporaries on every
    device), run on Parameters that alias chunks of flat_params[start:end].
    """

    def __init__(self, model: nn.Module, start: int, end: int, lr: float = 3e-4,
                 betas: tuple[float, float] = (0.9, 0.95), eps: float = 1e-8, weight_decay: float = 0.1):
        params = list(model.parameters())  # distinct: a tied head appears once
        if not params:
            raise ValueError("model has no parameters")
        n = sum(p.numel() for p in params)
        if not 0 <= start <= end <= n:
            raise ValueError(f"shard [{start}, {end}) is not inside [0, {n})")
        device = params[0].device
        self.start, self.end = start, end
        self.flat_params = torch.empty(n, dtype=torch.float32, device=device)
        self.flat_grads = torch.zeros(n, dtype=torch.float32, device=device)
        offset = 0
        with torch.no_grad():
            for p in params:
                k = p.numel()
                self.flat_params[offset:offset + k].copy_(p.detach().reshape(-1))
                p.data = self.flat_params[offset:offset + k].view_as(p)  # old storage is freed
                p.grad = self.flat_grads[offset:offset + k].view_as(p)
                offset += k
        # AdamW state for the slice only: (end - start,) fp32 each.
        self.exp_avg = torch.zeros(end - start, dtype=torch.float32, device=device)
        self.exp_avg_sq = torch.zeros(end - start, dtype=torch.float32, device=device)
        chunks = []
        for a in range(start, end, STEP_CHUNK_NUMEL):
            b = min(end, a + STEP_CHUNK_NUMEL)
            chunk = nn.Parameter(self.flat_params[a:b], requires_grad=True)  # aliases flat_params
            chunk.grad = self.flat_grads[a:b]
            chunks.append(chunk)
        self._chunks = chunks
        # None for an empty slice (a rank with shard fraction 0 owns no optimizer state)
        self.optimizer = torch.optim.AdamW(chunks, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                                           foreach=False) if chunks else None
        # State created now, as views of the two slice buffers: in steady state it lives
        # through forward and backward, so the traced first step must hold it too.
        off = 0
        for chunk in chunks:
            k = chunk.numel()
            self.optimizer.state[chunk] = {
                # a host scalar, as torch.optim.AdamW makes it; torch.tensor (not zeros) so that
                # FakeTensorMode keeps its value and the step's .item() works when traced
                "step": torch.tensor(0.0),
                "exp_avg": self.exp_avg[off:off + k],
                "exp_avg_sq": self.exp_avg_sq[off:off + k],
            }
            off += k

    @property
    def numel(self) -> int:
        return self.flat_params.numel()

    def zero_grad(self) -> None:
        self.flat_grads.zero_()  # keep the views: .grad must stay aliased to flat_grads

    @torch.no_grad()
    def step(self) -> None:
        """AdamW on flat_params[start:end] from flat_grads[start:end] (same math as torch.optim.AdamW)."""
        if self._chunks:
            self.optimizer.step()

    @property
    def step_count(self) -> int:
        return int(self.optimizer.state[self._chunks[0]]["step"].item()) if self._chunks else 0

    def state_dict(self) -> dict[str, Any]:
        """The slice's state (for torch.distributed.checkpoint): bounds, step count, AdamW moments."""
        return {"start": self.start, "end": self.end, "step": self.step_count,
                "exp_avg": self.exp_avg, "exp_avg_sq": self.exp_avg_sq}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if (state["start"], state["end"]) != (self.start, self.end):
            raise ValueError(f"checkpoint shard [{state['start']}, {state['end']}) != this shard "
                             f"[{self.start}, {self.end})")
        with torch.no_grad():
            self.exp_avg.copy_(state["exp_avg"])
            self.exp_avg_sq.copy_(state["exp_avg_sq"])
        for chunk in self._chunks:
            self.optimizer.state[chunk]["step"].fill_(float(state["step"]))


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
