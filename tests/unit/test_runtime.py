"""models/runtime.py (slices, the loss) and models/sharded.py on one process, against plain torch.

The reference is independent of the runtime: the decoder as an ordinary nn.Module, its loss per
micro-batch, torch.optim.AdamW with decay / no-decay groups, torch.nn.utils.clip_grad_norm_ and
the same LR per step. The runtime (one rank owning everything, LocalCollectives) must train the
same parameters at every ZeRO stage, with accumulation (layer-wise, recomputed) or without."""
import pytest
import torch

from models.collectives import LocalCollectives
from models.decoder import build_model
from models.optim import OptimConfig, lr_at
from models.runtime import micro_batch_loss, shard_bounds
from models.sharded import ShardedRuntime
from contracts.specs import PRESETS

CPU = torch.device("cpu")
OPTIM = OptimConfig(lr=2e-3, warmup_steps=1, max_grad_norm=0.3)
STEPS = 3


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


def test_split_invariance_of_gradients():
    spec = PRESETS["tiny-llama"]
    torch.manual_seed(0)
    m = build_model(spec)
    x, y = _batch(spec, 4, 24)
    total = x.numel()
    micro_batch_loss(m, x, y, total).backward()
    whole = [p.grad.clone() for p in m.parameters()]
    m.zero_grad()
    micro_batch_loss(m, x[:1], y[:1], total).backward()  # uneven split: 1 + 3 samples
    micro_batch_loss(m, x[1:], y[1:], total).backward()
    for a, b in zip(whole, (p.grad for p in m.parameters())):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


def _reference(spec, init: dict[str, torch.Tensor], steps_batches, normalizer: int) -> dict[str, torch.Tensor]:
    model = build_model(spec)
    model.load_state_dict(init, strict=False)
    if spec.tied_embeddings:
        assert model.lm_head is None
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": OPTIM.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=OPTIM.lr, betas=OPTIM.betas,
                            eps=OPTIM.eps, foreach=False)
    for step, batches in enumerate(steps_batches, start=1):
        opt.zero_grad()
        for x, y in batches:
            micro_batch_loss(model, x, y, normalizer).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), OPTIM.max_grad_norm)
        for g in opt.param_groups:
            g["lr"] = lr_at(step, STEPS, OPTIM)
        opt.step()
    return {k: v.detach() for k, v in model.named_parameters()}


@pytest.mark.parametrize("name", ["tiny", "tiny-llama"])  # tied GPT-2 / untied Llama
@pytest.mark.parametrize("zero,split,recompute", [
    (1, (4,), "none"), (1, (1, 3), "full"),
    (2, (4,), "none"), (2, (2, 2), "none"), (2, (4,), "full"),
    (3, (4,), "none"), (3, (1, 1, 2), "none"),
])
def test_the_runtime_trains_like_plain_torch(name, zero, split, recompute):
    spec = PRESETS[name]
    rt = ShardedRuntime(spec, zero=zero, fractions=[1.0], position=0, comm=LocalCollectives(0, 1), device=CPU,
                        recompute=recompute, optim=OPTIM, seed=3)
    init = rt.full_state_dict()
    steps_batches = []
    for step in range(STEPS):
        x, y = _batch(spec, 4, 16, seed=step)
        cuts, o = [], 0
        for m in split:
            cuts.append((x[o:o + m], y[o:o + m]))
            o += m
        steps_batches.append(cuts)
    losses = [rt.train_step(b, x.numel(), lr_at(s, STEPS, OPTIM)).loss for s, b in enumerate(steps_batches, 1)]
    assert losses[-1] < losses[0]
    want = _reference(spec, init, steps_batches, x.numel())
    got = rt.full_state_dict()
    assert got.keys() == want.keys()
    moved = max((want[k] - init[k]).abs().max().item() for k in want)
    assert moved > 1e-3
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-5, atol=1e-6, msg=k)


def test_init_is_the_same_for_every_plan_and_stage():
    spec = PRESETS["tiny-llama"]
    a = ShardedRuntime(spec, zero=1, fractions=[1.0], position=0, comm=LocalCollectives(0, 1), device=CPU, seed=5)
    b = ShardedRuntime(spec, zero=3, fractions=[1.0], position=0, comm=LocalCollectives(0, 1), device=CPU, seed=5)
    c = ShardedRuntime(spec, zero=3, fractions=[0.3, 0.7], position=1, comm=LocalCollectives(1, 2), device=CPU, seed=5)
    sa, sb = a.full_state_dict(), b.full_state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    # position 1 of an uneven world holds exactly its slice of the same values
    for ua, uc in zip(a.units, c.units):
        assert torch.equal(ua.master[uc.start:uc.end], uc.master)
    d = ShardedRuntime(spec, zero=1, fractions=[1.0], position=0, comm=LocalCollectives(0, 1), device=CPU, seed=6)
    assert not all(torch.equal(sa[k], d.full_state_dict()[k]) for k in sa)


def test_weight_decay_spares_norms_and_biases():
    """Every unit's decay ranges cover exactly its matrices and embeddings, whatever the slice."""
    spec = PRESETS["tiny"]  # GPT-2: LayerNorm weights and biases, Linear biases
    for fractions, position in (([1.0], 0), ([0.37, 0.63], 1)):
        rt = ShardedRuntime(spec, zero=3, fractions=fractions, position=position,
                            comm=LocalCollectives(position, len(fractions)), device=CPU)
        for u in rt.units:
            want = 0
            for p, o in zip(u.params, u.offsets):
                if p.dim() >= 2:  # the part of this matrix inside the slice
                    want += max(0, min(o + p.numel(), u.end) - max(o, u.start))
            assert sum(b - a for a, b in u.decay) == want, u.name
            assert all(0 <= a < b <= u.end - u.start for a, b in u.decay)


def test_fp16_overflow_skips_the_step_and_backs_off():
    spec = PRESETS["tiny"]
    rt = ShardedRuntime(spec, zero=3, fractions=[1.0], position=0, comm=LocalCollectives(0, 1), device=CPU,
                        loss_scaling=True)
    rt.scaler.load_state_dict({**rt.scaler.state_dict(), "scale": 3.0e38})  # loss x scale overflows fp32
    before = rt.full_state_dict()
    x, y = _batch(spec, 2, 8)
    r = rt.train_step([(x, y)], x.numel(), lr=1e-2)
    assert r.skipped and rt.step_count == 0 and rt.scaler.scale < 3.0e38
    after = rt.full_state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    # the scale halves on every overflow until the scaled gradients are finite again
    skipped = 1
    while rt.train_step([(x, y)], x.numel(), lr=1e-2).skipped:
        skipped += 1
        assert skipped < 200
    assert rt.step_count == 1 and rt.scaler.scale == pytest.approx(3.0e38 / 2 ** skipped, rel=1e-6)


def test_a_diverged_run_without_loss_scaling_says_so():
    spec = PRESETS["tiny"]
    rt = ShardedRuntime(spec, zero=2, fractions=[1.0], position=0, comm=LocalCollectives(0, 1), device=CPU)
    with torch.no_grad():
        rt.units[1].master.fill_(float("inf"))
    x, y = _batch(spec, 2, 8)
    with pytest.raises(FloatingPointError, match="non-finite"):
        rt.train_step([(x, y)], x.numel(), lr=1e-2)
