"""GPUMix dashboard: a router over thin pages (widgets -> one library call -> render).

Start: `bash scripts/dashboard.sh` (`gpumix dashboard`), which prints the URL with its access
token. A session without the token (GPUMIX_DASHBOARD_TOKEN, given as `?token=`) sees one line
and no page. The app opens on the local inventory; Plan -> Launch & monitor is the path of a
first run. Shared state lives in ui/state.py, shared rendering helpers in ui/common.py.
"""
import logging
import os

import streamlit as st

from contracts.secrets import ENV_DASHBOARD_TOKEN, TOKEN_PARAM, token_matches
from ui import state

log = logging.getLogger(__name__)

LAUNCH_URL_PATH = "launch"
GRANTED = "access_granted"  # session key: this session gave the right token once
REFUSED = "This dashboard needs its access token: open the URL printed at start (http://localhost:PORT/?token=…)."
NO_TOKEN = (f"This dashboard has no access token: start it with `bash scripts/dashboard.sh` (or set "
            f"{ENV_DASHBOARD_TOKEN} for the server and open it with ?{TOKEN_PARAM}=…).")

st.set_page_config(page_title="GPUMix", page_icon=":material/memory:", layout="wide")


def has_access() -> bool:
    """The session gave the server's token, in this run's URL or once before (so that moving
    between pages, whose URLs drop the query, keeps working). The token stays in the URL, so a
    reload of any page works too."""
    expected = os.environ.get(ENV_DASHBOARD_TOKEN, "")
    if not expected:
        return False  # never open by default: a dashboard started without a token serves nothing
    if st.session_state.get(GRANTED) != expected:
        if not token_matches(st.query_params.get(TOKEN_PARAM), expected):
            return False
        st.session_state[GRANTED] = expected
    if st.query_params.get(TOKEN_PARAM) != expected:
        st.query_params[TOKEN_PARAM] = expected
    return True


if not has_access():
    # before st.navigation: a refused session sees neither a page nor the page list
    st.error(REFUSED if os.environ.get(ENV_DASHBOARD_TOKEN) else NO_TOKEN, icon=":material/lock:")
    st.stop()

PAGES = {
    "Cluster": [
        st.Page("ui/inventory.py", title="Inventory", icon=":material/dns:", url_path="inventory", default=True),
        st.Page("ui/memory.py", title="Model & memory", icon=":material/memory:", url_path="memory"),
    ],
    "Train": [
        st.Page("ui/plan.py", title="Plan", icon=":material/account_tree:", url_path="plan"),
        st.Page("ui/launch.py", title="Launch & monitor", icon=":material/rocket_launch:", url_path=LAUNCH_URL_PATH),
        st.Page("ui/runs.py", title="Runs", icon=":material/history:", url_path="runs"),
    ],
    "Fleet": [
        st.Page("ui/scheduler.py", title="Scheduler", icon=":material/view_timeline:", url_path="scheduler"),
        st.Page("ui/geo.py", title="Geo", icon=":material/public:", url_path="geo"),
    ],
}

page = st.navigation(PAGES)


def live_run_link() -> None:
    """In the sidebar on every page: the run that is going, found in the store (so it
    survives a browser reload and an app restart), with a link to its monitor. Not cached:
    the store is the one source of status, so the link goes with Stop (which reruns the app)."""
    try:
        run_dir = state.find_live_run()
    except Exception as e:  # the indicator must never break a page
        log.debug("no live run indicator: %s", e)
        return
    if run_dir:
        name = os.path.basename(run_dir.rstrip("/"))
        st.sidebar.page_link(PAGES["Train"][1], label=f"Running: {name}", icon=":material/monitoring:")


def ensure_a_plan_to_launch() -> None:
    """Launch & monitor opened before Plan (a new user, a reloaded tab): give it the
    default plan for this machine, so that "Launch" runs it. Only there: a cluster edit on
    Inventory must not trigger a solve."""
    if page.url_path == LAUNCH_URL_PATH and state.get_plan() is None:
        try:
            state.get_or_default_plan()
        except ValueError as e:  # the page says how to get a plan
            log.info("no default plan: %s", e)


st.sidebar.caption("First run: **Plan** computes a plan for this machine, **Launch & monitor** runs it "
                   "and shows it live. Numbers are marked *predicted* or *measured*.")
live_run_link()
ensure_a_plan_to_launch()
page.run()
