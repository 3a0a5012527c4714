"""Step-time profiles with the executor's code path: FLOP counts, threads, bad input, the noise rule
(the fits on real CPU timings are timed, so they run one at a time: tests/e2e/test_step_profile_timing.py)."""
import pytest
import torch

from planner.core.profiles import analytic_flops_per_sample
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




def test_the_profile_command_gives_no_share_of_a_peak_the_kind_ran_above():
    """`profiler profile` prints the achieved rate as a share of the catalogue peak only where it is below
    it: above it (the CPU's nominal catalogue figure) a share would be no fraction of any ceiling."""
    from types import SimpleNamespace

    from profiler.commands.profile import _of_peak

    below = SimpleNamespace(efficiency=0.41, peak_tflops=312.0, device_type="A100-40GB")
    above = SimpleNamespace(efficiency=1.37, peak_tflops=0.05, device_type="cpu@share0.5")
    assert _of_peak(below) == " = 0.41 of peak 312"
    text = _of_peak(above)
    assert "of peak" not in text and "1.37" not in text and "nominal 0.05 TFLOP/s for cpu" in text
    assert _of_peak(SimpleNamespace(efficiency=None, peak_tflops=0.05, device_type="cpu")) == ""
