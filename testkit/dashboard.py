"""The real dashboard in a real browser, for the browser tests and bench/dashboard_latency.py.

- `streamlit_server(data_dir)` starts `streamlit run app.py` on a free localhost port with
  GPUMIX_DATA_DIR=data_dir and the access token TOKEN, and stops it (and, by default, every
  process started with that data dir: a launched run's torchrun group included) when the block
  ends. `page_url(url, "plan")` is a page's address with the token, as a user opens it.
- `launch_browser(playwright)` opens Debian's headless Chromium (never a downloaded build);
  `wait_idle(page)` waits until a load or a click has finished and everything has drawn.
"""
from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import urllib.request
from typing import Any, Iterator

from contracts.paths import ENV_DATA_DIR
from contracts.secrets import ENV_DASHBOARD_TOKEN, TOKEN_PARAM
from testkit import ROOT
from testkit.processes import free_port, kill_processes_with_data_dir
from testkit.wait import wait_until
from ui import plotly_component

CHROMIUM = "/usr/bin/chromium"
TOKEN = "test-dashboard-token"  # every test dashboard's access token (app.py lets no one in without one)
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


def _wait_healthy(url: str, proc: subprocess.Popen, timeout_s: float) -> None:
    def healthy() -> bool:
        if proc.poll() is not None:
            raise RuntimeError(f"streamlit exited with code {proc.returncode} before serving")
        with urllib.request.urlopen(f"{url}/_stcore/health", timeout=2) as r:
            return r.status == 200

    wait_until(healthy, timeout_s, f"streamlit to answer on {url}", ignore=(OSError,))


def page_url(url: str, path: str = "", token: str = TOKEN) -> str:
    """The address of the dashboard page `path` ("" the landing page, "plan", ...) with the access token."""
    return f"{url}/{path}?{TOKEN_PARAM}={token}"


@contextlib.contextmanager
def streamlit_server(data_dir: str, app: str = "app.py", timeout_s: float = 60.0,
                     kill_everything: bool = True) -> Iterator[str]:
    """Run `streamlit run app` on a free port with GPUMIX_DATA_DIR=data_dir and the access token
    TOKEN (in its environment); yield its URL (without the token: open pages with `page_url`).

    The server's log goes to <data_dir>/streamlit.log. On exit the server's process
    group is killed and, with `kill_everything`, every process carrying this data dir in
    its environment too; without it a run the app launched (its own session) survives,
    as it does when a user restarts the app."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = dict(os.environ, **{ENV_DATA_DIR: data_dir, ENV_DASHBOARD_TOKEN: TOKEN, "PYTHONUNBUFFERED": "1"})
    cmd = [
        sys.executable, "-m", "streamlit", "run", app,
        "--server.port", str(port),
        "--server.address", "127.0.0.1",
        "--server.headless", "true",
        "--server.fileWatcherType", "none",
        "--browser.gatherUsageStats", "false",
    ]
    log_path = os.path.join(data_dir, "streamlit.log")
    with open(log_path, "ab") as log_file:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log_file, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        _wait_healthy(url, proc, timeout_s)
        yield url
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
        if kill_everything:
            kill_processes_with_data_dir(data_dir)


def server_log(data_dir: str) -> str:
    try:
        with open(os.path.join(data_dir, "streamlit.log"), encoding="utf-8", errors="replace") as fh:
            return fh.read()[-4000:]
    except OSError:
        return ""


STEPS_RE = re.compile(r"Steps recorded:\s*(\d+)")  # the live line of ui/launch.py
WAIT_MS = 30_000  # one page or one widget reaction on a loaded 2-core machine


# Every chart is a `div.gpumix-chart` of ui/plotly_component that holds Plotly's SVG once drawn.
CHART_SELECTOR = f"div.{plotly_component.CHART_CLASS}"
CHARTS_JS = "() => document.querySelectorAll('%s').length" % CHART_SELECTOR


def in_chart_js(key: str, selector: str) -> str:
    """A JS expression: the element matching `selector` inside the chart that `show_figure` drew
    with `key` (Plotly's SVG: '.main-svg .scatterlayer .trace'), or null."""
    return f"document.querySelector('.st-key-{key} {CHART_SELECTOR} {selector}')"


# The page is idle and drawn: connected, no script run going (Streamlit's own e2e tests read these
# attributes of stApp), no loading skeleton left (lazy JS chunks: charts, tables), every Plotly
# chart drawn.
RENDERED_JS = """() => {
  const app = document.querySelector('[data-testid="stApp"]');
  return !!app && app.dataset.testConnectionState === 'CONNECTED'
    && app.dataset.testScriptState === 'notRunning'
    && !document.querySelector('[data-testid="stSkeleton"]')
    && [...document.querySelectorAll('%s')].every(c => !!c.querySelector('.main-svg'));
}""" % CHART_SELECTOR


def wait_idle(page: Any, timeout_ms: int = WAIT_MS) -> None:
    """Until the script run that a load or a click started has finished and everything has drawn."""
    page.wait_for_timeout(100)  # let a click's rerun request reach the client's state first
    page.wait_for_function(RENDERED_JS, timeout=timeout_ms, polling="raf")


def steps_recorded(page: Any, timeout_ms: int = WAIT_MS) -> int:
    loc = page.get_by_text(STEPS_RE).first
    loc.wait_for(timeout=timeout_ms)
    m = STEPS_RE.search(loc.inner_text())
    return int(m.group(1)) if m else -1


def launch_browser(playwright: Any) -> Any:
    """Debian's Chromium, headless, driven by playwright (no browser download)."""
    return playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
