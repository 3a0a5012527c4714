"""The SLURM job of a plan: its shape, and what SLURM says about it (executor/slurm.py submits
and follows it; executor/slurm_agent.py runs on each node).

One component per run of consecutive plan nodes asking the same GRES (`--nodes=k
--nodelist=... --gres=<gres name>:<type>:<n>`; several components make a heterogeneous job,
separated by ":" on sbatch's argument list). The batch script only starts one `srun` per
component, each running one agent per node, and ends the job when the first agent fails;
every value in it is validated (profiler.slurm_inventory.check_name) and shlex-quoted.
The job's state is read from `scontrol show job -o` (one line per component; the worst wins).
"""
from __future__ import annotations

import json
import os
import re
import shlex
import sys
import zlib
from dataclasses import dataclass, field

from executor import booking
from executor.rank_commands import DEFAULT_RDZV_PORT, plan_nodes
from contracts.paths import PROJECT_ROOT
from contracts.plan import Plan
from profiler.slurm_inventory import (SlurmNode, catalog_type, check_name, default_gres_name, parse_fields,
                                      slurm_client)

JOB_FILE = "slurm.json"
ACTIVE_STATES = ("PENDING", "CONFIGURING", "RUNNING", "SUSPENDED", "REQUEUED", "REQUEUE_HOLD", "RESIZING",
                 "SIGNALING", "STAGE_OUT", "STOPPED", "RESV_DEL_HOLD", "REQUEUE_FED")
FAILED_STATES = ("FAILED", "NODE_FAIL", "TIMEOUT", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE", "PREEMPTED")
RDZV_PORT_SPAN = 10_000  # the rendezvous port: base + a hash of the run id within this span

@dataclass(frozen=True)
class SlurmSettings:
    """How this site's SLURM is asked: the GRES name of its accelerators (`gpu`, or the count-only
    name the site uses), a partition, a time limit, the rendezvous port base, GRES type names that
    are not catalog names (type_map), and whether a run that loses a node goes on on the nodes left
    (elastic, executor/elastic.py)."""

    gres_name: str = field(default_factory=default_gres_name)
    partition: str | None = None
    time_limit_min: int | None = None
    rdzv_port_base: int = DEFAULT_RDZV_PORT
    type_map: tuple[tuple[str, str], ...] = ()
    elastic: bool = False

    def __post_init__(self) -> None:
        check_name(self.gres_name, "GRES name")
        if self.partition is not None:
            check_name(self.partition, "partition")
        if self.time_limit_min is not None and not (isinstance(self.time_limit_min, int) and self.time_limit_min > 0):
            raise ValueError(f"time limit must be a positive number of minutes, got {self.time_limit_min!r}")
        if not 1024 <= self.rdzv_port_base <= 65535 - RDZV_PORT_SPAN:
            raise ValueError(f"rendezvous port base must be in [1024, {65535 - RDZV_PORT_SPAN}], "
                             f"got {self.rdzv_port_base}")
        if not isinstance(self.elastic, bool):
            raise ValueError(f"elastic must be true or false, got {self.elastic!r}")

    def to_args(self) -> list[str]:
        """`executor launch` flags that reproduce these settings."""
        out = ["--backend", "slurm", "--gres-name", self.gres_name, "--rdzv-port", str(self.rdzv_port_base)]
        out += ["--partition", self.partition] if self.partition else []
        out += ["--time-limit", str(self.time_limit_min)] if self.time_limit_min else []
        for k, v in self.type_map:
            out += ["--type-map", f"{k}={v}"]
        return out + (["--elastic"] if self.elastic else [])


@dataclass(frozen=True)
class Component:
    """One allocation of the job: nodes asking the same GRES."""

    nodes: tuple[str, ...]
    gres: tuple[tuple[str, int], ...]  # (SLURM GRES type, count per node)

    def gres_arg(self, name: str) -> str:
        return ",".join(f"{name}:{t}:{n}" if t else f"{name}:{n}" for t, n in self.gres)


# ---- from the plan to the job --------------------------------------------------------------


def node_requests(plan: Plan, nodes: dict[str, SlurmNode], settings: SlurmSettings) -> list[Component]:
    """One component per run of consecutive plan nodes with the same GRES request; ValueError when
    a plan node is unknown to SLURM, down, or lacks the plan's devices."""
    type_map = dict(settings.type_map)
    per_node: list[tuple[str, tuple[tuple[str, int], ...]]] = []
    for name in plan_nodes(plan):
        check_name(name, "plan node")
        node = nodes.get(name)
        if node is None:
            raise ValueError(f"plan node {name!r} is not a SLURM node (SLURM has: {', '.join(nodes) or 'none'}): "
                             "plan on the cluster file of `python -m profiler inventory --slurm`")
        if not node.usable:
            raise ValueError(f"SLURM node {name} is {node.state}" + (f" ({node.reason})" if node.reason else ""))
        want: dict[str, int] = {}
        for a in plan.used:
            if a.node == name:
                want[a.type] = want.get(a.type, 0) + 1
        request = []
        for plan_type, count in want.items():
            have = {t: n for t, n in node.gres.items() if _maps_to(t, plan_type, type_map)}
            if sum(have.values()) < count:
                raise ValueError(f"SLURM node {name} has {sum(have.values())} {settings.gres_name} GRES of type "
                                 f"{plan_type} (its GRES: {node.gres or 'none'}), the plan uses {count}")
            for t, n in have.items():
                take = min(n, count)
                request.append((t, take))
                count -= take
                if not count:
                    break
        per_node.append((name, tuple(request)))
    components: list[Component] = []
    for name, req in per_node:
        if components and components[-1].gres == req:
            components[-1] = Component(components[-1].nodes + (name,), req)
        else:
            components.append(Component((name,), req))
    return components


def _maps_to(gres_type: str, plan_type: str, type_map: dict[str, str]) -> bool:
    try:
        return catalog_type(gres_type, type_map) == plan_type
    except ValueError:
        return False


def rdzv_port(run_id: str, settings: SlurmSettings) -> int:
    return settings.rdzv_port_base + zlib.crc32(run_id.encode()) % RDZV_PORT_SPAN


def run_id_of(run_dir: str) -> str:
    return re.sub(r"[^A-Za-z0-9_-]", "-", os.path.basename(os.path.abspath(run_dir)))[:64] or "run"


def batch_script(components: list[Component], agent_args: list[str]) -> str:
    """The job's script: one srun per component (one agent per node), the job ends with the first
    agent that fails (SLURM then ends the other steps) or when all are done."""
    lines = ["#!/bin/bash", "# GPUMix run: one torchrun agent per node (generated by executor/slurm.py)", "set -u",
             "# an srun whose node died may outlive the script: end every one we started on the way out",
             "cleanup() { kill $(jobs -p) 2>/dev/null; sleep 1; kill -9 $(jobs -p) 2>/dev/null; }",
             "trap cleanup EXIT"]
    het = len(components) > 1
    for i, c in enumerate(components):
        srun = ["srun", *([f"--het-group={i}"] if het else []), f"--nodes={len(c.nodes)}", "--ntasks-per-node=1",
                "--kill-on-bad-exit=1", "--export=ALL", sys.executable, "-m", "executor.slurm_agent",
                *agent_args]
        lines.append(shlex.join(srun) + " &")
    lines.append(f"for _ in {' '.join(str(i) for i in range(len(components)))}; do")
    lines.append("    wait -n || exit $?")
    lines.append("done")
    return "\n".join(lines) + "\n"


def sbatch_command(components: list[Component], script: str, run_dir: str, settings: SlurmSettings) -> list[str]:
    if "%" in run_dir:
        raise ValueError(f"run folder {run_dir}: '%' is SLURM's file name pattern character; choose another name")
    args = ["sbatch", "--parsable", f"--job-name=gpumix-{run_id_of(run_dir)}",
            f"--output={os.path.join(run_dir, 'logs', 'slurm-%j.out')}", f"--chdir={PROJECT_ROOT}", "--export=ALL"]
    for i, c in enumerate(components):
        if i:
            args.append(":")
        args += [f"--nodes={len(c.nodes)}", f"--nodelist={','.join(c.nodes)}", "--ntasks-per-node=1",
                 f"--gres={c.gres_arg(settings.gres_name)}"]
        args += [f"--partition={settings.partition}"] if settings.partition else []
        args += [f"--time={settings.time_limit_min}"] if settings.time_limit_min else []
    return args + [script]


# ---- what SLURM says -----------------------------------------------------------------------


@dataclass(frozen=True)
class JobState:
    job_id: str
    state: str  # the whole job's: the worst component's
    reason: str
    nodes: tuple[str, ...]
    known: bool = True  # False: SLURM has forgotten the job (MinJobAge)

    @property
    def active(self) -> bool:
        return self.known and self.state in ACTIVE_STATES

    @property
    def completing(self) -> bool:
        return self.known and self.state == "COMPLETING"


def parse_job(text: str, job_id: str) -> JobState:
    """`scontrol show job -o <id>` (one line per heterogeneous component) -> the job's state."""
    comps = [parse_fields(line) for line in text.splitlines() if line.startswith("JobId=")]
    if not comps:
        return JobState(job_id, "UNKNOWN", "", (), known=False)
    states = [c.get("JobState", "UNKNOWN") for c in comps]
    order = [s for s in ACTIVE_STATES if s in states] or ["COMPLETING"] * ("COMPLETING" in states) or [
        s for s in FAILED_STATES if s in states] or ["CANCELLED"] * ("CANCELLED" in states) or states
    reasons = list(dict.fromkeys(c.get("Reason", "None") for c in comps if c.get("Reason", "None") not in (
        "None", "(null)")))  # each once: the components of a job often share theirs
    nodes: list[str] = []
    for c in comps:
        nodes += expand_hostlist(c.get("NodeList", ""))
    return JobState(job_id, order[0], "; ".join(reasons), tuple(nodes))


def expand_hostlist(text: str) -> list[str]:
    """`n[1-3,5],gpu7` -> ["n1", "n2", "n3", "n5", "gpu7"] (SLURM's compact host lists)."""
    out: list[str] = []
    if not text or text == "(null)":
        return out
    for m in re.finditer(r"([^,\[]+)(?:\[([^\]]+)\])?", text):
        prefix, ranges = m.group(1), m.group(2)
        if not ranges:
            out.append(prefix)
            continue
        for r in ranges.split(","):
            lo, _, hi = r.partition("-")
            width = len(lo)
            out += [f"{prefix}{i:0{width}d}" for i in range(int(lo), int(hi or lo) + 1)]
    return out


def job_state(job_id: str) -> JobState:
    try:
        text = slurm_client(["scontrol", "show", "job", "-o", job_id])
    except ValueError as e:
        if "invalid job id" in str(e).lower():
            return JobState(job_id, "UNKNOWN", "", (), known=False)
        raise
    return parse_job(text, job_id)


def cancel_job(job_id: str) -> None:
    slurm_client(["scancel", "--full", check_name(job_id, "job id")])  # the batch script and every step


def read_job_file(run_dir: str) -> dict | None:
    try:
        with open(os.path.join(run_dir, JOB_FILE)) as fh:
            return json.load(fh)
    except (OSError, ValueError):
        return None


def slurm_device_keys(plan: Plan) -> list[str]:
    """The ledger's names of the plan's SLURM devices: `slurm:<node>/<index within the node>`
    (booking.plan_device_keys names the one node of a single-node plan "local": here it is a
    SLURM node like any other)."""
    return [f"slurm:{a.node}/{key.split('/', 1)[1]}" for a, key in zip(plan.used, booking.plan_device_keys(plan))]
