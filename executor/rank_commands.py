"""The command lines of a run: the launcher, torchrun and the worker, as argument lists.

From a plan and its RunConfig (contracts/run.py): the `executor.worker` arguments every rank gets,
torchrun for one machine (`local_torchrun_command`), for one node of several
(`node_torchrun_command`: c10d rendezvous on the first node) or for one agent of any c10d run
(`agent_torchrun_command`: one per rank with emulated links), the shell line per node of a
multi-node plan (`node_command_lines`), the `python -m executor launch` command that start_run
puts in a new session (`launcher_command`) and the environment of the ranks (`rank_env`).
Nothing here starts a process; executor/local.py and executor/slurm.py do. On several nodes each
worker finds its plan device from GPUMIX_NODE and LOCAL_RANK (the rendezvous' rank order does not
matter); every node needs this repository, the plan file and the corpus folder at the same paths.
"""
from __future__ import annotations

import json
import os
import re
import shlex
import socket
import sys
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Sequence

from contracts.paths import PROJECT_ROOT
from contracts.plan import Plan, plan_nodes
from contracts.run import RunConfig
from profiler import cgroups

if TYPE_CHECKING:  # models.optim imports torch; the dashboard imports this module
    from models.optim import OptimConfig

DEFAULT_RDZV_PORT = 29500
# RunConfig.optim key -> the `executor launch` flag that sets it
OPTIM_FLAGS = (("lr", "--lr"), ("warmup_steps", "--warmup-steps"), ("min_lr_ratio", "--min-lr-ratio"),
               ("weight_decay", "--weight-decay"), ("max_grad_norm", "--max-grad-norm"),
               ("decay_steps", "--decay-steps"))


def optim_dict(optim: OptimConfig | dict[str, Any] | None) -> dict[str, Any] | None:
    """RunConfig.optim of an OptimConfig (its to_dict), a dict as it is, None for the defaults."""
    return optim if optim is None or isinstance(optim, dict) else optim.to_dict()


def optim_flags(optim: OptimConfig | dict[str, Any]) -> list[str]:
    """`executor launch` flags that reproduce `optim` (start_run passes them on)."""
    d, out = optim_dict(optim), []
    for key, flag in OPTIM_FLAGS:
        v = d.get(key)
        if key == "max_grad_norm" and key in d:
            out += [flag, "none" if v is None else repr(v)]
        elif v is not None:
            out += [flag, str(v) if isinstance(v, int) else repr(v)]
    return out


def default_optim(steps: int, optim: OptimConfig | dict[str, Any] | None = None) -> OptimConfig:
    """The run's optimizer settings: the given ones, else OptimConfig's defaults with a linear
    warmup over the first 5 % of the steps (at most 2,000; GPT-3 warms up over 375M of 300B
    tokens, Llama 2 over 2,000 steps)."""
    from models.optim import OptimConfig

    if isinstance(optim, dict):
        return OptimConfig.from_dict(optim)
    return optim if optim is not None else OptimConfig(warmup_steps=min(2000, steps // 20))


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def worker_args(plan_path: str, config: RunConfig, tokens_path: str | None = None) -> list[str]:
    """The executor.worker arguments; `config.prefill` (a JSON object) goes to every rank as `--prefill`.
    Without `tokens_path` each node builds (and caches) its own token file."""
    args = ["-m", "executor.worker", "--plan", plan_path, "--steps", str(config.steps), "--run-dir", config.run_dir,
            "--seed", str(config.seed), "--checkpoint-every", str(config.checkpoint_every),
            "--keep-checkpoints", str(config.keep_checkpoints), "--val-every", str(config.val_every),
            "--optim", json.dumps(default_optim(config.steps, config.optim).to_dict())]
    if tokens_path:
        args += ["--tokens", tokens_path]
    else:
        args += (["--corpus", config.corpus_dir] if config.corpus_dir else []) + (
            ["--tokenizer", config.tokenizer] if config.tokenizer else [])
    if config.init_from:
        args += ["--init-from", config.init_from]
    if config.resume:
        args.append("--resume")
    if config.prefill is not None:
        args += ["--prefill", json.dumps(config.prefill)]
    return args


def local_torchrun_command(num_ranks: int, port: int, wargs: list[str]) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={num_ranks}", "--nnodes=1",
            "--master_addr=127.0.0.1", f"--master_port={port}", "--max_restarts=0", *wargs]


def run_id_of(run_dir: str) -> str:
    """The run's id in names outside its folder (rendezvous id, cgroups): the folder's name, sanitized."""
    return re.sub(r"[^A-Za-z0-9_-]", "-", os.path.basename(os.path.abspath(run_dir)))


def node_torchrun_command(python: str, plan: Plan, nodes: Sequence[str], i: int, endpoint: str, run_id: str,
                          wargs: Sequence[str], extra: Sequence[str] = ()) -> list[str]:
    """torchrun for node `nodes[i]` of a multi-node run: its share of the ranks, a c10d rendezvous at
    `endpoint` (`extra`: more torchrun flags, e.g. is_host and the node's own address)."""
    k = sum(1 for a in plan.used if a.node == nodes[i])
    return agent_torchrun_command(python, len(nodes), k, i, endpoint, run_id, wargs, extra)


def agent_torchrun_command(python: str, num_agents: int, nproc: int, i: int, endpoint: str, run_id: str,
                           wargs: Sequence[str], extra: Sequence[str] = ()) -> list[str]:
    """torchrun agent `i` of `num_agents`, starting `nproc` ranks, joined by a c10d rendezvous at
    `endpoint`: one per node of a multi-node run, one per rank of an emulated-links run."""
    return [python, "-m", "torch.distributed.run", f"--nnodes={num_agents}", f"--nproc-per-node={nproc}",
            f"--node-rank={i}", "--rdzv-backend=c10d", f"--rdzv-endpoint={endpoint}", f"--rdzv-id={run_id}",
            *extra, "--max-restarts=0", *wargs]


def node_command_lines(plan_path: str, plan: Plan, config: RunConfig, port: int = DEFAULT_RDZV_PORT) -> list[str]:
    """One shell line per node: `GPUMIX_NODE=<node> python -m torch.distributed.run --nnodes=N
    --nproc-per-node=k --node-rank=i --rdzv-backend=c10d --rdzv-endpoint=<first node>:<port> ...`
    (the prefill object is for runs started here, not in these lines)."""
    nodes = plan_nodes(plan)
    wargs = worker_args(plan_path, replace(config, prefill=None))
    lines = []
    for i, node in enumerate(nodes):
        cmd = node_torchrun_command("python", plan, nodes, i, f"{nodes[0]}:{port}", run_id_of(config.run_dir), wargs)
        lines.append(f"GPUMIX_NODE={shlex.quote(node)} {shlex.join(cmd)}")
    return lines


def launcher_command(plan_path: str, config: RunConfig, extra_args: Sequence[str] = ()) -> list[str]:
    """`python -m executor launch ...` reproducing `config` (`extra_args`: the backend's own flags;
    the prefill object travels as a file, so the caller passes `--prefill FILE` among them)."""
    cmd = [sys.executable, "-m", "executor", "launch", "--plan", plan_path, "--steps", str(config.steps),
           "--run-dir", config.run_dir, "--seed", str(config.seed), "--checkpoint-every", str(config.checkpoint_every),
           "--keep-checkpoints", str(config.keep_checkpoints), "--val-every", str(config.val_every)]
    if config.resume:
        cmd.append("--resume")
    for value, flag in ((config.corpus_dir, "--data"), (config.tokenizer, "--tokenizer"),
                        (config.init_from, "--init-from")):
        if value:
            cmd += [flag, value]
    if config.optim is not None:
        cmd += optim_flags(config.optim)
    if config.emulate_wan:
        cmd.append("--emulate-wan")
    if config.emulate_links_gbps is not None:
        cmd += ["--emulate-links", repr(config.emulate_links_gbps)]
    if config.stall_timeout_s is not None:
        cmd += ["--stall-timeout", repr(config.stall_timeout_s)]
    return cmd + list(extra_args)


def project_pythonpath() -> str:
    """PYTHONPATH with this repository first (the ranks and agents import the project from anywhere)."""
    return os.pathsep.join(p for p in (PROJECT_ROOT, os.environ.get("PYTHONPATH")) if p)


def rank_env(cgroup_table: str | None = None) -> dict[str, str]:
    """The environment of every torchrun agent and its ranks; `cgroup_table`: the run's emulation.json
    when the ranks join cgroups (profiler/cgroups.py)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", GPUMIX_LAUNCHED="1",
               PYTHONPATH=project_pythonpath())
    env.pop(cgroups.ENV_CGROUPS, None)
    if cgroup_table is not None:
        env[cgroups.ENV_CGROUPS] = cgroup_table
    return env
