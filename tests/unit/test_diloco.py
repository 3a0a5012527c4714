"""DiLoCo's pieces on one process: the outer optimizer against torch.optim.SGD, the int8 exchange's
error bound, fragments and their sync steps, the inner SGD against torch.optim.SGD, and one
DilocoRuntime of one group (LocalCollectives) against a ShardedRuntime step."""
from __future__ import annotations

import types

import pytest
import torch

from contracts.plan import DilocoSpec
from contracts.specs import PRESETS
from executor.checks import check_diloco
from models.collectives import LocalCollectives
from models.diloco import (DilocoRuntime, int8_error_bound, int8_levels, outer_update_, quantize_int8,
                           split_fragments, sync_offset)
from models.optim import OptimConfig, adamw_prepare_, adamw_step_
from models.sharded import ShardedRuntime

CPU = torch.device("cpu")


@pytest.mark.parametrize("mu,nesterov", [(0.0, False), (0.9, False), (0.9, True)])
def test_outer_update_is_torch_sgd_with_momentum(mu, nesterov):
    g = torch.Generator().manual_seed(0)
    p0 = torch.randn(50, generator=g)
    grads = [torch.randn(50, generator=g) for _ in range(4)]
    ref = torch.nn.Parameter(p0.clone())
    opt = torch.optim.SGD([ref], lr=0.7, momentum=mu, nesterov=nesterov)
    ours, m = p0.clone(), (torch.zeros(50) if mu > 0 else None)
    for gr in grads:
        ref.grad = gr.clone()
        opt.step()
        outer_update_(ours, gr, m, 0.7, mu, nesterov)
    torch.testing.assert_close(ours, ref.detach(), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("groups", [2, 3])
def test_int8_sum_of_groups_stays_within_its_bound(groups):
    g = torch.Generator().manual_seed(groups)
    deltas = [torch.randn(1000, generator=g) * (k + 1) * 1e-3 for k in range(groups)]
    levels = int8_levels(groups)
    scale = torch.stack([d.abs().max() for d in deltas]).max() / levels
    wire = torch.zeros(1000, dtype=torch.int8)
    for d in deltas:  # the all-reduce's sum, in int8 as gloo adds it
        wire += quantize_int8(d, scale, levels)
    exact = torch.stack(deltas).double().sum(0)
    err = (wire.double() * float(scale) - exact).abs().max().item()
    assert err <= int8_error_bound(float(scale), groups) * (1 + 1e-6)
    assert err > 0  # quantization is in play
    # relative to the largest element: about 1 / levels
    assert err / exact.abs().max().item() < groups / levels


def test_int8_refuses_more_groups_than_it_can_sum():
    with pytest.raises(ValueError, match="at most 127 groups"):
        int8_levels(128)


def test_fragments_are_contiguous_and_sync_at_their_own_steps():
    assert split_fragments(5, 2) == [[0, 1, 2], [3, 4]]
    assert split_fragments(4, 1) == [[0, 1, 2, 3]]
    with pytest.raises(ValueError, match="fragments"):
        split_fragments(3, 4)
    assert [sync_offset(f, 6, 3) for f in range(3)] == [0, 2, 4]


def test_inner_sgd_is_torch_sgd_with_weight_decay_on_the_decay_ranges():
    g = torch.Generator().manual_seed(1)
    p0, grad = torch.randn(20, generator=g), torch.randn(20, generator=g)
    cfg = OptimConfig(kind="sgd", weight_decay=0.1)
    decay = [(0, 12)]  # a matrix, then a norm's gains that do not decay
    ref_a = torch.nn.Parameter(p0[:12].clone())
    ref_b = torch.nn.Parameter(p0[12:].clone())
    opt = torch.optim.SGD([{"params": [ref_a], "weight_decay": 0.1}, {"params": [ref_b], "weight_decay": 0.0}],
                          lr=0.3)
    ref_a.grad, ref_b.grad = grad[:12].clone(), grad[12:].clone()
    opt.step()
    m, v = torch.zeros(20), torch.zeros(20)
    for prepared in (False, True):
        ours = p0.clone()
        if prepared:
            adamw_prepare_(ours, v, 0.3, cfg, decay)
        adamw_step_(ours, grad, m, v, 1, 0.3, cfg, decay, prepared=prepared)
        torch.testing.assert_close(ours, torch.cat([ref_a.detach(), ref_b.detach()]), rtol=1e-6, atol=1e-7)
    assert m.abs().sum() == 0 and v.abs().sum() == 0  # SGD leaves the moments alone


def test_optim_kind_is_checked_and_round_trips():
    with pytest.raises(ValueError, match="kind must be one of adamw, sgd"):
        OptimConfig(kind="lion")
    cfg = OptimConfig(kind="sgd", lr=0.1)
    assert OptimConfig.from_dict(cfg.to_dict()) == cfg
    assert OptimConfig.from_dict({k: v for k, v in cfg.to_dict().items() if k != "kind"}).kind == "adamw"


def _batches(step: int):
    g = torch.Generator().manual_seed(step)
    w = torch.randint(0, PRESETS["tiny"].vocab_size, (2, 17), generator=g)
    return [(w[:, :-1].contiguous(), w[:, 1:].contiguous())]


@pytest.mark.parametrize("zero", [1, 3])
def test_one_group_outer_step_moves_half_way_with_outer_lr_half(zero):
    """One group, H = 2, outer lr 0.5, no momentum: after the sync the parameters are θ0 + (θ2 - θ0)/2,
    θ2 the plain runtime's after the same 2 steps."""
    cfg = OptimConfig(kind="sgd", lr=0.5, max_grad_norm=None)

    def runtime() -> ShardedRuntime:
        return ShardedRuntime(PRESETS["tiny"], zero=zero, fractions=[1.0], position=0, comm=LocalCollectives(0, 1),
                              device=CPU, optim=cfg)
    plain = runtime()
    theta0 = plain.full_state_dict()
    for s in (1, 2):
        plain.train_step(_batches(s), 32, cfg.lr)
    theta2 = plain.full_state_dict()
    rt = DilocoRuntime(runtime(), DilocoSpec((("a",),), 2, outer_lr=0.5, outer_momentum=0.0),
                       group=0, weight=1.0, outer=LocalCollectives(0, 1))
    rt.train_step(_batches(1), 32, cfg.lr)
    assert rt.syncs == []
    rt.train_step(_batches(2), 32, cfg.lr)
    assert [(o.step, o.fragment) for o in rt.syncs] == [(2, 0)]
    assert rt.syncs[0].payload_bytes == PRESETS["tiny"].num_params * 4
    got = rt.full_state_dict()
    for k in got:
        torch.testing.assert_close(got[k], theta0[k] + 0.5 * (theta2[k] - theta0[k]), rtol=1e-5, atol=1e-6)
    assert max((theta2[k] - theta0[k]).abs().max().item() for k in got) > 1e-3  # the steps moved something
    # the next inner step starts from the synced parameters: its loss is theirs
    want = ShardedRuntime(PRESETS["tiny"], zero=zero, fractions=[1.0], position=0, comm=LocalCollectives(0, 1),
                          device=CPU, optim=cfg)
    want.load_parameters(lambda name, a, b: got[name].reshape(-1)[a:b])
    x, y = _batches(3)[0]
    assert rt.eval_loss(x, y) == pytest.approx(want.eval_loss(x, y), rel=1e-6)
    rt.settle()


def test_diloco_run_refuses_checkpoint_options():
    """executor.checks.check_diloco: the launcher (check_run) and every rank refuse them, naming the option."""
    diloco, plain = types.SimpleNamespace(diloco=object()), types.SimpleNamespace(diloco=None)
    check_diloco(diloco, resume=False, checkpoint_every=0)
    check_diloco(plain, resume=True, checkpoint_every=5)  # only DiLoCo plans
    with pytest.raises(ValueError, match="--checkpoint-every: a DiLoCo plan's run writes no checkpoint"):
        check_diloco(diloco, resume=False, checkpoint_every=5)
    with pytest.raises(ValueError, match="--resume: a DiLoCo plan's run writes no checkpoint"):
        check_diloco(diloco, resume=True, checkpoint_every=0)
