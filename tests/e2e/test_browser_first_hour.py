"""A new user's first run, in a real browser, on a mixed cluster any laptop has.

From an empty data folder: Inventory -> the one-click emulated mixed cluster (one CPU worker at a
full core, one at a third of a core with 2 GiB, held there by cgroups) -> Plan, where the page
says the figures are estimates and offers the one click that profiles both device kinds together,
each under its own limits, and plans again -> the plan splits unevenly -> Launch, watch the run to its end
-> the page's measured step within a factor of two of its prediction (the 15 % target is bench/hetero_speedup.py's) -> "Measure the even split" -> the
page shows the planned split measured faster than the even one. The figures asserted on are the
ones the page shows, checked against the runs' metrics stores. The prediction comes from the
profiles the page took (the planner's cost model), the measurement from the runs (the executor):
independent paths, and the profiles are taken in this test, under the load the runs see.

Screenshots: artifacts/screenshots/2*-first-hour-*.png. Global batch 192 (bench/hetero_speedup.py's): a planned step of about half a second, many CPU
quota periods (10 ms), with the collectives a small part of it. Every process the test started
is gone at the end. Skipped only where cgroups are unavailable (profiler.cgroups).
"""
from __future__ import annotations

import os
import re
import statistics
import time

import pytest

from profiler import cgroups
# its helpers, and its skips where playwright or Debian's chromium is missing
from tests.e2e.test_browser_e2e import assert_no_exception, click_key, fill_number, open_page, shot
from testkit.dashboard import WAIT_MS, launch_browser, page_url, server_log, streamlit_server, wait_idle
from testkit.processes import kill_processes_with_data_dir, processes_with_data_dir
from testkit.wait import page_pause, wait_until

_WHY = cgroups.unavailable_reason()
if _WHY is not None:
    pytest.skip(f"the emulated mixed cluster needs cgroups: {_WHY}", allow_module_level=True)
from playwright.sync_api import Page, sync_playwright  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.timeout(360)]

GLOBAL_BATCH = 192
PLANNED_STEPS = 10  # the median of steps 3..10: 8 steps after the warm-up
EVEN_STEPS = 7  # 5 steps after the warm-up, each about twice as long (the speedup is far from 1)
# A sanity bound, not the speed target: the 15 % agreement of a planned run with its prediction is a
# benchmark's check (bench/hetero_speedup.py, medians over rounds on a quiet machine). Here one profile
# taken in the test (each kind's micro-batches timed a few times, β noise 8-30 %, beside the browser)
# predicts a 10-step run a minute later on a shared 2-core virtual machine: this test printed
# +29.7 %, -34.1 % and +45.9 % (CI) on one day. A factor of two still catches a plan priced wrongly
# (the wrong micro-batch count, device or units).
MAX_RATIO = 2.0
PROFILE_TIMEOUT_S = 240  # two kinds, each under its quota beside a companion, on a loaded 2-core machine
RUN_TIMEOUT_S = 180
SECONDS = r"([0-9][0-9,.]*) (µs|ms|s)\b"
UNITS = {"µs": 1e-6, "ms": 1e-3, "s": 1.0}


def seconds(value: str, unit: str) -> float:
    return float(value.replace(",", "")) * UNITS[unit]


def shown(value: str, unit: str) -> float:
    """Half the last digit the page shows ("1.07 s": 0.005 s): how far a shown figure may be from the stored one."""
    decimals = len(value.split(".")[1]) if "." in value else 0
    return 0.5 * 10.0 ** -decimals * UNITS[unit] * (1 + 1e-9)


# the cells of an interactive grid (glide draws on a canvas; its ARIA grid has the text), or of a
# static st.table (HTML): (table, header cell, body row, body cell)
TABLES = (('[data-testid="stDataFrame"]', '[role="columnheader"]', '[role="row"]:has([role="gridcell"])',
           '[role="gridcell"]'),
          ('[data-testid="stTable"]', "thead th", "tbody tr", "th, td"))  # th: a row header under a header cell


def table_column(page: Page, header: str) -> list[str]:
    """The cells of one column of the page's first table, once it has drawn its headers (a grid
    redraws after a rerun)."""
    def column() -> tuple[list[str]] | None:
        for table, head, row, cell in TABLES:
            grid = page.locator(f'[data-testid="stMain"] {table}').first
            headers = [h.strip() for h in grid.locator(head).all_inner_texts()] if grid.count() else []
            cols = [i for i, h in enumerate(headers) if h.startswith(header)]
            if cols:
                rows = grid.locator(row)
                return ([rows.nth(i).locator(cell).nth(cols[0]).inner_text().strip() for i in range(rows.count())],)
        return None

    return wait_until(column, WAIT_MS / 1000, f"a table with a column {header!r} on the page", interval_s=0.25,
                      pause=page_pause(page))[0]


def iteration_shown(page: Page) -> str:
    """The plan's predicted iteration time as the Plan page shows it (its first metric)."""
    return page.locator('[data-testid="stMetricValue"]').first.inner_text()


def main_text(page: Page) -> str:
    return page.locator('[data-testid="stMain"]').inner_text()


def wait_text(page: Page, pattern: str, timeout_s: float) -> re.Match:
    """Until the page's main area shows `pattern` (the live panel redraws every second)."""
    # polled every 2 s: reading the whole page's text (Plotly's SVG included) costs the browser and the driver
    # CPU that would fall inside the profile and the runs this test measures
    return wait_until(lambda: re.search(pattern, main_text(page)), timeout_s, f"the page to show /{pattern}/",
                      interval_s=2.0, pause=page_pause(page))


def store_median(run_dir: str) -> tuple[float, float, int]:
    """(median step over steps 3.., predicted iteration, steps counted) from the run's own store."""
    from executor.store import read_metrics

    m = read_metrics(run_dir)
    assert m["status"] == "done", (run_dir, m["status"], m["reason"])
    times = [s["step_s"] for s in m["steps"][2:]]
    return statistics.median(times), m["predicted_iteration_s"], len(times)


def test_first_hour_mixed_cluster_plan_launch_and_the_even_split(data_dir):
    from executor.store import read_metrics

    runs_root = os.path.join(data_dir, "runs")
    assert sorted(os.listdir(data_dir)) == []  # an empty data folder: no profile, no run
    t0 = time.monotonic()

    def done(what: str) -> None:  # phase times, shown with -s
        print(f"  {time.monotonic() - t0:6.1f} s  {what}  (load {os.getloadavg()[0]:.1f})")

    with sync_playwright() as pw:
        browser = launch_browser(pw)
        page = browser.new_page(viewport={"width": 1400, "height": 2200})
        try:
            with streamlit_server(data_dir) as url:
                try:
                    # 1. Inventory: one click for the emulated mixed cluster
                    page.goto(page_url(url))
                    page.get_by_role("heading", name=re.compile("inventory", re.I)).first.wait_for(timeout=60_000)
                    wait_idle(page, 60_000)
                    click_key(page, "inv_emulated_mixed")
                    wait_idle(page, 60_000)
                    page.get_by_text("emulated-mixed").first.wait_for(timeout=WAIT_MS)
                    assert_no_exception(page, "Inventory")
                    done("emulated mixed cluster chosen")

                    # 2. Plan: estimated at first, then the one click that profiles both kinds and plans again
                    open_page(page, "Plan")
                    wait_idle(page, 60_000)
                    fill_number(page, "plan_global_batch", GLOBAL_BATCH)
                    click_key(page, "plan_compute")
                    page.locator(".st-key-plan_profile_now button").wait_for(timeout=60_000)
                    # the page fully drawn before the click, as a user sees it: the estimated plan's Plotly
                    # charts cost the browser about a second of CPU, which would fall inside the profile
                    wait_idle(page, 60_000)
                    assert "Estimated, not measured" in main_text(page)
                    done("estimated plan, profile button offered")
                    estimated_iteration = iteration_shown(page)
                    click_key(page, "plan_profile_now")
                    # profiled, then solved again: the estimate's warning and button gone, no solve
                    # pending, and the iteration time the new (measured) plan's
                    wait_until(lambda: not ("Estimated, not measured" in main_text(page)
                                            or "Solving the plan" in main_text(page)
                                            or page.locator(".st-key-plan_profile_now").count()
                                            or iteration_shown(page) == estimated_iteration),
                               PROFILE_TIMEOUT_S, "a measured plan after profiling", interval_s=2.0,
                               pause=page_pause(page))
                    wait_idle(page, 60_000)
                    assert_no_exception(page, "Plan after profiling")
                    batches = [int(b) for b in table_column(page, "batch")]
                    assert sum(batches) == GLOBAL_BATCH and len(batches) == 2, batches
                    assert batches[0] > batches[1], f"the full core should get more of the batch: {batches}"
                    shot(page, "20-first-hour-plan")
                    done(f"measured plan, split {batches}")

                    # 3. Launch and watch the run to its end
                    open_page(page, "Launch & monitor")
                    wait_idle(page, 60_000)
                    fill_number(page, "launch_steps", PLANNED_STEPS)
                    click_key(page, "launch_button")
                    wait_text(page, r"Run status:\s*done", RUN_TIMEOUT_S)
                    (planned_name,) = os.listdir(runs_root)
                    planned_dir = os.path.join(runs_root, planned_name)
                    done(f"planned run {planned_name} done")

                    # 4. the page's measured step against its prediction
                    gap = wait_text(page, rf"Measured median step {SECONDS} against {SECONDS} predicted", 30)
                    page_measured, page_predicted = seconds(*gap.group(1, 2)), seconds(*gap.group(3, 4))

                    # 5. the even split, measured the same way
                    fill_number(page, "launch_even_steps", EVEN_STEPS)
                    click_key(page, "launch_measure_even")
                    page.locator(".st-key-launch_compare_figures").wait_for(timeout=RUN_TIMEOUT_S * 1000)
                    figures = page.locator(".st-key-launch_compare_figures").inner_text()
                    assert_no_exception(page, "Launch after the even split")
                    shot(page, "21-first-hour-launch-vs-even")
                    done("even split measured")
                except BaseException:
                    shot(page, "29-first-hour-failure")
                    print(server_log(data_dir))
                    raise
        finally:
            browser.close()
            kill_processes_with_data_dir(data_dir)
    print(figures)

    # what the page showed is what the runs recorded
    measured, predicted, n = store_median(planned_dir)
    even_measured, even_predicted, even_n = store_median(planned_dir + "-even")
    assert page_measured == pytest.approx(measured, abs=shown(*gap.group(1, 2)))
    assert page_predicted == pytest.approx(predicted, abs=shown(*gap.group(3, 4)))
    m = re.search(rf"planned split {SECONDS} \((\d+) steps\), even split {SECONDS} \((\d+) steps\): the planned "
                  r"split is ([0-9.]+)× as fast", figures)
    assert m, figures
    assert seconds(*m.group(1, 2)) == pytest.approx(measured, abs=shown(*m.group(1, 2)))
    assert int(m.group(3)) == n == PLANNED_STEPS - 2
    assert seconds(*m.group(4, 5)) == pytest.approx(even_measured, abs=shown(*m.group(4, 5)))
    assert int(m.group(6)) == even_n == EVEN_STEPS - 2
    speedup = float(m.group(7))
    assert speedup == pytest.approx(even_measured / measured, abs=shown(m.group(7), "s"))
    per_step = [round(s["step_s"], 3) for s in read_metrics(planned_dir)["steps"]]
    context = (f"planned measured {measured:.4f} s vs predicted {predicted:.4f} s, even {even_measured:.4f} s "
               f"(predicted {even_predicted:.4f} s), load {os.getloadavg()}, planned steps {per_step}")
    # the first run agrees with its prediction, and the planned split beats the even one
    print(f"first hour: prediction error {(measured - predicted) / predicted:+.1%}")
    assert max(measured / predicted, predicted / measured) <= MAX_RATIO, context
    assert speedup > 1.0 and even_measured > measured, context
    assert processes_with_data_dir(data_dir) == []  # the server, its profilers, both launchers and their ranks
    print(f"first hour: {time.monotonic() - t0:.1f} s; {context}")
