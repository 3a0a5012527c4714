"""Physical emulation of a slower or smaller device on one machine: cgroup v1 limits.

A cluster-file device `{"type": "cpu", "cpu_share": 0.333, "memory_gb": 2}` is a CPU worker limited
by the kernel, not by arithmetic: `cpu_share` is a CFS quota (a third of one core: its wall time
stretches), `memory_gb` a memory limit over the process's own baseline (beyond it the OOM killer
ends the process, as a full device would). A process joins its cgroups before its first instruction
(`exec_in`). Cgroups live under the creator's own cgroup, named `gpumix-<run id>-r<rank>` or
`gpumix-profile-<pid>`. Where cgroups are unavailable (`unavailable_reason`) a run emulates by
sleeping and checking the measured peak, and records which it used; the profiler refuses.

The limits, the baseline and the fallback in full: docs/executor.md ("Emulated devices").
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import sys
import time
from dataclasses import asdict, dataclass
from typing import Iterator, Sequence

log = logging.getLogger(__name__)

CGROUP_ROOT = "/sys/fs/cgroup"
CONTROLLERS = ("cpu", "memory")
PREFIX = "gpumix-"
# The CFS period. The kernel's default of 100 ms would let a 1/3 share run 33 ms, then stall
# 67 ms: steps of a few tens of ms would see the quota as noise of their own length. 10 ms
# keeps every step much longer than the period; the kernel accepts 1 ms to 1 s.
CFS_PERIOD_US = 10_000
# cpu.shares of an emulated device: 10 nice-0 processes' weight (1024 each). Measured on this
# 2-core machine at a load average of 6: an unlimited single-thread process got 0.25-0.4 of a
# core, one in a cgroup of these shares and a quota of 1 core got 0.85-0.95 of one.
CPU_SHARES = 10 * 1024
ENV_CGROUPS = "GPUMIX_CGROUPS"  # the run's emulation.json (executor.launch sets it for the ranks)
REMOVE_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class Limits:
    """What one emulated device is limited to. None: not limited in that respect."""

    cpu_share: float | None = None  # fraction of one core
    memory_bytes: int | None = None  # device memory, on top of the process's baseline

    @property
    def any(self) -> bool:
        return self.cpu_share is not None or self.memory_bytes is not None

    def describe(self) -> str:
        parts = []
        if self.cpu_share is not None:
            parts.append(f"CPU quota {self.cpu_share:g} of a core")
        if self.memory_bytes is not None:
            parts.append(f"memory baseline + {self.memory_bytes / 2**30:g} GiB")
        return ", ".join(parts) or "no limits"


@dataclass(frozen=True)
class Cgroup:
    """One emulated device's cgroups: a directory per limited controller."""

    name: str
    limits: Limits
    cpu_dir: str | None = None
    memory_dir: str | None = None

    @property
    def dirs(self) -> tuple[str, ...]:
        return tuple(d for d in (self.memory_dir, self.cpu_dir) if d)

    def to_dict(self) -> dict:
        return {"name": self.name, "cpu_dir": self.cpu_dir, "memory_dir": self.memory_dir,
                "limits": asdict(self.limits)}

    @classmethod
    def from_dict(cls, d: dict) -> "Cgroup":
        return cls(d["name"], Limits(**d["limits"]), d.get("cpu_dir"), d.get("memory_dir"))


# ---- the hierarchy ---------------------------------------------------------------------------


def _own_path(controller: str, proc_cgroup: str = "/proc/self/cgroup") -> str | None:
    """This process's cgroup in the v1 hierarchy of `controller` ("/" at the root), None without one."""
    try:
        with open(proc_cgroup, encoding="utf-8") as fh:
            lines = fh.read().splitlines()
    except OSError:
        return None
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controller in controllers.split(","):
            return path
    return None


def parent_dir(controller: str) -> str:
    """Where this process creates cgroups of `controller`: under its own cgroup of that hierarchy."""
    own = _own_path(controller) or "/"
    return os.path.join(CGROUP_ROOT, controller, own.lstrip("/"))


def unavailable_reason() -> str | None:
    """None when this process can create cgroup v1 CPU and memory limits; else why not."""
    if os.geteuid() != 0:
        return "not root (cgroup v1 limits need root)"
    for controller, probe in (("cpu", "cpu.cfs_quota_us"), ("memory", "memory.limit_in_bytes")):
        if _own_path(controller) is None:
            return f"no cgroup v1 {controller!r} hierarchy (/proc/self/cgroup)"
        parent = parent_dir(controller)
        if not os.path.isfile(os.path.join(parent, probe)):
            return f"no cgroup v1 {controller!r} controller mounted at {parent}"
        if not os.access(parent, os.W_OK):
            return f"{parent} is not writable"
    return None


def _write(path: str, value: str | int) -> None:
    with open(path, "w", encoding="ascii") as fh:
        fh.write(str(value))


def _read(path: str) -> str:
    with open(path, encoding="ascii") as fh:
        return fh.read()


# ---- create, join, remove ------------------------------------------------------------------


def create(name: str, limits: Limits) -> Cgroup:
    """The cgroups of one emulated device (ValueError when cgroups are unavailable). The memory
    limit is set later, by the process itself, once its baseline is known (`apply_memory_limit`)."""
    why = unavailable_reason()
    if why is not None:
        raise ValueError(f"cannot create cgroup {name!r}: {why}")
    cpu_dir = memory_dir = None
    try:
        if limits.cpu_share is not None:
            cpu_dir = os.path.join(parent_dir("cpu"), name)
            os.makedirs(cpu_dir, exist_ok=True)
            _write(os.path.join(cpu_dir, "cpu.cfs_period_us"), CFS_PERIOD_US)
            _write(os.path.join(cpu_dir, "cpu.cfs_quota_us"), max(1000, round(limits.cpu_share * CFS_PERIOD_US)))
            _write(os.path.join(cpu_dir, "cpu.shares"), CPU_SHARES)
        if limits.memory_bytes is not None:
            memory_dir = os.path.join(parent_dir("memory"), name)
            os.makedirs(memory_dir, exist_ok=True)
            with contextlib.suppress(OSError):  # reclaim page cache before anything else; never swap
                _write(os.path.join(memory_dir, "memory.swappiness"), 0)
    except OSError as e:
        remove(Cgroup(name, limits, cpu_dir, memory_dir))
        raise ValueError(f"cannot create cgroup {name!r}: {e.strerror} ({e.filename})") from None
    return Cgroup(name, limits, cpu_dir, memory_dir)


def join(cg: Cgroup, pid: int = 0) -> None:
    """Move `pid` (0: this process, with its threads) into the device's cgroups."""
    for d in cg.dirs:
        _write(os.path.join(d, "cgroup.procs"), pid or os.getpid())


def is_member(cg: Cgroup, proc_cgroup: str = "/proc/self/cgroup") -> bool:
    for controller, d in (("cpu", cg.cpu_dir), ("memory", cg.memory_dir)):
        if d and os.path.join(CGROUP_ROOT, controller, (_own_path(controller, proc_cgroup) or "").lstrip("/")) != d:
            return False
    return True


def apply_memory_limit(cg: Cgroup) -> int | None:
    """Set the memory limit to what the cgroup is charged now (this process's baseline:
    interpreter and libraries, nothing built yet) plus the emulated device memory.
    Returns the baseline in bytes (None: no memory limit)."""
    if cg.memory_dir is None or cg.limits.memory_bytes is None:
        return None
    baseline = int(_read(os.path.join(cg.memory_dir, "memory.usage_in_bytes")))
    limit = baseline + cg.limits.memory_bytes
    _write(os.path.join(cg.memory_dir, "memory.limit_in_bytes"), limit)
    memsw = os.path.join(cg.memory_dir, "memory.memsw.limit_in_bytes")
    if os.path.exists(memsw):  # memsw >= limit: written after the limit, so always allowed
        _write(memsw, limit)
    return baseline


def oom_kills(cg: Cgroup) -> int:
    """How many processes the kernel's OOM killer killed in the device's memory cgroup."""
    if cg.memory_dir is None:
        return 0
    with contextlib.suppress(OSError, ValueError):
        for line in _read(os.path.join(cg.memory_dir, "memory.oom_control")).splitlines():
            key, _, value = line.partition(" ")
            if key == "oom_kill":
                return int(value)
    return 0


def memory_limit_bytes(cg: Cgroup) -> int | None:
    if cg.memory_dir is None:
        return None
    with contextlib.suppress(OSError, ValueError):
        return int(_read(os.path.join(cg.memory_dir, "memory.limit_in_bytes")))
    return None


def _members(d: str) -> list[int]:
    with contextlib.suppress(OSError, ValueError):
        return [int(x) for x in _read(os.path.join(d, "cgroup.procs")).split()]
    return []


def remove(cg: Cgroup, timeout_s: float = REMOVE_TIMEOUT_S) -> None:
    """Remove the device's cgroups. A cgroup with processes cannot be removed: whatever is left
    in it (ours: nothing else joins a gpumix cgroup) is killed first. Raises OSError if one
    stays, naming it."""
    for d in cg.dirs:
        if not os.path.isdir(d):
            continue
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                os.rmdir(d)
                break
            except FileNotFoundError:
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise OSError(f"cannot remove cgroup {d}: processes {_members(d)} are still in it") from None
                for pid in _members(d):
                    with contextlib.suppress(ProcessLookupError, PermissionError):
                        os.kill(pid, signal.SIGKILL)
                time.sleep(0.05)


def find(prefix: str) -> list[str]:
    """Cgroup directories (both hierarchies, under this process's own) whose name starts with `prefix`."""
    out = []
    for controller in CONTROLLERS:
        parent = parent_dir(controller)
        with contextlib.suppress(OSError):
            out += [os.path.join(parent, n) for n in sorted(os.listdir(parent)) if n.startswith(prefix)]
    return out


def remove_all(prefix: str) -> None:
    """Remove every cgroup `find(prefix)` lists (a run whose launcher was killed left them)."""
    for d in find(prefix):
        controller = os.path.relpath(d, CGROUP_ROOT).split(os.sep)[0]
        remove(Cgroup(os.path.basename(d), Limits(), d if controller == "cpu" else None,
                      d if controller == "memory" else None))


@contextlib.contextmanager
def created(name: str, limits: Limits) -> Iterator[Cgroup]:
    """A device's cgroups for the duration of the block, removed however it ends."""
    cg = create(name, limits)
    try:
        yield cg
    finally:
        remove(cg)


# ---- a run's table (emulation.json) ----------------------------------------------------------


def run_prefix(run_id: str) -> str:
    return f"{PREFIX}{run_id}-r"


def save_table(path: str, mode: str, reason: str, ranks: dict[int, Cgroup]) -> None:
    """emulation.json (docs/DESIGN.md): how this run emulates (`cgroup` | `sleep`, and why) and each
    rank's cgroups, `{"ranks": [{"rank": 0, "cpu_cgroup": dir | null, "memory_cgroup": dir | null,
    "name", "limits"}, ...]}` in rank order."""
    rows = [{"rank": r, "cpu_cgroup": c.cpu_dir, "memory_cgroup": c.memory_dir, "name": c.name,
             "limits": asdict(c.limits)} for r, c in sorted(ranks.items())]
    with open(path, "w", encoding="utf-8") as fh:
        json.dump({"mode": mode, "reason": reason, "ranks": rows}, fh, indent=2)


def load_table(path: str) -> tuple[str, dict[int, Cgroup]]:
    """(mode, {rank: its cgroups}) of a table save_table wrote."""
    with open(path, encoding="utf-8") as fh:
        d = json.load(fh)
    return d["mode"], {int(row["rank"]): Cgroup(row["name"], Limits(**row["limits"]), row["cpu_cgroup"],
                                                row["memory_cgroup"]) for row in d["ranks"]}


def rank_cgroup(rank: int) -> Cgroup | None:
    """This rank's cgroups from the table the launcher named in $GPUMIX_CGROUPS, None without one."""
    path = os.environ.get(ENV_CGROUPS)
    if not path:
        return None
    mode, ranks = load_table(path)
    return ranks.get(rank) if mode == "cgroup" else None


def start_rank(rank: int) -> tuple[Cgroup | None, int | None]:
    """At a rank's start, before it builds anything: check it runs inside its cgroups (exec_in put
    it there) and set its memory limit from its baseline. Returns (its cgroups or None, baseline)."""
    cg = rank_cgroup(rank)
    if cg is None:
        return None, None
    if not is_member(cg):
        raise RuntimeError(f"rank {rank} is not in its cgroup {cg.name} (the launcher starts it through "
                           "`python -m profiler.cgroups exec`)")
    return cg, apply_memory_limit(cg)


# ---- exec inside: `python -m profiler.cgroups exec -- ARGV` -------------------------------------


def exec_command(argv: Sequence[str]) -> list[str]:
    """The argument list that runs `argv` (python arguments: `-m module ...`) inside this rank's
    cgroups: torchrun starts it as its worker script, with RANK in the environment."""
    return ["-m", "profiler.cgroups", "exec", "--", *argv]


def _exec_main(args: list[str]) -> int:
    """Join the cgroups of $RANK (from $GPUMIX_CGROUPS), then exec the python command in `args`:
    nothing heavy is imported before the join, so the command's memory is charged inside."""
    if args[:1] != ["exec"] or "--" not in args:
        print("usage: python -m profiler.cgroups exec -- PYTHON_ARGS...", file=sys.stderr)
        return 2
    rest = args[args.index("--") + 1:]
    cg = rank_cgroup(int(os.environ.get("RANK", "0")))
    if cg is not None:
        join(cg)
    os.execv(sys.executable, [sys.executable, "-u", *rest])
    return 0  # not reached


if __name__ == "__main__":
    sys.exit(_exec_main(sys.argv[1:]))
