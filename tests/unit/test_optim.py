"""models/optim.py against torch's own implementations: torch.optim.AdamW on real nn.Parameters,
torch.nn.utils.clip_grad_norm_, torch's LR schedulers and GradScaler's update kernel."""
from __future__ import annotations

import json
import math

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from models.optim import (DynamicLossScaler, OptimConfig, adamw_prepare_, adamw_step_, clip_coefficient,
                          decay_ranges, global_grad_norm_sq, grad_norm_sq_in_place, lr_at)


def _model() -> nn.Module:
    torch.manual_seed(0)
    # embedding and matrices decay; biases and the norm's weight/bias do not
    return nn.Sequential(nn.Embedding(11, 4), nn.Linear(4, 6), nn.LayerNorm(6), nn.Linear(6, 3, bias=False))


def _flat(tensors) -> torch.Tensor:
    return torch.cat([t.detach().reshape(-1) for t in tensors])


def _run_both(cfg: OptimConfig, bounds, num_steps: int, chunk_numel: int, total_steps: int,
              wrong_decay: bool = False):
    """torch.optim.AdamW (two groups) on the model and adamw_step_ on the flat shards `bounds`,
    fed the same gradients; returns (torch's flat params, ours, the initial flat params)."""
    model = _model()
    params = list(model.parameters())
    shapes = [tuple(p.shape) for p in params]
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": cfg.weight_decay},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    opt = torch.optim.AdamW(groups, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, foreach=False, fused=False,
                            capturable=False, amsgrad=False, maximize=False)
    flat = _flat(params).clone()
    initial = flat.clone()
    n = flat.numel()
    assert bounds[0][0] == 0 and bounds[-1][1] == n
    states = [(torch.zeros(e - s), torch.zeros(e - s)) for s, e in bounds]
    gen = torch.Generator().manual_seed(1)
    for step in range(1, num_steps + 1):
        grads = [torch.randn(p.shape, generator=gen) * 3.0 for p in params]  # norm >> 1: clipping binds
        for p, g in zip(params, grads):
            p.grad = g.clone()
        lr = lr_at(step, total_steps, cfg)
        for group in opt.param_groups:
            group["lr"] = lr
        if cfg.max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(params, cfg.max_grad_norm)
        opt.step()

        gflat = _flat(grads)
        shard_grads = [gflat[s:e].clone() for s, e in bounds]
        # the runtime all-reduces the local sums; here the ranks' sums are added by hand
        total_norm = math.sqrt(sum(global_grad_norm_sq([g]).item() for g in shard_grads))
        coef = clip_coefficient(total_norm, cfg.max_grad_norm)
        for (s, e), g, (m, v) in zip(bounds, shard_grads, states):
            g.mul_(coef)
            decay = [(0, e - s)] if wrong_decay else decay_ranges(shapes, s, e)
            adamw_step_(flat[s:e], g, m, v, step, lr, cfg, decay, chunk_numel=chunk_numel)
    return _flat(params), flat, initial


# shards that cut through parameters: embedding [0, 44), Linear [44, 68) + bias [68, 74),
# LayerNorm [74, 80) + [80, 86), head [86, 104)
UNEVEN = [(0, 13), (13, 50), (50, 51), (51, 70), (70, 82), (82, 104)]


@pytest.mark.parametrize("chunk_numel", [5, 1 << 24])
def test_adamw_step_equals_torch_adamw_on_uneven_shards(chunk_numel):
    cfg = OptimConfig(lr=1e-2, weight_decay=0.1, max_grad_norm=None, warmup_steps=2)
    expected, got, initial = _run_both(cfg, UNEVEN, num_steps=6, chunk_numel=chunk_numel, total_steps=6)
    assert (expected - initial).abs().max() > 1e-3  # the steps moved the parameters
    assert (got - expected).abs().max().item() <= 1e-7


def test_adamw_step_with_clipping_and_schedule_equals_torch():
    cfg = OptimConfig(lr=1e-2, weight_decay=0.1, max_grad_norm=1.0, warmup_steps=2, min_lr_ratio=0.1)
    expected, got, _ = _run_both(cfg, UNEVEN, num_steps=5, chunk_numel=7, total_steps=5)
    assert (got - expected).abs().max().item() <= 1e-7


def test_the_comparison_sees_decay_on_the_wrong_elements():
    # decaying the biases and norms too must show: the equality above is not vacuous
    cfg = OptimConfig(lr=1e-2, weight_decay=0.1, max_grad_norm=None)
    expected, got, _ = _run_both(cfg, UNEVEN, num_steps=3, chunk_numel=5, total_steps=3, wrong_decay=True)
    assert (got - expected).abs().max().item() > 1e-6


class _Allocations(TorchDispatchMode):
    """Records (numel, dtype) of every tensor an op returns in fresh storage (not a view, not in place)."""

    def __init__(self):
        super().__init__()
        self.fresh: list[tuple[int, torch.dtype]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        inputs = {t.untyped_storage().data_ptr() for t in torch.utils._pytree.tree_leaves((args, kwargs))
                  if isinstance(t, torch.Tensor)}
        out = func(*args, **kwargs)
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in inputs:
                self.fresh.append((t.numel(), t.dtype))
        return out


@pytest.mark.parametrize("n,chunk_numel", [(103, 10), (103, 1000)])
def test_adamw_step_allocates_one_chunk_buffer(n, chunk_numel):
    cfg = OptimConfig()
    tensors = [torch.rand(n) for _ in range(4)]
    with _Allocations() as rec:
        adamw_step_(*tensors, 3, 1e-3, cfg, [(0, 40), (60, 103)], chunk_numel=chunk_numel)
    assert rec.fresh == [(min(n, chunk_numel), torch.float32)]


def test_grad_norm_temporaries_are_one_fp64_chunk():
    shards = [torch.rand(103), torch.rand(7)]
    with _Allocations() as rec:
        got = global_grad_norm_sq(shards, chunk_numel=10)
    big = [a for a in rec.fresh if a[0] > 1]
    assert big and max(numel for numel, _ in big) == 10 and {d for _, d in big} == {torch.float64}
    assert got.dtype == torch.float64
    assert got.item() == pytest.approx(sum(float((s.double() ** 2).sum()) for s in shards), rel=1e-12)


@pytest.mark.parametrize("wd", [0.0, 0.1])
def test_prepared_adamw_step_is_bitwise_the_same(wd):
    """The runtime applies the decay and exp_avg_sq *= beta2 ahead (adamw_prepare_) while gradients
    travel; the step that follows gives exactly the values of the step done in one go."""
    cfg = OptimConfig(weight_decay=wd)
    gen = torch.Generator().manual_seed(3)
    p, g, m, v = (torch.rand(1000, generator=gen) for _ in range(4))
    one = [t.clone() for t in (p, g, m, v)]
    decay = [(0, 400), (600, 1000)]
    adamw_step_(*one, 5, 3e-3, cfg, decay, chunk_numel=128)
    two = [t.clone() for t in (p, g, m, v)]
    adamw_prepare_(two[0], two[3], 3e-3, cfg, decay)
    adamw_step_(*two, 5, 3e-3, cfg, decay, chunk_numel=128, prepared=True)
    for a, b in zip(one, two):
        assert torch.equal(a, b)
    # and the prepared step alone is not the whole step (the comparison can fail)
    three = [t.clone() for t in (p, g, m, v)]
    adamw_step_(*three, 5, 3e-3, cfg, decay, chunk_numel=128, prepared=True)
    assert not torch.equal(three[3], one[3])


def test_in_place_grad_norm_agrees_and_allocates_only_scalars():
    gen = torch.Generator().manual_seed(5)
    shards = [torch.randn(300_001, generator=gen), torch.randn(7, generator=gen), torch.zeros(0)]
    with _Allocations() as rec:
        got = grad_norm_sq_in_place(shards, chunk_numel=1 << 14)
    assert rec.fresh and max(numel for numel, _ in rec.fresh) == 1
    assert got.dtype == torch.float64
    assert got.item() == pytest.approx(global_grad_norm_sq(shards).item(), rel=1e-6)
    assert not math.isfinite(grad_norm_sq_in_place([torch.tensor([1.0, float("inf")])]).item())
    assert grad_norm_sq_in_place([]).item() == 0.0
    with pytest.raises(ValueError, match="fp32"):
        grad_norm_sq_in_place([torch.ones(3, dtype=torch.float64)])


def test_grad_norm_sees_inf_and_nan():
    assert not math.isfinite(global_grad_norm_sq([torch.ones(5), torch.tensor([1.0, float("inf")])]).item())
    assert math.isnan(global_grad_norm_sq([torch.tensor([float("nan")])]).item())
    assert global_grad_norm_sq([]).item() == 0.0
    assert global_grad_norm_sq([torch.zeros(0)]).item() == 0.0


def _mask_ranges(shapes, start, end):
    """Independent path: a 0/1 mask of the whole flat buffer, sliced, turned into runs."""
    mask = torch.cat([torch.full((math.prod(s),), len(s) >= 2, dtype=torch.bool) for s in shapes])[start:end]
    runs, a = [], None
    for i, flag in enumerate(mask.tolist() + [False]):
        if flag and a is None:
            a = i
        elif not flag and a is not None:
            runs.append((a, i))
            a = None
    return runs


SHAPES = [(3, 4), (4,), (4,), (5, 2), (2, 3), (7,), (2, 2)]  # offsets 0, 12, 16, 20, 30, 36, 43 .. 47


def test_decay_ranges_cut_through_parameters():
    # shard [5, 33): the tail of the first matrix, two vectors, then two adjacent matrices merged
    assert decay_ranges(SHAPES, 5, 33) == [(0, 7), (15, 28)]
    assert decay_ranges(SHAPES, 13, 19) == []  # inside the vectors
    assert decay_ranges(SHAPES, 40, 47) == [(3, 7)]
    assert decay_ranges(SHAPES, 10, 10) == []
    for start in range(0, 48, 3):
        for end in range(start, 48, 5):
            assert decay_ranges(SHAPES, start, end) == _mask_ranges(SHAPES, start, end), (start, end)


@pytest.mark.parametrize("start,end", [(-1, 4), (5, 4), (0, 48)])
def test_decay_ranges_bad_bounds(start, end):
    with pytest.raises(ValueError, match="start"):
        decay_ranges(SHAPES, start, end)


def test_lr_at_points():
    cfg = OptimConfig(lr=1.0, warmup_steps=4, min_lr_ratio=0.1)
    assert lr_at(1, 12, cfg) == pytest.approx(0.25)
    assert lr_at(4, 12, cfg) == 1.0  # warmup end: the peak
    assert lr_at(8, 12, cfg) == pytest.approx(0.55)  # half way through the cosine: the mean of 1 and 0.1
    assert lr_at(12, 12, cfg) == 0.1  # exact at the last step
    assert lr_at(30, 12, cfg) == 0.1
    lrs = [lr_at(s, 12, cfg) for s in range(4, 13)]
    assert all(a > b for a, b in zip(lrs, lrs[1:]))

    no_warmup = OptimConfig(lr=2.0, warmup_steps=0, min_lr_ratio=0.0)
    assert lr_at(1, 10, no_warmup) == pytest.approx(1.0 + math.cos(math.pi / 10))
    assert lr_at(10, 10, no_warmup) == 0.0

    # total == warmup: the ramp is not cut short, then the floor
    only_warmup = OptimConfig(lr=1.0, warmup_steps=4, min_lr_ratio=0.1)
    assert [lr_at(s, 4, only_warmup) for s in (1, 4, 5)] == [pytest.approx(0.25), 1.0, 0.1]
    with pytest.raises(ValueError, match="step"):
        lr_at(0, 10, cfg)


def test_lr_at_matches_torch_schedulers():
    # torch's LinearLR then CosineAnnealingLR (recursive form), stepped as a training loop steps them
    warmup, total, base = 3, 11, 0.5
    cfg = OptimConfig(lr=base, warmup_steps=warmup, min_lr_ratio=0.2)
    opt = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=base)
    sched = torch.optim.lr_scheduler.SequentialLR(opt, [
        torch.optim.lr_scheduler.LinearLR(opt, start_factor=1 / warmup, end_factor=1.0, total_iters=warmup - 1),
        torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=total - warmup, eta_min=base * 0.2)],
        milestones=[warmup - 1])
    for step in range(1, total + 1):
        assert lr_at(step, total, cfg) == pytest.approx(opt.param_groups[0]["lr"], rel=1e-9), step
        opt.step()
        sched.step()


def test_clip_coefficient_matches_clip_grad_norm():
    model = _model()
    x = torch.randint(0, 11, (5,))
    model(x).pow(2).sum().backward()
    params = list(model.parameters())
    grads = [p.grad.clone() for p in params]
    total_norm = math.sqrt(global_grad_norm_sq([_flat(grads)[:50], _flat(grads)[50:]]).item())
    for max_norm in (total_norm / 3, total_norm * 3):
        for p, g in zip(params, grads):
            p.grad = g.clone()
        torch_norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
        assert total_norm == pytest.approx(torch_norm.item(), rel=1e-6)
        coef = clip_coefficient(total_norm, max_norm)
        torch.testing.assert_close(_flat(grads) * coef, _flat(p.grad for p in params), rtol=1e-6, atol=0)
    assert clip_coefficient(total_norm, total_norm * 3) == 1.0
    assert clip_coefficient(total_norm / 3, total_norm / 3) < 1.0
    assert clip_coefficient(1e9, None) == 1.0


def test_loss_scaler_hand_sequence():
    s = DynamicLossScaler(init_scale=8.0, growth_interval=2)
    seen = []
    for found_inf in [False, False, True, False, True, False, False, False]:
        s.update(found_inf)
        seen.append(s.scale)
    # grow after two good steps; backoff halves and restarts the count
    assert seen == [8, 16, 8, 8, 4, 4, 8, 8]
    off = DynamicLossScaler(enabled=False)
    off.update(True)
    assert off.scale == 1.0


@pytest.mark.parametrize("growth,backoff,interval", [(2.0, 0.5, 3), (1.7, 0.3, 2)])
def test_loss_scaler_matches_gradscaler_kernel(growth, backoff, interval):
    scale, tracker = torch.tensor([1000.0]), torch.zeros(1, dtype=torch.int32)
    ours = DynamicLossScaler(init_scale=1000.0, growth_factor=growth, backoff_factor=backoff,
                             growth_interval=interval)
    gen = torch.Generator().manual_seed(2)
    for i in range(40):
        found_inf = bool(torch.rand(1, generator=gen).item() < 0.25)
        torch._amp_update_scale_(scale, tracker, torch.tensor([float(found_inf)]), growth, backoff, interval)
        ours.update(found_inf)
        assert ours.scale == scale.item(), i
    # a restored scaler continues identically
    restored = DynamicLossScaler()
    restored.load_state_dict(json.loads(json.dumps(ours.state_dict())))
    for found_inf in [False] * 5 + [True]:
        ours.update(found_inf)
        restored.update(found_inf)
        assert restored.scale == ours.scale


def test_loss_scaler_never_grows_to_inf():
    s = DynamicLossScaler(init_scale=2.0 ** 127, growth_interval=1)
    s.update(False)
    assert s.scale == 2.0 ** 127


@pytest.mark.parametrize("field,value", [
    ("lr", 0.0), ("lr", float("nan")), ("betas", (0.9,)), ("betas", (0.9, 1.0)), ("eps", 0.0),
    ("weight_decay", -0.1), ("max_grad_norm", 0.0), ("warmup_steps", -1), ("warmup_steps", 2.5),
    ("min_lr_ratio", 1.5)])
def test_optim_config_rejects_bad_values(field, value):
    with pytest.raises(ValueError, match=field) as err:
        OptimConfig(**{field: value})
    assert repr(value) in str(err.value)


def test_optim_config_round_trip():
    cfg = OptimConfig(lr=1e-3, betas=(0.8, 0.99), max_grad_norm=None, warmup_steps=7)
    back = OptimConfig.from_dict(json.loads(json.dumps(cfg.to_dict())))
    assert back == cfg and back.betas == (0.8, 0.99)
    with pytest.raises(ValueError, match="unknown"):
        OptimConfig.from_dict({"learning_rate": 1e-3})
