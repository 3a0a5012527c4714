"""Dashboard latency, measured in real headless Chromium against the real app.

1. Time to first render of each page, two ways: a new tab opening the page's URL (a new
   Streamlit session: the browser parses Streamlit's JS again, from its HTTP cache like any
   browser a user already opened the dashboard in: every new tab is a page of ONE browser
   context that loaded the app once, uncounted, before the rounds) and a click on the page's
   sidebar link in an open tab (how a user moves around). Each until the title is on screen and until
   everything has drawn: the script run over, no loading skeleton left
   (tests/conftest.RENDERED_JS) and every chart drawn (PAGE_DRAWN_JS: a Vega-Lite chart's
   SVG/canvas, a Plotly chart's SVG). The very first load (a fresh browser profile: empty cache) is reported apart. A
   one-line Streamlit app is loaded the same way in the same rounds, interleaved with the
   pages (its own server, running beside the dashboard's): the floor that Streamlit and this
   machine's load set, printed beside each page with the page minus the floor.
2. Metric row -> browser: a running run (fabricated: plan.json + metrics.sqlite written
   through executor.store.MetricsStore, "launched" by this process so the store calls it
   running) is open on Launch & monitor; we write one step row and time until the page
   shows the new "Steps recorded: N". Median over `--rows` rows, written at random
   phases of the page's refresh period. Then, with rows arriving every 0.25 s, the share
   of samples in which the live loss chart is on screen without its curve.

Targets: every page opened in a new tab all drawn <= 2 s (issue 16); a metric row on screen <= 2 s
(issue 6). Run: python bench/dashboard_latency.py [--loads 3 --rows 8 --json]
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import re
import statistics
import sys
import tempfile
import time
from typing import Iterator

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from executor.store import MetricsStore  # noqa: E402
from contracts.paths import ENV_DATA_DIR  # noqa: E402
from tests.conftest import RENDERED_JS, fabricate_run, launch_browser, streamlit_server, write_step  # noqa: E402

TARGET_S = 2.0
FLOOR_WARN_SHARE = 0.8  # a floor above this share of the target is said aloud: the machine is loaded
PAGES = {"Inventory": "inventory", "Model & memory": "memory", "Plan": "plan", "Launch & monitor": "launch",
         "Runs": "runs", "Scheduler": "scheduler", "Geo": "geo"}
FIRST_STEPS = 3  # rows the fabricated run has when the page opens
PAGE_TIMEOUT_MS = 60_000


VIEWPORT = {"width": 1400, "height": 1000}


def _new_page(target):
    """A new tab: of a BrowserContext (its HTTP cache shared with the context's other tabs), or of a
    Browser (`Browser.new_page` makes a fresh context: a first visit, empty cache)."""
    return target.new_page(viewport=VIEWPORT) if hasattr(target, "contexts") else target.new_page()


# every chart on the page drawn, not only placed: a Vega-Lite chart has its SVG (or canvas), a
# Plotly chart (a page not moved to ui/charts.py yet) its main SVG
PAGE_DRAWN_JS = """() => {
  const charts = [...document.querySelectorAll('[data-testid="stVegaLiteChart"], [data-testid="stPlotlyChart"]')];
  return (%s)() && charts.every(c => !!c.querySelector('svg.marks, canvas.marks, .main-svg'));
}""" % RENDERED_JS


def time_page_load(browser, url: str) -> tuple[float, float, str]:
    """A new browser tab (a new Streamlit session) opens `url`: (seconds to the page title,
    seconds until everything has drawn, the title). `browser`: a Browser (a fresh profile) or a
    BrowserContext (a tab of a browser already in use)."""
    page = _new_page(browser)
    try:
        t0 = time.perf_counter()
        page.goto(url, wait_until="commit")
        h1 = page.locator('[data-testid="stMain"] h1').first
        h1.wait_for(timeout=PAGE_TIMEOUT_MS)
        t_title = time.perf_counter() - t0
        page.wait_for_function(PAGE_DRAWN_JS, timeout=PAGE_TIMEOUT_MS, polling="raf")
        return t_title, time.perf_counter() - t0, h1.inner_text()
    finally:
        page.close()


def time_navigation(browser, url: str, titles: dict[str, str], rounds: int) -> dict[str, list[tuple[float, float]]]:
    """In one tab, as a user moves around: click each sidebar link in turn, `rounds` times;
    per page (seconds to its title, seconds until everything has drawn)."""
    out: dict[str, list[tuple[float, float]]] = {t: [] for t in PAGES}
    page = _new_page(browser)
    try:
        page.goto(url)
        page.wait_for_function(PAGE_DRAWN_JS, timeout=PAGE_TIMEOUT_MS, polling="raf")
        nav = page.locator('[data-testid="stSidebarNav"]')
        order = list(PAGES)[1:] + list(PAGES)[:1]  # starts on Inventory
        for _ in range(rounds):
            for title in order:
                t0 = time.perf_counter()
                nav.get_by_role("link", name=title, exact=True).click()
                page.locator('[data-testid="stMain"] h1', has_text=titles[title]).first.wait_for(timeout=PAGE_TIMEOUT_MS)
                t_title = time.perf_counter() - t0
                page.wait_for_function(PAGE_DRAWN_JS, timeout=PAGE_TIMEOUT_MS, polling="raf")
                out[title].append((t_title, time.perf_counter() - t0))
    finally:
        page.close()
    return out


@contextlib.contextmanager
def reference_app() -> Iterator[str]:
    """A one-line Streamlit app on its own server (the URL): the floor that Streamlit itself and
    this machine's current load set for a new tab."""
    with tempfile.TemporaryDirectory(prefix="gpumix-ref-") as d:
        script = os.path.join(d, "reference_app.py")
        with open(script, "w", encoding="utf-8") as fh:
            fh.write("import streamlit as st\nst.title('Reference')\n")
        with streamlit_server(d, app=script) as url:
            yield url


def time_new_tabs(browser, url: str, ref_url: str, loads: int) -> tuple[dict[str, list], list]:
    """`loads` rounds, each a new-tab load of the one-line app then of every page: per page its
    samples, and the one-line app's (interleaved, so both see the same machine load)."""
    pages: dict[str, list] = {t: [] for t in PAGES}
    floor = []
    for _ in range(loads):
        floor.append(time_page_load(browser, ref_url))
        for title, path in PAGES.items():
            pages[title].append(time_page_load(browser, f"{url}/{path}"))
    return pages, floor


# the live loss chart (Vega-Lite, drawn as SVG) with its curve: a line path that has points
LOSS_CHART_DRAWN_JS = """() => {
  const e = document.querySelector('.st-key-launch_loss_chart .vega-embed svg .mark-line path');
  return !!e && /L/.test(e.getAttribute('d') || '');
}"""


def live_chart_blank_share(browser, url: str, store: MetricsStore, first_step: int, seconds: float) -> dict:
    """While rows arrive (one every 0.25 s, a fast run), how often the live loss chart of
    Launch & monitor is on screen without its curve (re-drawn after each refresh)."""
    page = browser.new_page(viewport={"width": 1400, "height": 2200})  # every chart in view
    samples = []
    try:
        page.goto(f"{url}/launch")
        page.wait_for_function(LOSS_CHART_DRAWN_JS, timeout=PAGE_TIMEOUT_MS, polling="raf")
        step, t_end, next_row = first_step, time.perf_counter() + seconds, 0.0
        while time.perf_counter() < t_end:
            if time.perf_counter() >= next_row:
                write_step(store, step, 4.0 / (1 + step))
                step, next_row = step + 1, time.perf_counter() + 0.25
            samples.append(page.evaluate(LOSS_CHART_DRAWN_JS))
            page.wait_for_timeout(50)
    finally:
        page.close()
    return {"blank_share": 1.0 - sum(samples) / len(samples), "samples": len(samples), "rows_written": step - first_step}


def time_rows(browser, url: str, store: MetricsStore, first_step: int, rows: int) -> list[float]:
    """Seconds from a committed step row to its count on the Launch & monitor page."""
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    delays = []
    try:
        page.goto(f"{url}/launch")
        page.get_by_text(re.compile(rf"Steps recorded:\s*{first_step}\b")).first.wait_for(timeout=PAGE_TIMEOUT_MS)
        rng = random.Random(0)
        for i in range(rows):
            page.wait_for_timeout(rng.uniform(0.2, 1.2) * 1000)  # a random phase of the refresh period
            step = first_step + i
            write_step(store, step, 4.0 / (1 + step))
            t0 = time.perf_counter()
            page.get_by_text(re.compile(rf"Steps recorded:\s*{step + 1}\b")).first.wait_for(timeout=PAGE_TIMEOUT_MS)
            delays.append(time.perf_counter() - t0)
    finally:
        page.close()
    return delays


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--loads", type=int, default=3, help="warm loads per page (median)")
    p.add_argument("--rows", type=int, default=8, help="metric rows timed (median)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    args = p.parse_args(argv)

    from playwright.sync_api import sync_playwright

    data_dir = tempfile.mkdtemp(prefix="gpumix-bench-")
    os.environ[ENV_DATA_DIR] = data_dir
    # running: its "launcher" is this process; we keep writing rows into it
    run_dir = fabricate_run("bench-live", FIRST_STEPS, None, root=os.path.join(data_dir, "runs"))
    store = MetricsStore(run_dir)
    result: dict = {"target_s": TARGET_S, "loads": args.loads, "rows": args.rows, "pages": {}}
    try:
        with streamlit_server(data_dir) as url, reference_app() as ref_url, sync_playwright() as pw:
            browser = launch_browser(pw)
            try:
                cold = time_page_load(browser, f"{url}/{PAGES['Inventory']}")
                result["cold_first_load"] = {"page": "Inventory", "title_s": cold[0], "complete_s": cold[1]}
                tabs_context = browser.new_context(viewport=VIEWPORT)  # the user's browser
                time_page_load(tabs_context, f"{url}/{PAGES['Inventory']}")  # its first visit: not counted
                time_page_load(tabs_context, ref_url)  # the one-line app's too (another origin, its own cache)
                tabs, floor = time_new_tabs(tabs_context, url, ref_url, args.loads)
                ref_complete = statistics.median(s[1] for s in floor)
                result["reference_one_line_app"] = {"tab_title_s": statistics.median(s[0] for s in floor),
                                                    "tab_complete_s": ref_complete}
                titles = {}
                for title, samples in tabs.items():
                    titles[title] = samples[-1][2]
                    complete = statistics.median(s[1] for s in samples)
                    result["pages"][title] = {
                        "tab_title_s": statistics.median(s[0] for s in samples),
                        "tab_complete_s": complete,
                        "tab_complete_minus_floor_s": complete - ref_complete,
                        "target_met": complete <= TARGET_S,
                    }
                for title, samples in time_navigation(browser, url, titles, args.loads).items():
                    result["pages"][title]["nav_title_s"] = statistics.median(s[0] for s in samples)
                    result["pages"][title]["nav_complete_s"] = statistics.median(s[1] for s in samples)
                delays = time_rows(browser, url, store, first_step=FIRST_STEPS, rows=args.rows)
                result["row_to_browser_s"] = {"median": statistics.median(delays), "max": max(delays),
                                              "samples": delays}
                result["live_loss_chart"] = live_chart_blank_share(browser, url, store, FIRST_STEPS + args.rows,
                                                                   seconds=8.0)
            finally:
                browser.close()
    finally:
        store.finish("stopped", "benchmark finished")
        store.close()

    if args.json:
        print(json.dumps(result))
        return 0
    ref = result["reference_one_line_app"]
    print(f"Dashboard latency in headless Chromium (medians of {args.loads}; load average "
          f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} cores)")
    c = result["cold_first_load"]
    print(f"  first load of the app ever (Inventory, a fresh browser profile): title {c['title_s']:.2f} s, all drawn {c['complete_s']:.2f} s")
    print(f"  floor: a one-line Streamlit app in a new tab, in the same rounds: title {ref['tab_title_s']:.2f} s, "
          f"all drawn {ref['tab_complete_s']:.2f} s")
    print(f"  {'page':<18} {'new tab: title':>15} {'all drawn':>10} {'floor':>6} {'− floor':>8}  "
          f"target (new tab all drawn <= {TARGET_S:g} s)  {'sidebar click: title':>21} {'all drawn':>10}")
    for title, r in result["pages"].items():
        ok = "ok" if r["target_met"] else "SLOW"
        print(f"  {title:<18} {r['tab_title_s']:>14.2f}s {r['tab_complete_s']:>9.2f}s {ref['tab_complete_s']:>5.2f}s "
              f"{r['tab_complete_minus_floor_s']:>+7.2f}s  {ok:<41} {r['nav_title_s']:>20.2f}s {r['nav_complete_s']:>9.2f}s")
    slow = [t for t, r in result["pages"].items() if not r["target_met"]]
    print(f"  new-tab target: {'every page ok' if not slow else 'SLOW: ' + ', '.join(slow)}")
    if ref["tab_complete_s"] > FLOOR_WARN_SHARE * TARGET_S:
        print(f"  note: the one-line app alone took {ref['tab_complete_s']:.2f} s in these rounds (Streamlit and this "
              f"machine's load): the target leaves a page {TARGET_S - ref['tab_complete_s']:+.2f} s above that floor")
    d = result["row_to_browser_s"]
    ok = "ok" if d["median"] <= TARGET_S else "SLOW"  # issue 6
    print(f"Metric row written to SQLite -> visible on Launch & monitor: median {d['median']:.2f} s, "
          f"max {d['max']:.2f} s over {args.rows} rows  {ok}")
    c = result["live_loss_chart"]
    print(f"Live loss chart drawn without its curve (a row every 0.25 s, sampled every ~50 ms): "
          f"{100 * c['blank_share']:.0f} % of {c['samples']} samples")
    return 0


if __name__ == "__main__":
    sys.exit(main())
