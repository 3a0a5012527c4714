"""Where GPUMix finds its files and keeps its data: profiles, runs, the job queue.

`PROJECT_ROOT` is the folder that holds the packages: a source checkout, or the
site-packages of an installed GPUMix (`pip install .`; workers are started with it on
PYTHONPATH either way). Data goes to `$GPUMIX_DATA_DIR` when set (tests point it at a
temporary folder); otherwise to `data/` of a source checkout, and for an installed
package, which must never write into site-packages, to `$XDG_DATA_HOME/gpumix`
(`~/.local/share/gpumix`). The example clusters and scenarios lie in the checkout's
`examples/`, or in the package as `gpumix/examples` (pyproject.toml). A path a dashboard user
types must lie under `allowed_roots()` (`confined_path`). See docs/DESIGN.md.
"""
from __future__ import annotations

import logging
import os

log = logging.getLogger(__name__)

PROJECT_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV_DATA_DIR = "GPUMIX_DATA_DIR"
ENV_ALLOWED_ROOTS = "GPUMIX_ALLOWED_ROOTS"  # more folders a typed path may name, joined by ':'
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


def allowed_roots() -> list[str]:
    """The folders a path typed in the dashboard may lie under, symlinks resolved: the data
    folder, the examples, and each absolute folder of GPUMIX_ALLOWED_ROOTS (a relative one would
    depend on the server's working directory: ignored, with a warning)."""
    roots = [data_dir(), EXAMPLES_DIR]
    for entry in os.environ.get(ENV_ALLOWED_ROOTS, "").split(os.pathsep):
        entry = os.path.expanduser(entry.strip())
        if not entry:
            continue
        if not os.path.isabs(entry):
            log.warning("%s: ignoring %r, not an absolute path", ENV_ALLOWED_ROOTS, entry)
            continue
        roots.append(entry)
    return list(dict.fromkeys(os.path.realpath(r) for r in roots))


def confined_path(path: str, what: str = "path") -> str:
    """`path` with `~` expanded and symlinks resolved, if it lies under one of `allowed_roots()`;
    otherwise ValueError, one line naming the path and how to allow it. Nothing is read here."""
    text = path.strip()
    if not text:
        raise ValueError(f"{what}: empty path")
    real = os.path.realpath(os.path.expanduser(text))
    for root in allowed_roots():
        if os.path.commonpath([real, root]) == root:
            return real
    raise ValueError(f"{what} {text!r} is outside the folders the dashboard may read (the data folder, the "
                     f"examples, {ENV_ALLOWED_ROOTS}): add its folder to {ENV_ALLOWED_ROOTS} when you start it")
