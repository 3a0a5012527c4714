"""The Plan page's one-click profile, which measures in worker processes: this machine profiled and
planned again on measured figures, and an emulated mixed cluster profiled under its cgroups and
split unevenly (the page's profile of that cluster: tests/e2e/conftest.py's mixed_page_profiled, which
tests/e2e/test_profile_paths.py checks against the command line's; the rest of the page:
tests/unit/test_ui_plan.py)."""
import pytest

from tests.unit.test_ui_plan import _page, settle

# profiling on a loaded 2-core machine: 170 s measured beside two busy cores; the page's own run may take 300 s
pytestmark = pytest.mark.timeout(600)


@pytest.mark.slow
def test_one_click_profiles_this_machine_and_plans_again_on_measured_figures():
    from planner.core.profiles import get_step_profile
    from contracts.specs import PRESETS

    at = _page()
    at.default_timeout = 300  # the click's run profiles the machine: minutes on a loaded one
    assert not get_step_profile("cpu", PRESETS["tiny"], 128, "fp32").measured
    settle(at.button(key="plan_profile_now").click().run())
    assert not at.exception and not at.error
    assert get_step_profile("cpu", PRESETS["tiny"], 128, "fp32").measured  # kept in the profile store
    assert not any("Estimated" in w.value for w in at.warning)
    assert not [b for b in at.button if b.key == "plan_profile_now"]
    plan = at.session_state["plan"]
    assert not any("estimated" in n for n in plan.notes)  # re-planned on the measured profile


@pytest.mark.slow
def test_emulated_mixed_cluster_is_profiled_under_its_cgroups_and_split_unevenly(mixed_page_profiled):
    # the page on a whole core and a third of one, before and after its click (tests/e2e/conftest.py)
    assert any("cpu@share0.33" in w and "Estimated" in w for w in mixed_page_profiled.warnings_before)
    at = mixed_page_profiled.at
    assert not at.exception and not at.error
    assert not any("Estimated" in w.value for w in at.warning)  # both kinds measured under their quotas
    fast, slow = at.session_state["plan"].assignments
    assert fast.batch > slow.batch  # the third of a core gets less of the batch, from measured figures
