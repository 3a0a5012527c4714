"""Supervising a run's processes: start the launcher, watch torchrun, stop, kill, say why it failed.

The pieces both backends (executor/local.py, executor/slurm.py) share once a run is checked:
`start_launcher` puts `python -m executor launch` in a new session (the run outlives the page or
the orchestrator that started it) and `RunHandle` follows it through the store; `watch` polls the
torchrun agents, dead ranks and stop requests; `stop_on_signals` turns SIGTERM/SIGINT to the
launcher into a stop; `kill_everything` ends the agents' groups and every rank's session
(SIGTERM, then SIGKILL after TERM_GRACE_S); `failure_reason` reads the store's events and
torchrun's summary for the run's failure reason and failed rank; `stop_escalated` is the stop of
a run whose launcher does not answer. See docs/ARCHITECTURE.md (the executor) for the process tree.
"""
from __future__ import annotations

import contextlib
import logging
import os
import re
import signal
import subprocess
import threading
import time
from dataclasses import dataclass
from typing import Sequence

from contracts.paths import PROJECT_ROOT
from contracts.plan import Plan
from contracts.run import RunConfig
from executor.rank_commands import launcher_command
from executor.store import MetricsStore, pid_alive, read_metrics

log = logging.getLogger(__name__)

POLL_S = 0.2
DEAD_RANK_GRACE_S = 10.0  # torchrun normally ends the group within a second; then we do
TERM_GRACE_S = 10.0  # SIGTERM -> SIGKILL
# secondary failures: the ranks that lost a peer, not the cause of the run's end
PEER_ERRORS = ("connection closed by peer", "connection reset", "broken pipe", "timed out", "gloo",
               "nccl", "signalexception", "terminated", "process group")


# ---- starting the launcher, following it ------------------------------------------------


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
            return "running" if pid_alive(self.pid) else "failed"

    def wait(self, timeout_s: float | None = None) -> str:
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while self.status() == "running":
            if deadline is not None and time.monotonic() > deadline:
                break
            time.sleep(POLL_S)
        return self.status()


def reap(proc: subprocess.Popen) -> None:
    """Wait for the launcher in a daemon thread: it leaves no <defunct> child behind the dashboard."""
    threading.Thread(target=proc.wait, name=f"reap-{proc.pid}", daemon=True).start()


def start_launcher(plan: Plan, config: RunConfig, extra_args: Sequence[str] = ()) -> subprocess.Popen:
    """`python -m executor launch ...` for the run in a new session (the local and the SLURM
    backends alike: `extra_args` carries the backend's own flags), its output in logs/launcher.log."""
    plan_path = os.path.join(config.run_dir, "plan.json")
    plan.save(plan_path)
    config.save()
    # the run row exists before the launcher has imported anything: a page polling the store
    # sees "running / starting" at once (the launcher rewrites the row with its own pid)
    store = MetricsStore(config.run_dir)
    store.init_run(plan, config.steps, config.seed, backend="gloo", resume=config.resume)
    with open(os.path.join(config.run_dir, "logs", "launcher.log"), "ab") as out:
        proc = subprocess.Popen(launcher_command(plan_path, config, extra_args), cwd=PROJECT_ROOT, stdout=out,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
    reap(proc)
    store.set_launcher_pid(proc.pid)
    store.close()
    return proc


def record_launch(store: MetricsStore, plan: Plan, config: RunConfig, resume_step: int | None) -> None:
    """The launcher's run row, the resume event (the store cut back to the checkpoint's step) and
    launcher.pid."""
    store.init_run(plan, config.steps, config.seed, backend="gloo", resume=config.resume)
    if resume_step is not None:
        store.truncate_after(resume_step)
        store.add_event("resume", f"resuming from the checkpoint of step {resume_step}")
    with open(os.path.join(config.run_dir, "launcher.pid"), "w") as fh:
        fh.write(str(os.getpid()))


@contextlib.contextmanager
def stop_on_signals(flag: threading.Event):
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


def watch(agents: Sequence[subprocess.Popen], store: MetricsStore, stop: threading.Event) -> None:
    """Until every agent has ended, a stop is asked, a registered rank has been dead for
    DEAD_RANK_GRACE_S while an agent runs, or one agent failed that long ago while others run."""
    dead_since: float | None = None
    failed_since: float | None = None
    while any(a.poll() is None for a in agents):
        if stop.is_set() or store.stop_requested():
            stop.set()
            return
        now = time.monotonic()
        dead = [p for p in store.worker_pids() if not pid_alive(p)]
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


def exit_code(agents: Sequence[subprocess.Popen]) -> int | None:
    """0 when every agent ended with 0; else the first failure's code (None: one still ran)."""
    codes = [a.poll() for a in agents]
    failed = [c for c in codes if c not in (None, 0)]
    return failed[0] if failed else (None if None in codes else 0)


# ---- killing -----------------------------------------------------------------------------


def signal_group(pgid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def is_our_worker(pid: int) -> bool:
    """Guard against pid reuse: only signal a process that is one of our ranks."""
    try:
        import psutil

        return "executor.worker" in " ".join(psutil.Process(pid).cmdline())
    except Exception:
        return False


def kill_everything(agents: Sequence[subprocess.Popen], worker_pids: list[int]) -> None:
    """SIGTERM every torchrun agent's group and every rank's session, SIGKILL what is left after the grace."""
    workers = [p for p in worker_pids if is_our_worker(p)]
    for agent in agents:
        if agent.poll() is None:
            signal_group(agent.pid, signal.SIGTERM)
    for pid in workers:
        signal_group(pid, signal.SIGTERM)  # each rank leads its own session (torchrun's start_new_session)
    deadline = time.monotonic() + TERM_GRACE_S
    while time.monotonic() < deadline:
        alive = any(a.poll() is None for a in agents) or any(pid_alive(p) for p in workers)
        if not alive:
            break
        time.sleep(0.1)
    for agent in agents:
        signal_group(agent.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            agent.wait(timeout=5)
    for pid in workers:
        if pid_alive(pid):
            signal_group(pid, signal.SIGKILL)


def read_pid(path: str) -> int | None:
    try:
        with open(path) as fh:
            return int(fh.read().strip())
    except (OSError, ValueError):
        return None


def still_running(run_dir: str, launcher: int | None, store: MetricsStore) -> bool:
    """The run's launcher, its torchrun or one of its ranks is alive."""
    torchrun_pid = read_pid(os.path.join(run_dir, "torchrun.pid"))
    return (pid_alive(launcher) or (torchrun_pid is not None and pid_alive(torchrun_pid))
            or any(is_our_worker(p) for p in store.worker_pids()))


def stop_escalated(run_dir: str, launcher: int | None, store: MetricsStore, timeout_s: float) -> None:
    """Ask the launcher to stop through the store; if it has not ended within `timeout_s` (or is
    gone), kill it, torchrun's group and every rank."""
    store.request_stop()
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and pid_alive(launcher):
        time.sleep(POLL_S)  # the launcher polls the flag, ends everything and records "stopped"
    if launcher and pid_alive(launcher):
        with contextlib.suppress(OSError):
            os.kill(launcher, signal.SIGKILL)  # the launcher only: its group may be a user's shell
    torchrun_pid = read_pid(os.path.join(run_dir, "torchrun.pid"))
    if torchrun_pid and pid_alive(torchrun_pid):
        signal_group(torchrun_pid, signal.SIGKILL)
    kill_everything((), store.worker_pids())


# ---- why a run failed --------------------------------------------------------------------


_RANK_EXIT = re.compile(r"rank\s*:\s*(\d+)[^\n]*\n\s*exitcode\s*:\s*(-?\d+)")


def torchrun_exit_codes(log_path: str) -> tuple[dict[int, int], int | None]:
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


def describe_exit(code: int | None) -> str:
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
    primary = [e for e in failed if not any(p in e["message"].lower() for p in PEER_ERRORS)]
    if primary:
        return primary[0]["message"], primary[0]["rank"]
    codes, root = torchrun_exit_codes(torchrun_log)
    reported = {e["rank"] for e in events if e["kind"] in ("rank_failed", "rank_done")}
    registered = store.registered_ranks()
    silent = [r for r in registered if r not in reported]
    if silent:
        # torchrun's first observed failure, unless it is a rank that spoke; then one killed by a signal
        killed = [r for r in silent if r == root] or [r for r in silent if codes.get(r, 0) < 0] or silent
        r = killed[0]
        return f"rank {r} died without reporting an error ({describe_exit(codes.get(r))})", r
    if failed:
        return failed[0]["message"], failed[0]["rank"]
    if codes:
        r = min(codes)
        return f"rank {r} failed ({describe_exit(codes[r])})", r
    return f"torchrun exited with code {rc} before the ranks started (see logs/torchrun.log)", None
