"""Launching a plan: torchrun as a process group, watched until the run ends.

Process tree of a local run (every arrow is an argument list, never a shell):

    [start_run: the dashboard] --new session--> python -m executor launch   (the launcher)
        --new session--> python -m torch.distributed.run ... -m executor.worker   (torchrun)
            --own session each (torchrun's choice)--> python -m executor.worker   (rank r)

`launch_run` is the launcher: it builds the corpus cache, writes plan.json and the
`run` row of metrics.sqlite, starts torchrun and polls it. A rank that dies makes
torchrun stop the others (its own monitor, 0.1 s); our watchdog also kills everything
left if a registered rank has been dead for `DEAD_RANK_GRACE_S` while torchrun still
runs, and every worker leaves on its own when torchrun goes (executor.worker). At the
end the launcher kills torchrun's group and every rank's session that is still alive,
then records the status with the reason and the failed rank.

Emulated devices (profiler/cgroups.py): before torchrun starts, the launcher creates one
cgroup per rank whose device has a `cpu_share` (its CPU quota, and its `memory_gb` as a memory
limit; `gpumix-<run id>-r<rank>`), and
torchrun starts each rank through `python -m profiler.cgroups exec`, which joins them before
the interpreter loads anything; the rank sets its memory limit from its baseline. The cgroups
are removed when the run ends, however it ends (and by `stop_run` when the launcher was killed).
A rank the kernel's OOM killer ended in its memory cgroup is the run's failure reason. Without
cgroups (or with GPUMIX_EMULATION=sleep) the run falls back to sleep emulation
(slowdown = 1 / cpu_share); emulation.json and an `emulation` event record which one ran.

`start_run` starts the launcher in a new session, so the run outlives the page (and the
app) that started it; `stop_run` asks for a stop through the store and escalates to
signals if the launcher does not answer.

Multi-node: a plan whose used devices sit on more than one node, not all of them this
machine ("localhost", "127.0.0.1", "local", this host's name), is not run here:
`multinode_commands` gives the exact torchrun command for each node (c10d rendezvous on
the first node). Each worker finds its plan device from GPUMIX_NODE and LOCAL_RANK, so
the rank order the rendezvous picks does not matter. A single-node plan runs here,
whatever the node is called: the command is run on that node.

Emulated datacenters (`emulate_wan`, executor/wan.py): a plan on k >= 2 nodes runs here with
each node a datacenter in its own network namespace; one torchrun agent per node, started in
its namespace (`nsenter --net=...`, an argument list) with the same flags as `multinode_commands`
(`node_torchrun_command`: c10d rendezvous hosted by node 0 at its namespace address), GPUMIX_NODE,
GLOO_SOCKET_IFNAME (the host interface once per TCP connection) and OMP_NUM_THREADS=1. The
launcher watches all agents as it watches the one of a local run (`_watch`: the store, dead
ranks, stop requests; one agent failed for DEAD_RANK_GRACE_S while others run ends the run too),
merges their logs into logs/torchrun.log for the failure reason, and removes the namespaces with
every process in them before it records the run's end, however the run ends; a guard process does
it if the launcher is killed, `stop_run` and the next emulated launch of the run as well.
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, replace
from typing import Sequence, TYPE_CHECKING

from executor import booking
from profiler import cgroups
from executor import checkpoint as ckpt
from executor import wan
from executor.corpus import build_corpus
from executor.store import MetricsStore, _pid_alive, has_run, read_metrics
from contracts.catalog import GIB
from contracts.paths import PROJECT_ROOT, runs_dir
from contracts.plan import Plan

if TYPE_CHECKING:  # models.optim imports torch; the dashboard imports this module
    from models.optim import OptimConfig

log = logging.getLogger(__name__)

POLL_S = 0.2
DEAD_RANK_GRACE_S = 10.0  # torchrun normally ends the group within a second; then we do
TERM_GRACE_S = 10.0  # SIGTERM -> SIGKILL
DEFAULT_RDZV_PORT = 29500
ENV_EMULATION = "GPUMIX_EMULATION"  # "sleep" forces the sleep fallback (default: cgroups where available)
EMULATION_FILE = "emulation.json"
PREFILL_FILE = "prefill.json"  # start_run's prefill object, for the launcher's --prefill
LOCAL_NAMES = booking.LOCAL_NAMES
# secondary failures: the ranks that lost a peer, not the cause of the run's end
_PEER_ERRORS = ("connection closed by peer", "connection reset", "broken pipe", "timed out", "gloo",
                "nccl", "signalexception", "terminated", "process group")


# ---- the commands ------------------------------------------------------------------------


def optim_flags(optim: OptimConfig) -> list[str]:
    """`executor launch` flags that reproduce `optim` (start_run passes them on)."""
    return ["--lr", repr(optim.lr), "--warmup-steps", str(optim.warmup_steps), "--min-lr-ratio",
            repr(optim.min_lr_ratio), "--weight-decay", repr(optim.weight_decay), "--max-grad-norm",
            "none" if optim.max_grad_norm is None else repr(optim.max_grad_norm)] + (
        [] if optim.decay_steps is None else ["--decay-steps", str(optim.decay_steps)])


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def default_optim(steps: int, optim: OptimConfig | None = None) -> OptimConfig:
    """The run's optimizer settings: the given ones, else OptimConfig's defaults with a linear
    warmup over the first 5 % of the steps (at most 2,000; GPT-3 warms up over 375M of 300B
    tokens, Llama 2 over 2,000 steps)."""
    if optim is not None:
        return optim
    from models.optim import OptimConfig

    return OptimConfig(warmup_steps=min(2000, steps // 20))


def worker_args(plan_path: str, steps: int, run_dir: str, seed: int = 0, resume: bool = False,
                checkpoint_every: int = 0, tokens_path: str | None = None, corpus_dir: str | None = None,
                optim: OptimConfig | None = None, tokenizer: str | None = None,
                init_from: str | None = None, prefill: dict | None = None) -> list[str]:
    """The executor.worker arguments; `prefill` (a JSON object) goes to every rank as `--prefill`."""
    args = ["-m", "executor.worker", "--plan", plan_path, "--steps", str(steps), "--run-dir", run_dir,
            "--seed", str(seed), "--checkpoint-every", str(checkpoint_every),
            "--optim", json.dumps(default_optim(steps, optim).to_dict())]
    if tokens_path:
        args += ["--tokens", tokens_path]
    else:  # each node builds (and caches) its own token file
        args += (["--corpus", corpus_dir] if corpus_dir else []) + (["--tokenizer", tokenizer] if tokenizer else [])
    if init_from:
        args += ["--init-from", init_from]
    if resume:
        args.append("--resume")
    if prefill is not None:
        args += ["--prefill", json.dumps(prefill)]
    return args


def local_torchrun_command(num_ranks: int, port: int, wargs: list[str]) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={num_ranks}", "--nnodes=1",
            "--master_addr=127.0.0.1", f"--master_port={port}", "--max_restarts=0", *wargs]


_is_local = booking.is_local_node


def plan_nodes(plan: Plan) -> list[str]:
    """The nodes with used devices, in plan order."""
    out: list[str] = []
    for a in plan.used:
        if a.node not in out:
            out.append(a.node)
    return out


def runs_here(plan: Plan) -> bool:
    nodes = plan_nodes(plan)
    return len(nodes) <= 1 or all(_is_local(n) for n in nodes)


def multinode_commands(plan_path: str, plan: Plan, steps: int, run_dir: str, seed: int = 0, resume: bool = False,
                       checkpoint_every: int = 0, corpus_dir: str | None = None,
                       port: int = DEFAULT_RDZV_PORT, optim: OptimConfig | None = None, tokenizer: str | None = None,
                       init_from: str | None = None) -> list[str]:
    """One shell line per node: `GPUMIX_NODE=<node> python -m torch.distributed.run --nnodes=N
    --nproc-per-node=k --node-rank=i --rdzv-backend=c10d --rdzv-endpoint=<first node>:<port> ...`.
    Every node needs this repository, the plan file and the corpus folder at the same paths."""
    nodes = plan_nodes(plan)
    run_id = run_id_of(run_dir)
    wargs = worker_args(plan_path, steps, run_dir, seed, resume, checkpoint_every, corpus_dir=corpus_dir, optim=optim,
                        tokenizer=tokenizer, init_from=init_from)
    lines = []
    for i, node in enumerate(nodes):
        cmd = node_torchrun_command("python", plan, nodes, i, f"{nodes[0]}:{port}", run_id, wargs)
        lines.append(f"GPUMIX_NODE={shlex.quote(node)} {shlex.join(cmd)}")
    return lines


def node_torchrun_command(python: str, plan: Plan, nodes: Sequence[str], i: int, endpoint: str, run_id: str,
                          wargs: Sequence[str], extra: Sequence[str] = ()) -> list[str]:
    """torchrun for node `nodes[i]` of a multi-node run: its share of the ranks, a c10d rendezvous at
    `endpoint` (`extra`: more torchrun flags, e.g. is_host and the node's own address)."""
    k = sum(1 for a in plan.used if a.node == nodes[i])
    return [python, "-m", "torch.distributed.run", f"--nnodes={len(nodes)}", f"--nproc-per-node={k}",
            f"--node-rank={i}", "--rdzv-backend=c10d", f"--rdzv-endpoint={endpoint}", f"--rdzv-id={run_id}",
            *extra, "--max-restarts=0", *wargs]


def run_id_of(run_dir: str) -> str:
    """The run's id in names outside its folder (rendezvous id, cgroups): the folder's name, sanitized."""
    return re.sub(r"[^A-Za-z0-9_-]", "-", os.path.basename(os.path.abspath(run_dir)))


# ---- emulation: cgroups, or the sleep fallback -----------------------------------------------


@dataclass(frozen=True)
class Emulation:
    mode: str  # "none" | "cgroup" | "sleep"
    reason: str
    ranks: dict[int, cgroups.Cgroup]  # rank -> its cgroups (mode "cgroup")


def emulation_limits(plan: Plan) -> dict[int, cgroups.Limits]:
    """rank -> the limits of its device, for the ranks whose device has a cpu_share (rank r trains
    the r-th used device: on a local run, and on an emulated-datacenter run too, whose used devices
    come in node order and whose rendezvous ranks the agents in node order, executor/wan.py).
    `cpu_share` is what asks for physical emulation; a device with only `slowdown` / `memory_gb`
    keeps the arithmetic one (sleep, measured-peak check), which the cost model it confirms was
    built for (contracts.cluster)."""
    devices = plan.cluster.devices()
    out = {}
    for rank, a in enumerate(plan.used):
        dev = devices[a.device_index][1]
        if dev.cpu_share is not None:
            out[rank] = cgroups.Limits(dev.cpu_share, None if dev.memory_gb is None else int(dev.memory_gb * GIB))
    return out


def sleep_fallback_plan(plan: Plan) -> Plan:
    """The plan a sleep-emulated run executes: each cpu_share device sleeps as a device 1/share slower."""
    devices = plan.cluster.devices()
    assignments = tuple(replace(a, slowdown=a.slowdown / devices[a.device_index][1].cpu_share)
                        if a.used and devices[a.device_index][1].cpu_share is not None else a
                        for a in plan.assignments)
    return replace(plan, assignments=assignments)


def setup_emulation(plan: Plan, run_dir: str) -> Emulation:
    """Create the ranks' cgroups (mode "cgroup"), or say why the run sleeps instead; emulation.json."""
    limits = emulation_limits(plan)
    if not limits:
        return Emulation("none", "no emulated device", {})
    why = "GPUMIX_EMULATION=sleep" if os.environ.get(ENV_EMULATION) == "sleep" else cgroups.unavailable_reason()
    if why is not None:
        emu = Emulation("sleep", f"sleep fallback: {why}", {})
    else:
        prefix = cgroups.run_prefix(run_id_of(run_dir))
        cgroups.remove_all(prefix)  # a resumed run whose launcher was killed
        made: dict[int, cgroups.Cgroup] = {}
        try:
            for rank, lim in limits.items():
                made[rank] = cgroups.create(f"{prefix}{rank}", lim)
        except BaseException:
            remove_emulation(Emulation("cgroup", "", made))
            raise
        emu = Emulation("cgroup", "cgroup v1 limits: " + "; ".join(
            f"rank {r}: {c.limits.describe()}" for r, c in made.items()), made)
    cgroups.save_table(os.path.join(run_dir, EMULATION_FILE), emu.mode, emu.reason, emu.ranks)
    return emu


def remove_emulation(emu: Emulation) -> None:
    for cg in emu.ranks.values():
        try:
            cgroups.remove(cg)
        except OSError as e:
            log.error("%s", e)


def oom_reason(emu: Emulation) -> tuple[str, int] | None:
    """(reason, rank) when the kernel's OOM killer ended a rank in its memory cgroup."""
    for rank, cg in sorted(emu.ranks.items()):
        if cgroups.oom_kills(cg):
            limit = cgroups.memory_limit_bytes(cg)
            baseline = None if limit is None else limit - (cg.limits.memory_bytes or 0)
            return (f"rank {rank} ran out of memory (emulated): the kernel's OOM killer ended it in its memory "
                    f"cgroup {cg.name} (limit = baseline {baseline / 2**20:.0f} MiB + memory_gb "
                    f"{(cg.limits.memory_bytes or 0) / GIB:g} GiB)"
                    if baseline is not None else f"rank {rank} ran out of memory (emulated): the kernel's OOM "
                    f"killer ended it in its memory cgroup {cg.name}"), rank
    return None


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


def _load(plan: Plan | str) -> Plan:
    return plan if isinstance(plan, Plan) else Plan.load(plan)


def check_numbers(steps: int, checkpoint_every: int, seed: int = 0) -> None:
    """The launch's numeric arguments, on every path (a multi-node plan only prints commands)."""
    for name, v, low in (("steps", steps, 1), ("checkpoint_every", checkpoint_every, 0), ("seed", seed, 0)):
        if isinstance(v, bool) or not isinstance(v, int):
            raise ValueError(f"{name} must be an integer, got {v!r}")
        if v < low:
            raise ValueError(f"{name} must be >= {low}, got {v}")


def cuda_device_count() -> int:
    """CUDA devices visible here; torch is imported only when a plan asks for a GPU."""
    try:
        import torch
    except ImportError:
        return 0
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def check_devices(plan: Plan) -> None:
    """Before any rank starts: the plan's node is this machine and its GPUs exist. CPU workers may
    outnumber the cores (oversubscribed ranks are slow, not wrong)."""
    nodes = plan_nodes(plan)
    if len(nodes) == 1 and not _is_local(nodes[0]):
        raise ValueError(f"plan runs on node {nodes[0]!r}, this machine is {socket.gethostname()!r}: run the "
                         "launch on that node (or plan for 'localhost')")
    gpus = [a for a in plan.used if a.type != "cpu"]
    if gpus:
        have = cuda_device_count()
        for local_rank, a in enumerate(gpus):
            if local_rank >= have:
                raise ValueError(f"plan device {a.device_index} ({a.type}) needs CUDA device {local_rank}, this "
                                 f"machine has {have} CUDA device(s)")


def check_emulate_wan(plan: Plan) -> None:
    """An emulated-datacenter run (executor/wan.py) can run here (ValueError saying why not)."""
    nodes = plan_nodes(plan)
    if len(nodes) < 2:
        raise ValueError(f"--emulate-wan: the plan's used devices sit on one node ({', '.join(nodes)}); emulated "
                         "datacenters need devices on at least 2 nodes (each node is one datacenter)")
    gpus = sorted({a.type for a in plan.used if a.type != "cpu"})
    if gpus:
        raise ValueError(f"--emulate-wan runs CPU ranks only (the plan uses {', '.join(gpus)}): NCCL between GPUs of "
                         "one machine takes shared memory or NVLink, past the emulated links")
    why = wan.unavailable_reason() or _store_unreachable_from_namespaces()
    if why is not None:
        raise ValueError(f"--emulate-wan: {why}")


def _store_unreachable_from_namespaces() -> str | None:
    """Why the ranks inside emulated datacenters could not write the run store, or None. Their
    namespaces reach no network outside them; a file (SQLite) or a Unix socket is not networked."""
    import urllib.parse

    from executor import db

    url = db.configured()
    if url is None or url.dialect != "postgresql":
        return None
    u = urllib.parse.urlsplit(url.target)
    host = (urllib.parse.parse_qs(u.query).get("host") or [u.hostname or ""])[0]
    if not host or host.startswith("/"):
        return None
    return (f"the ranks inside the emulated datacenters reach no network outside them, so not the PostgreSQL "
            f"store at {host} ({db.ENV_DB}); use the embedded store (unset {db.ENV_DB}) or a Unix-socket URL "
            "(postgresql://user@/db?host=/var/run/postgresql)")


def check_prefill(prefill: dict | None) -> None:
    if prefill is not None and not isinstance(prefill, dict):
        raise ValueError(f"prefill must be a JSON object, got {type(prefill).__name__}")


def _check_args(plan: Plan, steps: int, checkpoint_every: int, seed: int = 0, emulate_wan: bool = False,
                prefill: dict | None = None) -> None:
    check_numbers(steps, checkpoint_every, seed)
    check_prefill(prefill)
    if not plan.used:
        raise ValueError("plan uses no device")
    if emulate_wan:
        check_emulate_wan(plan)  # every node is emulated here, whatever it is called
        return
    if not runs_here(plan):
        raise ValueError(f"plan spans nodes {', '.join(plan_nodes(plan))}: run `python -m executor launch` "
                         "to print the per-node torchrun commands, or emulate them here with --emulate-wan")
    check_devices(plan)


def book_devices(plan: Plan, run_dir: str, pid: int | None = None) -> None:
    """Book the plan's devices for `run_dir` in the ledger (ValueError naming the run holding one)."""
    booking.Ledger().book(run_dir, booking.plan_device_keys(plan), pid)


def _check_not_running(run_dir: str) -> None:
    if has_run(run_dir):
        with contextlib.suppress(ValueError):
            m = read_metrics(run_dir)
            # start_run (our parent) writes the row before we run: that one is ours
            if m["status"] == "running" and m["launcher_pid"] not in (os.getpid(), os.getppid()):
                raise ValueError(f"run folder {run_dir} has a running run (launcher pid {m['launcher_pid']})")


# ---- killing -----------------------------------------------------------------------------


def _signal_group(pgid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def _worker_pids(store: MetricsStore) -> list[int]:
    return store.worker_pids()


def _is_our_worker(pid: int) -> bool:
    """Guard against pid reuse: only signal a process that is one of our ranks."""
    try:
        import psutil

        return "executor.worker" in " ".join(psutil.Process(pid).cmdline())
    except Exception:
        return False


def _kill_everything(agents: Sequence[subprocess.Popen], worker_pids: list[int]) -> None:
    """SIGTERM every torchrun agent's group and every rank's session, SIGKILL what is left after the grace."""
    workers = [p for p in worker_pids if _is_our_worker(p)]
    for agent in agents:
        if agent.poll() is None:
            _signal_group(agent.pid, signal.SIGTERM)
    for pid in workers:
        _signal_group(pid, signal.SIGTERM)  # each rank leads its own session (torchrun's start_new_session)
    deadline = time.monotonic() + TERM_GRACE_S
    while time.monotonic() < deadline:
        alive = any(a.poll() is None for a in agents) or any(_pid_alive(p) for p in workers)
        if not alive:
            break
        time.sleep(0.1)
    for agent in agents:
        _signal_group(agent.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            agent.wait(timeout=5)
    for pid in workers:
        if _pid_alive(pid):
            _signal_group(pid, signal.SIGKILL)


# ---- why a run failed --------------------------------------------------------------------


_RANK_EXIT = re.compile(r"rank\s*:\s*(\d+)[^\n]*\n\s*exitcode\s*:\s*(-?\d+)")


def _torchrun_exit_codes(log_path: str) -> tuple[dict[int, int], int | None]:
    """(rank -> exit code, the root-cause rank) from torchrun's failure summary
    ("rank : 1 (local_rank: 1)" then "exitcode : -9"; the "Root Cause" block names the first)."""
    try:
        with open(log_path, encoding="utf-8", errors="replace") as fh:
            text = fh.read()[-200_000:]
    except OSError:
        return {}, None
    codes = {int(r): int(c) for r, c in _RANK_EXIT.findall(text)}
    root = _RANK_EXIT.search(text[text.rfind("Root Cause"):]) if "Root Cause" in text else None
    return codes, int(root.group(1)) if root else None


def _describe_exit(code: int | None) -> str:
    if code is None:
        return "exit code unknown"
    if code < 0:
        with contextlib.suppress(ValueError):
            return f"killed by signal {-code} ({signal.Signals(-code).name})"
        return f"killed by signal {-code}"
    return f"exit code {code}"


def failure_reason(store: MetricsStore, torchrun_log: str, rc: int | None) -> tuple[str, int | None]:
    """(reason, failed rank): a rank's own error unless it only lost a peer; else a rank that
    died without a word (killed); else what torchrun said."""
    events = store.events()
    failed = [e for e in events if e["kind"] == "rank_failed"]
    primary = [e for e in failed if not any(p in e["message"].lower() for p in _PEER_ERRORS)]
    if primary:
        return primary[0]["message"], primary[0]["rank"]
    codes, root = _torchrun_exit_codes(torchrun_log)
    reported = {e["rank"] for e in events if e["kind"] in ("rank_failed", "rank_done")}
    registered = store.registered_ranks()
    silent = [r for r in registered if r not in reported]
    if silent:
        # torchrun's first observed failure, unless it is a rank that spoke; then one killed by a signal
        killed = [r for r in silent if r == root] or [r for r in silent if codes.get(r, 0) < 0] or silent
        r = killed[0]
        return f"rank {r} died without reporting an error ({_describe_exit(codes.get(r))})", r
    if failed:
        return failed[0]["message"], failed[0]["rank"]
    if codes:
        r = min(codes)
        return f"rank {r} failed ({_describe_exit(codes[r])})", r
    return f"torchrun exited with code {rc} before the ranks started (see logs/torchrun.log)", None


# ---- the launcher ------------------------------------------------------------------------


@contextlib.contextmanager
def _stop_on_signals(flag: threading.Event):
    """SIGTERM/SIGINT to the launcher = stop the run (only from the main thread)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    old = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    for s in old:
        signal.signal(s, lambda *_: flag.set())
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)


def check_init_from(plan: Plan, init_from: str | None) -> str | None:
    """The absolute Hugging Face folder to start from, refused (ValueError) when its config is not the
    plan's model: the weights must fill exactly the model the plan was made for."""
    if init_from is None:
        return None
    from contracts.specs import get_model

    folder = os.path.abspath(init_from)
    if not os.path.isfile(os.path.join(folder, "config.json")):
        raise ValueError(f"--init-from {init_from}: no config.json in that folder (a Hugging Face model folder)")
    want, got = get_model(plan.model), get_model(os.path.join(folder, "config.json"))
    if replace(want, name="") != replace(got, name=""):
        raise ValueError(f"--init-from {init_from}: its config describes another model than the plan's "
                         f"{plan.model!r} ({got.num_params:,} vs {want.num_params:,} parameters); plan with "
                         f"--model {os.path.join(folder, 'config.json')}")
    return folder


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


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


def launch_run(plan: Plan | str, steps: int, run_dir: str, seed: int = 0, resume: bool = False,
               checkpoint_every: int = 0, corpus_dir: str | None = None, optim: OptimConfig | None = None,
               tokenizer: str | None = None, init_from: str | None = None, emulate_wan: bool = False,
               prefill: dict | None = None) -> str:
    """Run `plan` for `steps` global steps with torchrun; block until it ends.
    Returns the final status: "done" | "failed" | "stopped". ValueError on bad input.
    `corpus_dir`: the training data (a folder of text files, JSON Lines with "text", or token
    files; default the Python standard library), `tokenizer`: a tokenizer.json (default bytes),
    `init_from`: a Hugging Face model folder to start from (each rank reads its own slices),
    `emulate_wan`: each plan node is a datacenter emulated on this machine (executor/wan.py),
    `prefill`: a JSON object every rank gets as `--prefill` (executor.prefill)."""
    plan = _load(plan)
    _check_args(plan, steps, checkpoint_every, seed, emulate_wan, prefill)
    init_from = check_init_from(plan, init_from)
    os.makedirs(os.path.join(run_dir, "logs"), exist_ok=True)
    _check_not_running(run_dir)
    book_devices(plan, run_dir)  # start_run booked already: the launcher takes the booking over
    try:
        return _launch_booked(plan, steps, run_dir, seed, resume, checkpoint_every, corpus_dir, optim, tokenizer,
                              init_from, emulate_wan, prefill)
    finally:
        booking.Ledger().release(run_dir)


def _launch_booked(plan: Plan, steps: int, run_dir: str, seed: int, resume: bool, checkpoint_every: int,
                   corpus_dir: str | None, optim: OptimConfig | None, tokenizer: str | None,
                   init_from: str | None, emulate_wan: bool, prefill: dict | None) -> str:
    meta = ckpt.check_resumable(run_dir, plan) if resume else None
    from contracts.specs import get_model

    tokens = build_corpus(corpus_dir, tokenizer, vocab_size=get_model(plan.model).vocab_size)
    copy_tokenizer(tokenizer, run_dir)
    emu = setup_emulation(plan, run_dir)
    try:
        return _launch_emulated(plan, steps, run_dir, seed, resume, checkpoint_every, optim, init_from, meta,
                                tokens, emu, emulate_wan, prefill)
    finally:
        remove_emulation(emu)


def _rank_env(run_dir: str, emu: Emulation) -> dict[str, str]:
    """The environment of every torchrun agent and its ranks."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", GPUMIX_LAUNCHED="1",
               PYTHONPATH=os.pathsep.join(p for p in (PROJECT_ROOT, os.environ.get("PYTHONPATH")) if p))
    env.pop(cgroups.ENV_CGROUPS, None)
    if emu.mode == "cgroup":
        env[cgroups.ENV_CGROUPS] = os.path.join(os.path.abspath(run_dir), EMULATION_FILE)
    return env


def _start_agent(cmd: list[str], env: dict[str, str], log_path: str) -> subprocess.Popen:
    log.info("starting %s", shlex.join(cmd))
    with open(log_path, "ab") as out:
        return subprocess.Popen(cmd, cwd=PROJECT_ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)


def _agent_log(run_dir: str, i: int) -> str:
    return os.path.join(run_dir, "logs", f"torchrun-node{i}.log")


def _start_wan_agents(setup: wan.WanSetup, plan: Plan, wargs: list[str], env: dict[str, str],
                      run_dir: str) -> list[subprocess.Popen]:
    """One torchrun agent per plan node, each inside its node's namespace: c10d rendezvous hosted by
    node 0 at its namespace address, gloo bound to the node's host interface (repeated once per
    TCP connection per transfer)."""
    endpoint = f"{setup.addr(0)}:{DEFAULT_RDZV_PORT}"  # nothing else listens inside namespace 0
    agents = []
    for i, node in enumerate(setup.nodes):
        cmd = setup.exec_prefix(i) + node_torchrun_command(
            sys.executable, plan, setup.nodes, i, endpoint, setup.run_id, wargs,
            extra=[f"--rdzv-conf=is_host={1 if i == 0 else 0}", f"--local-addr={setup.addr(i)}"])
        agents.append(_start_agent(cmd, dict(env, GPUMIX_NODE=node, GLOO_SOCKET_IFNAME=setup.gloo_ifname),
                                   _agent_log(run_dir, i)))
    return agents


def _start_wan(plan: Plan, run_dir: str, store: MetricsStore) -> tuple[wan.WanSetup, subprocess.Popen]:
    """The run's emulated datacenters and their guard (it removes them if this launcher is killed)."""
    run_id = run_id_of(run_dir)
    stale = wan.remove_stale(run_id)
    if stale:
        store.add_event("emulation", f"wan: removed stale namespaces {', '.join(stale)}")
    nodes = plan_nodes(plan)
    setup = wan.create(plan, nodes, run_id)
    try:
        setup.save(os.path.join(run_dir, wan.WAN_FILE))
        with open(os.path.join(run_dir, "logs", "wan-guard.log"), "ab") as out:
            guard = subprocess.Popen(wan.guard_command(setup, os.path.abspath(run_dir)), cwd=PROJECT_ROOT,
                                     env=dict(os.environ, PYTHONPATH=PROJECT_ROOT), stdout=out,
                                     stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
    except BaseException:
        wan.remove(setup)
        raise
    for line in setup.describe() + wan.connections_of(plan, nodes)[1]:
        store.add_event("emulation", line)
    return setup, guard


def _stop_wan(setup: wan.WanSetup, guard: subprocess.Popen | None) -> None:
    """Remove the namespaces (every process left in them first), then end the guard."""
    try:
        wan.remove(setup)
    except OSError as e:
        log.error("%s", e)
    if guard is not None:
        guard.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            guard.wait(timeout=10)


def _merge_agent_logs(run_dir: str, n: int, dest: str) -> None:
    """logs/torchrun.log: every agent's log one after the other (failure_reason reads one file)."""
    with open(dest, "ab") as out:
        for i in range(n):
            with contextlib.suppress(OSError), open(_agent_log(run_dir, i), "rb") as fh:
                out.write(f"==== torchrun agent of node {i} ====\n".encode())
                shutil.copyfileobj(fh, out)


def _watch(agents: Sequence[subprocess.Popen], store: MetricsStore, stop: threading.Event) -> None:
    """Until every agent has ended, a stop is asked, a registered rank has been dead for
    DEAD_RANK_GRACE_S while an agent runs, or one agent failed that long ago while others run."""
    dead_since: float | None = None
    failed_since: float | None = None
    while any(a.poll() is None for a in agents):
        if stop.is_set() or store.stop_requested():
            stop.set()
            return
        now = time.monotonic()
        dead = [p for p in _worker_pids(store) if not _pid_alive(p)]
        if dead and dead_since is None:
            dead_since = now
        if dead_since is not None and now - dead_since > DEAD_RANK_GRACE_S:
            log.warning("rank pid(s) %s dead for %.0f s while torchrun runs: ending the run", dead, DEAD_RANK_GRACE_S)
            return
        if failed_since is None and any(a.poll() not in (None, 0) for a in agents):
            failed_since = now
        if failed_since is not None and now - failed_since > DEAD_RANK_GRACE_S:
            log.warning("a torchrun agent failed %.0f s ago while others run: ending the run", DEAD_RANK_GRACE_S)
            return
        time.sleep(POLL_S)


def _exit_code(agents: Sequence[subprocess.Popen]) -> int | None:
    """0 when every agent ended with 0; else the first failure's code (None: one still ran)."""
    codes = [a.poll() for a in agents]
    failed = [c for c in codes if c not in (None, 0)]
    return failed[0] if failed else (None if None in codes else 0)


def _launch_emulated(plan: Plan, steps: int, run_dir: str, seed: int, resume: bool, checkpoint_every: int,
                     optim: OptimConfig | None, init_from: str | None, meta: dict | None, tokens: str,
                     emu: Emulation, emulate_wan: bool = False, prefill: dict | None = None) -> str:
    if emu.mode == "sleep":
        plan = sleep_fallback_plan(plan)
    plan_path = os.path.join(os.path.abspath(run_dir), "plan.json")
    plan.save(plan_path)
    store = MetricsStore(run_dir)
    store.init_run(plan, steps, seed, backend="gloo", resume=resume)
    if emu.mode != "none":
        store.add_event("emulation", f"{emu.mode}: {emu.reason}")
    if plan.dtype != "fp32" and all(a.type == "cpu" for a in plan.used):
        store.add_event("note", f"plan dtype {plan.dtype}: CPU ranks train in fp32 (autocast is for GPUs)")
    if meta is not None:
        store.truncate_after(int(meta["step"]))
        store.add_event("resume", f"resuming from the checkpoint of step {meta['step']}")
    with open(os.path.join(run_dir, "launcher.pid"), "w") as fh:
        fh.write(str(os.getpid()))
    wargs = worker_args(plan_path, steps, os.path.abspath(run_dir), seed, resume, checkpoint_every,
                        tokens_path=tokens, optim=optim, init_from=init_from, prefill=prefill)
    wargs = cgroups.exec_command(wargs) if emu.mode == "cgroup" else wargs
    env = _rank_env(run_dir, emu)
    torchrun_log = os.path.join(run_dir, "logs", "torchrun.log")
    stop = threading.Event()
    agents: list[subprocess.Popen] = []
    setup: wan.WanSetup | None = None
    guard: subprocess.Popen | None = None
    status, reason, failed_rank = "failed", None, None
    try:
        with _stop_on_signals(stop):
            if emulate_wan:
                setup, guard = _start_wan(plan, run_dir, store)
                agents = _start_wan_agents(setup, plan, wargs, env, run_dir)
            else:
                agents = [_start_agent(local_torchrun_command(len(plan.used), free_port(), wargs), env, torchrun_log)]
            with open(os.path.join(run_dir, "torchrun.pid"), "w") as fh:
                fh.write(str(agents[0].pid))  # the rendezvous host's agent
            _watch(agents, store, stop)
        rc = _exit_code(agents)
        _kill_everything(agents, _worker_pids(store))
        if setup is not None:
            _merge_agent_logs(run_dir, len(agents), torchrun_log)
        if stop.is_set() or store.stop_requested():
            status, reason = "stopped", "stopped on request"
        elif _last_step(store) == steps and (rc == 0 or _all_ranks_done(store)):
            status = "done"
            if rc != 0:  # every rank said it finished; one crashed on its way out
                store.add_event("exit", f"torchrun exit code {rc} after every rank reported all steps done")
        else:
            reason, failed_rank = oom_reason(emu) or failure_reason(store, torchrun_log, rc)
    except BaseException as e:
        reason = f"launcher error: {type(e).__name__}: {e}"
        _kill_everything(agents, _worker_pids(store))
        raise
    finally:
        if setup is not None:  # torn down before the run's end is recorded: "done" means nothing is left
            _stop_wan(setup, guard)
        store.finish(status, reason, failed_rank)
        store.close()
        log.info("run %s ended: %s%s", run_dir, status, f" ({reason})" if reason else "")
    return status


def _all_ranks_done(store: MetricsStore) -> bool:
    return store.all_ranks_done()  # this launch's ranks, not a resumed run's earlier ones


def _last_step(store: MetricsStore) -> int:
    return store.last_step()


# ---- non-blocking: the dashboard -------------------------------------------------------


@dataclass(frozen=True)
class RunHandle:
    run_dir: str
    pid: int  # the launcher's

    def metrics(self) -> dict:
        return read_metrics(self.run_dir)

    def status(self) -> str:
        try:
            return read_metrics(self.run_dir)["status"]
        except ValueError:
            return "running" if _pid_alive(self.pid) else "failed"

    def wait(self, timeout_s: float | None = None) -> str:
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while self.status() == "running":
            if deadline is not None and time.monotonic() > deadline:
                break
            time.sleep(POLL_S)
        return self.status()


def start_run(plan: Plan | str, steps: int, run_dir: str | None = None, seed: int = 0, resume: bool = False,
              checkpoint_every: int = 0, corpus_dir: str | None = None, optim: OptimConfig | None = None,
              tokenizer: str | None = None, init_from: str | None = None, emulate_wan: bool = False,
              prefill: dict | None = None) -> RunHandle:
    """Start `python -m executor launch ...` in a new session and return at once. The run
    survives the caller (a browser reload, an app restart). `run_dir` defaults to a new
    folder under contracts.paths.runs_dir(). `emulate_wan`, `prefill`: as launch_run (the
    prefill object travels as the run folder's prefill.json)."""
    plan = _load(plan)
    _check_args(plan, steps, checkpoint_every, seed, emulate_wan, prefill)
    init_from = check_init_from(plan, init_from)
    run_dir = os.path.abspath(run_dir or new_run_dir())
    os.makedirs(os.path.join(run_dir, "logs"), exist_ok=True)
    _check_not_running(run_dir)
    if resume:
        ckpt.check_resumable(run_dir, plan)
    book_devices(plan, run_dir)  # held by this process until the launcher takes it over
    extra = ["--emulate-wan"] if emulate_wan else []
    if prefill is not None:
        prefill_path = os.path.join(run_dir, PREFILL_FILE)
        with open(prefill_path, "w", encoding="utf-8") as fh:
            json.dump(prefill, fh)
        extra += ["--prefill", prefill_path]
    try:
        proc = _start_launcher(plan, steps, run_dir, seed, resume, checkpoint_every, corpus_dir, optim, tokenizer,
                               init_from, extra)
    except BaseException:
        booking.Ledger().release(run_dir)
        raise
    booking.Ledger().book(run_dir, (), proc.pid)  # the launcher holds it now (and again from inside)
    return RunHandle(run_dir, proc.pid)


def _reap(proc: subprocess.Popen) -> None:
    """Wait for the launcher in a daemon thread: it leaves no <defunct> child behind the dashboard."""
    threading.Thread(target=proc.wait, name=f"reap-{proc.pid}", daemon=True).start()


def _start_launcher(plan: Plan, steps: int, run_dir: str, seed: int, resume: bool, checkpoint_every: int,
                    corpus_dir: str | None, optim: OptimConfig | None, tokenizer: str | None,
                    init_from: str | None, extra_args: Sequence[str] = ()) -> subprocess.Popen:
    """`python -m executor launch ...` for the run in a new session (the local and the SLURM
    backends alike: `extra_args` carries the backend's own flags), its output in logs/launcher.log."""
    plan_path = os.path.join(run_dir, "plan.json")
    plan.save(plan_path)
    # the run row exists before the launcher has imported anything: a page polling the store
    # sees "running / starting" at once (the launcher rewrites the row with its own pid)
    store = MetricsStore(run_dir)
    store.init_run(plan, steps, seed, backend="gloo", resume=resume)
    cmd = [sys.executable, "-m", "executor", "launch", "--plan", plan_path, "--steps", str(steps),
           "--run-dir", run_dir, "--seed", str(seed), "--checkpoint-every", str(checkpoint_every)]
    if resume:
        cmd.append("--resume")
    if corpus_dir:
        cmd += ["--data", corpus_dir]
    if tokenizer:
        cmd += ["--tokenizer", tokenizer]
    if init_from:
        cmd += ["--init-from", init_from]
    if optim is not None:
        cmd += optim_flags(optim)
    cmd += list(extra_args)
    with open(os.path.join(run_dir, "logs", "launcher.log"), "ab") as out:
        proc = subprocess.Popen(cmd, cwd=PROJECT_ROOT, stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
    _reap(proc)
    store.set_launcher_pid(proc.pid)
    store.close()
    return proc


def stop_run(run_dir: str, timeout_s: float = 30.0) -> str:
    """Stop the run: ask the launcher through the store; if it does not end the run within
    `timeout_s` (or is gone, leaving torchrun and the ranks behind), kill the launcher,
    torchrun's group and every rank, and record "stopped". Returns the final status."""
    if not has_run(run_dir):
        raise ValueError(f"no run at {run_dir}")
    m = read_metrics(run_dir)
    launcher = m["launcher_pid"] if m["launcher_pid"] != os.getpid() else None
    torchrun_pid = _read_pid(os.path.join(run_dir, "torchrun.pid"))
    store = MetricsStore(run_dir)
    try:
        workers = [p for p in _worker_pids(store) if _is_our_worker(p)]
        left = _pid_alive(launcher) or (torchrun_pid is not None and _pid_alive(torchrun_pid)) or bool(workers)
        left = left or bool(wan.find(wan.run_prefix(run_id_of(run_dir))))  # a killed launcher's datacenters
        if not _pid_alive(launcher):
            from executor.slurm import cancel_slurm_run  # a SLURM job left behind by a killed launcher

            left = cancel_slurm_run(run_dir) or left
        if m["status"] != "running" and not left:
            return m["status"]
        store.request_stop()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and _pid_alive(launcher):
            time.sleep(POLL_S)  # the launcher polls the flag, ends everything and records "stopped"
        if launcher and _pid_alive(launcher):
            with contextlib.suppress(OSError):
                os.kill(launcher, signal.SIGKILL)  # the launcher only: its group may be a user's shell
        if torchrun_pid and _pid_alive(torchrun_pid):
            _signal_group(torchrun_pid, signal.SIGKILL)
        _kill_everything((), _worker_pids(store))
        _remove_leftovers(run_id_of(run_dir))
        if store.status() in (None, "running"):
            store.finish("stopped", "stopped on request (the launcher did not end the run; killed)")
    finally:
        store.close()
    booking.Ledger().release(run_dir)  # everything of the run is gone now
    return read_metrics(run_dir)["status"]


def _remove_leftovers(run_id: str) -> None:
    """A killed launcher's emulated datacenters (if its guard has not removed them yet) and cgroups."""
    for remove in (lambda: wan.remove_run(run_id), lambda: cgroups.remove_all(cgroups.run_prefix(run_id))):
        try:
            remove()
        except OSError as e:
            log.error("%s", e)


def _read_pid(path: str) -> int | None:
    try:
        with open(path) as fh:
            return int(fh.read().strip())
    except (OSError, ValueError):
        return None
