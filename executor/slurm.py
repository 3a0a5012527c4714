"""The `slurm` launch backend: a plan as one SLURM job, watched until it ends.

    python -m executor launch --plan P --steps N --run-dir R --backend slurm [--gres-name gpu]

The launcher (this process, on the submit host) checks the plan's nodes against
`scontrol show node -o`, writes the run store exactly as the local launcher does, and submits
one job with `sbatch`, an argument list: one component per group of plan nodes asking the same
GRES (`--nodes=k --nodelist=... --gres=<gres name>:<type>:<n>`; several groups make a
heterogeneous job, components separated by ":"). The generated batch script only starts one
`srun` per component, each running one agent per node (`python -m executor.slurm agent`), and
ends the job when the first of them fails; every value in it is validated and shlex-quoted.

The agent, on its node, starts torchrun with the node's share of the plan's ranks and a c10d
rendezvous hosted by the first plan node (`is_host` said explicitly, `--local-addr` the node's
SLURM address, gloo bound to the interface holding that address), and records `node_up` and
`node_exit` events in the run store.

What SLURM says (`scontrol show job -o`) is the truth the launcher follows: pending, running,
completed, failed, cancelled. A stop (`executor stop`, the dashboard, SIGTERM) is `scancel`;
a node that dies (SLURM reports it down, or its agent vanished without an exit while another
node's agent failed) ends the run as failed with the node and the reason recorded. The job id
is in the events (`slurm_job`) and in `slurm.json` in the run folder.

Every node needs this repository and the run folder at the same paths (a shared filesystem),
as torchrun's multi-node runs do.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
import zlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from executor import booking
from executor.launch import (DEFAULT_RDZV_PORT, RunHandle, _check_not_running, _last_step, _reap,
                             _stop_on_signals, check_init_from, check_numbers, copy_tokenizer, failure_reason,
                             new_run_dir, optim_flags, plan_nodes, worker_args, _all_ranks_done)
from executor.store import MetricsStore
from planner.core.paths import PROJECT_ROOT
from planner.core.plan import Plan
from profiler.slurm_inventory import (SlurmNode, catalog_type, check_name, default_gres_name, parse_fields,
                                      read_nodes, slurm_client)

if TYPE_CHECKING:
    from models.optim import OptimConfig

log = logging.getLogger(__name__)

JOB_FILE = "slurm.json"
ACTIVE_STATES = ("PENDING", "CONFIGURING", "RUNNING", "SUSPENDED", "REQUEUED", "REQUEUE_HOLD", "RESIZING",
                 "SIGNALING", "STAGE_OUT", "STOPPED", "RESV_DEL_HOLD", "REQUEUE_FED")
FAILED_STATES = ("FAILED", "NODE_FAIL", "TIMEOUT", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE", "PREEMPTED")
JOB_POLL_S = 1.0  # how often the launcher asks slurmctld about its job (a stop is answered within it)
NODE_CHECK_S = 2.0  # how often the launcher asks SLURM about the job's nodes
AGENT_FAIL_GRACE_S = 10.0  # an agent failed but the job still runs (its batch host died): scancel
COMPLETING_WAIT_S = 120.0  # after the end: wait for SLURM to clean the job's steps away
RDZV_PORT_SPAN = 10_000  # the rendezvous port: base + a hash of the run id within this span


@dataclass(frozen=True)
class SlurmSettings:
    """How this site's SLURM is asked: the GRES name of its accelerators (`gpu`, or the count-only
    name the site uses), a partition, a time limit, the rendezvous port base, GRES type names that
    are not catalog names (type_map)."""

    gres_name: str = field(default_factory=default_gres_name)
    partition: str | None = None
    time_limit_min: int | None = None
    rdzv_port_base: int = DEFAULT_RDZV_PORT
    type_map: tuple[tuple[str, str], ...] = ()

    def __post_init__(self) -> None:
        check_name(self.gres_name, "GRES name")
        if self.partition is not None:
            check_name(self.partition, "partition")
        if self.time_limit_min is not None and not (isinstance(self.time_limit_min, int) and self.time_limit_min > 0):
            raise ValueError(f"time limit must be a positive number of minutes, got {self.time_limit_min!r}")
        if not 1024 <= self.rdzv_port_base <= 65535 - RDZV_PORT_SPAN:
            raise ValueError(f"rendezvous port base must be in [1024, {65535 - RDZV_PORT_SPAN}], "
                             f"got {self.rdzv_port_base}")

    def to_args(self) -> list[str]:
        """`executor launch` flags that reproduce these settings."""
        out = ["--backend", "slurm", "--gres-name", self.gres_name, "--rdzv-port", str(self.rdzv_port_base)]
        out += ["--partition", self.partition] if self.partition else []
        out += ["--time-limit", str(self.time_limit_min)] if self.time_limit_min else []
        for k, v in self.type_map:
            out += ["--type-map", f"{k}={v}"]
        return out


@dataclass(frozen=True)
class Component:
    """One allocation of the job: nodes asking the same GRES."""

    nodes: tuple[str, ...]
    gres: tuple[tuple[str, int], ...]  # (SLURM GRES type, count per node)

    def gres_arg(self, name: str) -> str:
        return ",".join(f"{name}:{t}:{n}" if t else f"{name}:{n}" for t, n in self.gres)


# ---- from the plan to the job --------------------------------------------------------------


def node_requests(plan: Plan, nodes: dict[str, SlurmNode], settings: SlurmSettings) -> list[Component]:
    """One component per run of consecutive plan nodes with the same GRES request; ValueError when
    a plan node is unknown to SLURM, down, or lacks the plan's devices."""
    type_map = dict(settings.type_map)
    per_node: list[tuple[str, tuple[tuple[str, int], ...]]] = []
    for name in plan_nodes(plan):
        check_name(name, "plan node")
        node = nodes.get(name)
        if node is None:
            raise ValueError(f"plan node {name!r} is not a SLURM node (SLURM has: {', '.join(nodes) or 'none'}): "
                             "plan on the cluster file of `python -m profiler inventory --slurm`")
        if not node.usable:
            raise ValueError(f"SLURM node {name} is {node.state}" + (f" ({node.reason})" if node.reason else ""))
        want: dict[str, int] = {}
        for a in plan.used:
            if a.node == name:
                want[a.type] = want.get(a.type, 0) + 1
        request = []
        for plan_type, count in want.items():
            have = {t: n for t, n in node.gres.items() if _maps_to(t, plan_type, type_map)}
            if sum(have.values()) < count:
                raise ValueError(f"SLURM node {name} has {sum(have.values())} {settings.gres_name} GRES of type "
                                 f"{plan_type} (its GRES: {node.gres or 'none'}), the plan uses {count}")
            for t, n in have.items():
                take = min(n, count)
                request.append((t, take))
                count -= take
                if not count:
                    break
        per_node.append((name, tuple(request)))
    components: list[Component] = []
    for name, req in per_node:
        if components and components[-1].gres == req:
            components[-1] = Component(components[-1].nodes + (name,), req)
        else:
            components.append(Component((name,), req))
    return components


def _maps_to(gres_type: str, plan_type: str, type_map: dict[str, str]) -> bool:
    try:
        return catalog_type(gres_type, type_map) == plan_type
    except ValueError:
        return False


def rdzv_port(run_id: str, settings: SlurmSettings) -> int:
    return settings.rdzv_port_base + zlib.crc32(run_id.encode()) % RDZV_PORT_SPAN


def run_id_of(run_dir: str) -> str:
    return re.sub(r"[^A-Za-z0-9_-]", "-", os.path.basename(os.path.abspath(run_dir)))[:64] or "run"


def batch_script(components: list[Component], agent_args: list[str]) -> str:
    """The job's script: one srun per component (one agent per node), the job ends with the first
    agent that fails (SLURM then ends the other steps) or when all are done."""
    lines = ["#!/bin/bash", "# GPUMix run: one torchrun agent per node (generated by executor/slurm.py)", "set -u",
             "# an srun whose node died may outlive the script: end every one we started on the way out",
             "cleanup() { kill $(jobs -p) 2>/dev/null; sleep 1; kill -9 $(jobs -p) 2>/dev/null; }",
             "trap cleanup EXIT"]
    het = len(components) > 1
    for i, c in enumerate(components):
        srun = ["srun", *([f"--het-group={i}"] if het else []), f"--nodes={len(c.nodes)}", "--ntasks-per-node=1",
                "--kill-on-bad-exit=1", "--export=ALL", sys.executable, "-m", "executor.slurm", "agent",
                *agent_args]
        lines.append(shlex.join(srun) + " &")
    lines.append(f"for _ in {' '.join(str(i) for i in range(len(components)))}; do")
    lines.append("    wait -n || exit $?")
    lines.append("done")
    return "\n".join(lines) + "\n"


def sbatch_command(components: list[Component], script: str, run_dir: str, settings: SlurmSettings) -> list[str]:
    if "%" in run_dir:
        raise ValueError(f"run folder {run_dir}: '%' is SLURM's file name pattern character; choose another name")
    args = ["sbatch", "--parsable", f"--job-name=gpumix-{run_id_of(run_dir)}",
            f"--output={os.path.join(run_dir, 'logs', 'slurm-%j.out')}", f"--chdir={PROJECT_ROOT}", "--export=ALL"]
    for i, c in enumerate(components):
        if i:
            args.append(":")
        args += [f"--nodes={len(c.nodes)}", f"--nodelist={','.join(c.nodes)}", "--ntasks-per-node=1",
                 f"--gres={c.gres_arg(settings.gres_name)}"]
        args += [f"--partition={settings.partition}"] if settings.partition else []
        args += [f"--time={settings.time_limit_min}"] if settings.time_limit_min else []
    return args + [script]


# ---- what SLURM says -----------------------------------------------------------------------


@dataclass(frozen=True)
class JobState:
    job_id: str
    state: str  # the whole job's: the worst component's
    reason: str
    nodes: tuple[str, ...]
    known: bool = True  # False: SLURM has forgotten the job (MinJobAge)

    @property
    def active(self) -> bool:
        return self.known and self.state in ACTIVE_STATES

    @property
    def completing(self) -> bool:
        return self.known and self.state == "COMPLETING"


def parse_job(text: str, job_id: str) -> JobState:
    """`scontrol show job -o <id>` (one line per heterogeneous component) -> the job's state."""
    comps = [parse_fields(line) for line in text.splitlines() if line.startswith("JobId=")]
    if not comps:
        return JobState(job_id, "UNKNOWN", "", (), known=False)
    states = [c.get("JobState", "UNKNOWN") for c in comps]
    order = [s for s in ACTIVE_STATES if s in states] or ["COMPLETING"] * ("COMPLETING" in states) or [
        s for s in FAILED_STATES if s in states] or ["CANCELLED"] * ("CANCELLED" in states) or states
    reasons = list(dict.fromkeys(c.get("Reason", "None") for c in comps if c.get("Reason", "None") not in (
        "None", "(null)")))  # each once: the components of a job often share theirs
    nodes: list[str] = []
    for c in comps:
        nodes += expand_hostlist(c.get("NodeList", ""))
    return JobState(job_id, order[0], "; ".join(reasons), tuple(nodes))


def expand_hostlist(text: str) -> list[str]:
    """`n[1-3,5],gpu7` -> ["n1", "n2", "n3", "n5", "gpu7"] (SLURM's compact host lists)."""
    out: list[str] = []
    if not text or text == "(null)":
        return out
    for m in re.finditer(r"([^,\[]+)(?:\[([^\]]+)\])?", text):
        prefix, ranges = m.group(1), m.group(2)
        if not ranges:
            out.append(prefix)
            continue
        for r in ranges.split(","):
            lo, _, hi = r.partition("-")
            width = len(lo)
            out += [f"{prefix}{i:0{width}d}" for i in range(int(lo), int(hi or lo) + 1)]
    return out


def job_state(job_id: str) -> JobState:
    try:
        text = slurm_client(["scontrol", "show", "job", "-o", job_id])
    except ValueError as e:
        if "invalid job id" in str(e).lower():
            return JobState(job_id, "UNKNOWN", "", (), known=False)
        raise
    return parse_job(text, job_id)


def cancel_job(job_id: str) -> None:
    slurm_client(["scancel", "--full", check_name(job_id, "job id")])  # the batch script and every step


def read_job_file(run_dir: str) -> dict | None:
    try:
        with open(os.path.join(run_dir, JOB_FILE)) as fh:
            return json.load(fh)
    except (OSError, ValueError):
        return None


def slurm_device_keys(plan: Plan) -> list[str]:
    """The ledger's names of the plan's SLURM devices: `slurm:<node>/<index within the node>`
    (booking.plan_device_keys names the one node of a single-node plan "local": here it is a
    SLURM node like any other)."""
    return [f"slurm:{a.node}/{key.split('/', 1)[1]}" for a, key in zip(plan.used, booking.plan_device_keys(plan))]


# ---- the launcher --------------------------------------------------------------------------


def launch_slurm(plan: Plan | str, steps: int, run_dir: str, settings: SlurmSettings | None = None, seed: int = 0,
                 resume: bool = False, checkpoint_every: int = 0, corpus_dir: str | None = None,
                 optim: OptimConfig | None = None, tokenizer: str | None = None, init_from: str | None = None) -> str:
    """Submit `plan` as one SLURM job and follow it until it ends; "done" | "failed" | "stopped"."""
    from executor import checkpoint as ckpt
    from executor.corpus import build_corpus
    from planner.core.specs import get_model

    settings = settings or SlurmSettings()
    plan = plan if isinstance(plan, Plan) else Plan.load(plan)
    check_numbers(steps, checkpoint_every, seed)
    if not plan.used:
        raise ValueError("plan uses no device")
    init_from = check_init_from(plan, init_from)
    run_dir = os.path.abspath(run_dir)
    nodes = {n.name: n for n in read_nodes(settings.gres_name, plan_nodes(plan))}
    components = node_requests(plan, nodes, settings)
    os.makedirs(os.path.join(run_dir, "logs"), exist_ok=True)
    _check_not_running(run_dir)
    if resume:
        ckpt.check_resumable(run_dir, plan)
    ledger = booking.Ledger()
    ledger.book(run_dir, slurm_device_keys(plan))
    try:
        plan_path = os.path.join(run_dir, "plan.json")
        plan.save(plan_path)
        tokens = build_corpus(corpus_dir, tokenizer, vocab_size=get_model(plan.model).vocab_size)
        copy_tokenizer(tokenizer, run_dir)
        store = MetricsStore(run_dir)
        try:
            store.init_run(plan, steps, seed, backend="gloo", resume=resume)
            if resume:
                meta = ckpt.check_resumable(run_dir, plan)
                store.truncate_after(int(meta["step"]))
                store.add_event("resume", f"resuming from the checkpoint of step {meta['step']}")
            with open(os.path.join(run_dir, "launcher.pid"), "w") as fh:
                fh.write(str(os.getpid()))
            wargs = worker_args(plan_path, steps, run_dir, seed, resume, checkpoint_every, tokens_path=tokens,
                                optim=optim, init_from=init_from)
            return _follow(store, plan, steps, run_dir, settings, components, nodes, wargs)
        finally:
            store.close()
    finally:
        ledger.release(run_dir)


def _submit(run_dir: str, plan: Plan, settings: SlurmSettings, components: list[Component],
            nodes: dict[str, SlurmNode], wargs: list[str]) -> str:
    first = components[0].nodes[0]
    run_id = run_id_of(run_dir)
    addrs = [f"{n}={check_name(nodes[n].addr, 'node address')}" for n in plan_nodes(plan)]
    agent = ["--plan", os.path.join(run_dir, "plan.json"), "--run-dir", run_dir, "--first-node", first,
             "--rdzv-endpoint", f"{nodes[first].addr}:{rdzv_port(run_id, settings)}", "--rdzv-id", run_id,
             *[x for a in addrs for x in ("--node-addr", a)], "--", *wargs]
    script = os.path.join(run_dir, "slurm.sbatch")
    with open(script, "w") as fh:
        fh.write(batch_script(components, agent))
    env = dict(os.environ, PYTHONUNBUFFERED="1",
               PYTHONPATH=os.pathsep.join(p for p in (PROJECT_ROOT, os.environ.get("PYTHONPATH")) if p))
    cmd = sbatch_command(components, script, run_dir, settings)
    log.info("submitting %s", shlex.join(cmd))
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=60, env=env, stdin=subprocess.DEVNULL)
    if r.returncode != 0:
        msg = (r.stderr or r.stdout).strip().splitlines()
        raise ValueError(f"sbatch refused the job: {msg[-1] if msg else f'exit code {r.returncode}'}")
    return r.stdout.strip().split(";")[0]


def _events(store: MetricsStore, kind: str) -> list[str]:
    return [r[0] for r in store.conn.execute("SELECT message FROM events WHERE kind = ? ORDER BY id", (kind,))]


def _agent_nodes(store: MetricsStore) -> tuple[set[str], dict[str, int]]:
    """(nodes whose agent started, node -> its torchrun's exit code) from the agents' events."""
    up = {m.split(":", 1)[0].removeprefix("node ") for m in _events(store, "node_up")}
    exits = {}
    for m in _events(store, "node_exit"):
        node, _, rest = m.partition(":")
        code = re.search(r"exit code (-?\d+)", rest)
        exits[node.removeprefix("node ")] = int(code.group(1)) if code else 1
    return up, exits


def dead_nodes(store: MetricsStore, job_nodes: list[str], gres_name: str) -> list[tuple[str, str]]:
    """(node, why) for each node of the job that died: SLURM reports it down, or its agent started
    and vanished without an exit while another agent failed."""
    up, exits = _agent_nodes(store)
    out = []
    try:
        states = {n.name: n for n in read_nodes(gres_name, job_nodes)} if job_nodes else {}
    except ValueError:
        states = {}
    failed_elsewhere = any(code != 0 for code in exits.values())
    for n in job_nodes:
        s = states.get(n)
        if s is not None and not s.usable:
            out.append((n, f"SLURM reports node {n} {s.state}" + (f" ({s.reason})" if s.reason else "")))
        elif n in up and n not in exits and failed_elsewhere:
            out.append((n, f"node {n} stopped answering: its agent ended without an exit while the other "
                           "nodes' ranks lost their peers"))
    return out


def _follow(store: MetricsStore, plan: Plan, steps: int, run_dir: str, settings: SlurmSettings,
            components: list[Component], nodes: dict[str, SlurmNode], wargs: list[str]) -> str:
    stop = threading.Event()
    cancelled = False
    status, reason, failed_rank = "failed", None, None
    job_id: str | None = None
    state: JobState | None = None
    job_nodes = [n for c in components for n in c.nodes]
    try:
        with _stop_on_signals(stop):
            job_id = _submit(run_dir, plan, settings, components, nodes, wargs)
            with open(os.path.join(run_dir, JOB_FILE), "w") as fh:
                json.dump({"job_id": job_id, "nodes": job_nodes, "gres_name": settings.gres_name,
                           "launcher_pid": os.getpid(), "submitted_s": time.time()}, fh)
            store.add_event("slurm_job", f"SLURM job {job_id} submitted: " + " : ".join(
                f"{','.join(c.nodes)} {c.gres_arg(settings.gres_name)}" for c in components))
            last_node_check, agent_failed_since, phase = 0.0, None, None
            while True:
                state = job_state(job_id)
                if not state.active:
                    break
                if state.state == "PENDING" and phase != state.reason:
                    phase = state.reason
                    store.set_phase(f"queued in SLURM ({state.reason or 'pending'})")
                if (stop.is_set() or store.stop_requested()) and not cancelled:
                    stop.set()
                    cancel_job(job_id)
                    cancelled = True
                now = time.monotonic()
                if not cancelled and now - last_node_check > NODE_CHECK_S:
                    last_node_check = now
                    _, exits = _agent_nodes(store)
                    down = [d for d in dead_nodes(store, job_nodes, settings.gres_name) if "SLURM reports" in d[1]]
                    if any(c != 0 for c in exits.values()):
                        agent_failed_since = agent_failed_since or now
                    if down or (agent_failed_since and now - agent_failed_since > AGENT_FAIL_GRACE_S):
                        log.warning("job %s: %s; cancelling", job_id, down or "an agent failed")
                        cancel_job(job_id)
                        cancelled = True
                time.sleep(JOB_POLL_S)
        state = _settle(state)
        status, reason, failed_rank = _verdict(store, steps, run_dir, settings, state, job_nodes,
                                               stop.is_set() or store.stop_requested(), cancelled)
    except BaseException as e:
        reason = f"launcher error: {type(e).__name__}: {e}"
        raise
    finally:
        if job_id is not None:
            _cleanup(job_id)
        store.finish(status, reason, failed_rank)
        log.info("run %s ended: %s%s", run_dir, status, f" ({reason})" if reason else "")
    return status


def _verdict(store: MetricsStore, steps: int, run_dir: str, settings: SlurmSettings, state: JobState,
             job_nodes: list[str], stopped: bool, cancelled: bool) -> tuple[str, str | None, int | None]:
    """(status, reason, failed rank) of the ended job; `cancelled`: the launcher scancelled it."""
    job_id = state.job_id
    what = f"SLURM job {job_id}: {state.state}" + (f", {state.reason}" if state.reason else "")
    store.add_event("slurm_end", what)
    if stopped:
        return "stopped", f"stopped on request (scancel of SLURM job {job_id})", None
    if state.state == "CANCELLED" and not cancelled:
        return "stopped", f"SLURM job {job_id} was cancelled outside GPUMix (scancel)", None
    if _last_step(store) == steps and (state.state in ("COMPLETED", "COMPLETING", "UNKNOWN")
                                       or _all_ranks_done(store)):
        return "done", None, None
    dead = dead_nodes(store, job_nodes, settings.gres_name)
    if dead:
        node, why = dead[0]
        rows = store.conn.execute("SELECT rank FROM ranks WHERE node = ? AND pid IS NOT NULL ORDER BY rank",
                                  (node,)).fetchall()
        return "failed", f"node {node} died: {why} ({what})", (rows[0][0] if rows else None)
    logs = os.path.join(run_dir, "logs", f"slurm-{job_id}.out")
    reason, rank = failure_reason(store, logs, None)
    return "failed", f"{reason} ({what})", rank


def _settle(state: JobState) -> JobState:
    """The job's state once SLURM has cleaned its steps away (COMPLETING lasts until a dead node is
    declared down), or the last one seen after COMPLETING_WAIT_S."""
    deadline = time.monotonic() + COMPLETING_WAIT_S
    while (state.active or state.completing) and time.monotonic() < deadline:
        time.sleep(JOB_POLL_S)
        state = job_state(state.job_id)
    if state.active or state.completing:
        log.warning("SLURM job %s still %s after %.0f s", state.job_id, state.state, COMPLETING_WAIT_S)
    return state


def _cleanup(job_id: str) -> None:
    """Nothing of the job left running: scancel what is still active, wait out COMPLETING."""
    with contextlib.suppress(ValueError):
        state = job_state(job_id)
        if state.active:
            cancel_job(job_id)
        _settle(state)


# ---- non-blocking: the dashboard and the orchestrator --------------------------------------


def start_slurm_run(plan: Plan | str, steps: int, run_dir: str | None = None, settings: SlurmSettings | None = None,
                    seed: int = 0, checkpoint_every: int = 0, corpus_dir: str | None = None,
                    optim: OptimConfig | None = None, tokenizer: str | None = None,
                    init_from: str | None = None) -> RunHandle:
    """Start `python -m executor launch --backend slurm ...` in a new session and return at once
    (the launcher outlives its caller: a dashboard reload, an orchestrator restart). `run_dir`
    defaults to a new folder under planner.core.paths.runs_dir(), as executor.launch.start_run."""
    settings = settings or SlurmSettings()
    plan = plan if isinstance(plan, Plan) else Plan.load(plan)
    check_numbers(steps, checkpoint_every, seed)
    init_from = check_init_from(plan, init_from)
    run_dir = os.path.abspath(run_dir or new_run_dir())
    os.makedirs(os.path.join(run_dir, "logs"), exist_ok=True)
    _check_not_running(run_dir)
    plan_path = os.path.join(run_dir, "plan.json")
    plan.save(plan_path)
    store = MetricsStore(run_dir)  # the row exists before the launcher runs: a poller sees "starting"
    store.init_run(plan, steps, seed, backend="gloo")
    cmd = [sys.executable, "-m", "executor", "launch", "--plan", plan_path, "--steps", str(steps), "--run-dir",
           run_dir, "--seed", str(seed), "--checkpoint-every", str(checkpoint_every), *settings.to_args()]
    cmd += (["--data", corpus_dir] if corpus_dir else []) + (["--tokenizer", tokenizer] if tokenizer else [])
    cmd += ["--init-from", init_from] if init_from else []
    cmd += optim_flags(optim) if optim is not None else []
    with open(os.path.join(run_dir, "logs", "launcher.log"), "ab") as out:
        proc = subprocess.Popen(cmd, cwd=PROJECT_ROOT, stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
    _reap(proc)
    store.conn.execute("UPDATE run SET launcher_pid = ? WHERE id = 1 AND phase = 'starting'", (proc.pid,))
    store.close()
    return RunHandle(run_dir, proc.pid)


def cancel_slurm_run(run_dir: str) -> bool:
    """scancel the run's SLURM job if SLURM still runs it (a launcher that was killed leaves it);
    True when there was one."""
    job = read_job_file(run_dir)
    if not job:
        return False
    s = job_state(str(job["job_id"]))
    if s.active:
        cancel_job(s.job_id)
        return True
    return False


# ---- the agent: one per node, started by srun ----------------------------------------------


def interface_of(addr: str) -> str | None:
    """The network interface holding `addr` here (gloo binds to it), or None."""
    try:
        import psutil
        import socket

        ip = socket.gethostbyname(addr)
        for name, addrs in psutil.net_if_addrs().items():
            if any(a.address == ip for a in addrs):
                return name
    except (OSError, ImportError):
        pass
    return None


def agent_main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="executor.slurm agent")
    p.add_argument("--plan", required=True)
    p.add_argument("--run-dir", required=True)
    p.add_argument("--first-node", required=True)
    p.add_argument("--rdzv-endpoint", required=True)
    p.add_argument("--rdzv-id", required=True)
    p.add_argument("--node-addr", action="append", default=[], metavar="NODE=ADDR")
    p.add_argument("worker", nargs=argparse.REMAINDER)
    args = p.parse_args(argv)
    wargs = args.worker[1:] if args.worker[:1] == ["--"] else args.worker
    node = os.environ.get("SLURMD_NODENAME", "")
    plan = Plan.load(args.plan)
    nodes = plan_nodes(plan)
    k = sum(1 for a in plan.used if a.node == node)
    addrs = dict(a.split("=", 1) for a in args.node_addr)
    store = MetricsStore(args.run_dir)
    if k == 0 or node not in addrs:
        store.add_event("node_exit", f"node {node}: exit code 2, the plan has no devices on this node")
        return 2
    env = dict(os.environ, GPUMIX_NODE=node, GPUMIX_LAUNCHED="1", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    iface = interface_of(addrs[node])
    if iface:
        env["GLOO_SOCKET_IFNAME"] = iface
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nnodes={len(nodes)}", f"--nproc-per-node={k}",
           "--rdzv-backend=c10d", f"--rdzv-endpoint={args.rdzv_endpoint}", f"--rdzv-id={args.rdzv_id}",
           f"--rdzv-conf=is_host={1 if node == args.first_node else 0}", f"--local-addr={addrs[node]}",
           "--max-restarts=0", *wargs]
    proc = subprocess.Popen(cmd, env=env, cwd=PROJECT_ROOT)
    store.add_event("node_up", f"node {node}: agent pid {os.getpid()}, torchrun pid {proc.pid}, {k} rank(s), "
                               f"address {addrs[node]}" + (f" ({iface})" if iface else ""))

    def forward(sig, _frame):
        with contextlib.suppress(OSError):
            proc.send_signal(sig)

    for s in (signal.SIGTERM, signal.SIGINT):
        signal.signal(s, forward)
    rc = proc.wait()
    store.add_event("node_exit", f"node {node}: torchrun exit code {rc}")
    store.close()
    return 0 if rc == 0 else 1


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if sys.argv[1:2] != ["agent"]:
        sys.exit("usage: python -m executor.slurm agent ... (started by the batch script of executor/slurm.py)")
    sys.exit(agent_main(sys.argv[2:]))
