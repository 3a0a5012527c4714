"""The `gpumix` command: every sub-command of the planner, the profiler and the executor, and the dashboard.

`gpumix plan ...` is `python -m planner plan ...`, `gpumix launch ...` is `python -m executor launch
...`, and so for every sub-command of the three tools (gpumix/tools.py imports their tables). Where
two tools share a name the planner's comes first: `gpumix memory` is the planner's prediction, the
profiler's measurement is `gpumix profiler memory`; `gpumix planner|profiler|executor COMMAND` names
any command by its tool. `gpumix dashboard` starts the dashboard (gpumix/dashboard.py). The
`python -m planner|profiler|executor` forms stay. Installed by `pip install .` (pyproject.toml);
the commands' flags are in docs/DESIGN.md.
"""
from __future__ import annotations

import sys
from typing import Sequence

from contracts import cli
from gpumix.tools import EXECUTOR, PLANNER, PROFILER, TOOLS

PROG = "gpumix"


def first_wins(*tables: dict[str, str]) -> dict[str, str]:
    """The tables merged; a name that several tables hold keeps the first table's command."""
    merged: dict[str, str] = {}
    for table in tables:
        for name, module in table.items():
            merged.setdefault(name, module)
    return merged


COMMANDS = {**first_wins(PLANNER, PROFILER, EXECUTOR), "dashboard": "gpumix.dashboard",
            **dict.fromkeys(TOOLS, "gpumix.tools")}


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["dashboard"] and not {"-h", "--help"} & set(argv[1:2]):
        argv = ["dashboard", "--", *argv[1:]]  # Streamlit's own flags pass through, never parsed here
    return cli.main(PROG, COMMANDS, argv)
