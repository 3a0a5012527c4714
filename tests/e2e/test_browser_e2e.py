"""End to end in a real browser: the path a user takes, in headless Debian Chromium.

Start the dashboard (its own GPUMIX_DATA_DIR), open every page, compute a plan for
this machine (tiny model, small global batch), launch it as a real 2-rank run, watch
"Steps recorded" grow, reload the browser mid-run and then restart the app (each
time the page must find the run again from SQLite and keep counting), stop it,
find it under Runs. Screenshots of each
page go to artifacts/screenshots/. Every process the test started is killed at the
end, and the test checks that none is left.
"""
from __future__ import annotations

import contextlib
import os
import re
import time

import pytest

from testkit import ROOT
from testkit.dashboard import (CHROMIUM, WAIT_MS, in_chart_js, launch_browser, page_url, server_log, steps_recorded,
                               streamlit_server, wait_idle)
from testkit.processes import kill_processes_with_data_dir, processes_with_data_dir
from testkit.wait import page_pause, wait_until

pytest.importorskip("playwright")
if not os.path.exists(CHROMIUM):
    pytest.skip("Debian chromium is not installed (scripts/install.sh installs it)", allow_module_level=True)
from playwright.sync_api import Error as PlaywrightError  # noqa: E402
from playwright.sync_api import Page, sync_playwright  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

SHOTS = os.path.join(ROOT, "artifacts", "screenshots")
# sidebar title -> url path (app.py)
PAGES = {"Inventory": "", "Model & memory": "memory", "Plan": "plan", "Launch & monitor": "launch",
         "Runs": "runs", "Scheduler": "scheduler", "Geo": "geo"}
GLOBAL_BATCH = 4  # 2 CPU ranks, small enough that a step takes well under a second
RUN_STEPS = 100_000  # far more than the test watches: the run must still be going when it is stopped


def shot(page: Page, name: str) -> None:
    """A screenshot once the page has drawn (best effort: a failing page is shot as it is)."""
    os.makedirs(SHOTS, exist_ok=True)
    with contextlib.suppress(PlaywrightError):
        wait_idle(page, 10_000)
    page.screenshot(path=os.path.join(SHOTS, f"{name}.png"), full_page=True)


@contextlib.contextmanager
def shot_on_failure(page: Page, data_dir: str):
    """On an error: a screenshot and the server's log, while the server still runs."""
    try:
        yield
    except BaseException:
        shot(page, "99-failure")
        print(server_log(data_dir))
        raise


def open_page(page: Page, title: str) -> None:
    """Click the sidebar link, as a user does (a URL change would start a new session)."""
    page.locator('[data-testid="stSidebarNav"]').get_by_role("link", name=title, exact=True).click()
    page.wait_for_url(re.compile(rf"/{PAGES[title]}/?(\?.*)?$"), timeout=WAIT_MS)  # the access token stays in the query
    page.locator('[data-testid="stMain"] h1').first.wait_for(timeout=WAIT_MS)


def assert_no_exception(page: Page, where: str) -> None:
    n = page.locator('[data-testid="stException"]').count()
    assert n == 0, f"{where}: the page shows a traceback"


def wait_steps_at_least(page: Page, n: int, timeout_s: float) -> int:
    seen = [-1]

    def enough() -> int | None:
        seen[0] = steps_recorded(page, timeout_ms=5_000)
        return seen[0] if seen[0] >= n else None

    # PlaywrightError: the fragment re-renders the line while we read it
    return wait_until(enough, timeout_s, f"Steps recorded >= {n}", interval_s=0.5, ignore=(PlaywrightError,),
                      detail=lambda: f"Steps recorded at {seen[0]}", pause=page_pause(page))


LOSS_POINTS_JS = """() => {
  // the live loss chart is Plotly's SVG: its first trace draws a marker
  // per step (up to a few hundred), and its line a vertex per step (an M/L command)
  const t = %s;
  if (!t) return -1;
  const line = t.querySelector('path.js-line');
  const d = line && line.getAttribute('d');
  return Math.max(t.querySelectorAll('.points path').length, d ? (d.match(/[ML]/g) || []).length : 0);
}""" % in_chart_js("launch_loss_chart", ".main-svg .scatterlayer .trace")


def wait_loss_chart_points(page: Page, n: int, timeout_s: float) -> int:
    """Until the live loss chart (Plotly, key launch_loss_chart) holds at least n steps."""
    page.wait_for_function(f"() => ({LOSS_POINTS_JS})() >= {n}", timeout=timeout_s * 1000, polling=200)
    return page.evaluate(LOSS_POINTS_JS)


def click_key(page: Page, key: str) -> None:
    page.locator(f".st-key-{key} button").first.click()


def fill_number(page: Page, key: str, value: int) -> None:
    box = page.locator(f".st-key-{key} input").first
    box.fill(str(value))
    box.press("Enter")
    wait_idle(page)


def test_plan_launch_watch_reload_restart_stop_and_find_the_run(data_dir):
    from executor.store import read_metrics

    runs_root = os.path.join(data_dir, "runs")
    t0 = time.monotonic()

    def done(what: str) -> None:  # phase times, shown with -s (where the 2.5 min budget goes)
        print(f"  {time.monotonic() - t0:6.1f} s  {what}")

    with sync_playwright() as pw:
        browser = launch_browser(pw)
        # Streamlit scrolls inside its main area: a tall window shows the whole page in a screenshot
        page = browser.new_page(viewport={"width": 1400, "height": 2200})
        try:
            # the first app: it dies at the end of this block, the run it launched does not
            with streamlit_server(data_dir, kill_everything=False) as url, shot_on_failure(page, data_dir):
                # 1. the app opens on the local inventory
                page.goto(page_url(url))
                page.get_by_role("heading", name=re.compile("inventory", re.I)).first.wait_for(timeout=60_000)
                wait_idle(page, 60_000)
                assert_no_exception(page, "Inventory")
                shot(page, "01-inventory")
                done("opened on Inventory")

                # 2. every page renders
                for i, title in enumerate(list(PAGES)[1:], start=2):
                    open_page(page, title)
                    wait_idle(page, 60_000)
                    assert_no_exception(page, title)
                    shot(page, f"{i:02d}-{title.split()[0].lower()}")
                    done(title)

                # 3. a plan for this machine: default (tiny) model, small global batch
                open_page(page, "Plan")
                fill_number(page, "plan_global_batch", GLOBAL_BATCH)
                click_key(page, "plan_compute")
                wait_idle(page, 60_000)
                assert_no_exception(page, "Plan after compute")
                shot(page, "10-plan-computed")
                done("plan computed")

                # 4. launch it and watch it move
                open_page(page, "Launch & monitor")
                fill_number(page, "launch_steps", RUN_STEPS)
                click_key(page, "launch_button")
                first = wait_steps_at_least(page, 1, timeout_s=60)
                grown = wait_steps_at_least(page, first + 3, timeout_s=30)
                # the live loss chart gains steps too
                points = wait_loss_chart_points(page, 1, timeout_s=30)
                more_points = wait_loss_chart_points(page, points + 3, timeout_s=30)
                assert_no_exception(page, "Launch & monitor while running")
                shot(page, "11-launch-running")
                done(f"launched, steps {first} -> {grown}, loss chart points {points} -> {more_points}")
                run_names = os.listdir(runs_root)
                assert len(run_names) == 1, run_names
                run_dir = os.path.join(runs_root, run_names[0])

                # 5. a browser reload loses the session; the page finds the run in SQLite again
                page.reload()
                after_reload = wait_steps_at_least(page, grown + 1, timeout_s=30)
                shot(page, "12-launch-after-reload")
                done(f"reloaded, steps {after_reload}")

            # 6. the app is gone; the run is not
            assert read_metrics(run_dir)["status"] == "running"
            done("app stopped, run still running")
            with streamlit_server(data_dir, kill_everything=False) as url, shot_on_failure(page, data_dir):
                page.goto(page_url(url, PAGES['Launch & monitor']))
                after_restart = wait_steps_at_least(page, after_reload + 1, timeout_s=60)
                shot(page, "13-launch-after-restart")
                done(f"app restarted, steps {after_restart}")

                # 7. stop it
                click_key(page, "stop_button")
                # stop_run asks the launcher, then kills after 30 s: allow for that on a loaded machine
                page.get_by_text(re.compile(r"Run status:\s*stopped")).first.wait_for(timeout=2 * WAIT_MS)
                shot(page, "14-launch-stopped")
                done("stopped")

                # 8. it is in the history
                open_page(page, "Runs")
                # a row of the history table (glide draws on a canvas; its cells are an ARIA grid)
                page.locator('[data-testid="stDataFrame"] [role="gridcell"]', has_text=run_names[0]).first.wait_for(
                    state="attached", timeout=WAIT_MS)
                page.locator(".st-key-runs_export", has_text=run_names[0]).wait_for(timeout=WAIT_MS)
                assert_no_exception(page, "Runs")
                shot(page, "15-runs")
                done("found under Runs")
        finally:
            browser.close()
            kill_processes_with_data_dir(data_dir)
    assert read_metrics(run_dir)["status"] == "stopped"
    # the servers, the launcher, torchrun and both ranks are gone
    assert processes_with_data_dir(data_dir) == []
    print(f"browser end-to-end: {time.monotonic() - t0:.1f} s")
