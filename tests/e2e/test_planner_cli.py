"""`python -m planner plan` / `evaluate` (planner/hetero/plan_command.py, evaluate.py): output, plan files, exit codes."""
import json
import os
import subprocess
import sys

import pytest

from planner.__main__ import COMMANDS
from contracts.cli import main
from contracts.plan import Plan

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LOCAL = os.path.join(ROOT, "examples", "clusters", "local-2cpu-emulated.json")
CEPHALO = os.path.join(ROOT, "examples", "clusters", "cephalo.json")


def planner(*argv):
    return main("python -m planner", COMMANDS, list(argv))


def test_plan_json_is_a_plan_file_and_evaluate_reproduces_it(tmp_path, capsys):
    out = tmp_path / "plan.json"
    assert planner("plan", "--cluster", LOCAL, "--model", "tiny", "--global-batch", "8", "--json",
                   "--out", str(out)) == 0
    printed = json.loads(capsys.readouterr().out)
    plan = Plan.from_dict(printed)  # the --json output is itself a plan file
    assert Plan.load(str(out)) == plan
    for key in ("assignments", "predicted_iteration_s", "predicted_samples_per_s", "baselines", "solve_s", "zero",
                "zero_candidates"):
        assert key in printed
    assert printed["zero"] in (1, 2, 3) and printed["zero_candidates"][str(printed["zero"])]["note"] == "chosen"
    for a in printed["assignments"]:
        assert {"node", "type", "micro_batch", "accum_steps", "batch", "shard_fraction",
                "predicted_memory_bytes", "predicted_step_s"} <= set(a)
    assert {"even", "proportional"} <= set(printed["baselines"])
    assert all("oom" in b and "predicted_iteration_s" in b for b in printed["baselines"].values())
    assert sum(a.batch for a in plan.assignments) == 8

    assert planner("evaluate", "--plan", str(out), "--json") == 0
    evaluated = Plan.from_dict(json.loads(capsys.readouterr().out))
    assert evaluated.predicted_iteration_s == pytest.approx(plan.predicted_iteration_s, rel=1e-9)
    assert [a.predicted_memory_bytes for a in evaluated.assignments] == [a.predicted_memory_bytes
                                                                         for a in plan.assignments]


def test_evaluate_reprices_an_edited_plan(tmp_path, capsys):
    out = tmp_path / "plan.json"
    assert planner("plan", "--cluster", LOCAL, "--model", "tiny", "--global-batch", "8", "--out", str(out)) == 0
    d = json.loads(out.read_text())
    # give everything to the emulated 3x slower device: the evaluation must get slower
    d["assignments"][0].update(micro_batch=0, accum_steps=0, batch=0, shard_fraction=0.0)
    d["assignments"][1].update(micro_batch=8, accum_steps=1, batch=8, shard_fraction=1.0)
    out.write_text(json.dumps(d))
    capsys.readouterr()
    assert planner("evaluate", "--plan", str(out), "--json") == 0
    worse = json.loads(capsys.readouterr().out)
    assert worse["predicted_iteration_s"] > d["predicted_iteration_s"]


def test_default_output_is_a_per_device_table(capsys):
    assert planner("plan", "--cluster", CEPHALO, "--model", "gpt-2.7b", "--global-batch", "64", "--dtype", "bf16",
                   "--recompute", "full") == 0
    text = capsys.readouterr().out
    assert "micro_batch" in text and "predicted iteration" in text
    assert "zero 1:" in text and "zero 3:" in text  # what each stage gave
    assert "P40 has no bf16" in text
    assert len([line for line in text.splitlines() if line.split()[:1] in (["0"], ["1"], ["2"], ["3"])]) == 4


@pytest.mark.parametrize("argv, message", [
    (["plan", "--cluster", LOCAL, "--model", "no-such-model", "--global-batch", "8"], "unknown model"),
    (["plan", "--cluster", LOCAL, "--model", "llama2-13b", "--global-batch", "8"], "no feasible plan"),
    (["plan", "--cluster", "/nonexistent.json", "--model", "tiny", "--global-batch", "8"], "cannot read"),
    (["plan", "--cluster", LOCAL, "--model", "tiny", "--global-batch", "0"], "global batch"),
    (["plan", "--cluster", LOCAL, "--model", "tiny", "--global-batch", "8", "--dtype", "int8"], "invalid choice"),
    (["evaluate", "--plan", "/nonexistent.json"], "cannot read"),
])
def test_bad_input_exits_2_with_one_line(argv, message, capsys):
    try:
        code = planner(*argv)
    except SystemExit as e:  # argparse's own errors exit directly
        code = e.code
    assert code == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1


def test_module_entry_point_exit_code():
    r = subprocess.run([sys.executable, "-m", "planner", "plan", "--cluster", LOCAL, "--model", "tiny",
                        "--global-batch", "-3"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "Traceback" not in r.stderr


def test_tables_show_a_dash_for_what_is_not_there(capsys):
    from contracts.cli import print_table

    print_table([{"step": 1, "val_loss": None, "x": float("nan")}, {"step": 2, "val_loss": 4.5, "x": 1.0}])
    out = capsys.readouterr().out
    assert "None" not in out and "nan" not in out
    assert out.splitlines()[1].split() == ["1", "-", "-"]
