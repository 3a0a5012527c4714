"""Emulated links on one machine: a network namespace per rank, each joined to a hub's bridge by a
veth shaped with tc tbf in both directions, so communication between ranks takes wire time.

`executor launch --emulate-links GBPS` (or the cluster file's `emulate_links_gbps`) runs a plan on
this machine with rank i's torchrun agent and process inside namespace i, whose one interface
(`gmx0`, 10.79.X.(100+i)/24) is a veth to port `r<i>` of a bridge in the run's hub namespace. tbf
shapes gmx0 (what the rank sends) and r<i> (what it receives) to GBPS of TCP payload, so every pair
of ranks talks over two shaped links, as over NICs of GBPS behind a non-blocking switch. Each rank
reads its own gmx0 counters (/proc/self/net/dev) around its steps: the bytes it put on the link.

Namespaces, shaping, tear-down and the guard are executor/netns.py's, shared with the emulated
datacenters (executor/wan.py). Layout and why: docs/emulated_wan.md ("Emulated links").
"""
from __future__ import annotations

import logging
import os
from dataclasses import asdict, dataclass

from contracts.constants import BITS_PER_BYTE, GBIT
from contracts.jsonio import load_json_file, save_json_file
from executor import netns
from executor.store import LINKS_FILE  # noqa: F401  (the run folder's record of the links, read by read_metrics)

log = logging.getLogger(__name__)

PREFIX = "gpumix-lnk."  # + "<run id>.<launcher pid>.<rank>" and ".hub"
HUB = "hub"
BRIDGE = "gmxbr"
RANK_IF = "gmx0"  # the rank's one interface; its hub end is r<i>
SUBNET_PREFIX = "10.79"
ADDR_BASE = 100  # rank i is 10.79.X.(100 + i): three digits, string order = rank order
MAX_RANKS = 255 - ADDR_BASE
ENV_LINK_IF = "GPUMIX_LINK_IF"  # set for the ranks: the interface whose counters they record


def check_gbps(gbps: object, where: str = "--emulate-links") -> float:
    """`gbps` as a float > 0 (ValueError naming `where` otherwise)."""
    if isinstance(gbps, bool) or not isinstance(gbps, (int, float)) or not gbps > 0 or gbps != gbps:
        raise ValueError(f"{where} must be a link rate in Gbit/s > 0, got {gbps!r}")
    if gbps > 100:
        raise ValueError(f"{where} {gbps:g} Gbit/s: at most 100 (tc tbf on a veth cannot shape faster "
                         "than the machine copies)")
    return float(gbps)


@dataclass(frozen=True)
class LinksSetup:
    """One run's emulated links: enough to enter, describe and remove them (links.json)."""

    run_id: str
    owner_pid: int  # the launcher: a namespace whose owner is gone is stale
    subnet: str  # "10.79.X"
    num_ranks: int
    gbps: float  # TCP payload each way of every rank's link

    def netns(self, i: int | str) -> str:
        """Rank i's namespace, or the hub's (i = HUB)."""
        return netns.name_of(PREFIX, self.run_id, self.owner_pid, i)

    def names(self) -> list[str]:
        return [self.netns(i) for i in range(self.num_ranks)] + [self.netns(HUB)]

    def addr(self, i: int) -> str:
        return f"{self.subnet}.{ADDR_BASE + i}"

    def exec_prefix(self, i: int) -> list[str]:
        """The argument list that runs a command inside rank i's namespace."""
        return netns.exec_prefix(self.netns(i))

    @property
    def tbf_rate_bps(self) -> int:
        return netns.tbf_rate_bps(self.gbps)

    def describe(self) -> list[str]:
        """What is emulated, one line per fact, for the run's `emulation` events."""
        rate = self.tbf_rate_bps
        return [f"links: {self.num_ranks} ranks, each in its own network namespace on this machine ("
                + ", ".join(f"rank {i} = {self.netns(i)} at {self.addr(i)}" for i in range(self.num_ranks))
                + f"), joined by bridge {BRIDGE} in {self.netns(HUB)}",
                f"links: every rank's link shaped with tc tbf each direction, {self.gbps * 1e3:g} Mbit/s of TCP "
                f"payload (tbf rate {rate / 1e6:.3f} Mbit/s of frames at MTU {netns.MTU}), burst "
                f"{netns.burst_bytes(rate)} bytes, queue {netns.QUEUE_S * 1e3:g} ms; a transfer between two ranks "
                "crosses the sender's link and the receiver's"]

    def to_dict(self) -> dict:
        d = asdict(self)
        d["netns"] = self.names()
        d["addrs"] = [self.addr(i) for i in range(self.num_ranks)]
        d["payload_rate_bytes_per_s"] = self.gbps * GBIT / BITS_PER_BYTE
        return d

    def save(self, path: str) -> None:
        save_json_file(path, self.to_dict())

    @classmethod
    def load(cls, path: str) -> "LinksSetup":
        d = load_json_file(path, "emulated links")
        return cls(d["run_id"], d["owner_pid"], d["subnet"], d["num_ranks"], d["gbps"])


def layout(num_ranks: int, gbps: float, run_id: str, owner_pid: int, subnet: str) -> LinksSetup:
    """The emulated links of a run of `num_ranks` ranks (no command run)."""
    if num_ranks < 2:
        raise ValueError(f"--emulate-links: the plan uses {num_ranks} device; links join at least 2 ranks")
    if num_ranks > MAX_RANKS:
        raise ValueError(f"--emulate-links: {num_ranks} ranks, at most {MAX_RANKS} emulated links")
    return LinksSetup(run_id, owner_pid, subnet, num_ranks, check_gbps(gbps))


def build_commands(setup: LinksSetup) -> list[list[str]]:
    """Every command that builds `setup`, in order: the hub and its bridge, then per rank its
    namespace, its veth to the bridge, its address and tbf on both ends."""
    hub = setup.netns(HUB)
    cmds = [["ip", "netns", "add", hub],
            ["ip", "-n", hub, "link", "set", "lo", "up"],
            ["ip", "-n", hub, "link", "add", BRIDGE, "type", "bridge"],
            ["ip", "-n", hub, "link", "set", BRIDGE, "up"]]
    for i in range(setup.num_ranks):
        ns, port = setup.netns(i), f"r{i}"
        cmds += [["ip", "netns", "add", ns],
                 ["ip", "-n", ns, "link", "set", "lo", "up"],
                 ["ip", "-n", hub, "link", "add", port, "mtu", str(netns.MTU), "type", "veth",
                  "peer", "name", RANK_IF, "netns", ns, "mtu", str(netns.MTU)],
                 ["ip", "-n", hub, "link", "set", port, "master", BRIDGE],
                 ["ip", "-n", hub, "link", "set", port, "up"],
                 ["ip", "-n", ns, "addr", "add", f"{setup.addr(i)}/24", "dev", RANK_IF],
                 ["ip", "-n", ns, "link", "set", RANK_IF, "up"],
                 netns.tbf_command(ns, RANK_IF, setup.gbps),  # what rank i sends
                 netns.tbf_command(hub, port, setup.gbps)]  # what rank i receives
    return cmds


def create(num_ranks: int, gbps: float, run_id: str, owner_pid: int | None = None) -> LinksSetup:
    """Build the emulated links (RuntimeError naming the command that failed; what was built is
    removed again)."""
    why = netns.unavailable_reason()
    if why is not None:
        raise ValueError(f"--emulate-links: {why}")
    setup = layout(num_ranks, gbps, run_id, owner_pid or os.getpid(), netns.free_subnet(SUBNET_PREFIX))
    try:
        for cmd in build_commands(setup):
            netns.run_cmd(cmd)
    except BaseException:
        remove(setup)
        raise
    return setup


def remove(setup: LinksSetup) -> None:
    netns.remove_names(setup.names())


def run_prefix(run_id: str) -> str:
    return f"{PREFIX}{run_id}."


def remove_run(run_id: str) -> None:
    """Remove every namespace of the run's links (any launcher of it), with its processes."""
    netns.remove_names(netns.find(run_prefix(run_id)))


def remove_stale(run_id: str) -> list[str]:
    """Remove this run's link namespaces and those whose launcher is gone; the names removed."""
    return netns.remove_stale(PREFIX, run_id)


def leftovers(setup: LinksSetup) -> list[str]:
    return netns.leftovers(setup.names())


def guard_command(setup: LinksSetup, run_dir: str | None = None) -> list[str]:
    return netns.guard_command(PREFIX, setup.run_id, setup.owner_pid, "links", run_dir)


class LinkCounter:
    """A rank's TCP payload sent on its emulated link between `start()` and `stop()`, from its
    interface's counters (netns.payload_bytes). None everywhere when the rank has no such link."""

    def __init__(self, dev: str | None):
        self.dev = dev if dev and netns.read_tx_counters(dev) is not None else None
        self._start: tuple[int, int] | None = None

    def start(self) -> None:
        self._start = netns.read_tx_counters(self.dev) if self.dev else None

    def stop(self) -> int | None:
        if self.dev is None or self._start is None:
            return None
        now = netns.read_tx_counters(self.dev)
        if now is None:
            return None
        return netns.payload_bytes(now[0] - self._start[0], now[1] - self._start[1])
