"""`gpumix planner|profiler|executor COMMAND ...`: a tool's command, named by its tool.

The three tools' sub-command tables are their `__main__.COMMANDS`, imported here and
never copied; gpumix/cli.py merges them into the top-level command list.
"""
from __future__ import annotations

import argparse

from contracts import cli
from executor.__main__ import COMMANDS as EXECUTOR
from planner.__main__ import COMMANDS as PLANNER
from profiler.__main__ import COMMANDS as PROFILER

TOOLS = {"planner": PLANNER, "profiler": PROFILER, "executor": EXECUTOR}
HELP = "a command named by its tool: gpumix planner|profiler|executor COMMAND ..."


def add_arguments(parser: argparse.ArgumentParser) -> None:
    tool = parser.prog.split()[-1]  # the sub-command's own name: planner, profiler or executor
    parser.add_argument("args", nargs=argparse.REMAINDER, metavar="COMMAND ...",
                        help=f"one of {', '.join(TOOLS[tool])}, and its flags ({parser.prog} COMMAND --help)")


def run(args: argparse.Namespace) -> int:
    return cli.main(f"gpumix {args.command}", TOOLS[args.command], args.args)
