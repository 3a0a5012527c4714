import copy

import pytest
import torch

from models.decoder import build_model
from models.runtime import FlatShardedState, micro_batch_loss, shard_bounds
from planner.specs import PRESETS


def test_shard_bounds():
    assert shard_bounds(10, [0.5, 0.5]) == [(0, 5), (5, 10)]
    assert shard_bounds(10, [0.3, 0.0, 0.7]) == [(0, 3), (3, 3), (3, 10)]
    assert shard_bounds(7, [1, 1, 1]) == [(0, 2), (2, 5), (5, 7)]  # round-half-up of 7/3, 14/3
    b = shard_bounds(1001, [0.1, 0.25, 0.65])
    assert b[0][0] == 0 and b[-1][1] == 1001 and all(b[i][1] == b[i + 1][0] for i in range(2))
    with pytest.raises(ValueError):
        shard_bounds(10, [0.5, -0.1])
    with pytest.raises(ValueError):
        shard_bounds(10, [0, 0])


def _batch(spec, b, t, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randint(0, spec.vocab_size, (b, t), generator=g),
            torch.randint(0, spec.vocab_size, (b, t), generator=g))


@pytest.mark.parametrize("name", ["tiny", "tiny-llama"])
def test_adamw_equivalence_and_sharding(name):
    spec = PRESETS[name]
    torch.manual_seed(0)
    ref = build_model(spec)
    mine = copy.deepcopy(ref)
    sharded = copy.deepcopy(ref)
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    state = FlatShardedState(mine, 0, spec.num_params, lr=1e-2)
    n = state.numel
    lo, hi = shard_bounds(n, [0.3, 0.7])[1]
    part = FlatShardedState(sharded, lo, hi, lr=1e-2)
    before = part.flat_params.clone()
    for step in range(3):
        x, y = _batch(spec, 2, 16, seed=step)
        opt.zero_grad()
        micro_batch_loss(ref, x, y, x.numel()).backward()
        opt.step()
        for s, m in ((state, mine), (part, sharded)):
            s.zero_grad()
            micro_batch_loss(m, x, y, x.numel()).backward()
            s.step()
        if step == 0:  # only the slice moves on the sharded state
            assert torch.equal(part.flat_params[:lo], before[:lo])
            assert not torch.equal(part.flat_params[lo:hi], before[lo:hi])
            part.flat_params[:lo] = state.flat_params[:lo]  # what the owner's broadcast would do
    for p_ref, p_mine in zip(ref.parameters(), mine.parameters()):
        torch.testing.assert_close(p_ref, p_mine, rtol=1e-5, atol=1e-6)
    assert state.step_count == 3
    assert part.exp_avg.numel() == hi - lo


def test_split_invariance_of_gradients():
    spec = PRESETS["tiny-llama"]
    torch.manual_seed(0)
    m = build_model(spec)
    state = FlatShardedState(m, 0, 0)  # no optimizer state needed here
    x, y = _batch(spec, 4, 24)
    total = x.numel()
    micro_batch_loss(m, x, y, total).backward()
    whole = state.flat_grads.clone()
    state.zero_grad()
    micro_batch_loss(m, x[:1], y[:1], total).backward()  # uneven split: 1 + 3 samples
    micro_batch_loss(m, x[1:], y[1:], total).backward()
    torch.testing.assert_close(state.flat_grads, whole, rtol=1e-5, atol=1e-7)
    assert m.embed.weight.grad.data_ptr() == state.flat_grads.data_ptr()  # views, not copies


def test_state_dict_round_trip():
    spec = PRESETS["tiny"]
    torch.manual_seed(0)
    m = build_model(spec)
    s = FlatShardedState(m, 10, 500)
    x, y = _batch(spec, 1, 8)
    micro_batch_loss(m, x, y, x.numel()).backward()
    s.step()
    sd = {k: (v.clone() if torch.is_tensor(v) else v) for k, v in s.state_dict().items()}
    s2 = FlatShardedState(copy.deepcopy(m), 10, 500)
    s2.load_state_dict(sd)
    assert s2.step_count == 1 and torch.equal(s2.exp_avg, s.exp_avg)
    with pytest.raises(ValueError):
        FlatShardedState(copy.deepcopy(m), 0, 10).load_state_dict(sd)
