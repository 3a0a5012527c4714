"""A real two-node SLURM cluster on this machine, for the tests (the `slurm_cluster` fixture of
tests/conftest.py wraps `running_slurm_cluster()`, one per session).

It starts munged, slurmctld on a bridge (10.77.X.1) and two slurmd, n1 (Gres=gpumix:cpu:2) and n2
(Gres=gpumix:cpu:1), each in its own network namespace joined to the bridge by a veth pair, so a
run's traffic between nodes crosses a real link; it installs nothing (scripts/install.sh installs
the Debian packages). slurmd is started with `nsenter --net=...`, not `ip netns exec` (which
remounts /sys, hiding the cgroup filesystem); GPU types are a count-only GRES with
`Type=<catalog type>`; no accounting daemon. Torn down when the block ends (jobs, processes,
daemons, namespaces, veths, bridge; `leftovers()` checks). A platform that cannot run it (not
root, no binaries, no network namespaces) skips with the reason.
"""
from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from typing import Iterator

from executor.wan import free_subnet
from testkit.processes import free_port
from testkit.wait import wait_until

GRES_NAME = "gpumix"
SUBNET_PREFIX = "10.77"  # each test cluster takes the first 10.77.X.0/24 no interface of this host uses
NODES = (("n1", 2), ("n2", 1))  # (node, count of its cpu GRES)
BINARIES = ("munged", "mungekey", "slurmctld", "slurmd", "sbatch", "srun", "scontrol", "squeue", "sinfo",
            "scancel", "ip", "nsenter")
START_TIMEOUT_S = 60.0


def _run(*cmd: str, check: bool = True, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(list(cmd), check=check, capture_output=True, text=True, timeout=60, env=env)


def _free_subnet() -> str:
    """10.77.X with no address of this host in it: two test clusters on one machine (two engineers'
    runs) must not answer each other's daemons."""
    return free_subnet(SUBNET_PREFIX)


def _subnet(nodes: list) -> str:
    return nodes[0].addr.rsplit(".", 1)[0]


@dataclass
class SlurmNode:
    name: str
    netns: str
    veth: str  # the root-side end
    addr: str
    gres_count: int
    slurmd: subprocess.Popen | None = None


@dataclass
class SlurmCluster:
    root: str
    nodes: list[SlurmNode]
    bridge: str
    env: dict[str, str]  # SLURM_CONF: pass to every SLURM client
    daemons: list[subprocess.Popen] = field(default_factory=list)
    gres_name: str = GRES_NAME

    @property
    def conf(self) -> str:
        return self.env["SLURM_CONF"]

    def cmd(self, *args: str, check: bool = True) -> str:
        return _run(*args, check=check, env={**os.environ, **self.env}).stdout

    def node(self, name: str) -> SlurmNode:
        return next(n for n in self.nodes if n.name == name)

    def netns_pids(self, node: SlurmNode) -> list[int]:
        """Every process in the node's network namespace (what runs "on" that node)."""
        try:
            ino = os.stat(f"/var/run/netns/{node.netns}").st_ino
        except OSError:
            return []
        out = []
        for pid in filter(str.isdigit, os.listdir("/proc")):
            with contextlib.suppress(OSError):
                if os.readlink(f"/proc/{pid}/ns/net") == f"net:[{ino}]":
                    out.append(int(pid))
        return out

    def kill_node(self, name: str) -> None:
        """The node dies: its slurmd, its job steps and everything they started, SIGKILLed at once."""
        node = self.node(name)
        for pid in self.netns_pids(node):
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        if node.slurmd is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                node.slurmd.wait(timeout=5)

    def start_slurmd(self, node: SlurmNode) -> None:
        log = open(os.path.join(self.root, f"slurmd-{node.name}.out"), "ab")
        node.slurmd = subprocess.Popen(
            ["nsenter", f"--net=/var/run/netns/{node.netns}", "slurmd", "-D", "-N", node.name, "-f", self.conf],
            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env={**os.environ, **self.env})
        log.close()

    def revive_node(self, name: str) -> None:
        """Start the node's slurmd again and return it to service (after kill_node)."""
        node = self.node(name)
        self.start_slurmd(node)
        self.wait_idle([name])

    def node_states(self) -> dict[str, str]:
        out = self.cmd("sinfo", "-h", "-N", "-o", "%N %T")
        return dict(line.split() for line in out.splitlines() if line.strip())

    def wait_idle(self, names: list[str] | None = None, timeout_s: float = START_TIMEOUT_S) -> None:
        names = names or [n.name for n in self.nodes]

        def idle() -> dict[str, str] | None:
            states = self.node_states()
            if all(states.get(n) == "idle" for n in names):
                return states
            for n in names:  # a node that was down comes back once its slurmd answers
                if states.get(n, "").startswith("down"):
                    self.cmd("scontrol", "update", f"nodename={n}", "state=resume", check=False)
            if any(n.slurmd is not None and n.slurmd.poll() is not None for n in self.nodes if n.name in names):
                raise RuntimeError(f"a slurmd exited (states {states}); see {self.root}")  # it will not answer
            return None

        try:
            wait_until(idle, timeout_s, f"SLURM nodes {names} idle", interval_s=0.5,
                       ignore=(subprocess.CalledProcessError, ValueError))
        except TimeoutError as e:
            raise RuntimeError(f"{e}; see {self.root}") from None

    def jobs(self) -> list[str]:
        return self.cmd("squeue", "-h", "-o", "%i").split()

    def wait_no_jobs(self, timeout_s: float = 60.0) -> None:
        try:
            wait_until(lambda: not self.jobs(), timeout_s, "no SLURM job left", interval_s=0.3)
        except TimeoutError:
            raise AssertionError(f"SLURM jobs left: {self.cmd('squeue')}") from None

    def leftovers(self) -> list[str]:
        """What of the cluster still exists (empty after teardown)."""
        left = [f"netns {n.netns}" for n in self.nodes if os.path.exists(f"/var/run/netns/{n.netns}")]
        links = _run("ip", "-o", "link", "show", check=False).stdout
        left += [f"link {x}" for x in [self.bridge] + [n.veth for n in self.nodes] if f" {x}:" in links or
                 f" {x}@" in links]
        left += [f"daemon pid {p.pid}" for p in self.daemons + [n.slurmd for n in self.nodes if n.slurmd]
                 if p.poll() is None]
        return left


def platform_problem() -> str | None:
    """Why this machine cannot run the cluster, or None."""
    if os.geteuid() != 0:
        return "the SLURM fixture needs root (network namespaces, munged, slurmd)"
    missing = [b for b in BINARIES if shutil.which(b) is None]
    if missing:
        return (f"missing {', '.join(missing)}: apt-get install -y slurmd slurmctld munge slurm-client "
                "(scripts/install.sh)")
    probe = f"gmxprobe{os.getpid()}"
    r = _run("ip", "netns", "add", probe, check=False)
    if r.returncode != 0:
        return f"network namespaces unavailable here: {r.stderr.strip()}"
    _run("ip", "netns", "del", probe, check=False)
    return None


def _slurm_conf(root: str, nodes: list[SlurmNode], ctl_port: int) -> str:
    host = socket.gethostname().split(".")[0]
    lines = [
        "ClusterName=gpumix", f"SlurmctldHost={host}({_subnet(nodes)}.1)", f"SlurmctldPort={ctl_port}", "SlurmdPort=6818",
        "SlurmUser=root", "SlurmdUser=root", "AuthType=auth/munge", "CredType=cred/munge",
        f"AuthInfo=socket={root}/munge.socket", f"StateSaveLocation={root}/state", f"SlurmdSpoolDir={root}/spool/%n",
        f"SlurmctldPidFile={root}/slurmctld.pid", f"SlurmdPidFile={root}/slurmd-%n.pid",
        f"SlurmctldLogFile={root}/slurmctld.log", f"SlurmdLogFile={root}/slurmd-%n.log",
        "ProctrackType=proctrack/linuxproc", "TaskPlugin=task/none", "SelectType=select/cons_tres",
        "SelectTypeParameters=CR_CPU", f"GresTypes={GRES_NAME}", "JobAcctGatherType=jobacct_gather/none",
        "AccountingStorageType=accounting_storage/none", "MpiDefault=none", "SchedulerType=sched/backfill",
        "SlurmdParameters=config_overrides", "ReturnToService=2", "SlurmdTimeout=5", "SlurmctldTimeout=10",
        "KillWait=2", "InactiveLimit=0", "MinJobAge=600", "MessageTimeout=5",
        "SchedulerParameters=sched_interval=2,bf_interval=1",  # het jobs start by backfill only (30 s default)
        "LaunchParameters=use_interactive_step",
    ]
    cpus = max(2, os.cpu_count() or 2)
    for n in nodes:
        lines.append(f"NodeName={n.name} NodeAddr={n.addr} CPUs={cpus} RealMemory=1000 "
                     f"Gres={GRES_NAME}:cpu:{n.gres_count} State=UNKNOWN")
    lines.append(f"PartitionName=debug Nodes={','.join(n.name for n in nodes)} Default=YES MaxTime=INFINITE "
                 "State=UP OverSubscribe=YES")
    path = os.path.join(root, "slurm.conf")
    with open(path, "w") as fh:
        fh.write("\n".join(lines) + "\n")
    with open(os.path.join(root, "gres.conf"), "w") as fh:
        fh.write("".join(f"NodeName={n.name} Name={GRES_NAME} Type=cpu Count={n.gres_count}\n" for n in nodes))
    return path


def _network_up(cluster: SlurmCluster) -> None:
    _run("ip", "link", "add", cluster.bridge, "type", "bridge")
    _run("ip", "addr", "add", f"{_subnet(cluster.nodes)}.1/24", "dev", cluster.bridge)
    _run("ip", "link", "set", cluster.bridge, "up")
    for n in cluster.nodes:
        _run("ip", "netns", "add", n.netns)
        _run("ip", "link", "add", n.veth, "type", "veth", "peer", "name", "eth0", "netns", n.netns)
        _run("ip", "link", "set", n.veth, "master", cluster.bridge, "up")
        _run("ip", "netns", "exec", n.netns, "ip", "addr", "add", f"{n.addr}/24", "dev", "eth0")
        _run("ip", "netns", "exec", n.netns, "ip", "link", "set", "eth0", "up")
        _run("ip", "netns", "exec", n.netns, "ip", "link", "set", "lo", "up")
        # no default route: a name lookup (reverse DNS of a peer, c10d does one per connection) to a
        # server outside the subnet fails at once instead of timing out


def _teardown(cluster: SlurmCluster) -> None:
    with contextlib.suppress(Exception):
        cluster.cmd("scancel", "--full", "--quiet", *cluster.jobs(), check=False)
    for n in cluster.nodes:
        if n.slurmd is not None and n.slurmd.poll() is None:
            n.slurmd.terminate()
    time.sleep(0.5)
    for n in cluster.nodes:
        cluster.kill_node(n.name)
    for p in reversed(cluster.daemons):
        if p.poll() is None:
            p.terminate()
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(timeout=5)
    for n in cluster.nodes:
        _run("ip", "link", "del", n.veth, check=False)
        _run("ip", "netns", "del", n.netns, check=False)
    _run("ip", "link", "del", cluster.bridge, check=False)


def _start(cluster: SlurmCluster) -> None:
    root = cluster.root
    for d in ["state"] + [f"spool/{n.name}" for n in cluster.nodes]:
        os.makedirs(os.path.join(root, d), exist_ok=True)
    key = os.path.join(root, "munge.key")
    _run("mungekey", "--create", f"--keyfile={key}")
    os.chmod(key, 0o400)
    munge_log = open(os.path.join(root, "munged.out"), "ab")
    cluster.daemons.append(subprocess.Popen(
        ["munged", "--foreground", "--force", f"--key-file={key}", f"--socket={root}/munge.socket",
         f"--pid-file={root}/munged.pid", f"--log-file={root}/munged.log", f"--seed-file={root}/munged.seed"],
        stdout=munge_log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL))
    wait_until(lambda: os.path.exists(f"{root}/munge.socket"), 10, "munged's socket", interval_s=0.1)
    _network_up(cluster)
    ctl_log = open(os.path.join(root, "slurmctld.out"), "ab")
    cluster.daemons.append(subprocess.Popen(["slurmctld", "-D", "-i", "-f", cluster.conf], stdout=ctl_log,
                                            stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                            env={**os.environ, **cluster.env}))
    for n in cluster.nodes:
        cluster.start_slurmd(n)
    cluster.wait_idle()


def _problem_text(root: str) -> str:
    out = []
    for name in sorted(os.listdir(root)):
        if name.endswith((".log", ".out")):
            with open(os.path.join(root, name), errors="replace") as fh:
                out.append(f"--- {name}\n" + "".join(fh.readlines()[-15:]))
    return "\n".join(out)


@contextlib.contextmanager
def running_slurm_cluster() -> Iterator[SlurmCluster]:
    """The cluster for the block; raises RuntimeError where `platform_problem()` names one or it does
    not start (with the daemons' last log lines), and asserts on leaving that nothing of it is left."""
    problem = platform_problem()
    if problem:
        raise RuntimeError(problem)
    root = tempfile.mkdtemp(prefix="gpumix-slurm-")
    os.chmod(root, 0o755)  # munged refuses a group/world-writable folder; slurmd's children read it
    tag = f"gmx{os.getpid() % 100000}"
    subnet = _free_subnet()
    nodes = [SlurmNode(name, f"{tag}{name}", f"{tag}{name}v", f"{subnet}.{i + 2}", count)
             for i, (name, count) in enumerate(NODES)]
    cluster = SlurmCluster(root, nodes, f"{tag}br", {"SLURM_CONF": os.path.join(root, "slurm.conf")})
    _slurm_conf(root, nodes, free_port())
    try:
        _start(cluster)
    except BaseException as e:
        text = _problem_text(root)
        _teardown(cluster)
        shutil.rmtree(root, ignore_errors=True)
        raise RuntimeError(f"the SLURM test cluster did not start: {e}\n{text}") from None
    try:
        yield cluster
    finally:
        _teardown(cluster)
        left = cluster.leftovers()
        if not left:
            shutil.rmtree(root, ignore_errors=True)
        assert not left, f"SLURM fixture left {left}"
