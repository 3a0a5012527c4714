"""`gpumix dashboard` (what scripts/dashboard.sh runs) started from a folder that has no
.streamlit/config.toml: it listens on 127.0.0.1 only, prints its URL with the access token, and
hands the token to the server in its environment, never in its arguments (`ps` shows those)."""
from __future__ import annotations

import os
import re
import subprocess
import sys
import urllib.request

import psutil

from contracts.secrets import ENV_DASHBOARD_TOKEN
from testkit import ROOT
from testkit.processes import free_port, kill_processes_with_data_dir
from testkit.wait import wait_until

URL_RE = re.compile(r"http://localhost:(\d+)/\?token=([A-Za-z0-9_-]+)")


def test_dashboard_from_another_folder_listens_on_localhost_only(data_dir, tmp_path):
    port = free_port()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = {k: v for k, v in os.environ.items() if k != ENV_DASHBOARD_TOKEN}
    env.update({"GPUMIX_DATA_DIR": data_dir, "PYTHONPATH": ROOT})
    log_path = tmp_path / "dashboard.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "gpumix", "dashboard", "--server.port", str(port)],
                                cwd=elsewhere, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_until(lambda: urllib.request.urlopen(f"http://127.0.0.1:{port}/_stcore/health", timeout=5).read() == b"ok",
                   90, "the dashboard to answer", ignore=(OSError,), detail=lambda: log_path.read_text())
        m = URL_RE.search(log_path.read_text())
        assert m and int(m.group(1)) == port, log_path.read_text()
        token = m.group(2)
        server = psutil.Process(proc.pid)  # gpumix became streamlit (exec)
        listening = [c.laddr for c in server.net_connections(kind="inet") if c.status == psutil.CONN_LISTEN]
        assert listening and all(addr.ip == "127.0.0.1" for addr in listening), listening
        assert not any(token in arg for arg in server.cmdline())
        assert server.environ().get(ENV_DASHBOARD_TOKEN) == token
    finally:
        kill_processes_with_data_dir(data_dir)
        proc.wait(timeout=30)
