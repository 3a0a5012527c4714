"""The optimizer of the sharded runtime: AdamW, the LR schedule, clipping and loss scaling on flat shards.

Per model unit the runtime (models/sharded.py) keeps a 1-D fp32 master shard, its gradient shard
and their AdamW moments; nothing here sees an nn.Module or a process group. Per optimizer step:

    norm_sq = global_grad_norm_sq(grad_shards)          # local, fp64; the runtime all-reduces it
    found_inf = not isfinite(norm_sq)                     # an inf/nan anywhere makes the sum inf/nan
    scaler.update(found_inf); skip the step if found_inf  # fp16 only; the scale is 1.0 otherwise
    total_norm = sqrt(norm_sq) / scale_used               # the norm of the unscaled gradient
    g *= clip_coefficient_t(total_norm, cfg.max_grad_norm) / scale_used   # unscale and clip in one pass

Nothing here reads a device value to the host: the norm, the overflow flag and the clip
coefficient stay tensors (`clip_coefficient_t`); only the fp16 scaler's update needs a host bool.
    adamw_step_(p, g, m, v, step, lr_at(step, total_steps, cfg), cfg, decay_ranges(...))

(`scale_used` is the scale the backward ran with.) `OptimConfig.kind` "sgd" makes the same two
entry points plain SGD (no momentum): adamw_prepare_ applies only the decay and adamw_step_ does
param -= lr · g, torch.optim.SGD(momentum=0)'s update with its weight decay on the decay ranges
(p - lr·(g + wd·p) = p·(1 - lr·wd) - lr·g). The sharded runtime keeps allocating the AdamW moments;
SGD leaves them untouched. Its use: DiLoCo's inner optimizer (models/diloco.py), where H = 1 with an
outer SGD of learning rate 1 is then exactly synchronous data parallelism. Defaults (betas 0.9/0.95, weight decay 0.1 on
matrices only, clipping at 1.0, cosine to 10 % of the peak) follow GPT-3 (Brown et al. 2020, B.1)
and Llama 2 (Touvron et al. 2023, §2.2).
"""
from __future__ import annotations

import logging
import math
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass

import torch
from torch import Tensor
from contracts.constants import STEP_CHUNK_NUMEL

log = logging.getLogger(__name__)

# Elements the optimizer step and the norm walk at a time; planner/core/memory.py counts the
# temporaries of one chunk (see adamw_step_ and global_grad_norm_sq).
# torch.nn.utils.clip_grad_norm_ adds this to the norm before dividing (no division by zero)
CLIP_EPS = 1e-6
# grad_norm_sq_in_place's fp32 dot products: chunks this long keep each one's rounding near 1e-7
DOT_CHUNK_NUMEL = 1 << 16
# OptimConfig.kind: the update adamw_step_ applies to a slice
OPTIMIZER_KINDS = ("adamw", "sgd")


@dataclass(frozen=True)
class OptimConfig:
    lr: float = 3e-4  # peak learning rate (after warmup)
    betas: tuple[float, float] = (0.9, 0.95)  # GPT-3 / Llama: 0.95, not 0.999, for stability at scale
    eps: float = 1e-8  # torch.optim.AdamW's default
    weight_decay: float = 0.1  # decoupled (AdamW), matrices and embeddings only: see decay_ranges
    max_grad_norm: float | None = 1.0  # clip by the global norm over all shards; None = no clipping
    warmup_steps: int = 0  # linear warmup; the runtime's callers pick a default from the run length
    min_lr_ratio: float = 0.1  # the cosine ends at lr * min_lr_ratio at the last step
    # the step the cosine ends at; None: the run's --steps. Set it when a run is trained in
    # several launches (a preempted job, a resume on other GPUs) so the schedule stays one curve
    decay_steps: int | None = None
    # "adamw", or "sgd": plain SGD without momentum (betas and eps unused), DiLoCo's exact-DP inner step
    kind: str = "adamw"

    def __post_init__(self) -> None:
        if self.kind not in OPTIMIZER_KINDS:
            raise ValueError(f"OptimConfig.kind must be one of {', '.join(OPTIMIZER_KINDS)}, got {self.kind!r}")
        if not (isinstance(self.lr, (int, float)) and math.isfinite(self.lr) and self.lr > 0):
            raise ValueError(f"OptimConfig.lr must be a finite number > 0, got {self.lr!r}")
        betas = self.betas
        if not (isinstance(betas, (tuple, list)) and len(betas) == 2
                and all(isinstance(b, (int, float)) and 0.0 <= b < 1.0 for b in betas)):
            raise ValueError(f"OptimConfig.betas must be two numbers in [0, 1), got {betas!r}")
        object.__setattr__(self, "betas", (float(betas[0]), float(betas[1])))  # a JSON list -> tuple
        if not (isinstance(self.eps, (int, float)) and math.isfinite(self.eps) and self.eps > 0):
            raise ValueError(f"OptimConfig.eps must be a finite number > 0, got {self.eps!r}")
        if not (isinstance(self.weight_decay, (int, float)) and math.isfinite(self.weight_decay)
                and self.weight_decay >= 0):
            raise ValueError(f"OptimConfig.weight_decay must be a finite number >= 0, got {self.weight_decay!r}")
        if self.max_grad_norm is not None and not (
                isinstance(self.max_grad_norm, (int, float)) and math.isfinite(self.max_grad_norm)
                and self.max_grad_norm > 0):
            raise ValueError(f"OptimConfig.max_grad_norm must be None or a finite number > 0, "
                             f"got {self.max_grad_norm!r}")
        if isinstance(self.warmup_steps, bool) or not isinstance(self.warmup_steps, int) or self.warmup_steps < 0:
            raise ValueError(f"OptimConfig.warmup_steps must be an integer >= 0, got {self.warmup_steps!r}")
        if self.decay_steps is not None and (isinstance(self.decay_steps, bool) or not isinstance(self.decay_steps, int)
                                             or self.decay_steps < 1):
            raise ValueError(f"OptimConfig.decay_steps must be None or an integer >= 1, got {self.decay_steps!r}")
        if not (isinstance(self.min_lr_ratio, (int, float)) and 0.0 <= self.min_lr_ratio <= 1.0):
            raise ValueError(f"OptimConfig.min_lr_ratio must be in [0, 1], got {self.min_lr_ratio!r}")

    def to_dict(self) -> dict:
        d = asdict(self)
        d["betas"] = list(self.betas)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> OptimConfig:
        unknown = set(d) - set(cls.__dataclass_fields__)
        if unknown:
            raise ValueError(f"OptimConfig: unknown field(s) {sorted(unknown)}")
        return cls(**d)


def lr_at(step: int, total_steps: int, cfg: OptimConfig) -> float:
    """The learning rate of optimizer step `step` (counted from 1) of a `total_steps`-step run.

    Linear warmup (Goyal et al. 2017, "Accurate, Large Minibatch SGD", §2.2), then half a cosine
    (Loshchilov & Hutter 2017, SGDR, eq. 5, one cycle without restarts), as GPT-3 and Llama train:
        step <= W:          lr · step / W
        W < step <= T:      lr_min + (lr - lr_min) · ½ · (1 + cos(π · (step - W) / (T - W)))
        step >= T:          lr_min                    (exactly, and constant beyond T)
    with W = cfg.warmup_steps, T = cfg.decay_steps or total_steps, lr_min = lr · cfg.min_lr_ratio.
    When T <= W the warmup is never cut short: the cosine phase is empty, the ramp reaches lr at
    step W (so step T == W gets lr, not lr_min) and every step after W gets lr_min.
    """
    if isinstance(step, bool) or not isinstance(step, int) or step < 1:
        raise ValueError(f"lr_at: step counts from 1, got {step!r}")
    if isinstance(total_steps, bool) or not isinstance(total_steps, int) or total_steps < 1:
        raise ValueError(f"lr_at: total_steps must be an integer >= 1, got {total_steps!r}")
    warmup = cfg.warmup_steps
    total_steps = cfg.decay_steps or total_steps
    lr_min = cfg.lr * cfg.min_lr_ratio
    if step <= warmup:
        return cfg.lr * step / warmup
    if step >= total_steps:
        return lr_min
    progress = (step - warmup) / (total_steps - warmup)  # in (0, 1)
    return lr_min + (cfg.lr - lr_min) * 0.5 * (1.0 + math.cos(math.pi * progress))


def decay_ranges(param_shapes: Sequence[tuple[int, ...]], start: int, end: int) -> list[tuple[int, int]]:
    """The [a, b) ranges of the shard flat[start:end] that weight decay applies to, in shard
    coordinates (0 .. end - start), adjacent ranges merged.

    `param_shapes` are one unit's parameters in the order they lie back to back in the flat
    buffer. Parameters with ndim >= 2 (linear weights, embeddings) decay; ndim <= 1 (norm weights,
    biases, gains) do not, as in GPT-3 / nanoGPT's optimizer groups.
    """
    numels = [math.prod(shape) for shape in param_shapes]
    total = sum(numels)
    if not (0 <= start <= end <= total):
        raise ValueError(f"decay_ranges: need 0 <= start <= end <= {total} (the unit's numel), "
                         f"got start={start}, end={end}")
    ranges: list[tuple[int, int]] = []
    offset = 0
    for shape, numel in zip(param_shapes, numels):
        a, b = max(offset, start), min(offset + numel, end)
        offset += numel
        if len(shape) < 2 or a >= b:
            continue
        a, b = a - start, b - start
        if ranges and ranges[-1][1] == a:
            ranges[-1] = (ranges[-1][0], b)
        else:
            ranges.append((a, b))
    return ranges


@torch.no_grad()
def adamw_prepare_(param: Tensor, exp_avg_sq: Tensor, lr: float, cfg: OptimConfig,
                   decay: Sequence[tuple[int, int]]) -> None:
    """The two operations of `adamw_step_` that need no gradient, done ahead (while the step's last
    gradients are still on the wire): param[decay] *= 1 - lr · wd, exp_avg_sq *= β2. The step then
    runs with `prepared=True`. Each element sees the same operations in the same order, so the
    update's values do not change. SGD (cfg.kind "sgd"): the decay only."""
    if cfg.weight_decay != 0:
        factor = 1 - lr * cfg.weight_decay
        for a, b in decay:
            param[a:b].mul_(factor)
    if cfg.kind == "adamw":
        exp_avg_sq.mul_(cfg.betas[1])


@torch.no_grad()
def adamw_step_(param: Tensor, grad: Tensor, exp_avg: Tensor, exp_avg_sq: Tensor, step: int, lr: float,
                cfg: OptimConfig, decay: Sequence[tuple[int, int]], chunk_numel: int = STEP_CHUNK_NUMEL,
                prepared: bool = False) -> None:
    """One AdamW update of a flat shard, in place: the math of torch.optim.AdamW(foreach=False,
    fused=False, capturable=False, amsgrad=False, maximize=False), torch/optim/adam.py
    `_single_tensor_adam`, operation by operation:

        param[decay] *= 1 - lr · wd                       (decoupled decay, decay ranges only)
        exp_avg.lerp_(grad, 1 - β1)
        exp_avg_sq.mul_(β2).addcmul_(grad, grad, value=1 - β2)
        denom = sqrt(exp_avg_sq) / sqrt(1 - β2^step) + eps
        param.addcdiv_(exp_avg, denom, value=-lr / (1 - β1^step))

    `step` is the step number after the increment (1 for the first update); the bias corrections
    are computed in Python floats from it, as torch does from its step tensor's value.

    Temporaries: ONE fp32 buffer of min(len(param), chunk_numel) elements, allocated once and
    reused for every chunk (it holds sqrt(v), then denom, in place), i.e. 4·min(n, chunk_numel)
    bytes; no step tensor either. torch's own step makes two per tensor (sqrt(v) and
    sqrt(v) / c, alive together); sqrt(out=), div_ and add_ run the same kernels on the same
    values, so the result does not change.

    `prepared`: `adamw_prepare_` already applied this step's two gradient-free operations (the decay
    and exp_avg_sq *= β2); the rest runs as above, so the values are the same.

    cfg.kind "sgd": `sgd_step_` instead (the moments are neither read nor written).
    """
    if cfg.kind == "sgd":
        sgd_step_(param, grad, lr, cfg, decay, prepared=prepared)
        return
    n = param.numel()
    for name, t in (("param", param), ("grad", grad), ("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq)):
        if t.dim() != 1 or t.numel() != n or t.dtype != torch.float32:
            raise ValueError(f"adamw_step_: {name} must be a 1-D fp32 tensor of {n} elements, "
                             f"got shape {tuple(t.shape)} {t.dtype}")
    if isinstance(step, bool) or not isinstance(step, int) or step < 1:
        raise ValueError(f"adamw_step_: step counts from 1 (after the increment), got {step!r}")
    if chunk_numel < 1:
        raise ValueError(f"adamw_step_: chunk_numel must be >= 1, got {chunk_numel}")
    if any(not (0 <= a < b <= n) for a, b in decay):
        raise ValueError(f"adamw_step_: decay ranges must lie in [0, {n}), got {list(decay)}")
    if n == 0:
        return
    beta1, beta2 = cfg.betas
    bias_correction1 = 1 - beta1 ** step
    bias_correction2 = 1 - beta2 ** step
    step_size = lr / bias_correction1
    bias_correction2_sqrt = bias_correction2 ** 0.5
    decay_factor = 1 - lr * cfg.weight_decay
    buf = torch.empty(min(n, chunk_numel), dtype=torch.float32, device=param.device)  # (chunk,) fp32

    for lo in range(0, n, chunk_numel):
        hi = min(lo + chunk_numel, n)
        p, g, m, v = param[lo:hi], grad[lo:hi], exp_avg[lo:hi], exp_avg_sq[lo:hi]  # views
        if cfg.weight_decay != 0 and not prepared:  # torch skips the multiply when wd == 0
            for a, b in decay:
                a, b = max(a, lo), min(b, hi)
                if a < b:
                    param[a:b].mul_(decay_factor)
        m.lerp_(g, 1 - beta1)
        if not prepared:
            v.mul_(beta2)
        v.addcmul_(g, g, value=1 - beta2)
        denom = buf[: hi - lo]
        torch.sqrt(v, out=denom)
        denom.div_(bias_correction2_sqrt).add_(cfg.eps)
        p.addcdiv_(m, denom, value=-step_size)


@torch.no_grad()
def sgd_step_(param: Tensor, grad: Tensor, lr: float, cfg: OptimConfig, decay: Sequence[tuple[int, int]],
              prepared: bool = False) -> None:
    """One SGD update of a flat fp32 shard, in place (torch.optim.SGD with momentum 0, its weight decay
    applied only on the decay ranges, as AdamW's is):

        param[decay] *= 1 - lr · wd        (skipped when `prepared`: adamw_prepare_ did it)
        param -= lr · grad
    """
    n = param.numel()
    for name, t in (("param", param), ("grad", grad)):
        if t.dim() != 1 or t.numel() != n or t.dtype != torch.float32:
            raise ValueError(f"sgd_step_: {name} must be a 1-D fp32 tensor of {n} elements, "
                             f"got shape {tuple(t.shape)} {t.dtype}")
    if any(not (0 <= a < b <= n) for a, b in decay):
        raise ValueError(f"sgd_step_: decay ranges must lie in [0, {n}), got {list(decay)}")
    if cfg.weight_decay != 0 and not prepared:
        factor = 1 - lr * cfg.weight_decay
        for a, b in decay:
            param[a:b].mul_(factor)
    param.add_(grad, alpha=-lr)


def global_grad_norm_sq(shards: Iterable[Tensor], chunk_numel: int = STEP_CHUNK_NUMEL) -> Tensor:
    """The sum of squares of every element of `shards`, a 0-d fp64 tensor on the shards' device
    (CPU when there are none). Local only: the runtime all-reduces (SUM) it across ranks, then the
    global norm is its square root. Non-finite if any gradient element is inf or nan, so the same
    number answers the fp16 loss scaler's "found inf".

    Temporaries: one fp64 copy of a chunk at a time, 8·min(len(shard), chunk_numel) bytes.
    """
    total: Tensor | None = None
    for shard in shards:
        flat = shard.reshape(-1)
        if total is None:
            total = torch.zeros((), dtype=torch.float64, device=flat.device)
        for lo in range(0, flat.numel(), chunk_numel):
            c = flat[lo:lo + chunk_numel].to(torch.float64)  # (chunk,) fp64
            total += torch.dot(c, c)
            del c
    return total if total is not None else torch.zeros((), dtype=torch.float64)


def grad_norm_sq_in_place(shards: Iterable[Tensor], chunk_numel: int = DOT_CHUNK_NUMEL) -> Tensor:
    """`global_grad_norm_sq` of fp32 shards without its fp64 copies: fp32 dot products of chunks of
    `chunk_numel` elements (a chunk's relative rounding stays near 1e-7), summed in fp64. It allocates
    nothing but its scalars, so the runtime can compute it beside reduces still holding their buffers."""
    total: Tensor | None = None
    for shard in shards:
        flat = shard.reshape(-1)
        if flat.dtype != torch.float32:
            raise ValueError(f"grad_norm_sq_in_place: shards are fp32 slice gradients, got {flat.dtype}")
        if total is None:
            total = torch.zeros((), dtype=torch.float64, device=flat.device)
        for lo in range(0, flat.numel(), chunk_numel):
            c = flat[lo:lo + chunk_numel]  # a view
            total += torch.dot(c, c).to(torch.float64)
    return total if total is not None else torch.zeros((), dtype=torch.float64)


def clip_coefficient(total_norm: float, max_norm: float | None) -> float:
    """The factor torch.nn.utils.clip_grad_norm_ multiplies every gradient by:
    min(1, max_norm / (total_norm + 1e-6)); 1.0 when clipping is off (max_norm None)."""
    if max_norm is None:
        return 1.0
    return min(1.0, max_norm / (float(total_norm) + CLIP_EPS))


def clip_coefficient_t(total_norm: Tensor, max_norm: float | None) -> Tensor:
    """clip_coefficient on the device: min(1, max_norm / (total_norm + 1e-6)) as a tensor of
    total_norm's dtype, computed without reading total_norm to the host (no synchronization);
    the same IEEE operations as clip_coefficient, so the same value in fp64. Ones when clipping
    is off."""
    if max_norm is None:
        return torch.ones_like(total_norm)
    return (torch.full_like(total_norm, max_norm) / (total_norm + CLIP_EPS)).clamp(max=1.0)


def _as_fp32(x: float) -> float:
    """x rounded to fp32 (inf on overflow), as GradScaler stores its scale."""
    return torch.tensor(x, dtype=torch.float32).item()


class DynamicLossScaler:
    """torch.amp.GradScaler's scale policy (aten `_amp_update_scale_`), for flat shards: fp16
    training on GPUs without bf16 (V100, T4, P40). The loss is multiplied by `scale` before
    backward; the runtime unscales the gradient shards itself (module docstring).

    update(found_inf): an inf/nan gradient multiplies the scale by `backoff_factor` and restarts
    the count of good steps; `growth_interval` good steps in a row multiply it by `growth_factor`
    (kept only if finite in fp32). The scale is kept in fp32, as GradScaler keeps it.
    Disabled (bf16 / fp32 training): scale 1.0 and update does nothing.
    """

    def __init__(self, init_scale: float = 2.0 ** 16, growth_factor: float = 2.0, backoff_factor: float = 0.5,
                 growth_interval: int = 2000, enabled: bool = True) -> None:
        if not (math.isfinite(init_scale) and init_scale > 0):
            raise ValueError(f"DynamicLossScaler: init_scale must be a finite number > 0, got {init_scale!r}")
        if not growth_factor > 1.0:
            raise ValueError(f"DynamicLossScaler: growth_factor must be > 1, got {growth_factor!r}")
        if not 0.0 < backoff_factor < 1.0:
            raise ValueError(f"DynamicLossScaler: backoff_factor must be in (0, 1), got {backoff_factor!r}")
        if isinstance(growth_interval, bool) or not isinstance(growth_interval, int) or growth_interval < 1:
            raise ValueError(f"DynamicLossScaler: growth_interval must be an integer >= 1, got {growth_interval!r}")
        self.enabled = bool(enabled)
        self.growth_factor = float(growth_factor)
        self.backoff_factor = float(backoff_factor)
        self.growth_interval = growth_interval
        self._scale = _as_fp32(init_scale)
        self._growth_tracker = 0  # good steps since the last growth or backoff

    @property
    def scale(self) -> float:
        return self._scale if self.enabled else 1.0

    def update(self, found_inf: bool) -> None:
        if not self.enabled:
            return
        if found_inf:
            self._scale = _as_fp32(self._scale * self.backoff_factor)
            self._growth_tracker = 0
            log.info("loss scale backed off to %g (inf/nan gradient, step skipped)", self._scale)
            return
        self._growth_tracker += 1
        if self._growth_tracker == self.growth_interval:
            grown = _as_fp32(self._scale * self.growth_factor)
            if math.isfinite(grown):
                self._scale = grown
            self._growth_tracker = 0

    def state_dict(self) -> dict:
        return {"scale": self._scale, "growth_tracker": self._growth_tracker, "growth_factor": self.growth_factor,
                "backoff_factor": self.backoff_factor, "growth_interval": self.growth_interval,
                "enabled": self.enabled}

    def load_state_dict(self, d: dict) -> None:
        missing = {"scale", "growth_tracker"} - set(d)
        if missing:
            raise ValueError(f"DynamicLossScaler.load_state_dict: missing {sorted(missing)}")
        self._scale = _as_fp32(float(d["scale"]))
        self._growth_tracker = int(d["growth_tracker"])
        self.growth_factor = float(d.get("growth_factor", self.growth_factor))
        self.backoff_factor = float(d.get("backoff_factor", self.backoff_factor))
        self.growth_interval = int(d.get("growth_interval", self.growth_interval))
        self.enabled = bool(d.get("enabled", self.enabled))
