"""Fixtures shared by end-to-end test files: one measurement that several files check from their side."""
from __future__ import annotations

from dataclasses import dataclass

import pytest

from contracts.paths import ENV_DATA_DIR
from contracts.secrets import ENV_DASHBOARD_TOKEN, TOKEN_PARAM
from testkit.dashboard import TOKEN

# one device at a whole core, one at a third: two kinds the Plan page profiles under their cgroups
MIXED_SHARES = (1.0, 0.33)


@dataclass
class PageProfiled:
    """The Plan page on the mixed cluster, before and after its "Profile now" click.

    `plan_before` and `warnings_before` are the page's on estimated figures; `at` is the page after the
    click; `profiles` the step profiles the click saved in its store, by kind."""
    at: object
    plan_before: object
    warnings_before: list[str]
    profiles: dict


def mixed_cluster():
    """One node of two CPU devices at MIXED_SHARES of a core."""
    from contracts.cluster import ClusterSpec

    return ClusterSpec.from_dict({"name": "mixed", "nodes": [{"name": "localhost", "datacenter": "local", "gpus": [
        {"type": "cpu", "cpu_share": s} for s in MIXED_SHARES]}]})


@pytest.fixture(scope="session")
def mixed_page_profiled(tmp_path_factory) -> PageProfiled:
    """The Plan page's one-click profile of the mixed cluster, taken once for every test that reads it."""
    from profiler import cgroups

    if cgroups.unavailable_reason() is not None:
        pytest.skip(f"profiling under CPU quotas needs cgroups: {cgroups.unavailable_reason()}")
    from streamlit.testing.v1 import AppTest

    from planner.core.profiles import load_step_profiles
    from tests.unit.test_ui_plan import PAGE, settle

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(ENV_DATA_DIR, str(tmp_path_factory.mktemp("page-profile-data")))
        mp.setenv(ENV_DASHBOARD_TOKEN, TOKEN)  # set up before the per-test token fixture: given here
        at = AppTest.from_file(PAGE, default_timeout=300)
        at.query_params[TOKEN_PARAM] = TOKEN
        at.session_state["cluster"] = mixed_cluster()
        settle(at.run())
        plan = at.session_state["plan"]
        warnings = [w.value for w in at.warning]
        settle(at.button(key="plan_profile_now").click().run())  # the page's path, saved in the store
        profiles = {p.device_type: p for p in load_step_profiles() if p.seq == plan.seq}
    return PageProfiled(at, plan, warnings, profiles)
