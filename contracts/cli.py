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
import logging
import math
import os
import re
import sys
from typing import Any, Callable, Sequence

from contracts.jsonio import dumps

EXIT_BAD_INPUT = 2


# No count, size or length GPUMix handles comes near this: larger is a typo, refused at the door.
MAX_ARG_VALUE = 10**12


def int_arg(low: int = 1, high: int = MAX_ARG_VALUE) -> Callable[[str], int]:
    """An argparse `type=`: an integer in [low, high]; anything else is refused with one line."""
    def parse(text: str) -> int:
        try:
            value = int(text.strip())
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"must be in [{low}, {high}], got {value}")
        return value

    parse.__name__ = "integer"
    return parse


def float_arg(low: float = 0.0, high: float = float(MAX_ARG_VALUE), low_open: bool = False) -> Callable[[str], float]:
    """An argparse `type=`: a finite number in [low, high] ((low, high] with low_open); NaN/inf refused."""
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        if not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"must be a finite number, got {text!r}")
        if value < low or value > high or (low_open and value == low):
            raise argparse.ArgumentTypeError(f"must be in {'(' if low_open else '['}{low:g}, {high:g}], got {value:g}")
        return value

    parse.__name__ = "number"
    return parse


_DEVICE = re.compile(r"(cpu|cuda|mps)(:\d{1,3})?")


def device_arg(text: str) -> str:
    """An argparse `type=` for a torch device name (checked as text: the planner has no torch)."""
    if not _DEVICE.fullmatch(text.strip()):
        raise argparse.ArgumentTypeError(f"expected a torch device like cpu, cuda or cuda:1, got {text!r}")
    return text.strip()


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # argparse's own errors: one line, code 2
        sys.stderr.write(f"{self.prog}: error: {message}\n")
        raise SystemExit(EXIT_BAD_INPUT)


def print_json(obj: Any) -> None:
    """One strict JSON object on stdout: NaN/inf become null (planner/jsonio.dumps)."""
    print(dumps(obj))


def print_table(rows: list[dict[str, Any]], columns: Sequence[str] | None = None) -> None:
    """Plain fixed-width table for the human-readable default output."""
    if not rows:
        print("(none)")
        return
    columns = list(columns or rows[0].keys())

    def fmt(v: Any) -> str:
        if v is None:
            return "-"  # not measured (yet): never Python's None in a table a person reads
        if isinstance(v, float):
            return f"{v:.4g}" if math.isfinite(v) else "-"
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
    except (ValueError, FileNotFoundError, OverflowError) as e:
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        sys.stderr.write(f"{prog} {args.command}: error: {msg}\n")
        return EXIT_BAD_INPUT
    except RecursionError:  # json's decoder on a file of 100,000 nested brackets
        sys.stderr.write(f"{prog} {args.command}: error: an input file is nested too deeply to be a GPUMix file\n")
        return EXIT_BAD_INPUT
    except MemoryError:  # an input too large for this machine: say so, never a traceback
        sys.stderr.write(f"{prog} {args.command}: error: out of memory (the input is too large for this machine)\n")
        return EXIT_BAD_INPUT
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # `... | head`: the reader left; no traceback, no second error at exit
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
