"""Emulated devices' cgroup settings without starting a run: a CPU share asks for physical emulation
(memory alone stays checked), and no cgroups means no emulated profile (runs under quotas:
tests/e2e/test_cgroup_emulation.py)."""
import pytest

from contracts.cluster import DeviceSpec
from profiler import cgroups
from tests.e2e.test_cgroup_emulation import SEQ, plan_for


pytestmark = pytest.mark.skipif(cgroups.unavailable_reason() is not None,
                                reason=f"cgroups unavailable: {cgroups.unavailable_reason()}")


def test_cpu_share_asks_for_physical_emulation_memory_alone_stays_checked():
    from executor.launch import emulation_limits

    devs = [DeviceSpec("cpu", memory_gb=1.0), DeviceSpec("cpu", cpu_share=0.5, memory_gb=1.0), DeviceSpec("cpu"),
            DeviceSpec("cpu", cpu_share=1.0)]
    assert emulation_limits(plan_for(devs, [(1, 1, 0.25)] * 4)) == {
        1: cgroups.Limits(0.5, 2**30), 3: cgroups.Limits(1.0, None)}


def test_no_cgroups_no_emulated_profile(monkeypatch):
    from profiler.step_profile import profile_local

    monkeypatch.setattr(cgroups, "unavailable_reason", lambda: "not root (cgroup v1 limits need root)")
    with pytest.raises(ValueError, match="not root .* measured, not derived"):
        profile_local("tiny", SEQ, micro_batches=(1, 2, 3, 4), cpu_share=0.5, save=False)
