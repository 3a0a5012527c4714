"""Step-time profiles measured on this machine's CPU with the executor's code path: the α/β fit on
real timings and its prediction of a micro-batch it was not fitted on. Timed, so in tests/e2e (one
test at a time: a unit run on every core would time them beside other tests)."""
import statistics
import time

import pytest
import torch

from contracts.specs import PRESETS
from models.decoder import build_model
from models.runtime import micro_batch_loss
from planner.core.profiles import get_step_profile
from profiler.step_profile import count_flops, executor_threads, profile_local


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
