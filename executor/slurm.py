"""The `slurm` launch backend (SlurmBackend, executor/backend.py's interface): a plan as one SLURM
job, watched until it ends.

    python -m executor launch --plan P --steps N --run-dir R --backend slurm [--gres-name gpu]

The launcher (on the submit host) checks the plan's nodes against `scontrol show node -o`, writes
the run store as the local launcher does, and submits the job (executor/slurm_job.py) with `sbatch`;
on each node an agent (executor/slurm_agent.py) starts torchrun with the node's ranks and reports
`node_up` / `node_exit` (the first node in the store, the others through the job's output file,
recorded in the store at the end: only rank 0, the first node and the launcher write it). What
`scontrol show job -o` says is the truth the launcher follows; a stop is `scancel`; a dead node
fails the run with the node and the reason recorded, or, with `--elastic` (SlurmSettings.elastic),
the run goes on on the nodes left from its last checkpoint in a new job (executor/elastic.py).
The job id (the newest job's) is in the events and `slurm.json`.
Every node needs this repository and the run folder at the same paths (a shared filesystem), as
torchrun's multi-node runs do.
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import shlex
import subprocess
import threading
import time
from typing import TYPE_CHECKING, Mapping, NamedTuple

from contracts.plan import Plan
from contracts.run import RunConfig
from executor import booking, elastic
from executor.backend import prepare_data, prepare_folder, resume_step, run_config
from executor.checks import check_run
from executor.rank_commands import plan_nodes, project_pythonpath, worker_args
from executor.slurm_job import (JOB_FILE, Component, JobState, SlurmSettings, batch_script, cancel_job, job_state,
                                node_requests, rdzv_port, read_job_file, run_id_of, sbatch_command,
                                slurm_device_keys)
from executor.slurm_agent import REPORT_MARK
from executor.store import MetricsStore
from executor.supervise import RunHandle, failure_reason, record_launch, start_launcher, stop_on_signals
from profiler.slurm_inventory import SlurmNode, check_name, read_nodes

if TYPE_CHECKING:
    from models.optim import OptimConfig

log = logging.getLogger(__name__)

JOB_POLL_S = 1.0  # how often the launcher asks slurmctld about its job (a stop is answered within it)
NODE_CHECK_S = 2.0  # how often the launcher asks SLURM about the job's nodes
AGENT_FAIL_GRACE_S = 10.0  # an agent failed but the job still runs (its batch host died): scancel
COMPLETING_WAIT_S = 120.0  # after the end: wait for SLURM to clean the job's steps away


class SlurmBackend:
    """The plan as one SLURM job, submitted and followed from this machine (the submit host)."""

    name = "slurm"

    def __init__(self, settings: SlurmSettings | None = None) -> None:
        self.settings = settings or SlurmSettings()

    def check(self, plan: Plan, config: RunConfig) -> RunConfig:
        if config.emulate_wan:
            raise ValueError("--emulate-wan emulates the datacenters on this machine: use it with --backend local")
        if config.prefill is not None:
            raise ValueError("--prefill runs with --backend local")
        if self.settings.elastic:
            elastic.check_elastic(plan, config)
        return check_run(plan, config)

    def launch(self, plan: Plan, config: RunConfig) -> str:
        """Submit `plan` as one SLURM job and follow it until it ends; "done" | "failed" | "stopped"."""
        config = self.check(plan, config)
        nodes = {n.name: n for n in read_nodes(self.settings.gres_name, plan_nodes(plan))}
        components = node_requests(plan, nodes, self.settings)
        config = prepare_folder(config)
        step = resume_step(plan, config)
        ledger = booking.Ledger()
        ledger.book(config.run_dir, slurm_device_keys(plan))
        try:
            plan_path = os.path.join(config.run_dir, "plan.json")
            plan.save(plan_path)
            tokens = prepare_data(plan, config)
            store = MetricsStore(config.run_dir)
            store.keep_room()  # the run's end is recorded even on a disk its steps filled
            try:
                record_launch(store, plan, config, step)
                return _follow(store, plan, config, self.settings, components, nodes, tokens)
            finally:
                store.close()
        finally:
            ledger.release(config.run_dir)

    def start(self, plan: Plan, config: RunConfig) -> RunHandle:
        """`python -m executor launch --backend slurm ...` in a new session; return at once (the
        launcher outlives its caller: a dashboard reload, an orchestrator restart)."""
        config = prepare_folder(self.check(plan, config))
        proc = start_launcher(plan, config, self.settings.to_args())
        return RunHandle(config.run_dir, proc.pid)

    def leftovers(self, run_dir: str) -> bool:
        job = read_job_file(run_dir)
        return bool(job) and job_state(str(job["job_id"])).active

    def remove_leftovers(self, run_dir: str) -> None:
        try:
            cancel_slurm_run(run_dir)
        except ValueError as e:  # SLURM does not answer: say so, the rest of the stop goes on
            log.error("run %s: cannot cancel its SLURM job: %s", run_dir, e)


# ---- the launcher --------------------------------------------------------------------------


def launch_slurm(plan: Plan | str, steps: int, run_dir: str, settings: SlurmSettings | None = None, seed: int = 0,
                 resume: bool = False, checkpoint_every: int = 0, corpus_dir: str | None = None,
                 optim: OptimConfig | None = None, tokenizer: str | None = None, init_from: str | None = None) -> str:
    """SlurmBackend(settings).launch with the settings as keywords."""
    config = run_config(steps, run_dir, optim, seed=seed, resume=resume, checkpoint_every=checkpoint_every,
                        corpus_dir=corpus_dir, tokenizer=tokenizer, init_from=init_from)
    return SlurmBackend(settings).launch(plan if isinstance(plan, Plan) else Plan.load(plan), config)


def _submit(run_dir: str, plan: Plan, settings: SlurmSettings, components: list[Component],
            nodes: dict[str, SlurmNode], wargs: list[str], attempt: int = 0) -> str:
    """sbatch the job; its id. `attempt` > 0: an elastic run's next job, with a rendezvous of its own
    (another id and port than the ended job's, whose store may linger on the port)."""
    first = components[0].nodes[0]
    run_id = run_id_of(run_dir) + (f"-r{attempt}" if attempt else "")
    addrs = [f"{n}={check_name(nodes[n].addr, 'node address')}" for n in plan_nodes(plan)]
    agent = ["--plan", os.path.join(run_dir, "plan.json"), "--run-dir", run_dir, "--first-node", first,
             "--rdzv-endpoint", f"{nodes[first].addr}:{rdzv_port(run_id, settings)}", "--rdzv-id", run_id,
             *[x for a in addrs for x in ("--node-addr", a)], "--", *wargs]
    script = os.path.join(run_dir, "slurm.sbatch")
    with open(script, "w") as fh:
        fh.write(batch_script(components, agent))
    env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONPATH=project_pythonpath())
    cmd = sbatch_command(components, script, run_dir, settings)
    log.info("submitting %s", shlex.join(cmd))
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=60, env=env, stdin=subprocess.DEVNULL)
    if r.returncode != 0:
        msg = (r.stderr or r.stdout).strip().splitlines()
        raise ValueError(f"sbatch refused the job: {msg[-1] if msg else f'exit code {r.returncode}'}")
    return r.stdout.strip().split(";")[0]


AGENT_KINDS = ("node_up", "node_exit")  # what the agents report (executor/slurm_agent.py)


def _events(store: MetricsStore, kind: str, job_log: str | None = None, skip: Mapping[str, int] | None = None
            ) -> list[str]:
    """The agents' `kind` reports: the first node's events in the store (less the first skip[kind]:
    an earlier job's), the other nodes' lines in the job's output file (executor/slurm_agent.py)."""
    out = [e["message"] for e in store.events(kind)][(skip or {}).get(kind, 0):]
    if job_log is not None:
        mark = f"{REPORT_MARK}{kind} "
        with contextlib.suppress(OSError), open(job_log, encoding="utf-8", errors="replace") as fh:
            out += [line[line.index(mark) + len(mark):].rstrip("\n") for line in fh if mark in line]
    return out


def job_log_of(run_dir: str, job_id: str | None) -> str | None:
    """The job's output file (sbatch --output), where srun brings every agent's output."""
    return None if job_id is None else os.path.join(run_dir, "logs", f"slurm-{job_id}.out")


def _agent_nodes(store: MetricsStore, job_log: str | None = None, skip: Mapping[str, int] | None = None
                 ) -> tuple[set[str], dict[str, int]]:
    """(nodes whose agent started, node -> its torchrun's exit code) from the agents' reports."""
    up = {m.split(":", 1)[0].removeprefix("node ") for m in _events(store, "node_up", job_log, skip)}
    exits = {}
    for m in _events(store, "node_exit", job_log, skip):
        node, _, rest = m.partition(":")
        code = re.search(r"exit code (-?\d+)", rest)
        exits[node.removeprefix("node ")] = int(code.group(1)) if code else 1
    return up, exits


def dead_nodes(store: MetricsStore, job_nodes: list[str], gres_name: str, job_log: str | None = None,
               skip: Mapping[str, int] | None = None) -> list[tuple[str, str]]:
    """(node, why) for each node of the job that died: SLURM reports it down, or its agent started
    and vanished without an exit while another agent failed (`skip`: as _events')."""
    up, exits = _agent_nodes(store, job_log, skip)
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


class Verdict(NamedTuple):
    """How a job ended: the run's status, reason and failed rank, and its nodes found dead."""

    status: str
    reason: str | None
    failed_rank: int | None
    dead: list[tuple[str, str]]


def _follow(store: MetricsStore, plan: Plan, config: RunConfig, settings: SlurmSettings,
            components: list[Component], nodes: dict[str, SlurmNode], tokens: str) -> str:
    """Follow the run's job until it ends and record the run's end; with settings.elastic a job
    that lost nodes is followed by the next one on the nodes left (executor/elastic.py)."""
    plan_path = os.path.join(config.run_dir, "plan.json")
    stop = threading.Event()
    v = Verdict("failed", None, None, [])
    try:
        with stop_on_signals(stop):
            attempt = 0
            while True:
                wargs = worker_args(plan_path, config, tokens_path=tokens)
                v = _follow_job(store, plan, config, settings, components, nodes, wargs, stop, attempt)
                if not (settings.elastic and v.status == "failed" and v.dead) or stop.is_set() or \
                        store.stop_requested():
                    break
                try:
                    r = elastic.resumption_after(store, plan, config, v.dead)
                    nodes = {n.name: n for n in read_nodes(settings.gres_name, plan_nodes(r.plan))}
                    components = node_requests(r.plan, nodes, settings)
                except ValueError as e:
                    v = v._replace(reason=f"{v.reason}; --elastic cannot go on: {e}")
                    break
                elastic.begin_resume(store, r, plan_path)
                plan, config, attempt = r.plan, r.config, attempt + 1
    except BaseException as e:
        v = Verdict("failed", f"launcher error: {type(e).__name__}: {e}", None, [])
        raise
    finally:
        store.finish(v.status, v.reason, v.failed_rank)
        log.info("run %s ended: %s%s", config.run_dir, v.status, f" ({v.reason})" if v.reason else "")
    return v.status


def _follow_job(store: MetricsStore, plan: Plan, config: RunConfig, settings: SlurmSettings,
                components: list[Component], nodes: dict[str, SlurmNode], wargs: list[str], stop: threading.Event,
                attempt: int = 0) -> Verdict:
    """Submit one job of the run and follow it until it ends, nothing of it left in SLURM; how it
    ended."""
    run_dir = config.run_dir
    cancelled = False
    job_id: str | None = None
    state: JobState | None = None
    job_nodes = [n for c in components for n in c.nodes]
    before = {kind: len(store.events(kind)) for kind in AGENT_KINDS}  # an earlier job's reports
    try:
        job_id = _submit(run_dir, plan, settings, components, nodes, wargs, attempt)
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
                job_log = job_log_of(run_dir, job_id)
                _, exits = _agent_nodes(store, job_log, before)
                down = [d for d in dead_nodes(store, job_nodes, settings.gres_name, job_log, before)
                        if "SLURM reports" in d[1]]
                if any(c != 0 for c in exits.values()):
                    agent_failed_since = agent_failed_since or now
                if down or (agent_failed_since and now - agent_failed_since > AGENT_FAIL_GRACE_S):
                    log.warning("job %s: %s; cancelling", job_id, down or "an agent failed")
                    cancel_job(job_id)
                    cancelled = True
            time.sleep(JOB_POLL_S)
        state = _settle(state)
        return _verdict(store, config, settings, state, job_nodes, stop.is_set() or store.stop_requested(),
                        cancelled, before)
    finally:
        if job_id is not None:
            _cleanup(job_id)


def _verdict(store: MetricsStore, config: RunConfig, settings: SlurmSettings, state: JobState,
             job_nodes: list[str], stopped: bool, cancelled: bool, before: Mapping[str, int] | None = None) -> Verdict:
    """How the ended job ended; `cancelled`: the launcher scancelled it; `before`: the agents'
    reports in the store that are an earlier job's (kind -> count)."""
    job_id = state.job_id
    what = f"SLURM job {job_id}: {state.state}" + (f", {state.reason}" if state.reason else "")
    job_log = job_log_of(config.run_dir, job_id)
    for kind in AGENT_KINDS:  # the other nodes' reports join the first node's in the store
        for message in _events(store, kind, job_log)[len(store.events(kind)):]:
            store.add_event(kind, message)
    store.add_event("slurm_end", what)
    if stopped:
        return Verdict("stopped", f"stopped on request (scancel of SLURM job {job_id})", None, [])
    if state.state == "CANCELLED" and not cancelled:
        return Verdict("stopped", f"SLURM job {job_id} was cancelled outside GPUMix (scancel)", None, [])
    if store.last_step() == config.steps and (state.state in ("COMPLETED", "COMPLETING", "UNKNOWN")
                                              or store.all_ranks_done()):
        return Verdict("done", None, None, [])
    dead = dead_nodes(store, job_nodes, settings.gres_name, skip=before)  # the store holds every node's reports now
    if dead:
        node, why = dead[0]
        ranks = store.registered_ranks(node=node)
        return Verdict("failed", f"node {node} died: {why} ({what})", (ranks[0] if ranks else None), dead)
    logs = os.path.join(config.run_dir, "logs", f"slurm-{job_id}.out")
    reason, rank = failure_reason(store, logs, None)
    return Verdict("failed", f"{reason} ({what})", rank, [])


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
    """SlurmBackend(settings).start with the settings as keywords; `run_dir` defaults to a new folder
    under contracts.paths.runs_dir()."""
    config = run_config(steps, run_dir, optim, seed=seed, checkpoint_every=checkpoint_every, corpus_dir=corpus_dir,
                        tokenizer=tokenizer, init_from=init_from)
    return SlurmBackend(settings).start(plan if isinstance(plan, Plan) else Plan.load(plan), config)


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
