"""A tiny sub-command dispatcher shared by the planner, profiler and executor CLIs.

Each sub-command is a module with `HELP: str`, `add_arguments(parser)` and
`run(args) -> int`. Modules are imported only when their command runs, so
`python -m planner memory` never pays for pulp or torch it does not need.
Bad input (a `ValueError` or `FileNotFoundError` raised anywhere) exits with
code 2 and one line naming the problem, never a traceback (DESIGN.md).
"""
from __future__ import annotations

import argparse
import importlib
import json
import logging
import os
import sys
from typing import Any, Sequence

EXIT_BAD_INPUT = 2


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # argparse's own errors: one line, code 2
        sys.stderr.write(f"{self.prog}: error: {message}\n")
        raise SystemExit(EXIT_BAD_INPUT)


def print_json(obj: Any) -> None:
    print(json.dumps(obj, indent=2, default=str))


def print_table(rows: list[dict[str, Any]], columns: Sequence[str] | None = None) -> None:
    """Plain fixed-width table for the human-readable default output."""
    if not rows:
        print("(none)")
        return
    columns = list(columns or rows[0].keys())

    def fmt(v: Any) -> str:
        if isinstance(v, float):
            return f"{v:.4g}"
        return str(v)

    cells = [[fmt(r.get(c, "")) for c in columns] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(columns)]
    print("  ".join(c.ljust(w) for c, w in zip(columns, widths)))
    for row in cells:
        print("  ".join(v.ljust(w) for v, w in zip(row, widths)))


def main(prog: str, commands: dict[str, str], argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = _Parser(prog=prog)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    # Only import the chosen command's module (and list the others by name).
    chosen = next((a for a in argv if not a.startswith("-")), None)
    for name, module in commands.items():
        if name == chosen:
            mod = importlib.import_module(module)
            p = sub.add_parser(name, help=mod.HELP)
            mod.add_arguments(p)
            p.set_defaults(_run=mod.run)
        else:
            sub.add_parser(name, help=f"(see {prog} {name} --help)")
    args = parser.parse_args(argv)
    if not getattr(args, "_run", None):
        parser.print_help()
        return EXIT_BAD_INPUT
    try:
        return int(args._run(args) or 0)
    except (ValueError, FileNotFoundError) as e:
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        sys.stderr.write(f"{prog} {args.command}: error: {msg}\n")
        return EXIT_BAD_INPUT
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # `... | head`: the reader left; no traceback, no second error at exit
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
