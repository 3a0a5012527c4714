"""The CLI fuzz cases cover every command enough (the runs: tests/e2e/test_cli_fuzz.py)."""
from __future__ import annotations

from tests.e2e.test_cli_fuzz import CASES


def test_there_are_enough_cases_over_every_command():
    assert len(CASES) >= 150
    commands = {(prog, argv[0]) for _, prog, argv in CASES}
    for prog, module in (("planner", "planner.__main__"), ("profiler", "profiler.__main__"),
                         ("executor", "executor.__main__")):
        mod = __import__(module, fromlist=["COMMANDS"])
        expected = set(mod.COMMANDS) - ({"stop", "queue", "orchestrate"} if prog == "executor" else set())
        assert expected <= {c for p, c in commands if p == prog}, prog
