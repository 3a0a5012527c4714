"""Where GPUMix finds its files and keeps its data: profiles, runs, the job queue.

`PROJECT_ROOT` is the folder that holds the packages: a source checkout, or the
site-packages of an installed GPUMix (`pip install .`; workers are started with it on
PYTHONPATH either way). Data goes to `$GPUMIX_DATA_DIR` when set (tests point it at a
temporary folder); otherwise to `data/` of a source checkout, and for an installed
package, which must never write into site-packages, to `$XDG_DATA_HOME/gpumix`
(`~/.local/share/gpumix`). The example clusters and scenarios lie in the checkout's
`examples/`, or in the package as `gpumix/examples` (pyproject.toml). See docs/DESIGN.md.
"""
from __future__ import annotations

import os

PROJECT_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV_DATA_DIR = "GPUMIX_DATA_DIR"
# A checkout has its pyproject.toml beside the packages; an installed package does not.
SOURCE_CHECKOUT = os.path.isfile(os.path.join(PROJECT_ROOT, "pyproject.toml"))
EXAMPLES_DIR = os.path.join(PROJECT_ROOT, *(("examples",) if SOURCE_CHECKOUT else ("gpumix", "examples")))


def default_data_dir() -> str:
    """The data folder when GPUMIX_DATA_DIR is not set (see the module docstring)."""
    if SOURCE_CHECKOUT:
        return os.path.join(PROJECT_ROOT, "data")
    xdg = os.environ.get("XDG_DATA_HOME", "")
    if not os.path.isabs(xdg):  # unset, or relative: the XDG spec says to ignore it
        xdg = os.path.join(os.path.expanduser("~"), ".local", "share")
    return os.path.join(xdg, "gpumix")


def data_dir() -> str:
    path = os.environ.get(ENV_DATA_DIR) or default_data_dir()
    os.makedirs(path, exist_ok=True)
    return path


def sub_dir(name: str) -> str:
    path = os.path.join(data_dir(), name)
    os.makedirs(path, exist_ok=True)
    return path


def profiles_dir() -> str:
    return sub_dir("profiles")


def runs_dir() -> str:
    return sub_dir("runs")


def clusters_dir() -> str:
    return sub_dir("clusters")


def queue_db_path() -> str:
    return os.path.join(data_dir(), "queue.sqlite")
