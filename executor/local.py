"""The local backend: a plan run with torchrun on this machine, watched until it ends.

Process tree (every arrow is an argument list, never a shell):

    [start: the dashboard] --new session--> python -m executor launch   (the launcher)
        --new session--> python -m torch.distributed.run ... -m executor.worker   (torchrun)
            --own session each (torchrun's choice)--> python -m executor.worker   (rank r)

torchrun and the ranks die with their parent (executor/lifeline.py); SIGTERM, SIGINT, SIGHUP stop
the run. The launcher builds the corpus cache, writes plan.json, run.json and the run row, starts
torchrun and watches it (executor/supervise.py, executor/stall.py); at the end it kills what is
left and records the status.
Emulated devices run under per-rank cgroups (profiler/cgroups.py) or sleep where there are none;
emulated datacenters put each plan node's torchrun agent in its own network namespace
(executor/wan.py), emulated links each rank's (executor/links.py). More: docs/executor.md, docs/emulated_wan.md.
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
import shlex
import shutil
import subprocess
import sys
import threading
from dataclasses import dataclass, replace

from contracts.catalog import GIB
from contracts.paths import PROJECT_ROOT
from contracts.plan import Plan
from contracts.run import RunConfig
from executor import booking, db, lifeline, links, netns, wan
from executor.backend import prepare_data, prepare_folder, resume_step
from executor.checks import check_local, check_run
from executor.rank_commands import (DEFAULT_RDZV_PORT, agent_torchrun_command, free_port, local_torchrun_command,
                                    node_torchrun_command, plan_nodes, rank_env, run_id_of, worker_args)
from executor.store import MetricsStore
from executor.stall import stall_bound_s
from executor.supervise import (RunHandle, exit_code, failure_reason, kill_everything, record_launch,
                                start_launcher, stop_on_signals, watch)
from profiler import cgroups

log = logging.getLogger(__name__)

ENV_EMULATION = "GPUMIX_EMULATION"  # "sleep" forces the sleep fallback (default: cgroups where available)
EMULATION_FILE = "emulation.json"
PREFILL_FILE = "prefill.json"  # start's prefill object, for the launcher's --prefill


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


# ---- the torchrun agents: one here, or one per emulated datacenter ----------------------------


def start_agent(cmd: list[str], env: dict[str, str], log_path: str) -> subprocess.Popen:
    """A torchrun agent in its own session (the group kill_everything ends), killed by the kernel
    if this launcher dies first (called from the thread that watches it to the end)."""
    log.info("starting %s", shlex.join(cmd))
    with open(log_path, "ab") as out:
        return subprocess.Popen(lifeline.command(cmd), cwd=PROJECT_ROOT, env=env, stdout=out,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)


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
        agents.append(start_agent(cmd, dict(env, GPUMIX_NODE=node, GLOO_SOCKET_IFNAME=setup.gloo_ifname),
                                  _agent_log(run_dir, i)))
    return agents


def _start_guard(cmd: list[str], run_dir: str) -> subprocess.Popen:
    return netns.start_guard(cmd, PROJECT_ROOT, dict(os.environ, PYTHONPATH=PROJECT_ROOT),
                             os.path.join(run_dir, "logs", "netns-guard.log"))


def _start_netns(what: str, kind, create, file_name: str, run_dir: str, store: MetricsStore,
                 notes: tuple[str, ...] = ()) -> tuple:
    """Build a run's namespaces (`create(run id)`; `kind`: executor.wan or executor.links) after
    removing stale ones, record them in the run folder and start their guard (it removes them if
    this launcher is killed); (setup, guard)."""
    run_id = run_id_of(run_dir)
    stale = kind.remove_stale(run_id)
    if stale:
        store.add_event("emulation", f"{what}: removed stale namespaces {', '.join(stale)}")
    setup = create(run_id)
    try:
        setup.save(os.path.join(run_dir, file_name))
        guard = _start_guard(kind.guard_command(setup, run_dir), run_dir)
    except BaseException:
        kind.remove(setup)
        raise
    for line in setup.describe() + list(notes):
        store.add_event("emulation", line)
    return setup, guard


def _start_wan(plan: Plan, run_dir: str, store: MetricsStore) -> tuple[wan.WanSetup, subprocess.Popen]:
    """The run's emulated datacenters (a namespace per plan node) and their guard."""
    nodes = plan_nodes(plan)
    return _start_netns("wan", wan, lambda run_id: wan.create(plan, nodes, run_id), wan.WAN_FILE, run_dir, store,
                        tuple(wan.connections_of(plan, nodes)[1]))


def _start_links(plan: Plan, gbps: float, run_dir: str, store: MetricsStore) -> tuple[links.LinksSetup,
                                                                                      subprocess.Popen]:
    """The run's emulated links (a namespace per rank) and their guard."""
    return _start_netns("links", links, lambda run_id: links.create(len(plan.used), gbps, run_id), links.LINKS_FILE,
                        run_dir, store)


def link_agent_commands(setup: links.LinksSetup, wargs: list[str], python: str = sys.executable) -> list[list[str]]:
    """One torchrun agent per rank, each inside the rank's namespace: c10d rendezvous hosted by rank
    0's agent at its address (the rendezvous ranks agents by --local-addr, three-digit addresses
    in rank order, so agent i is rank i)."""
    endpoint = f"{setup.addr(0)}:{DEFAULT_RDZV_PORT}"
    return [setup.exec_prefix(i) + agent_torchrun_command(
                python, setup.num_ranks, 1, i, endpoint, setup.run_id, wargs,
                extra=[f"--rdzv-conf=is_host={1 if i == 0 else 0}", f"--local-addr={setup.addr(i)}"])
            for i in range(setup.num_ranks)]


def link_env(env: dict[str, str]) -> dict[str, str]:
    """The agents' environment: gloo bound to the rank's link, whose counters the rank records."""
    return dict(env, GLOO_SOCKET_IFNAME=links.RANK_IF, **{links.ENV_LINK_IF: links.RANK_IF})


def _start_link_agents(setup: links.LinksSetup, wargs: list[str], env: dict[str, str],
                       run_dir: str) -> list[subprocess.Popen]:
    return [start_agent(cmd, link_env(env), _agent_log(run_dir, i))
            for i, cmd in enumerate(link_agent_commands(setup, wargs))]


def _stop_netns(remove, guard: subprocess.Popen | None) -> None:
    """Remove the namespaces (every process left in them first), then end the guard."""
    try:
        remove()
    except OSError as e:
        log.error("%s", e)
    netns.stop_guard(guard)


def _merge_agent_logs(run_dir: str, n: int, dest: str) -> None:
    """logs/torchrun.log: every agent's log one after the other (failure_reason reads one file); agent
    i is plan node i's (emulated datacenters) or rank i's (emulated links)."""
    with open(dest, "ab") as out:
        for i in range(n):
            with contextlib.suppress(OSError), open(_agent_log(run_dir, i), "rb") as fh:
                out.write(f"==== torchrun agent {i} ====\n".encode())
                shutil.copyfileobj(fh, out)


# ---- the launcher ------------------------------------------------------------------------


def _run(plan: Plan, config: RunConfig, tokens: str, emu: Emulation, step: int | None,
         stop: threading.Event) -> str:
    """Start the agents (none when a stop signal came while the run was prepared), watch them, end
    everything, record the status."""
    run_dir = config.run_dir
    if emu.mode == "sleep":
        plan = sleep_fallback_plan(plan)
    plan_path = os.path.join(run_dir, "plan.json")
    plan.save(plan_path)
    store = MetricsStore(run_dir)
    store.keep_room()  # the run's end is recorded even on a disk its steps filled
    record_launch(store, plan, config, step)
    if emu.mode != "none":
        store.add_event("emulation", f"{emu.mode}: {emu.reason}")
    if plan.dtype != "fp32" and all(a.type == "cpu" for a in plan.used):
        store.add_event("note", f"plan dtype {plan.dtype}: CPU ranks train in fp32 (autocast is for GPUs)")
    wargs = lifeline.python_args(worker_args(plan_path, config, tokens_path=tokens))  # a rank dies with torchrun
    wargs = cgroups.exec_command(wargs) if emu.mode == "cgroup" else wargs
    env = rank_env(os.path.join(run_dir, EMULATION_FILE) if emu.mode == "cgroup" else None)
    torchrun_log = os.path.join(run_dir, "logs", "torchrun.log")
    agents: list[subprocess.Popen] = []
    setup: wan.WanSetup | links.LinksSetup | None = None
    guard: subprocess.Popen | None = None
    status, reason, failed_rank, stall = "failed", None, None, None
    full: db.DiskFull | None = None  # the store's disk filled: the run's end, then the launcher's error
    try:
        if stop.is_set():  # a stop signal came while the run was prepared: start nothing
            pass
        elif config.emulate_wan:
            setup, guard = _start_wan(plan, run_dir, store)
            agents = _start_wan_agents(setup, plan, wargs, env, run_dir)
        elif config.emulate_links_gbps is not None:
            setup, guard = _start_links(plan, config.emulate_links_gbps, run_dir, store)
            agents = _start_link_agents(setup, wargs, env, run_dir)
        else:
            agents = [start_agent(local_torchrun_command(len(plan.used), free_port(), wargs), env, torchrun_log)]
        if agents:
            with open(os.path.join(run_dir, "torchrun.pid"), "w") as fh:
                fh.write(str(agents[0].pid))  # the rendezvous host's agent
        stall = watch(agents, store, stop, stall_bound_s(plan, config.stall_timeout_s))
        rc = exit_code(agents)
        kill_everything(agents, store.worker_pids(), run_dir)
        if setup is not None:
            _merge_agent_logs(run_dir, len(agents), torchrun_log)
        if stop.is_set() or store.stop_requested():
            status, reason = "stopped", "stopped on request"
        elif stall is not None:
            reason, failed_rank = stall.reason, stall.rank
            store.add_event("stall", stall.reason, stall.rank)
        elif store.last_step() == config.steps and (rc == 0 or store.all_ranks_done()):
            status = "done"  # all_ranks_done: this launch's ranks, not a resumed run's earlier ones
            if rc != 0:  # every rank said it finished; one crashed on its way out
                store.add_event("exit", f"torchrun exit code {rc} after every rank reported all steps done")
        else:
            reason, failed_rank = oom_reason(emu) or failure_reason(store, torchrun_log, rc)
            if "disk full" not in reason:  # a rank that died writing a full disk could not say so
                full = store.disk_full()
    except db.DiskFull as e:  # one of this launcher's own writes: end the run, then say so
        full = e
        kill_everything(agents, store.worker_pids(), run_dir)
    except BaseException as e:
        reason = f"launcher error: {type(e).__name__}: {e}"
        kill_everything(agents, store.worker_pids(), run_dir)
        raise
    finally:
        if setup is not None:  # torn down before the run's end is recorded: "done" means nothing is left
            _stop_netns(lambda: (wan.remove if isinstance(setup, wan.WanSetup) else links.remove)(setup), guard)
        if full is not None:
            status, reason, failed_rank = "failed", str(full), None
        try:
            store.finish(status, reason, failed_rank)
        except db.DiskFull as e:  # the end cannot be recorded: the launcher's error says it
            full = full or e
        store.close()
        log.info("run %s ended: %s%s", run_dir, status, f" ({reason})" if reason else "")
    if full is not None:
        raise full
    return status


def book_devices(plan: Plan, run_dir: str, pid: int | None = None) -> None:
    """Book the plan's devices for `run_dir` in the ledger (ValueError naming the run holding one)."""
    booking.Ledger().book(run_dir, booking.plan_device_keys(plan), pid)


class LocalBackend:
    """torchrun on this machine (emulated devices and datacenters included)."""

    name = "local"

    def check(self, plan: Plan, config: RunConfig) -> RunConfig:
        """The run's checks; a cluster file's `emulate_links_gbps` is the rate of a run that asks
        neither emulated links nor datacenters itself."""
        config = check_run(plan, config)
        if config.emulate_links_gbps is None and not config.emulate_wan and plan.cluster.emulate_links_gbps:
            config = replace(config, emulate_links_gbps=plan.cluster.emulate_links_gbps)
        check_local(plan, config)
        return config

    def launch(self, plan: Plan, config: RunConfig) -> str:
        """Run it here; a stop signal (SIGTERM, SIGINT, SIGHUP) from the first check on stops it."""
        stop = threading.Event()
        with stop_on_signals(stop):
            config = prepare_folder(self.check(plan, config))
            book_devices(plan, config.run_dir)  # start booked already: the launcher takes the booking over
            try:
                step = resume_step(plan, config)
                tokens = prepare_data(plan, config)
                emu = setup_emulation(plan, config.run_dir)
                try:
                    return _run(plan, config, tokens, emu, step, stop)
                finally:
                    remove_emulation(emu)
            finally:
                booking.Ledger().release(config.run_dir)

    def start(self, plan: Plan, config: RunConfig) -> RunHandle:
        """The launcher in a new session; the prefill object travels as the run folder's prefill.json."""
        config = prepare_folder(self.check(plan, config))
        resume_step(plan, config)
        book_devices(plan, config.run_dir)  # held by this process until the launcher takes it over
        extra: list[str] = []
        if config.prefill is not None:
            prefill_path = os.path.join(config.run_dir, PREFILL_FILE)
            with open(prefill_path, "w", encoding="utf-8") as fh:
                json.dump(config.prefill, fh)
            extra += ["--prefill", prefill_path]
        try:
            proc = start_launcher(plan, config, extra)
        except BaseException:
            booking.Ledger().release(config.run_dir)
            raise
        booking.Ledger().book(config.run_dir, (), proc.pid)  # the launcher holds it now (and again from inside)
        return RunHandle(config.run_dir, proc.pid)

    def leftovers(self, run_dir: str) -> bool:
        run_id = run_id_of(run_dir)  # a killed launcher's datacenters, links or cgroups
        return bool(netns.find(wan.run_prefix(run_id)) or netns.find(links.run_prefix(run_id))
                    or cgroups.find(cgroups.run_prefix(run_id)))

    def remove_leftovers(self, run_dir: str) -> None:
        """A killed launcher's emulated datacenters or links (if its guard has not removed them yet)
        and cgroups."""
        run_id = run_id_of(run_dir)
        for remove in (lambda: wan.remove_run(run_id), lambda: links.remove_run(run_id),
                       lambda: cgroups.remove_all(cgroups.run_prefix(run_id))):
            try:
                remove()
            except OSError as e:
                log.error("%s", e)
