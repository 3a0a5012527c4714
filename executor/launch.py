"""Launching a plan: the door every caller goes through (CLI, dashboard, orchestrator, benches).

`launch_run` (blocking: the launcher's body), `start_run` (the launcher in a new session, a
RunHandle back) and `stop_run` take the run settings as keywords, build the RunConfig
(contracts/run.py, validated once) and hand it to a backend (executor/backend.py):
LocalBackend (executor/local.py) here, SlurmBackend (executor/slurm.py) for `--backend slurm`.
`multinode_commands` prints the per-node torchrun lines of a plan spanning machines.

Read in this order: checks.py (plan + config against this machine), rank_commands.py (the
command lines), supervise.py (start, watch, stop, failure reasons; stall.py its watchdog,
lifeline.py the parent-death signal), local.py and slurm.py (the backends). docs/ARCHITECTURE.md
(the executor) has the process tree.
"""
from __future__ import annotations

import logging
import os
import socket
from dataclasses import replace
from typing import TYPE_CHECKING

from contracts.plan import Plan
from contracts.run import RunConfig
from executor import booking
from executor.backend import TOKENIZER_FILES, Backend, copy_tokenizer, new_run_dir, run_config  # noqa: F401
from executor.checks import check_emulate_links, check_emulate_wan, runs_here  # noqa: F401
from executor.local import EMULATION_FILE, LocalBackend, emulation_limits, sleep_fallback_plan  # noqa: F401
from executor.rank_commands import (DEFAULT_RDZV_PORT, default_optim, free_port,  # noqa: F401
                                    local_torchrun_command, node_command_lines, run_id_of)
from executor.slurm import SlurmBackend
from executor.store import MetricsStore, has_run, read_metrics, read_run_row
from executor.supervise import (RunHandle, record_vanished, still_running, stop_elsewhere, stop_escalated,
                                verified_launcher)

if TYPE_CHECKING:  # models.optim imports torch; the dashboard imports this module
    from models.optim import OptimConfig

log = logging.getLogger(__name__)


def backend_for(name: str = "local", settings=None) -> Backend:
    """The backend called `name` ("local" | "slurm"; `settings`: the SlurmSettings)."""
    if name == "local":
        return LocalBackend()
    if name == "slurm":
        return SlurmBackend(settings)
    raise ValueError(f"backend must be local or slurm, got {name!r}")


def _plan(plan: Plan | str, rebalance: str | None = None) -> Plan:
    """The plan (a Plan or a plan file), its `rebalance` replaced when given ("auto" | "off")."""
    plan = plan if isinstance(plan, Plan) else Plan.load(plan)
    return plan if rebalance is None else replace(plan, rebalance=rebalance)


def launch_run(plan: Plan | str, steps: int, run_dir: str, seed: int = 0, resume: bool = False,
               checkpoint_every: int = 0, corpus_dir: str | None = None, optim: OptimConfig | None = None,
               tokenizer: str | None = None, init_from: str | None = None, emulate_wan: bool = False,
               prefill: dict | None = None, emulate_links_gbps: float | None = None,
               stall_timeout_s: float | None = None, rebalance: str | None = None) -> str:
    """Run `plan` for `steps` global steps with torchrun here; block until it ends. Returns the final
    status: "done" | "failed" | "stopped". ValueError on bad input. The settings: RunConfig's;
    `rebalance` ("auto" | "off") replaces the plan's own (executor/rebalance.py)."""
    config = run_config(steps, run_dir, optim, seed=seed, resume=resume, checkpoint_every=checkpoint_every,
                        corpus_dir=corpus_dir, tokenizer=tokenizer, init_from=init_from, emulate_wan=emulate_wan,
                        prefill=prefill, emulate_links_gbps=emulate_links_gbps, stall_timeout_s=stall_timeout_s)
    return LocalBackend().launch(_plan(plan, rebalance), config)


def start_run(plan: Plan | str, steps: int, run_dir: str | None = None, seed: int = 0, resume: bool = False,
              checkpoint_every: int = 0, corpus_dir: str | None = None, optim: OptimConfig | None = None,
              tokenizer: str | None = None, init_from: str | None = None, emulate_wan: bool = False,
              prefill: dict | None = None, emulate_links_gbps: float | None = None,
              stall_timeout_s: float | None = None, rebalance: str | None = None) -> RunHandle:
    """Start `python -m executor launch ...` in a new session and return at once. The run
    survives the caller (a browser reload, an app restart). `run_dir` defaults to a new
    folder under contracts.paths.runs_dir(); `rebalance` as launch_run's."""
    config = run_config(steps, run_dir, optim, seed=seed, resume=resume, checkpoint_every=checkpoint_every,
                        corpus_dir=corpus_dir, tokenizer=tokenizer, init_from=init_from, emulate_wan=emulate_wan,
                        prefill=prefill, emulate_links_gbps=emulate_links_gbps, stall_timeout_s=stall_timeout_s)
    return LocalBackend().start(_plan(plan, rebalance), config)


def multinode_commands(plan_path: str, plan: Plan, steps: int, run_dir: str, seed: int = 0, resume: bool = False,
                       checkpoint_every: int = 0, corpus_dir: str | None = None,
                       port: int = DEFAULT_RDZV_PORT, optim: OptimConfig | None = None, tokenizer: str | None = None,
                       init_from: str | None = None) -> list[str]:
    """One shell line per node (rank_commands.node_command_lines)."""
    config = run_config(steps, run_dir, optim, seed=seed, resume=resume, checkpoint_every=checkpoint_every,
                        corpus_dir=corpus_dir, tokenizer=tokenizer, init_from=init_from)
    return node_command_lines(plan_path, plan, config, port)


def stop_run(run_dir: str, timeout_s: float = 30.0) -> str:
    """Stop the run: ask the launcher through the store; if it does not end the run within
    `timeout_s` (or is gone, leaving torchrun and the ranks behind), kill the launcher,
    torchrun's group and every rank, end what the backends left (emulated datacenters, cgroups,
    a SLURM job), and record "stopped". Only verified processes are signalled: a run recorded on
    another host is asked through the store alone, and a recorded pid that is now another process
    (start time or command line not the launcher's) is a ValueError. Returns the final status."""
    if not has_run(run_dir):
        raise ValueError(f"no run at {run_dir}")
    row = read_run_row(run_dir)
    store = MetricsStore(run_dir)
    try:
        if row["host"] and row["host"] != socket.gethostname():
            return stop_elsewhere(run_dir, row["host"], store, timeout_s)
        pid = row["launcher_pid"]
        launcher = verified_launcher(run_dir, pid, store) if pid != os.getpid() else None
        backends = (LocalBackend(), SlurmBackend())
        left = still_running(run_dir, launcher, store) or any(b.leftovers(run_dir) for b in backends)
        if not left and pid != os.getpid():  # a launcher gone without a word, nothing of it left
            record_vanished(store, pid, row["host"])
            return read_metrics(run_dir)["status"]
        if not left and store.status() != "running":
            return store.status()
        stop_escalated(run_dir, launcher, store, timeout_s)
        for b in backends:
            b.remove_leftovers(run_dir)
        if store.status() in (None, "running"):
            store.finish("stopped", "stopped on request (the launcher did not end the run; killed)")
    finally:
        store.close()
    booking.Ledger().release(run_dir)  # everything of the run is gone now
    return read_metrics(run_dir)["status"]
