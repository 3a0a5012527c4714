"""The launch backend interface, and the steps every backend takes before its ranks start.

A backend runs a plan with a RunConfig (contracts/run.py): `check` refuses what it cannot run
here, `launch` is the launcher's blocking body (it returns "done" | "failed" | "stopped"),
`start` puts that launcher in a new session and returns a RunHandle (executor/supervise.py) to
wait on, `leftovers`/`remove_leftovers` find and end what a killed launcher left behind (stop_run).
Two implement it: LocalBackend (executor/local.py: torchrun on this machine, emulated devices in
cgroups, emulated datacenters) and SlurmBackend (executor/slurm.py: one SLURM job). They import
this module, checks, rank_commands and supervise, never each other; executor/launch.py picks one.
The shared steps: the run folder (`prepare_folder`, emptied of an earlier run by `overwrite`), the
checkpoint to resume from
(`resume_step`), the tokens and the tokenizer copy (`prepare_data`), run.json.
"""
from __future__ import annotations

import contextlib
import glob
import logging
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
from executor.checks import check_not_running, folder_in_use
from executor.corpus import build_corpus
from executor.rank_commands import optim_dict
from executor.store import db_path
from executor.supervise import RunHandle

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
# what a launch writes beside plan.json and run.json (local.py, wan.py, links.py, slurm_job.py, the
# worker): removed by --overwrite with the checkpoints, the logs and the store
RUN_STATE_FILES = ("launcher.pid", "torchrun.pid", "emulation.json", "wan.json", "links.json", "slurm.json",
                   "slurm.sbatch", "timeline.json", "prefill.json")

log = logging.getLogger(__name__)


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
    when another launcher's run is live in it (an earlier run the config neither resumes nor
    overwrites was refused by its check, checks.check_run); overwrite empties the earlier run's
    state first. The config naming it."""
    config = config if config.run_dir is not None else replace(config, run_dir=new_run_dir())
    os.makedirs(config.run_dir, exist_ok=True)
    check_not_running(config.run_dir)
    if config.overwrite and folder_in_use(config.run_dir) is not None:
        clear_run_state(config.run_dir)
    os.makedirs(os.path.join(config.run_dir, "logs"), exist_ok=True)
    return config


def clear_run_state(run_dir: str) -> None:
    """Remove what a run left in its folder (checkpoints, logs, the folder's own store, the files the
    launcher and the ranks write) and nothing else: --run-dir may name a folder holding the user's
    files too. A shared store's rows of the run go when the new run's row is written (init_run)."""
    ckpts = os.path.join(run_dir, ckpt.CKPT_DIR)
    if os.path.isdir(ckpts):  # its contents: the folder itself may be a mount point
        for name in os.listdir(ckpts):
            path = os.path.join(ckpts, name)
            shutil.rmtree(path) if os.path.isdir(path) and not os.path.islink(path) else os.remove(path)
    shutil.rmtree(os.path.join(run_dir, "logs"), ignore_errors=True)
    db_file = db_path(run_dir)
    names = [db_file + suffix for suffix in ("", "-wal", "-shm", "-journal")]
    names += [os.path.join(run_dir, n) for n in RUN_STATE_FILES]
    names += glob.glob(os.path.join(run_dir, "prefill_rank*.json"))
    for path in names:
        with contextlib.suppress(FileNotFoundError):
            os.remove(path)
    log.info("run folder %s: the earlier run's state removed (--overwrite)", run_dir)


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
