"""A huge plan in a real browser, then the tab closes: its solver process must not outlive it.

Once, a global batch of 100,000 kept `cbc` at 100 % CPU for minutes after the tab closed.
Here the real dashboard (its own GPUMIX_DATA_DIR) and headless Debian Chromium plan 1e6
samples on an uploaded cluster of 6,144 GPUs in 384 kinds (8 types at 48 slowdowns; several
seconds of solving: the example clusters now solve in a tenth of a second), find the solver's process
among the server's descendants, close the browser, and check that the process and everything it
started (cbc) are gone within 10 s.
"""
from __future__ import annotations

import os
import re
import time

import pytest

from testkit.clusters import many_kinds_cluster
from testkit.dashboard import CHROMIUM, WAIT_MS, launch_browser, page_url, server_log, streamlit_server, wait_idle
from testkit.processes import processes_with_data_dir
from testkit.wait import wait_until

pytest.importorskip("playwright")
if not os.path.exists(CHROMIUM):
    pytest.skip("Debian chromium is not installed (scripts/install.sh installs it)", allow_module_level=True)
import psutil  # noqa: E402

UPLOAD_SOURCE = "Upload a cluster file…"  # ui/plan.py (a page script: importing it would run the page)
from playwright.sync_api import sync_playwright  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.timeout(90)]

HUGE_BATCH = 1_000_000  # the page's upper bound
GONE_WITHIN_S = 10.0  # the bound, from the tab's close


def solver_processes(data_dir: str) -> list[psutil.Process]:
    """The server's background jobs (ui/background.py children) and their descendants (cbc)."""
    found = []
    for server in processes_with_data_dir(data_dir):
        try:
            if "streamlit" not in " ".join(server.cmdline()):
                continue
            for child in server.children(recursive=True):
                if "ui.background" in " ".join(child.cmdline()):
                    found += [child, *child.children(recursive=True)]
        except psutil.Error:
            continue
    return found


def alive(p: psutil.Process) -> bool:
    try:
        return p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_closing_the_tab_ends_a_huge_solve(data_dir, monkeypatch):
    # the page shows Cancel at once (no first wait), so the tab closes while the solver still works
    monkeypatch.setenv("GPUMIX_UI_FIRST_WAIT_S", "0")
    with streamlit_server(data_dir) as url, sync_playwright() as pw:
        browser = launch_browser(pw)
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        try:
            page.goto(page_url(url, "plan"), timeout=WAIT_MS)
            page.locator('[data-testid="stMain"] h1').first.wait_for(timeout=WAIT_MS)
            wait_idle(page, 60_000)  # the first open's default plan (this machine, small batch)
            page.locator(".st-key-plan_cluster_source [role=combobox]").first.click()
            page.get_by_role("option", name=UPLOAD_SOURCE, exact=True).click()
            wait_idle(page)
            page.locator(".st-key-plan_cluster_upload input[type=file]").first.set_input_files(
                many_kinds_cluster(os.path.join(data_dir, "many-kinds.json")))
            wait_idle(page)
            box = page.locator(".st-key-plan_global_batch input").first
            box.fill(str(HUGE_BATCH))
            box.press("Enter")
            wait_idle(page)
            page.locator(".st-key-plan_compute button").first.click()
            # past the first wait the page says so and offers Cancel
            page.locator(".st-key-plan_cancel button").first.wait_for(timeout=WAIT_MS)
            # the notice is drawn by the waiting fragment, a moment after the button
            page.get_by_text(re.compile("Solving the plan")).first.wait_for(timeout=WAIT_MS)
            solvers = wait_until(lambda: solver_processes(data_dir), 30,
                                 "a solver process under the server while the page says it is solving")
            time.sleep(1.0)  # let the solver start its cbc, if it does
            solvers = solver_processes(data_dir) or solvers
            # the solve is still running when the tab closes (else this test would prove nothing)
            assert any(alive(p) for p in solvers), "the solve ended before the tab closed: make it bigger"
        except BaseException:
            print(server_log(data_dir))
            raise
        finally:
            browser.close()  # the tab is gone: its websocket closes
        wait_until(lambda: not any(alive(p) for p in solvers), GONE_WITHIN_S, "the solver to end after the tab closed",
                   interval_s=0.1, detail=lambda: f"{[p.pid for p in solvers if alive(p)]}\n{server_log(data_dir)}")
