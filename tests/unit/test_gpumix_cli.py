"""The `gpumix` command (gpumix/cli.py): one command over the three tools' tables, and the dashboard's command
line. Run in-process; tests/e2e/test_install.py runs the installed command."""
from __future__ import annotations

import pytest

from executor.__main__ import COMMANDS as EXECUTOR
from gpumix import cli, dashboard
from planner.__main__ import COMMANDS as PLANNER
from profiler.__main__ import COMMANDS as PROFILER


def test_every_sub_command_is_reachable_and_the_planner_wins_memory():
    for name, module in {**EXECUTOR, **PROFILER}.items():
        assert cli.COMMANDS[name] == (PLANNER.get(name) or module), name
    assert cli.COMMANDS["memory"] == PLANNER["memory"] != PROFILER["memory"]
    assert {"dashboard", "planner", "profiler", "executor"} <= set(cli.COMMANDS)


def test_first_wins_keeps_the_first_table_on_a_shared_name():
    assert cli.first_wins({"a": "x", "b": "y"}, {"b": "z", "c": "w"}) == {"a": "x", "b": "y", "c": "w"}


@pytest.mark.parametrize("argv, prog", [(["profiler", "memory", "--help"], "gpumix profiler memory"),
                                        (["memory", "--help"], "gpumix memory"),
                                        (["executor", "launch", "--help"], "gpumix executor launch")])
def test_commands_by_name_or_by_tool(capsys, argv, prog):
    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    out = capsys.readouterr().out
    assert e.value.code == 0 and out.startswith(f"usage: {prog} "), out
    assert ("--fake" in out) == (argv[0] == "profiler")  # the profiler's memory measures (--fake), the planner's predicts


def test_a_tool_alone_lists_its_commands(capsys):
    assert cli.main(["planner"]) == 2
    listed = capsys.readouterr().out
    assert all(f"    {name} " in listed for name in PLANNER), listed


def test_dashboard_passes_streamlit_flags_through_after_its_settings(monkeypatch):
    ran = []
    monkeypatch.setattr(dashboard.os, "execv", lambda exe, argv: ran.append(argv))
    assert cli.main(["dashboard", "--server.port", "8502", "--", "script-arg"]) == 0
    (argv,) = ran
    assert argv[1:5] == ["-m", "streamlit", "run", dashboard.APP]
    assert "--server.address=127.0.0.1" in argv and "--server.headless=true" in argv
    assert argv[-4:] == ["--server.port", "8502", "--", "script-arg"]  # last: the user's flags win


def test_config_flags_turn_toml_into_streamlit_flags(tmp_path):
    toml = tmp_path / "config.toml"
    toml.write_text('[server]\naddress = "127.0.0.1"\nheadless = true\nport = 8600\n[client]\ntoolbarMode = "minimal"\n')
    assert dashboard.config_flags(str(toml)) == ["--server.address=127.0.0.1", "--server.headless=true",
                                                 "--server.port=8600", "--client.toolbarMode=minimal"]
