"""Emulated datacenters on one machine: a network namespace per plan node, veth links shaped by tc.

`executor launch --emulate-wan` runs a plan whose used devices sit on k >= 2 nodes (each node one
datacenter) on this machine, each node's torchrun agent and ranks inside the node's own network
namespace (one host address per node, a veth link per pair of nodes, nothing in the root
namespace), so every byte between datacenters crosses a real link: tc tbf at the plan's rate,
corrected from frames to TCP payload, plus netem's RTT where the kernel has it (else the RTT is
recorded as modelled). gloo's connections per link follow `plan.connections`. `remove`,
`remove_run`, a guard process and `remove_stale` tear every namespace and process of a run down,
however it ends; the namespace machinery they use is executor/netns.py, shared with the emulated
links of executor/links.py.

The layout and why, the shaping figures, RTT, connections and tear-down: docs/emulated_wan.md.
"""
from __future__ import annotations

import logging
import os
from dataclasses import asdict, dataclass
from typing import Sequence

from contracts.constants import BITS_PER_BYTE
from contracts.jsonio import load_json_file, save_json_file
from contracts.plan import Plan, link_key
from executor import netns
from executor.netns import (FRAME_BYTES, MTU, NETNS_DIR, QUEUE_S, find, netns_inode, pids_in,  # noqa: F401
                            remove_names)

log = logging.getLogger(__name__)

PREFIX = "gpumix-wan."  # + "<run id>.<launcher pid>.<node index>"; a run id has no "." (launch.run_id_of)
HOST_IF, HOST_PEER_IF = "gmx0", "gmx0p"
SUBNET_PREFIX = "10.78"
ADDR_BASE = 100  # node i is 10.78.X.(100 + i): three digits, string order = node order
MAX_NODES = 255 - ADDR_BASE
NETEM_MIN_LIMIT = 1000  # packets, netem's default
WAN_FILE = "wan.json"
_run = netns.run_cmd


# ---- what this machine can do ----------------------------------------------------------------


def unavailable_reason() -> str | None:
    """None when this process can build emulated datacenters; else what is missing."""
    return netns.unavailable_reason()


def probe_netem() -> str | None:
    """None when the kernel has netem (a delay can be added); else the kernel's answer."""
    ns = f"{PREFIX}probe.{os.getpid()}.0"
    _run(["ip", "netns", "add", ns])
    try:
        r = _run(["tc", "-n", ns, "qdisc", "add", "dev", "lo", "root", "netem", "delay", "1ms"], check=False)
        return None if r.returncode == 0 else ((r.stderr or r.stdout).strip() or f"tc exit code {r.returncode}")
    finally:
        _run(["ip", "netns", "del", ns], check=False)


def free_subnet(prefix: str = SUBNET_PREFIX) -> str:
    """`prefix`.X (10.78.X by default) with no address of any host interface in it (the SLURM test
    cluster takes 10.77.X the same way)."""
    return netns.free_subnet(prefix)


# ---- the layout (pure) -------------------------------------------------------------------------


@dataclass(frozen=True)
class Link:
    """The link between nodes i < j; gbps None: the plan has no wan link for the pair (unshaped)."""

    i: int
    j: int
    a: str
    b: str
    gbps: float | None
    rtt_ms: float = 0.0

    @property
    def tbf_rate_bps(self) -> int:
        """tbf's rate in bit/s: frames, so that TCP's payload gets `gbps` (docs/emulated_wan.md)."""
        assert self.gbps is not None
        return netns.tbf_rate_bps(self.gbps)

    @property
    def burst_bytes(self) -> int:
        return netns.burst_bytes(self.tbf_rate_bps)

    def netem_limit_packets(self) -> int:
        """netem holds the packets of half a round trip plus the queue (it replaces tbf's queue), twice
        over: a limit too short drops what TCP has in flight and the link runs below its rate."""
        frames_per_s = self.tbf_rate_bps / BITS_PER_BYTE / FRAME_BYTES
        return max(NETEM_MIN_LIMIT, round(2 * frames_per_s * (self.rtt_ms / 2000 + QUEUE_S)))


@dataclass(frozen=True)
class WanSetup:
    """One run's emulated datacenters: enough to enter, describe and remove them (wan.json)."""

    run_id: str
    owner_pid: int  # the launcher: a namespace whose owner is gone is stale
    subnet: str  # "10.78.X"
    nodes: tuple[str, ...]  # plan node names, in plan order: node i is namespace i
    links: tuple[Link, ...]
    connections: int
    rtt_mode: str  # "netem": the RTT is added; "modelled": the kernel cannot add it
    netem_problem: str | None = None

    def netns(self, i: int) -> str:
        return netns.name_of(PREFIX, self.run_id, self.owner_pid, i)

    def addr(self, i: int) -> str:
        return f"{self.subnet}.{ADDR_BASE + i}"

    def exec_prefix(self, i: int) -> list[str]:
        """The argument list that runs a command inside node i's namespace."""
        return netns.exec_prefix(self.netns(i))

    @property
    def gloo_ifname(self) -> str:
        return ",".join([HOST_IF] * self.connections)

    def describe(self) -> list[str]:
        """What is emulated, one line per fact, for the run's `emulation` events."""
        lines = [f"wan: {len(self.nodes)} datacenters, each in its own network namespace on this machine ("
                 + ", ".join(f"{n} = {self.netns(i)} at {self.addr(i)}" for i, n in enumerate(self.nodes)) + ")"]
        for ln in self.links:
            if ln.gbps is None:
                lines.append(f"wan: link {ln.a}–{ln.b}: the plan has no wan link for this pair: unshaped veth")
                continue
            rtt = ("no round trip asked" if ln.rtt_ms == 0 else
                   f"RTT {ln.rtt_ms:g} ms added (netem delay {ln.rtt_ms / 2:g} ms each way)" if self.rtt_mode == "netem"
                   else f"RTT {ln.rtt_ms:g} ms modelled, not added (netem unavailable: {self.netem_problem})")
            lines.append(f"wan: link {ln.a}–{ln.b}: tc tbf each direction, {ln.gbps * 1e3:g} Mbit/s of TCP payload "
                         f"(tbf rate {ln.tbf_rate_bps / 1e6:.3f} Mbit/s of frames at MTU {MTU}), burst "
                         f"{ln.burst_bytes} bytes, queue {QUEUE_S * 1e3:g} ms; {rtt}")
        lines.append(f"wan: {self.connections} TCP connection(s) per transfer between every pair of ranks "
                     f"(GLOO_SOCKET_IFNAME={self.gloo_ifname}); RTT "
                     + ("added with netem" if self.rtt_mode == "netem" else "modelled, not added"))
        return lines

    def to_dict(self) -> dict:
        d = asdict(self)
        d["netns"] = [self.netns(i) for i in range(len(self.nodes))]
        d["addrs"] = [self.addr(i) for i in range(len(self.nodes))]
        return d

    def save(self, path: str) -> None:
        save_json_file(path, self.to_dict())

    @classmethod
    def load(cls, path: str) -> "WanSetup":
        d = load_json_file(path, "emulated datacenters")
        return cls(d["run_id"], d["owner_pid"], d["subnet"], tuple(d["nodes"]), tuple(Link(**ln) for ln in d["links"]),
                   d["connections"], d["rtt_mode"], d.get("netem_problem"))


def connections_of(plan: Plan, nodes: Sequence[str]) -> tuple[int, list[str]]:
    """(the connections every rank opens, notes): the most any link between used nodes asks."""
    asked = {link_key(a, b): plan.connections.get(link_key(a, b), 1)
             for i, a in enumerate(nodes) for b in nodes[i + 1:]}
    n = max(asked.values(), default=1)
    notes = []
    if len(set(asked.values())) > 1:
        notes.append(f"wan: links ask different connection counts ({', '.join(f'{k}: {v}' for k, v in asked.items())}"
                     f"); gloo opens the same number on every rank: {n}")
    return n, notes


def layout(plan: Plan, nodes: Sequence[str], run_id: str, owner_pid: int, subnet: str,
           netem_problem: str | None) -> WanSetup:
    """The emulated datacenters of `plan` (no command run): one namespace per node, a link per pair."""
    if len(nodes) < 2:
        raise ValueError(f"--emulate-wan: the plan's used devices sit on one node ({', '.join(nodes) or 'none'}); "
                         "emulated datacenters need devices on at least 2 nodes")
    if len(nodes) > MAX_NODES:
        raise ValueError(f"--emulate-wan: {len(nodes)} nodes, at most {MAX_NODES} emulated datacenters")
    if "." in run_id:
        raise ValueError(f"run id {run_id!r} must not contain '.' (namespace names split on it)")
    wan = {link_key(w.a, w.b): w for w in plan.wan}
    links = []
    for i, a in enumerate(nodes):
        for j in range(i + 1, len(nodes)):
            w = wan.get(link_key(a, nodes[j]))
            links.append(Link(i, j, a, nodes[j], None if w is None else w.gbps, 0.0 if w is None else w.rtt_ms))
    connections, _ = connections_of(plan, nodes)
    return WanSetup(run_id, owner_pid, subnet, tuple(nodes), tuple(links), connections,
                    "netem" if netem_problem is None else "modelled", netem_problem)


def _shape_commands(setup: WanSetup, ln: Link) -> list[list[str]]:
    """tc commands for both ends of one shaped link."""
    out = []
    for me, peer in ((ln.i, ln.j), (ln.j, ln.i)):
        ns, dev = setup.netns(me), f"wan{peer}"
        out.append(netns.tbf_command(ns, dev, ln.gbps))
        if setup.rtt_mode == "netem" and ln.rtt_ms > 0:
            out.append(["tc", "-n", ns, "qdisc", "add", "dev", dev, "parent", "1:1", "handle", "10:", "netem",
                        "delay", f"{ln.rtt_ms / 2:g}ms", "limit", str(ln.netem_limit_packets())])
    return out


def build_commands(setup: WanSetup) -> list[list[str]]:
    """Every command that builds `setup`, in order (namespaces, host addresses, links, routes, tc)."""
    n = len(setup.nodes)
    cmds: list[list[str]] = []
    for i in range(n):
        ns = setup.netns(i)
        cmds += [["ip", "netns", "add", ns],
                 ["ip", "-n", ns, "link", "set", "lo", "up"],
                 ["ip", "-n", ns, "link", "add", HOST_IF, "type", "veth", "peer", "name", HOST_PEER_IF],
                 ["ip", "-n", ns, "addr", "add", f"{setup.addr(i)}/32", "dev", HOST_IF],
                 ["ip", "-n", ns, "link", "set", HOST_PEER_IF, "up"],
                 ["ip", "-n", ns, "link", "set", HOST_IF, "up"]]
    for ln in setup.links:
        a, b = setup.netns(ln.i), setup.netns(ln.j)
        cmds.append(["ip", "-n", a, "link", "add", f"wan{ln.j}", "mtu", str(MTU), "type", "veth",
                     "peer", "name", f"wan{ln.i}", "netns", b, "mtu", str(MTU)])
        for me, peer in ((ln.i, ln.j), (ln.j, ln.i)):
            ns, dev = setup.netns(me), f"wan{peer}"
            cmds += [["ip", "-n", ns, "link", "set", dev, "up"],
                     ["ip", "-n", ns, "route", "add", f"{setup.addr(peer)}/32", "dev", dev, "src", setup.addr(me)]]
        if ln.gbps is not None:
            cmds += _shape_commands(setup, ln)
    return cmds


# ---- create and remove -------------------------------------------------------------------------


def create(plan: Plan, nodes: Sequence[str], run_id: str, owner_pid: int | None = None) -> WanSetup:
    """Build the emulated datacenters of `plan` (RuntimeError naming the command that failed; what
    was built is removed again)."""
    why = unavailable_reason()
    if why is not None:
        raise ValueError(f"--emulate-wan: {why}")
    setup = layout(plan, nodes, run_id, owner_pid or os.getpid(), free_subnet(), probe_netem())
    try:
        for cmd in build_commands(setup):
            _run(cmd)
    except BaseException:
        remove(setup)
        raise
    return setup


def remove(setup: WanSetup) -> None:
    remove_names([setup.netns(i) for i in range(len(setup.nodes))])


def run_prefix(run_id: str) -> str:
    return f"{PREFIX}{run_id}."


def remove_run(run_id: str) -> None:
    """Remove every namespace of the run (any launcher of it), with its processes."""
    remove_names(find(run_prefix(run_id)))


def remove_stale(run_id: str) -> list[str]:
    """Remove this run's namespaces and those whose launcher is gone (a killed launcher left them);
    returns the names removed."""
    return netns.remove_stale(PREFIX, run_id)


def leftovers(setup: WanSetup) -> list[str]:
    """What still holds a namespace of `setup` by name (executor/netns.leftovers)."""
    return netns.leftovers([setup.netns(i) for i in range(len(setup.nodes))])


def guard_command(setup: WanSetup, run_dir: str | None = None) -> list[str]:
    """The guard that removes the datacenters if the launcher is killed (executor/netns.py)."""
    return netns.guard_command(PREFIX, setup.run_id, setup.owner_pid, "wan", run_dir)
