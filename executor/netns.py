"""Network namespaces of a run, shared by emulated datacenters (executor/wan.py) and emulated links
(executor/links.py): the checks, tc tbf shaping corrected from frames to TCP payload, the payload
count of an interface's counters, and the tear-down (kill every process inside, delete the
namespaces) with its guard process and the removal of a dead launcher's namespaces.

A run's namespaces are named `<prefix><run id>.<launcher pid>.<suffix>`, e.g. `gpumix-wan.run-3.
4242.0`: the prefix says which emulation made them, the pid which launcher owns them (a namespace
whose launcher is gone is stale). Layouts, shaping figures and why: docs/emulated_wan.md.
"""
from __future__ import annotations

import argparse
import contextlib
import logging
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from typing import Sequence

from contracts.constants import BITS_PER_BYTE, GBIT

log = logging.getLogger(__name__)

NETNS_DIR = "/var/run/netns"
BINARIES = ("ip", "tc", "nsenter")
MTU = 1500
FRAME_BYTES = MTU + 14  # what tbf counts of a full segment: the Ethernet header and the IP packet
HEADER_BYTES = 14 + 20 + 20 + 12  # Ethernet, IP, TCP, the timestamp option (on by default in every namespace)
PAYLOAD_BYTES = MTU + 14 - HEADER_BYTES  # 1448: a full TCP segment's payload
BURST_S = 0.001
BURST_MIN_BYTES = 16 * 1024
QUEUE_S = 0.020
COMMAND_TIMEOUT_S = 30.0
KILL_TIMEOUT_S = 10.0
GUARD_POLL_S = 0.5


def run_cmd(argv: Sequence[str], check: bool = True) -> subprocess.CompletedProcess:
    """Run one command (an argument list); RuntimeError naming it when it fails and `check`."""
    r = subprocess.run(list(argv), capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S,
                       stdin=subprocess.DEVNULL)
    if check and r.returncode != 0:
        raise RuntimeError(f"`{shlex.join(argv)}` failed: {(r.stderr or r.stdout).strip() or r.returncode}")
    return r


def unavailable_reason() -> str | None:
    """None when this process can build namespaces, veth links and tc qdiscs; else what is missing."""
    if os.geteuid() != 0:
        return "not root (network namespaces, veth links and tc need root)"
    missing = [b for b in BINARIES if shutil.which(b) is None]
    if missing:
        return f"missing {', '.join(missing)} (Debian: apt-get install iproute2 util-linux)"
    return None


def free_subnet(prefix: str) -> str:
    """`prefix`.X with no address of any host interface in it."""
    used = run_cmd(["ip", "-o", "-4", "addr", "show"]).stdout
    for x in range(256):
        if f" {prefix}.{x}." not in used:
            return f"{prefix}.{x}"
    raise RuntimeError(f"every {prefix}.X.0/24 subnet is in use on this host")


def exec_prefix(name: str) -> list[str]:
    """The argument list that runs a command inside namespace `name` (nsenter, not `ip netns exec`,
    which remounts /sys, where profiler/cgroups.py then finds no cgroup hierarchy)."""
    return ["nsenter", f"--net={NETNS_DIR}/{name}"]


# ---- shaping: tbf counts frames, the cost models price TCP payload -----------------------------


def tbf_rate_bps(gbps: float) -> int:
    """tbf's rate in bit/s: frames, so that TCP's payload gets `gbps` (docs/emulated_wan.md)."""
    return round(gbps * GBIT * FRAME_BYTES / PAYLOAD_BYTES)


def burst_bytes(rate_bps: int) -> int:
    return max(BURST_MIN_BYTES, round(rate_bps / BITS_PER_BYTE * BURST_S))


def tbf_command(ns: str, dev: str, gbps: float) -> list[str]:
    """The tc command that shapes the egress of `dev` in namespace `ns` to `gbps` of TCP payload."""
    rate = tbf_rate_bps(gbps)
    return ["tc", "-n", ns, "qdisc", "add", "dev", dev, "root", "handle", "1:", "tbf",
            "rate", f"{rate}bit", "burst", str(burst_bytes(rate)), "latency", f"{QUEUE_S * 1e3:g}ms"]


def payload_bytes(tx_bytes: int, tx_packets: int) -> int:
    """TCP payload of an interface's transmit counters: each packet (a frame, or a GSO super-frame)
    carries one HEADER_BYTES header, so a pure ACK counts 0 and a full segment 1448."""
    return tx_bytes - HEADER_BYTES * tx_packets


def read_tx_counters(dev: str, proc_net_dev: str = "/proc/self/net/dev") -> tuple[int, int] | None:
    """(tx_bytes, tx_packets) of `dev` in the calling process's network namespace (/proc/self/net/dev
    follows the namespace, /sys/class/net does not), None when there is no such interface."""
    with contextlib.suppress(OSError), open(proc_net_dev, encoding="ascii") as fh:
        for line in fh.read().splitlines()[2:]:
            name, _, rest = line.partition(":")
            if name.strip() == dev:
                f = rest.split()  # rx: bytes packets errs drop fifo frame compressed multicast; tx: bytes packets ...
                return int(f[8]), int(f[9])
    return None


# ---- tear-down ---------------------------------------------------------------------------------


def name_of(prefix: str, run_id: str, owner_pid: int, suffix: str | int) -> str:
    if "." in run_id:
        raise ValueError(f"run id {run_id!r} must not contain '.' (namespace names split on it)")
    return f"{prefix}{run_id}.{owner_pid}.{suffix}"


def netns_inode(name: str) -> int | None:
    try:
        return os.stat(os.path.join(NETNS_DIR, name)).st_ino
    except OSError:
        return None


def pids_in(inodes: set[int]) -> list[int]:
    """Every process whose network namespace is one of `inodes`."""
    wanted = {f"net:[{ino}]" for ino in inodes}
    out = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        with contextlib.suppress(OSError):
            if os.readlink(f"/proc/{pid}/ns/net") in wanted:
                out.append(int(pid))
    return out


def find(prefix: str) -> list[str]:
    """Namespace names under NETNS_DIR that start with `prefix`."""
    with contextlib.suppress(OSError):
        return sorted(n for n in os.listdir(NETNS_DIR) if n.startswith(prefix))
    return []


def remove_names(names: Sequence[str]) -> None:
    """Kill every process in these namespaces, then delete them (OSError if a process survives).
    With the namespaces go their veths (both ends live in run namespaces), bridges and qdiscs."""
    inodes = {ino for ino in map(netns_inode, names) if ino is not None}
    deadline = time.monotonic() + KILL_TIMEOUT_S
    while inodes:
        pids = pids_in(inodes)
        if not pids:
            break
        if time.monotonic() > deadline:
            raise OSError(f"processes {pids} in namespaces {', '.join(names)} survive SIGKILL")
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.05)
    for name in names:
        if netns_inode(name) is not None:
            r = run_cmd(["ip", "netns", "del", name], check=False)
            if r.returncode != 0 and netns_inode(name) is not None:
                raise OSError(f"cannot delete namespace {name}: {r.stderr.strip()}")


def _owner(prefix: str, name: str) -> tuple[str, int] | None:
    parts = name[len(prefix):].split(".")
    if len(parts) != 3 or not parts[1].isdigit():
        return None
    return parts[0], int(parts[1])


def alive(pid: int) -> bool:
    """The process exists and is not a zombie (a killed launcher its parent has not reaped yet)."""
    try:
        import psutil

        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except ImportError:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, 0)
            return True
        return False
    except Exception:  # psutil.NoSuchProcess
        return False


def remove_stale(prefix: str, run_id: str) -> list[str]:
    """Remove the namespaces under `prefix` of this run and those whose launcher is gone (a killed
    launcher left them); returns the names removed."""
    stale = []
    for name in find(prefix):
        owner = _owner(prefix, name)
        if owner is not None and (owner[0] == run_id or not alive(owner[1])):
            stale.append(name)
    remove_names(stale)
    return stale


def leftovers(names: Sequence[str]) -> list[str]:
    """What still holds one of the namespaces `names` by name: its file under NETNS_DIR or a mount
    of it (empty after a complete tear-down; with no process left in them either, the kernel has
    freed the namespaces and, with them, their links and qdiscs). Processes are the caller's to
    check: a namespace's inode number is reused once it is freed."""
    left = [f"netns {n}" for n in names if netns_inode(n) is not None]
    with contextlib.suppress(OSError), open("/proc/self/mountinfo", encoding="utf-8") as fh:
        mounts = fh.read()
        left += [f"mount of {n}" for n in names if f"{NETNS_DIR}/{n} " in mounts]
    return left


# ---- the guard: tear-down when the launcher is killed -------------------------------------------


def guard_command(prefix: str, run_id: str, owner_pid: int, what: str, run_dir: str | None = None) -> list[str]:
    """`python -m executor.netns guard ...`: removes the launcher's namespaces under `prefix` once
    it is gone (`what`: the emulation's name in the run's event)."""
    return [sys.executable, "-m", "executor.netns", "guard", "--prefix", prefix, "--owner-pid", str(owner_pid),
            "--run-id", run_id, "--what", what, *(["--run-dir", run_dir] if run_dir else [])]


def start_guard(cmd: list[str], cwd: str, env: dict[str, str], log_path: str) -> subprocess.Popen:
    """The guard in its own session (a Ctrl-C or a kill of the launcher's group does not reach it)."""
    with open(log_path, "ab") as out:
        return subprocess.Popen(cmd, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)


def stop_guard(guard: subprocess.Popen | None) -> None:
    """End a guard whose launcher removed its namespaces itself."""
    if guard is not None:
        guard.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            guard.wait(timeout=10)


def _guard_main(argv: list[str]) -> int:
    """Wait for the launcher to go; if it went without removing its namespaces, remove them.
    SIGTERM (the launcher's own tear-down is done) ends the guard without touching anything."""
    p = argparse.ArgumentParser(prog="python -m executor.netns guard")
    p.add_argument("--prefix", required=True)
    p.add_argument("--owner-pid", type=int, required=True)
    p.add_argument("--run-id", required=True)
    p.add_argument("--what", default="netns")
    p.add_argument("--run-dir", default=None)
    args = p.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C at the launcher's terminal is the launcher's
    mine = f"{args.prefix}{args.run_id}.{args.owner_pid}."
    while alive(args.owner_pid):
        time.sleep(GUARD_POLL_S)
    names = find(mine)
    if not names:
        return 0
    remove_names(names)
    if args.run_dir:
        with contextlib.suppress(Exception):
            from executor.store import MetricsStore

            store = MetricsStore(args.run_dir)
            store.add_event("emulation", f"{args.what}: launcher pid {args.owner_pid} gone: the guard removed "
                                         f"{', '.join(names)} and every process in them")
            store.close()
    return 0


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if sys.argv[1:2] != ["guard"]:
        print("usage: python -m executor.netns guard --prefix P --owner-pid PID --run-id ID [--what W] "
              "[--run-dir R]", file=sys.stderr)
        sys.exit(2)
    sys.exit(_guard_main(sys.argv[2:]))
