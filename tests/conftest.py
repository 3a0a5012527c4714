"""Shared pytest fixtures and markers; the helpers themselves are plain functions in testkit/.

- Every test gets its own GPUMIX_DATA_DIR (a tmp folder), so no test writes into data/.
  Use the `data_dir` fixture to get its path.
- Every test's dashboard has the access token testkit.dashboard.TOKEN, and every AppTest
  session opens with it (`?token=`), as a browser on the URL printed at start does.
- `postgres_server` (one per session) and `store_backend` (a test run on SQLite and on
  PostgreSQL) wrap testkit/postgres.py; `slurm_cluster` (one per session) wraps testkit/slurm.py.
  Each skips, with the reason, where the platform cannot run it.
- Markers (pytest.ini): `unit` and `e2e` by folder (tests/unit: no process started;
  tests/e2e: processes, servers, browsers); `browser` (files test_browser_*.py), `slurm`
  (tests using slurm_cluster) and `postgres` (tests using PostgreSQL) are set here too.
  `bash scripts/test.sh --fast` runs tests/unit; `bash scripts/test.sh -m "not browser"` and the
  like select by kind.
"""
from __future__ import annotations

import os
import sys
from typing import Iterator

import pytest

from contracts.paths import ENV_DATA_DIR
from contracts.secrets import ENV_DASHBOARD_TOKEN, TOKEN_PARAM
from testkit.dashboard import TOKEN
from testkit.postgres import BACKENDS, PostgresServer, init_store, running_postgres, unavailable
from testkit.slurm import SlurmCluster, platform_problem, running_slurm_cluster

KIND_BY_FOLDER = {"unit": "unit", "e2e": "e2e"}


@pytest.fixture(autouse=True)
def data_dir(tmp_path, monkeypatch) -> str:
    """A fresh GPUMIX_DATA_DIR for every test (contracts/paths.py reads it on each call)."""
    path = str(tmp_path / "gpumix-data")
    os.makedirs(path, exist_ok=True)
    monkeypatch.setenv(ENV_DATA_DIR, path)
    monkeypatch.delenv("GPUMIX_DB", raising=False)  # a developer's shared store never reaches a test
    return path


@pytest.fixture(autouse=True)
def dashboard_token(monkeypatch) -> str:
    """app.py's access token for this test, given to every AppTest session (tests that check the
    refusal take it out of `at.query_params`). AppTest is patched only where a test imported it."""
    monkeypatch.setenv(ENV_DASHBOARD_TOKEN, TOKEN)
    app_test = getattr(sys.modules.get("streamlit.testing.v1.app_test"), "AppTest", None)
    if app_test is not None:
        init = app_test.__init__

        def with_token(self, *args, **kwargs):
            init(self, *args, **kwargs)
            self.query_params[TOKEN_PARAM] = TOKEN

        monkeypatch.setattr(app_test, "__init__", with_token)
    return TOKEN


_MAIN = sys.modules["__main__"]


@pytest.fixture(autouse=True)
def restore_main_module() -> Iterator[None]:
    """Streamlit's script runner (AppTest) installs the page's script as `__main__` and leaves it
    there; a later `torch.multiprocessing` spawn would re-run that script in every child. Put
    pytest's own `__main__` back after each test."""
    yield
    sys.modules["__main__"] = _MAIN


@pytest.fixture(scope="session")
def postgres_server() -> Iterator[PostgresServer]:
    """A PostgreSQL server of our own for the whole session (fsync off: tests only)."""
    reason = unavailable()
    if reason is not None:
        pytest.skip(reason)
    with running_postgres() as server:
        yield server


@pytest.fixture(params=BACKENDS)
def store_backend(request, monkeypatch) -> str:
    """The test runs twice: on the embedded SQLite files (GPUMIX_DB unset) and on a fresh
    PostgreSQL database (GPUMIX_DB set, schema initialised). Returns the backend's name."""
    monkeypatch.delenv("GPUMIX_DB", raising=False)
    if request.param == "postgresql":
        server = request.getfixturevalue("postgres_server")
        monkeypatch.setenv("GPUMIX_DB", server.create_database())
        init_store()
    return request.param


@pytest.fixture(scope="session")
def slurm_cluster() -> Iterator[SlurmCluster]:
    """A real two-node SLURM cluster on this machine for the whole session."""
    problem = platform_problem()
    if problem:
        pytest.skip(problem)
    with running_slurm_cluster() as cluster:
        yield cluster


def kinds(item: pytest.Item) -> list[str]:
    """The markers of kind that `item` gets from where it lives and what it uses."""
    path = item.path
    found = [KIND_BY_FOLDER[path.parent.name]] if path.parent.name in KIND_BY_FOLDER else []
    if path.name.startswith("test_browser_"):
        found.append("browser")
    names = set(getattr(item, "fixturenames", ()))
    if "slurm_cluster" in names:
        found.append("slurm")
    params = getattr(getattr(item, "callspec", None), "params", {})
    if "postgres_server" in names or params.get("store_backend") == "postgresql":
        found.append("postgres")
    return found


def pytest_collection_modifyitems(config, items) -> None:
    for item in items:
        for kind in kinds(item):
            item.add_marker(kind)
