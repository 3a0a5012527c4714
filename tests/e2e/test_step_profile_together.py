"""profile_together: the emulated CPU devices of one run timed at once, each under its own cgroups."""
import os
import re

import pytest

from profiler import cgroups

_WHY = cgroups.unavailable_reason()
if _WHY is not None:
    pytest.skip(f"profiling under a CPU quota needs cgroups: {_WHY}", allow_module_level=True)

SEQ = 64


def test_the_run_s_devices_are_timed_together_in_one_window_and_saved_per_kind(data_dir):
    import psutil

    from planner.core.profiles import get_step_profile
    from contracts.specs import get_model
    from profiler.step_profile import profile_together

    messages = []
    full, half = profile_together("tiny", SEQ, devices=[(1.0, None), (0.5, 1.0)], micro_batches=(4, 8, 12, 16),
                                  repeats=2, warmup=1, progress=lambda f, m: messages.append(m))
    assert (full.device_type, half.device_type) == ("cpu@share1", "cpu@share0.5")
    assert all(p.measured and "profiled together with the run's devices (cpu@share1 + cpu@share0.5" in p.source
               for p in (full, half))
    assert "memory baseline + 1 GiB" in half.source and "memory" not in full.source.split("limits (")[1].split(")")[0]
    rounds = {p.device_type: int(re.search(r"medians of (\d+)", p.source).group(1)) for p in (full, half)}
    # the full core is done with its 2 rounds first and times on while the half core finishes its own
    assert rounds["cpu@share0.5"] >= 2 and rounds["cpu@share1"] > rounds["cpu@share0.5"], rounds
    # half a core beside the full one: measurably slower (its calls span several 10 ms quota periods)
    assert sum(half.step_times_s) > 1.3 * sum(full.step_times_s), (half.step_times_s, full.step_times_s)
    assert "2 of 2 devices timed" in messages
    for p in (full, half):  # saved under its kind, what the planner prices the device from
        assert get_step_profile(p.device_type, get_model("tiny"), SEQ, "fp32").beta_s == p.beta_s
    assert cgroups.find(f"{cgroups.PREFIX}profile-{os.getpid()}") == []
    assert not [c for c in psutil.Process().children(recursive=True) if "profiler.step_profile" in " ".join(c.cmdline())]


