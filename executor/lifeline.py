"""Die with the parent: a process of a run must not outlive the process that started it.

    python -m executor.lifeline --parent PID -- PROGRAM ARGS...  (exec PROGRAM: torchrun under the launcher)
    python -m executor.lifeline --python -- PYTHON_ARGS...       (exec this python: a rank under torchrun)

Asks Linux for a parent-death signal (prctl PR_SET_PDEATHSIG, SIGKILL), which survives exec, then
execs the command in place, so the pid the parent holds is the command's. torchrun and its ranks
each lead their own session, so a killed launcher's process group never reaches them: without this
a SIGKILLed or SIGHUPed launcher left them training. The signal follows the thread that forked, so
the launcher starts its agents from the thread that watches them to the end. Nothing heavy is
imported: a rank joins its cgroup (profiler/cgroups.py) before anything is charged to it. Elsewhere
than Linux it only execs.
"""
from __future__ import annotations

import ctypes
import os
import signal
import sys

PR_SET_PDEATHSIG = 1  # linux/prctl.h


def die_with_parent(sig: int = signal.SIGKILL) -> bool:
    """Have the kernel send `sig` to this process when its parent ends; False where unsupported."""
    if not sys.platform.startswith("linux"):
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    return libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0


def command(argv: list[str]) -> list[str]:
    """`argv` (a program and its arguments) run under the lifeline, as a child of this process."""
    return [sys.executable, "-m", "executor.lifeline", "--parent", str(os.getpid()), "--", *argv]


def python_args(args: list[str]) -> list[str]:
    """Python arguments (`-m module ...`, as torchrun takes its worker) run under the lifeline."""
    return ["-m", "executor.lifeline", "--python", "--", *args]


def main(args: list[str]) -> int:
    if "--" not in args or args.index("--") == len(args) - 1:
        print("usage: python -m executor.lifeline [--python] -- COMMAND...", file=sys.stderr)
        return 2
    own, rest = args[:args.index("--")], args[args.index("--") + 1:]
    # the parent we were started by (torchrun's pid is not known when its ranks' arguments are built)
    parent = int(own[own.index("--parent") + 1]) if "--parent" in own[:-1] else os.getppid()
    die_with_parent()
    if os.getppid() != parent:  # the parent ended before the signal was asked for
        return 70
    if "--python" in own:
        os.execv(sys.executable, [sys.executable, "-u", *rest])
    os.execvp(rest[0], rest)
    return 0  # not reached


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
