"""The agent of a SLURM run: one per node, started by the job's srun (executor/slurm_job.py).

    python -m executor.slurm_agent --plan P --run-dir R --first-node N --rdzv-endpoint ADDR:PORT \
        --rdzv-id ID --node-addr NODE=ADDR ... -- <executor.worker arguments>

It finds its node (SLURMD_NODENAME) in the plan and starts torchrun with that node's share of
the ranks and a c10d rendezvous hosted by the first plan node: `is_host` said explicitly (a
node's name or address need not match its hostname), `--local-addr` the node's SLURM address,
gloo bound to the interface holding that address. It reports `node_up` and `node_exit` (a node
whose agent never says `node_exit` died): the first node's agent in the run store, the others on
their output, which the job's output file collects (only rank 0 and the first node write the
store); it forwards SIGTERM to torchrun (scancel), and exits 1 when torchrun failed.
"""
from __future__ import annotations

import argparse
import contextlib
import logging
import os
import signal
import subprocess
import sys

from executor.rank_commands import plan_nodes
from executor.store import MetricsStore
from contracts.paths import PROJECT_ROOT
from contracts.plan import Plan

REPORT_MARK = "gpumix-agent-event: "  # a line of an agent's output: "<mark><kind> <message>"


def interface_of(addr: str) -> str | None:
    """The network interface holding `addr` here (gloo binds to it), or None."""
    try:
        import psutil
        import socket

        ip = socket.gethostbyname(addr)
        for name, addrs in psutil.net_if_addrs().items():
            if any(a.address == ip for a in addrs):
                return name
    except (OSError, ImportError):
        pass
    return None


def agent_main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="executor.slurm_agent")
    p.add_argument("--plan", required=True)
    p.add_argument("--run-dir", required=True)
    p.add_argument("--first-node", required=True)
    p.add_argument("--rdzv-endpoint", required=True)
    p.add_argument("--rdzv-id", required=True)
    p.add_argument("--node-addr", action="append", default=[], metavar="NODE=ADDR")
    p.add_argument("worker", nargs=argparse.REMAINDER)
    args = p.parse_args(argv)
    wargs = args.worker[1:] if args.worker[:1] == ["--"] else args.worker
    node = os.environ.get("SLURMD_NODENAME", "")
    plan = Plan.load(args.plan)
    nodes = plan_nodes(plan)
    k = sum(1 for a in plan.used if a.node == node)
    addrs = dict(a.split("=", 1) for a in args.node_addr)
    say = _reporter(args.run_dir, node == args.first_node)
    if k == 0 or node not in addrs:
        say("node_exit", f"node {node}: exit code 2, the plan has no devices on this node")
        return 2
    env = dict(os.environ, GPUMIX_NODE=node, GPUMIX_LAUNCHED="1", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    iface = interface_of(addrs[node])
    if iface:
        env["GLOO_SOCKET_IFNAME"] = iface
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nnodes={len(nodes)}", f"--nproc-per-node={k}",
           "--rdzv-backend=c10d", f"--rdzv-endpoint={args.rdzv_endpoint}", f"--rdzv-id={args.rdzv_id}",
           f"--rdzv-conf=is_host={1 if node == args.first_node else 0}", f"--local-addr={addrs[node]}",
           "--max-restarts=0", *wargs]
    proc = subprocess.Popen(cmd, env=env, cwd=PROJECT_ROOT)
    say("node_up", f"node {node}: agent pid {os.getpid()}, torchrun pid {proc.pid}, {k} rank(s), "
                               f"address {addrs[node]}" + (f" ({iface})" if iface else ""))

    def forward(sig, _frame):
        with contextlib.suppress(OSError):
            proc.send_signal(sig)

    for s in (signal.SIGTERM, signal.SIGINT):
        signal.signal(s, forward)
    rc = proc.wait()
    say("node_exit", f"node {node}: torchrun exit code {rc}")
    return 0 if rc == 0 else 1


def _reporter(run_dir: str, writes: bool):
    """How this agent reports node_up / node_exit: the first node's agent in the run store, the
    others as REPORT_MARK lines on their output, which srun brings to the job's output file
    (executor/slurm.py reads both): only the first node writes the store."""
    if not writes:
        return lambda kind, message: print(f"{REPORT_MARK}{kind} {message}", flush=True)

    def say(kind: str, message: str) -> None:
        store = MetricsStore(run_dir)
        try:
            store.add_event(kind, message)
        finally:
            store.close()
    return say


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    sys.exit(agent_main(sys.argv[1:]))
