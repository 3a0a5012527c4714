"""The launch backend interface, and the steps every backend takes before its ranks start.

A backend runs a plan with a RunConfig (contracts/run.py): `check` refuses what it cannot run
here, `launch` is the launcher's blocking body (it returns "done" | "failed" | "stopped"),
`start` puts that launcher in a new session and returns a RunHandle (executor/supervise.py) to
wait on, `leftovers`/`remove_leftovers` find and end what a killed launcher left behind (stop_run).
Two implement it: LocalBackend (executor/local.py: torchrun on this machine, emulated devices in
cgroups, emulated datacenters) and SlurmBackend (executor/slurm.py: one SLURM job). They import
this module, checks, rank_commands and supervise, never each other; executor/launch.py picks one.
The shared steps: the run folder (`prepare_folder`), the checkpoint to resume from
(`resume_step`), the tokens and the tokenizer copy (`prepare_data`), run.json.
"""
from __future__ import annotations

import os
import shutil
import time
from dataclasses import replace
from typing import Any, Protocol

from contracts.paths import runs_dir
from contracts.plan import Plan
from contracts.run import RunConfig
from contracts.specs import get_model
from executor import checkpoint as ckpt
from executor.checks import check_not_running
from executor.corpus import build_corpus
from executor.rank_commands import optim_dict
from executor.supervise import RunHandle

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


class Backend(Protocol):
    name: str

    def check(self, plan: Plan, config: RunConfig) -> RunConfig:
        """ValueError when this backend cannot run `plan` with `config` here; else the config with
        its paths absolute."""

    def launch(self, plan: Plan, config: RunConfig) -> str:
        """Run until the run ends, in this process (the launcher); the final status."""

    def start(self, plan: Plan, config: RunConfig) -> RunHandle:
        """Start the launcher in a new session and return at once."""

    def leftovers(self, run_dir: str) -> bool:
        """Something this backend's launcher of `run_dir` made still runs without it."""

    def remove_leftovers(self, run_dir: str) -> None:
        """End what a killed launcher of `run_dir` left behind (stop_run, once the launcher is gone)."""


def run_config(steps: int, run_dir: str | None, optim: Any = None, **settings: Any) -> RunConfig:
    """The RunConfig of the keyword API (launch_run, start_run, ...): `optim` an OptimConfig, its
    dict or None."""
    return RunConfig(steps=steps, run_dir=run_dir, optim=optim_dict(optim), **settings)


def new_run_dir(root: str | None = None) -> str:
    root = root or runs_dir()
    base = time.strftime("run-%Y%m%d-%H%M%S", time.gmtime())
    for i in range(1000):
        path = os.path.join(root, base if i == 0 else f"{base}-{i}")
        try:
            os.makedirs(path)
            return path
        except FileExistsError:
            continue
    raise ValueError(f"cannot create a new run folder under {root}")


def prepare_folder(config: RunConfig) -> RunConfig:
    """The run folder (a new one under runs/ when the config names none) with its logs/, refused
    when another launcher's run is live in it; the config naming it."""
    config = config if config.run_dir is not None else replace(config, run_dir=new_run_dir())
    os.makedirs(os.path.join(config.run_dir, "logs"), exist_ok=True)
    check_not_running(config.run_dir)
    return config


def resume_step(plan: Plan, config: RunConfig) -> int | None:
    """The step of the checkpoint a resumed run starts from (ValueError when there is none the plan
    can load); None when the run does not resume."""
    if not config.resume:
        return None
    return int(ckpt.check_resumable(config.run_dir, plan)["step"])


def prepare_data(plan: Plan, config: RunConfig) -> str:
    """The launcher's first work: run.json, the token file (built or found in the cache) and the
    tokenizer kept in the run folder. The token file's path."""
    config.save()
    tokens = build_corpus(config.corpus_dir, config.tokenizer, vocab_size=get_model(plan.model).vocab_size)
    copy_tokenizer(config.tokenizer, config.run_dir)
    return tokens


def copy_tokenizer(tokenizer: str | None, dest_dir: str) -> None:
    """Copy a tokenizer.json (and the config files beside it) into `dest_dir`: the run folder keeps
    the run's tokenizer, where `executor export` takes it from into the exported model folder."""
    if tokenizer is None:
        return
    src = os.path.dirname(os.path.abspath(tokenizer))
    shutil.copyfile(tokenizer, os.path.join(dest_dir, TOKENIZER_FILES[0]))
    for name in TOKENIZER_FILES[1:]:
        if os.path.isfile(os.path.join(src, name)):
            shutil.copyfile(os.path.join(src, name), os.path.join(dest_dir, name))
