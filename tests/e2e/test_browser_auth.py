"""The dashboard on a shared machine, in a real browser: without its access token a visitor sees
one refusal line and no page; with it every page works, across page changes and a reload; a
dataset path outside the allowed roots is refused on the page and nothing is read; a hostile
cluster upload (a few bytes claiming 10^8 devices) is one error line, parsed outside the server.
"""
from __future__ import annotations

import glob
import os

import pytest

from testkit.dashboard import CHROMIUM, WAIT_MS, launch_browser, page_url, server_log, streamlit_server, wait_idle

pytest.importorskip("playwright")
if not os.path.exists(CHROMIUM):
    pytest.skip("Debian chromium is not installed (scripts/install.sh installs it)", allow_module_level=True)
from playwright.sync_api import sync_playwright  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

TITLE = '[data-testid="stMain"] h1'
REFUSAL = "needs its access token"
HUGE_CLUSTER = b'{"nodes": [{"name": "n", "gpus": {"A100-80GB": 100000000}}]}'


def refused(page, url: str) -> None:
    """`url` opens on the refusal line alone: no page title, no page list."""
    page.goto(url, timeout=WAIT_MS)
    page.get_by_text(REFUSAL).first.wait_for(timeout=WAIT_MS)
    wait_idle(page)
    assert page.locator(TITLE).count() == 0
    assert page.locator('[data-testid="stSidebarNav"]').count() == 0
    assert page.locator('[data-testid="stMain"] input').count() == 0


def test_no_token_no_page_and_typed_paths_confined(data_dir, monkeypatch):
    monkeypatch.delenv("GPUMIX_ALLOWED_ROOTS", raising=False)
    with streamlit_server(data_dir) as url, sync_playwright() as pw:
        browser = launch_browser(pw)
        page = browser.new_page(viewport={"width": 1400, "height": 1400})
        try:
            for bad in (f"{url}/", f"{url}/memory", page_url(url, "plan", token="not-the-token")):
                refused(page, bad)

            # the token opens the page; a move through the sidebar keeps the session in
            page.goto(page_url(url, "memory"), timeout=WAIT_MS)
            page.locator(TITLE, has_text="Model & memory").first.wait_for(timeout=WAIT_MS)
            wait_idle(page, 60_000)
            box = page.locator(".st-key-mem_data input").first
            box.fill("/etc/hostname")
            box.press("Enter")
            page.get_by_text("is outside the folders the dashboard may read").first.wait_for(timeout=WAIT_MS)
            wait_idle(page)
            assert page.locator(".st-key-mem_count_tokens button").count() == 0
            assert not glob.glob(os.path.join(data_dir, "corpus", "**", "*.bin"), recursive=True)

            page.locator('[data-testid="stSidebarNav"]').get_by_role("link", name="Inventory", exact=True).click()
            page.locator(TITLE, has_text="Inventory").first.wait_for(timeout=WAIT_MS)
            wait_idle(page, 60_000)
            page.reload()  # a new session: the URL still carries the token
            page.locator(TITLE, has_text="Inventory").first.wait_for(timeout=WAIT_MS)
            wait_idle(page, 60_000)

            upload = os.path.join(data_dir, "huge.json")
            with open(upload, "wb") as fh:
                fh.write(HUGE_CLUSTER)
            page.locator(".st-key-inv_upload input[type=file]").first.set_input_files(upload)
            page.get_by_text("Cannot use this cluster file").first.wait_for(timeout=WAIT_MS)
            wait_idle(page)
            assert page.locator(TITLE, has_text="Inventory").count() == 1  # the server still answers
        except BaseException:
            print(server_log(data_dir))
            raise
        finally:
            browser.close()
