"""Step-time profiles measured on this machine's CPU with the executor's code path."""
import statistics
import time

import pytest
import torch

from models.decoder import build_model
from models.runtime import micro_batch_loss
from planner.core.profiles import analytic_flops_per_sample, get_step_profile
from contracts.specs import PRESETS
from profiler.step_profile import count_flops, executor_threads, profile_local


@pytest.mark.parametrize("name,seq", [("gpt2", 1024), ("llama2-7b", 512)])
def test_counted_flops_match_6N_plus_attention(name, seq):
    """FlopCounterMode on the runtime's forward+backward vs ModelSpec.flops_per_token
    (6·N_matmul + 12·L·h·s), counted under FakeTensorMode so a 7B model costs nothing."""
    spec = PRESETS[name]
    counted = count_flops(spec, seq, micro_batch=2)
    analytic = spec.flops_per_token(seq) * 2 * seq
    assert counted == pytest.approx(analytic, rel=0.10)
    # and the attention term is really in the count (the CPU SDPA kernel is registered)
    attention = 12.0 * spec.num_layers * spec.hidden * seq * 2 * seq
    assert counted > analytic - 0.5 * attention


def test_full_recompute_counts_the_blocks_forward_once_more():
    spec = PRESETS["tiny-llama"]
    none, full = count_flops(spec, 128, 2), count_flops(spec, 128, 2, recompute="full")
    assert full / none == pytest.approx(analytic_flops_per_sample(spec, 128, "full") /
                                        analytic_flops_per_sample(spec, 128), rel=0.05)
    assert 1.1 < full / none < 4 / 3  # the LM head is not recomputed


def test_alpha_beta_fit_on_real_cpu_timings(data_dir):
    fractions = []
    p = profile_local("tiny", 128, "fp32", micro_batches=(4, 8, 16, 32), repeats=5,
                      progress=lambda f, m: fractions.append(f))
    assert p.measured and p.device_type == "cpu" and p.micro_batches == (4, 8, 16, 32)
    assert p.r2 >= 0.95, f"R² {p.r2:.3f}, medians {p.step_times_s}"
    assert p.beta_s > 0 and p.alpha_s >= 0 and p.optimizer_s_per_param > 0
    # bigger micro-batches take longer, and the fit describes the medians it was fitted to
    # (where compute dominates: at m=4 a few ms of noise or a clamped α is a large fraction)
    assert list(p.step_times_s) == sorted(p.step_times_s)
    for m, t in zip(p.micro_batches, p.step_times_s):
        if m >= 8:
            assert p.step_time_s(m) == pytest.approx(t, rel=0.35)
    assert fractions[0] == 0.0 and fractions[-1] == 1.0 and fractions == sorted(fractions)
    # saved: the planner's reader now returns it as measured
    got = get_step_profile("cpu", PRESETS["tiny"], 128, "fp32")
    assert got == p and got.measured
    assert p.flops_per_sample == pytest.approx(count_flops(PRESETS["tiny"], 128, 1))


def test_profile_predicts_an_unprofiled_micro_batch(data_dir):
    """The fit (from 4, 8, 16, 32) against an independent timing of m=24 on the same path."""
    spec = PRESETS["tiny"]
    p = profile_local(spec, 128, micro_batches=(4, 8, 16, 32), repeats=5, save=False)
    dev = torch.device("cpu")
    with executor_threads(dev):
        torch.manual_seed(1)
        model = build_model(spec)
        x = torch.randint(0, spec.vocab_size, (24, 128))
        samples = []
        for i in range(7):
            t0 = time.thread_time()  # the profiler's clock on a CPU (step_clock)
            micro_batch_loss(model, x, x, 24 * 128).backward()
            if i >= 2:
                samples.append(time.thread_time() - t0)
    ratio = statistics.median(samples) / p.step_time_s(24)
    assert 0.5 < ratio < 2.0, f"measured/predicted {ratio:.2f} at m=24"


def test_threads_are_restored_and_bad_input_is_rejected():
    before = torch.get_num_threads()
    with executor_threads(torch.device("cpu")):
        assert torch.get_num_threads() == 1
    assert torch.get_num_threads() == before
    with pytest.raises(ValueError, match="at least 4 distinct"):
        profile_local("tiny", 128, micro_batches=(1, 2, 2, 4), save=False)
    with pytest.raises(ValueError, match="dtype"):
        profile_local("tiny", 128, dtype="int8", save=False)
    with pytest.raises(ValueError, match="unknown model"):
        profile_local("nope", 128, save=False)


def test_a_noise_dominated_fit_is_timed_again_then_refused(data_dir, monkeypatch):
    """A fit whose time per sample is not positive is noise: timed again with twice the rounds,
    kept when the slope turns positive, refused with the medians when it never does."""
    import profiler.step_profile as sp

    calls = []

    def fake(run_spec, seq, sizes, recompute, dtype, repeats, warmup, dev, progress, workers=1, **kw):
        calls.append(repeats)
        slope = 1e-3 if len(calls) == 2 else -1e-4  # noise first, then a real slope
        return {m: [0.01 + slope * m] * repeats for m in sizes}, 0.001, None

    monkeypatch.setattr(sp, "_measure", fake)
    p = profile_local("tiny", 32, micro_batches=(1, 2, 3, 4), repeats=2, save=False)
    assert calls == [2, 4] and p.beta_s == pytest.approx(1e-3)
    calls.clear()

    def always_noise(run_spec, seq, sizes, *rest, **kw):
        calls.append(1)
        return {m: [0.02 - 1e-4 * m] for m in sizes}, 0.0, None

    monkeypatch.setattr(sp, "_measure", always_noise)
    with pytest.raises(RuntimeError, match="not positive.*noise"):
        profile_local("tiny", 32, micro_batches=(1, 2, 3, 4), repeats=2, save=False)
    assert len(calls) == 1 + sp.NOISY_RETRIES


