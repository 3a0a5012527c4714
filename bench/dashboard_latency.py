"""Dashboard latency, measured in real headless Chromium against the real app.

1. Time to first render of each page: a fresh browser session opens the page's URL;
   we time until its title is on screen ("title") and until the script run has
   finished ("complete"). The first load of all (the cold one: JS bundle, imports) is
   reported apart; the table gives the median of `--loads` later loads.
2. Metric row -> browser: a running run (fabricated: plan.json + metrics.sqlite written
   through executor.store.MetricsStore, "launched" by this process so the store calls it
   running) is open on Launch & monitor; we write one step row and time until the page
   shows the new "Steps recorded: N". Median over `--rows` rows, written at random
   phases of the page's refresh period.

Target (issue 6): both <= 2 s. Run: python bench/dashboard_latency.py [--loads 3 --rows 8 --json]
"""
from __future__ import annotations

import argparse
import json
import os
import random
import re
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from executor.store import MetricsStore  # noqa: E402
from planner.paths import ENV_DATA_DIR  # noqa: E402
from tests.conftest import fabricate_run, launch_browser, streamlit_server, wait_idle, write_step  # noqa: E402

TARGET_S = 2.0
PAGES = {"Inventory": "inventory", "Model & memory": "memory", "Plan": "plan", "Launch & monitor": "launch",
         "Runs": "runs", "Scheduler": "scheduler", "Geo": "geo"}
FIRST_STEPS = 3  # rows the fabricated run has when the page opens
PAGE_TIMEOUT_MS = 60_000


def time_page_load(browser, url: str) -> tuple[float, float]:
    """(seconds to the page title, seconds to the end of the script run) in a fresh session."""
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    try:
        t0 = time.perf_counter()
        page.goto(url, wait_until="commit")
        page.locator('[data-testid="stMain"] h1').first.wait_for(timeout=PAGE_TIMEOUT_MS)
        t_title = time.perf_counter() - t0
        wait_idle(page, PAGE_TIMEOUT_MS)
        return t_title, time.perf_counter() - t0
    finally:
        page.close()


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
        with streamlit_server(data_dir) as url, sync_playwright() as pw:
            browser = launch_browser(pw)
            try:
                cold_title, cold_done = time_page_load(browser, f"{url}/{PAGES['Inventory']}")
                result["cold_first_load"] = {"page": "Inventory", "title_s": cold_title, "complete_s": cold_done}
                for title, path in PAGES.items():
                    samples = [time_page_load(browser, f"{url}/{path}") for _ in range(args.loads)]
                    result["pages"][title] = {
                        "title_s": statistics.median(s[0] for s in samples),
                        "complete_s": statistics.median(s[1] for s in samples),
                    }
                delays = time_rows(browser, url, store, first_step=FIRST_STEPS, rows=args.rows)
                result["row_to_browser_s"] = {"median": statistics.median(delays), "max": max(delays),
                                              "samples": delays}
            finally:
                browser.close()
    finally:
        store.finish("stopped", "benchmark finished")
        store.close()

    if args.json:
        print(json.dumps(result))
        return 0
    print(f"Dashboard latency (headless Chromium, median of {args.loads} warm loads per page; target <= {TARGET_S:g} s)")
    c = result["cold_first_load"]
    print(f"  cold first load of the app (Inventory): title {c['title_s']:.2f} s, complete {c['complete_s']:.2f} s")
    print(f"  {'page':<18} {'title (s)':>10} {'complete (s)':>13}  target")
    for title, r in result["pages"].items():
        ok = "ok" if r["complete_s"] <= TARGET_S else "SLOW"
        print(f"  {title:<18} {r['title_s']:>10.2f} {r['complete_s']:>13.2f}  {ok}")
    d = result["row_to_browser_s"]
    ok = "ok" if d["median"] <= TARGET_S else "SLOW"
    print(f"Metric row written to SQLite -> visible on Launch & monitor: median {d['median']:.2f} s, "
          f"max {d['max']:.2f} s over {args.rows} rows  {ok}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
