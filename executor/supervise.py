"""Supervising a run's processes: start the launcher, watch torchrun, stop, kill, say why it failed.

The pieces both backends (executor/local.py, executor/slurm.py) share once a run is checked:
`start_launcher` puts `python -m executor launch` in a new session (the run outlives the page or
the orchestrator that started it) and `RunHandle` follows it through the store; `record_launch`
records the launcher's identity (pid, host, start time, command line) that `verified_launcher`
checks before `executor stop` signals anything; `watch` polls the torchrun agents, dead ranks, stop
requests and the stall watchdog (no new step within `stall_bound_s`, the stalled rank named);
`stop_on_signals` turns SIGTERM/SIGINT/SIGHUP to the launcher into a stop; `kill_everything` ends
the agents' groups and every rank's session (SIGTERM, then SIGKILL after TERM_GRACE_S);
`failure_reason` reads the store's events and torchrun's summary for the run's failure reason and
failed rank; `stop_escalated` is the stop of a run whose launcher does not answer.
See docs/ARCHITECTURE.md (the executor) for the process tree.
"""
from __future__ import annotations

import contextlib
import logging
import os
import re
import shlex
import signal
import socket
import subprocess
import threading
import time
from dataclasses import dataclass
from typing import Sequence

from contracts.paths import PROJECT_ROOT
from contracts.plan import Plan
from contracts.run import RunConfig
from executor.rank_commands import launcher_command
from executor.stall import Stall, StallWatch
from executor.store import MetricsStore, pid_alive, read_metrics

log = logging.getLogger(__name__)

POLL_S = 0.2
DEAD_RANK_GRACE_S = 10.0  # torchrun normally ends the group within a second; then we do
TERM_GRACE_S = 10.0  # SIGTERM -> SIGKILL
START_TIME_TOLERANCE_S = 1.0  # psutil's create_time is rounded to the clock tick; a reused pid starts later
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)  # SIGHUP: the ssh session of a CLI launch dropped
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
    """The launcher's run row, its identity (a "launcher" event: pid, host, start time, command
    line, what `executor stop` checks before it signals), the resume event (the store cut back to
    the checkpoint's step) and launcher.pid."""
    store.init_run(plan, config.steps, config.seed, backend="gloo", resume=config.resume)
    me = process_identity(os.getpid())
    if me is not None:
        store.add_event("launcher", f"launcher pid {os.getpid()} on {socket.gethostname()}, started at "
                                    f"{me[0]:.2f}: {shlex.join(me[1])}")
    if resume_step is not None:
        store.truncate_after(resume_step)
        store.add_event("resume", f"resuming from the checkpoint of step {resume_step}")
    with open(os.path.join(config.run_dir, "launcher.pid"), "w") as fh:
        fh.write(str(os.getpid()))


@contextlib.contextmanager
def stop_on_signals(flag: threading.Event):
    """SIGTERM/SIGINT/SIGHUP to the launcher = stop the run (only from the main thread)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    old = {s: signal.getsignal(s) for s in STOP_SIGNALS}
    for s in old:
        signal.signal(s, lambda *_: flag.set())
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)


def watch(agents: Sequence[subprocess.Popen], store: MetricsStore, stop: threading.Event,
          stall_s: float | None = None) -> Stall | None:
    """Until every agent has ended, a stop is asked, a registered rank has been dead for
    DEAD_RANK_GRACE_S while an agent runs, one agent failed that long ago while others run, or
    (with `stall_s`) the run made no progress that long: then the Stall, else None."""
    dead_since: float | None = None
    failed_since: float | None = None
    stalls = StallWatch(store, stall_s) if stall_s is not None else None
    while any(a.poll() is None for a in agents):
        if stop.is_set() or store.stop_requested():
            stop.set()
            return None
        stall = stalls.check() if stalls is not None else None
        if stall is not None:
            return stall
        now = time.monotonic()
        dead = [p for p in store.worker_pids() if not pid_alive(p)]
        if dead and dead_since is None:
            dead_since = now
        if dead_since is not None and now - dead_since > DEAD_RANK_GRACE_S:
            log.warning("rank pid(s) %s dead for %.0f s while torchrun runs: ending the run", dead, DEAD_RANK_GRACE_S)
            return None
        if failed_since is None and any(a.poll() not in (None, 0) for a in agents):
            failed_since = now
        if failed_since is not None and now - failed_since > DEAD_RANK_GRACE_S:
            log.warning("a torchrun agent failed %.0f s ago while others run: ending the run", DEAD_RANK_GRACE_S)
            return None
        time.sleep(POLL_S)
    return None


def exit_code(agents: Sequence[subprocess.Popen]) -> int | None:
    """0 when every agent ended with 0; else the first failure's code (None: one still ran)."""
    codes = [a.poll() for a in agents]
    failed = [c for c in codes if c not in (None, 0)]
    return failed[0] if failed else (None if None in codes else 0)


# ---- killing -----------------------------------------------------------------------------


def signal_group(pgid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


WORKER, TORCHRUN, LAUNCHER = "executor.worker", "torch.distributed.run", "-m executor launch"  # command-line marks
_LAUNCHER_EVENT = re.compile(r"^launcher pid (\d+) on (\S+), started at ([\d.]+): (.*)$")


def process_identity(pid: int | None) -> tuple[float, list[str]] | None:
    """(start time, seconds since the epoch; command line) of live process `pid`; None when it is
    gone, a zombie or not ours to read."""
    try:
        import psutil

        p = psutil.Process(pid)
        with p.oneshot():
            return None if p.status() == psutil.STATUS_ZOMBIE else (p.create_time(), p.cmdline())
    except Exception:  # NoSuchProcess, AccessDenied, a pid of None
        return None


def _same_folder(a: str, b: str) -> bool:
    return os.path.realpath(a) == os.path.realpath(b)


def is_run_process(pid: int | None, run_dir: str, mark: str) -> bool:
    """Guard against pid reuse: `pid` is alive, its command line holds `mark` (WORKER, TORCHRUN,
    LAUNCHER) and names `run_dir` with --run-dir (a relative one read against the process's folder)."""
    try:
        import psutil

        p = psutil.Process(pid)
        cmd = p.cmdline()
        if p.status() == psutil.STATUS_ZOMBIE or mark not in " ".join(cmd):
            return False
        dirs = [cmd[i + 1] for i, a in enumerate(cmd[:-1]) if a == "--run-dir"]
        return any(_same_folder(os.path.join(p.cwd(), d), run_dir) for d in dirs)
    except Exception:
        return False


def recorded_launcher(store: MetricsStore) -> tuple[int, str, float, list[str]] | None:
    """(pid, host, start time, command line) the launcher recorded (record_launch), the latest one."""
    for e in reversed(store.events("launcher")):
        m = _LAUNCHER_EVENT.match(e["message"])
        if m:
            return int(m.group(1)), m.group(2), float(m.group(3)), shlex.split(m.group(4))
    return None


EXITING_GRACE_S = 2.0  # how long a process with an empty command line is given to finish exiting


def verified_launcher(run_dir: str, pid: int | None, store: MetricsStore) -> int | None:
    """`pid`, the store's launcher, when it is alive and is this run's launcher: the start time and
    command line it recorded, or (before it recorded them) an `executor launch` of this run folder
    (rank 0 of a run without a launcher writes its own pid); None when it is gone. ValueError (one
    line) when the pid is now another process's."""
    now = process_identity(pid)
    deadline = time.monotonic() + EXITING_GRACE_S
    while now is not None and not now[1] and time.monotonic() < deadline:
        # an empty command line: a process in the middle of exiting (its memory already gone,
        # not yet a zombie), e.g. a launcher just SIGKILLed; give it a moment to be gone
        time.sleep(0.05)
        now = process_identity(pid)
    if now is None:
        return None
    rec = recorded_launcher(store)
    if rec is not None and rec[0] == pid:
        if abs(now[0] - rec[2]) > START_TIME_TOLERANCE_S:
            raise ValueError(f"run {run_dir}: pid {pid} is not its launcher (that process started at "
                             f"{_clock(now[0])}, the launcher at {_clock(rec[2])}); nothing signalled")
        if now[1] != rec[3]:
            raise ValueError(f"run {run_dir}: pid {pid} is not its launcher (its command line is not the one the "
                             "launcher recorded); nothing signalled")
        return pid
    if is_run_process(pid, run_dir, LAUNCHER) or is_run_process(pid, run_dir, WORKER):
        return pid  # a launcher not yet recorded, or rank 0 of a run started without one
    raise ValueError(f"run {run_dir}: pid {pid} is not its launcher (it runs {shlex.join(now[1])[:80]!r}); "
                     "nothing signalled")


def _clock(t: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t))


def kill_everything(agents: Sequence[subprocess.Popen], worker_pids: list[int], run_dir: str) -> None:
    """SIGTERM every torchrun agent's group and every rank's session (SIGCONT too: a stopped rank
    takes its SIGTERM only once continued), SIGKILL what is left after the grace. Only ranks of
    `run_dir` are signalled."""
    workers = [p for p in worker_pids if is_run_process(p, run_dir, WORKER)]
    for agent in agents:
        if agent.poll() is None:
            signal_group(agent.pid, signal.SIGTERM)
    for pid in workers:
        signal_group(pid, signal.SIGTERM)  # each rank leads its own session (torchrun's start_new_session)
        signal_group(pid, signal.SIGCONT)
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


def _torchrun(run_dir: str) -> int | None:
    """The run's torchrun (the rendezvous host's agent) while it lives and is the run's."""
    pid = read_pid(os.path.join(run_dir, "torchrun.pid"))
    return pid if is_run_process(pid, run_dir, TORCHRUN) else None


def still_running(run_dir: str, launcher: int | None, store: MetricsStore) -> bool:
    """The run's launcher (verified by the caller), its torchrun or one of its ranks is alive."""
    return (pid_alive(launcher) or _torchrun(run_dir) is not None
            or any(is_run_process(p, run_dir, WORKER) for p in store.worker_pids()))


def stop_escalated(run_dir: str, launcher: int | None, store: MetricsStore, timeout_s: float) -> None:
    """Ask the launcher (verified by the caller) to stop through the store; if it has not ended
    within `timeout_s` (or is gone), kill it, torchrun's group and every rank, each verified."""
    store.request_stop()
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and pid_alive(launcher):
        time.sleep(POLL_S)  # the launcher polls the flag, ends everything and records "stopped"
    if launcher and pid_alive(launcher):
        with contextlib.suppress(OSError):
            os.kill(launcher, signal.SIGKILL)  # the launcher only: its group may be a user's shell
    torchrun_pid = _torchrun(run_dir)
    if torchrun_pid is not None:
        signal_group(torchrun_pid, signal.SIGKILL)
    kill_everything((), store.worker_pids(), run_dir)


def record_vanished(store: MetricsStore, pid: int | None, host: str | None) -> None:
    """A run still "running" in the store whose launcher is gone: record it failed, saying so."""
    if store.status() == "running":
        store.finish("failed", f"launcher vanished: the launcher (pid {pid} on {host}) ended without recording "
                               "the end of the run")


def stop_elsewhere(run_dir: str, host: str, store: MetricsStore, timeout_s: float) -> str:
    """Stop a run whose launcher is on `host`, not this machine (a shared store): ask it through the
    store, the one channel that reaches it, and signal nothing here; its status, or ValueError
    (one line) when it has not answered within `timeout_s`."""
    if store.status() != "running":
        return store.status()
    store.request_stop()
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and store.status() == "running":
        time.sleep(POLL_S)
    if store.status() == "running":
        raise ValueError(f"run {run_dir} was started on host {host}; stop it there (its launcher did not answer "
                         f"the stop asked through the store within {timeout_s:g} s; nothing signalled here)")
    return store.status()


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
