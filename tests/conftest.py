"""Shared test fixtures.

- Every test gets its own GPUMIX_DATA_DIR (a tmp folder), so no test writes into data/.
  Use the `data_dir` fixture to get its path.
- `streamlit_server(data_dir)` starts the real dashboard on a free localhost port and
  stops it — and every process started with that data dir (a launched run's torchrun
  group included) — when the block ends. The browser test and
  bench/dashboard_latency.py use it.
- `launch_browser(playwright)` opens Debian's headless Chromium (never a downloaded build).
"""
from __future__ import annotations

import contextlib
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from typing import Any, Iterator

import pytest

from contracts.paths import ENV_DATA_DIR

log = logging.getLogger(__name__)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CHROMIUM = "/usr/bin/chromium"
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


@pytest.fixture(autouse=True)
def data_dir(tmp_path, monkeypatch) -> str:
    """A fresh GPUMIX_DATA_DIR for every test (contracts/paths.py reads it on each call)."""
    path = str(tmp_path / "gpumix-data")
    os.makedirs(path, exist_ok=True)
    monkeypatch.setenv(ENV_DATA_DIR, path)
    monkeypatch.delenv("GPUMIX_DB", raising=False)  # a developer's shared store never reaches a test
    return path


# ---- fabricated runs: what the executor writes, through its own store API ---------------

GLOBAL_BATCH = 4
SEQ = 64
STEP_S = 0.25


def two_cpu_plan(slowdown: float = 1.0) -> Any:
    """A 2-rank plan of the tiny model on this machine; rank 1 emulated slower if slowdown != 1."""
    from contracts.cluster import ClusterSpec, DeviceSpec, NodeSpec
    from contracts.plan import Assignment, Plan

    dev = DeviceSpec("cpu", slowdown=slowdown)
    cluster = ClusterSpec("local", (NodeSpec("localhost", "local", (DeviceSpec("cpu"), dev)),))
    asg = (
        Assignment(0, "localhost", "cpu", 2, 1, 2, 0.5, 10**7, 0.1),
        Assignment(1, "localhost", "cpu", 1, 2, 2, 0.5, 10**7, 0.1, emulated=dev.emulated, slowdown=slowdown),
    )
    return Plan(cluster, "tiny", GLOBAL_BATCH, SEQ, "fp32", "none", asg, 0.1, 40.0)


def losses(offset: float, n: int) -> list[float]:
    return [offset + 4.0 / (1 + i) for i in range(n)]


def write_step(store: Any, step: int, loss: float) -> None:
    """One optimizer step as the ranks record it (rank rows first, then rank 0's step row)."""
    for rank in (0, 1):
        store.record_rank_step(rank, step, 0.2, 0.0, 0.01, 0.02, 5_000_000 + rank)
    store.record_step(step, loss, STEP_S, GLOBAL_BATCH, SEQ)


def fabricate_run(name: str, n_steps: int, status: str | None, slowdown: float = 1.0, loss_offset: float = 0.0,
                  root: str | None = None) -> str:
    """A run folder as the executor writes it: plan.json + metrics.sqlite through MetricsStore.
    status None leaves it running (its 'launcher' is this process, which is alive)."""
    from executor.store import MetricsStore
    from contracts.paths import runs_dir

    run_dir = os.path.join(root or runs_dir(), name)
    os.makedirs(run_dir)
    plan = two_cpu_plan(slowdown)
    plan.save(os.path.join(run_dir, "plan.json"))
    store = MetricsStore(run_dir)
    try:
        store.init_run(plan, steps_target=10_000, seed=0, backend="gloo")
        for step, loss in enumerate(losses(loss_offset, n_steps)):
            write_step(store, step, loss)
        if status is not None:
            store.finish(status)
    finally:
        store.close()
    return run_dir


# ---- the real dashboard in a real browser -------------------------------------------------


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_healthy(url: str, proc: subprocess.Popen, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"streamlit exited with code {proc.returncode} before serving")
        try:
            with urllib.request.urlopen(f"{url}/_stcore/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.2)
    raise TimeoutError(f"streamlit did not answer on {url} within {timeout_s:.0f} s")


def processes_with_data_dir(path: str) -> list[Any]:
    """Every live process of this user whose environment has GPUMIX_DATA_DIR=path: the
    server, and whatever it launched (torchrun and its ranks inherit the environment)."""
    import psutil

    found = []
    for p in psutil.process_iter(["pid"]):
        if p.pid == os.getpid():
            continue
        try:
            if p.environ().get(ENV_DATA_DIR) == path:
                found.append(p)
        except (psutil.Error, OSError):
            continue
    return found


def kill_processes_with_data_dir(path: str, grace_s: float = 5.0) -> int:
    """SIGTERM, then SIGKILL after `grace_s`, every process started with this data dir.
    Returns how many there were."""
    import psutil

    procs = processes_with_data_dir(path)
    for p in procs:
        with contextlib.suppress(psutil.Error):
            p.terminate()
    _, alive = psutil.wait_procs(procs, timeout=grace_s)
    for p in alive:
        with contextlib.suppress(psutil.Error):
            p.kill()
    psutil.wait_procs(alive, timeout=grace_s)
    return len(procs)


@contextlib.contextmanager
def streamlit_server(data_dir: str, app: str = "app.py", timeout_s: float = 60.0,
                     kill_everything: bool = True) -> Iterator[str]:
    """Run `streamlit run app` on a free port with GPUMIX_DATA_DIR=data_dir; yield its URL.

    The server's log goes to <data_dir>/streamlit.log. On exit the server's process
    group is killed and, with `kill_everything`, every process carrying this data dir in
    its environment too; without it a run the app launched (its own session) survives,
    as it does when a user restarts the app."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = dict(os.environ, **{ENV_DATA_DIR: data_dir, "PYTHONUNBUFFERED": "1"})
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


# The page is idle and drawn: connected, no script run going (Streamlit's own e2e tests read these
# attributes of stApp), and no loading skeleton left (lazy JS chunks: charts, tables).
RENDERED_JS = """() => {
  const app = document.querySelector('[data-testid="stApp"]');
  return !!app && app.dataset.testConnectionState === 'CONNECTED'
    && app.dataset.testScriptState === 'notRunning'
    && !document.querySelector('[data-testid="stSkeleton"]');
}"""


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
