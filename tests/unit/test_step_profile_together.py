"""Timing devices together is refused for devices without a quota or alone (the timing itself, in
cgroups: tests/e2e/test_step_profile_together.py)."""
import pytest


def test_devices_without_a_quota_or_alone_are_refused():
    from profiler.step_profile import profile_together

    with pytest.raises(ValueError, match="two or more"):
        profile_together("tiny", 32, devices=[(0.5, None)], save=False)
    with pytest.raises(ValueError, match="CPU-quota devices"):
        profile_together("tiny", 32, devices=[(0.5, None), (None, 1.0)], save=False)
