"""The stall watchdog: a run that makes no progress for too long fails, naming the stalled rank.

A rank that stops (SIGSTOP, a debugger, a hung filesystem) leaves its peers waiting in a collective,
and gloo's default timeout is 30 minutes. The launcher's watch loop (executor/supervise.py) feeds a
`StallWatch` the store's progress (the last step, the events, the ranks registered) about once a
second; with none for `stall_bound_s` (RunConfig.stall_timeout_s, `--stall-timeout`, or derived
from the plan's predicted iteration) it returns a `Stall`: the reason and the rank, a stopped
process (state T or D) first, else the one busy on the CPU while the others wait. Before a launch's
first step the bound grows by STARTUP_ALLOWANCE_S (imports, rendezvous, model build, weights read).
`collective_timeout` gives the ranks' process group a timeout past the watchdog's bound, so a hang
ends even where no launcher watches (multi-node torchrun lines, SLURM) and the watchdog, which
names the rank, fires first where one does.
"""
from __future__ import annotations

import datetime
import logging
import time
from dataclasses import dataclass

from contracts.plan import Plan
from contracts.run import RunConfig

log = logging.getLogger(__name__)

# A step may run this many times slower than predicted (a loaded machine, a checkpoint save between
# steps, a validation pass) before it counts as a stall; never less than STALL_MIN_S.
STALL_FACTOR = 20.0
STALL_MIN_S = 120.0
STARTUP_ALLOWANCE_S = 600.0  # before the first step: torch import, rendezvous, model build, init_from reads
CHECK_EVERY_S = 1.0  # the watchdog reads the store this often (the watch loop polls faster)
BUSY_SHARE = 0.5  # a rank that used this share of a core through the stall is the one computing


def stall_bound_s(plan: Plan, stall_timeout_s: float | None) -> float:
    """Seconds without progress that fail the run: the given timeout, else STALL_FACTOR x the
    plan's predicted iteration, at least STALL_MIN_S."""
    if stall_timeout_s is not None:
        return float(stall_timeout_s)
    return max(STALL_MIN_S, STALL_FACTOR * (plan.predicted_iteration_s or 0.0))


def collective_timeout(plan: Plan, run_dir: str) -> datetime.timedelta:
    """The ranks' process-group timeout: twice the stall bound plus the startup allowance (the run
    folder's run.json gives the stall timeout; without one, the derived bound)."""
    try:
        given = RunConfig.load(run_dir).stall_timeout_s
    except (OSError, ValueError):  # a rank started by hand, without run.json
        given = None
    return datetime.timedelta(seconds=2 * stall_bound_s(plan, given) + STARTUP_ALLOWANCE_S)


@dataclass(frozen=True)
class Stall:
    reason: str
    rank: int | None


def _cpu_s(pid: int) -> float | None:
    try:
        import psutil

        t = psutil.Process(pid).cpu_times()
        return t.user + t.system
    except Exception:  # gone, or not ours to read
        return None


def _state(pid: int) -> str | None:
    try:
        import psutil

        return psutil.Process(pid).status()
    except Exception:
        return None


def _rank_pids(store) -> dict[int, int]:
    """rank -> pid of the ranks registered (both lists are in rank order)."""
    return dict(zip(store.registered_ranks(), store.worker_pids()))


def stalled_rank(pids: dict[int, int], cpu_then: dict[int, float | None], elapsed_s: float) -> tuple[int | None, str]:
    """(rank, why) of the rank holding the others up: a stopped or disk-waiting process first, else
    the one busy on the CPU (the others wait in a collective); (None, why) when none stands out."""
    for rank, pid in sorted(pids.items()):
        state = _state(pid)
        if state in ("stopped", "tracing-stop"):
            return rank, f"its process (pid {pid}) is stopped (state T)"
        if state == "disk-sleep":
            return rank, f"its process (pid {pid}) waits on the disk (state D)"
    used = {r: now - then for r, pid in pids.items()
            if (then := cpu_then.get(r)) is not None and (now := _cpu_s(pid)) is not None}
    if used:
        rank = max(used, key=used.get)
        if used[rank] > BUSY_SHARE * elapsed_s:
            return rank, f"busy on the CPU ({used[rank]:.0f} s in {elapsed_s:.0f} s) while the other ranks wait"
    return None, "no rank stands out (every rank waits)"


class StallWatch:
    """Progress of one launch, read from its store; `check()` says when it stalled."""

    def __init__(self, store, bound_s: float) -> None:
        self.store, self.bound_s = store, bound_s
        self.first_step = store.last_step()  # a resumed run starts past its checkpoint's step
        self._seen: tuple | None = None
        self._since = time.monotonic()
        self._next_check = 0.0
        self._cpu: dict[int, float | None] = {}

    def _progress(self) -> tuple:
        return self.store.last_step(), len(self.store.events()), len(self.store.registered_ranks())

    def check(self) -> Stall | None:
        now = time.monotonic()
        if now < self._next_check:
            return None
        self._next_check = now + CHECK_EVERY_S
        seen = self._progress()
        if seen != self._seen:
            self._seen, self._since = seen, now
            self._cpu = {r: _cpu_s(p) for r, p in _rank_pids(self.store).items()}
            return None
        stepped = seen[0] > self.first_step
        limit = self.bound_s if stepped else self.bound_s + STARTUP_ALLOWANCE_S
        elapsed = now - self._since
        if elapsed <= limit:
            return None
        rank, why = stalled_rank(_rank_pids(self.store), self._cpu, elapsed)
        where = f"after step {seen[0]}" if stepped else "before the first step"
        who = f"rank {rank} stalled: {why}" if rank is not None else why
        log.warning("no progress for %.0f s %s: %s", elapsed, where, who)
        return Stall(f"stalled: no progress for {elapsed:.0f} s {where} (bound {limit:.0f} s); {who}", rank)
