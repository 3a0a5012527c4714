"""RunConfig (contracts/run.py): one-line errors naming the field, and the round trip through run.json."""
from __future__ import annotations

import json
import os

import pytest

from contracts.run import RUN_FILE, RunConfig


@pytest.mark.parametrize("kwargs, message", [
    ({"steps": 0}, "steps must be >= 1, got 0"),
    ({"steps": 2.5}, "steps must be an integer, got 2.5"),
    ({"steps": True}, "steps must be an integer, got True"),
    ({"steps": 3, "checkpoint_every": -1}, "checkpoint_every must be >= 0, got -1"),
    ({"steps": 3, "seed": -2}, "seed must be >= 0, got -2"),
    ({"steps": 3, "resume": "yes"}, "resume must be true or false, got 'yes'"),
    ({"steps": 3, "emulate_wan": 1}, "emulate_wan must be true or false, got 1"),
    ({"steps": 3, "run_dir": ""}, "run_dir must be a path, got ''"),
    ({"steps": 3, "tokenizer": 7}, "tokenizer must be a path, got 7"),
    ({"steps": 3, "prefill": [1, 2]}, "prefill must be a JSON object, got list"),
    ({"steps": 3, "optim": "fast"}, "optim must be a JSON object, got str"),
])
def test_a_bad_setting_is_one_line_naming_the_field(kwargs, message):
    with pytest.raises(ValueError) as e:
        RunConfig(**kwargs)
    assert str(e.value) == message


def test_the_config_round_trips_through_run_json(tmp_path):
    config = RunConfig(steps=7, run_dir=str(tmp_path), seed=3, resume=True, checkpoint_every=2,
                       corpus_dir="/data/c", tokenizer="/t/tokenizer.json", init_from="/hf/tiny",
                       optim={"lr": 0.001, "warmup_steps": 1, "max_grad_norm": None}, emulate_wan=True,
                       prefill={"model": "tiny", "requests": 4})
    path = config.save()
    assert path == os.path.join(str(tmp_path), RUN_FILE)
    with open(path) as fh:
        assert json.load(fh)["optim"] == {"lr": 0.001, "warmup_steps": 1, "max_grad_norm": None}
    assert RunConfig.load(str(tmp_path)) == config
    assert RunConfig.from_dict(config.to_dict()) == config


def test_a_moved_run_folder_loads_with_its_own_path(tmp_path):
    RunConfig(steps=2, run_dir="/somewhere/else").save(str(tmp_path))
    assert RunConfig.load(str(tmp_path)).run_dir == os.path.abspath(str(tmp_path))


def test_a_bad_run_json_names_the_file_and_the_field(tmp_path):
    path = os.path.join(str(tmp_path), RUN_FILE)
    for content, message in (('{"steps": -1}', "steps must be >= 1, got -1"),
                             ('{"steps": 2, "speed": 9}', "unknown field(s) speed"),
                             ('{"seed": 2}', "missing field steps"),
                             ('[2]', "must be a JSON object, not list")):
        with open(path, "w") as fh:
            fh.write(content)
        with pytest.raises(ValueError) as e:
            RunConfig.load(str(tmp_path))
        assert str(e.value) == f"{path}: {message}", content
    with pytest.raises(ValueError, match="no such file"):
        RunConfig.load(str(tmp_path / "nowhere"))


def test_save_needs_a_folder():
    with pytest.raises(ValueError, match="run_dir: no run folder"):
        RunConfig(steps=1).save()


def test_the_launcher_command_reproduces_the_config(tmp_path):
    """start_run hands the config to its launcher as `executor launch` flags: they parse back to it."""
    import argparse

    from executor.commands import launch as cli
    from executor.rank_commands import launcher_command
    from models.optim import OptimConfig

    optim = OptimConfig(lr=1e-3, warmup_steps=3, decay_steps=80, max_grad_norm=None, min_lr_ratio=0.2).to_dict()
    for config in (RunConfig(steps=50, run_dir=str(tmp_path), seed=4, resume=True, checkpoint_every=5,
                             corpus_dir="/c", tokenizer="/t/tokenizer.json", init_from="/hf", optim=optim,
                             emulate_wan=True),
                   RunConfig(steps=1, run_dir=str(tmp_path))):
        cmd = launcher_command("/p/plan.json", config)
        assert cmd[1:4] == ["-m", "executor", "launch"]
        parser = argparse.ArgumentParser()
        cli.add_arguments(parser)
        args = parser.parse_args(cmd[4:])
        assert args.plan == "/p/plan.json" and args.backend == "local"
        assert cli.run_config_of(args) == config


def test_the_backends_check_the_plan_with_the_config(tmp_path, monkeypatch):
    """Paths come back absolute, a config without a folder keeps none (start picks one), and each
    backend refuses what it cannot run, before anything is written."""
    from executor.local import LocalBackend
    from executor.slurm import SlurmBackend
    from testkit.runs import two_cpu_plan

    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    plan = two_cpu_plan()
    assert LocalBackend().check(plan, RunConfig(steps=2, run_dir="r")).run_dir == os.path.join(str(work), "r")
    assert LocalBackend().check(plan, RunConfig(steps=2)).run_dir is None
    with pytest.raises(ValueError, match="no config.json in that folder"):
        LocalBackend().check(plan, RunConfig(steps=2, init_from="nowhere"))
    with pytest.raises(ValueError, match="sit on one node"):
        LocalBackend().check(plan, RunConfig(steps=2, emulate_wan=True))
    with pytest.raises(ValueError, match="--prefill runs with --backend local"):
        SlurmBackend().check(plan, RunConfig(steps=2, prefill={}))
    assert os.listdir(work) == []
