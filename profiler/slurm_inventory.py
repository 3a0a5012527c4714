"""The cluster file from a SLURM cluster's own records: `scontrol show node -o` and `sinfo`.

`scontrol show node -o` prints one line per node of `Key=Value` fields separated by spaces
(some values hold spaces themselves: `OS=Linux 6.1 #1 SMP`, `Reason=Not responding [root@...]`),
so a field runs up to the next ` Key=`. GPUs are generic resources: `Gres=gpu:a100:4(S:0-1)`,
several separated by commas; only the site's GRES name counts (`gpu` by default; a site may
use another, e.g. a count-only `gpumix:cpu:2`). `sinfo -h -N -o "%N|%P|%T"` lists each node's
partitions ("*" marks the default partition).

A GRES type becomes a catalog type when it names one (case-insensitive: `H200`, `a100-80gb`,
`cpu`), when the site maps it (`type_map`, e.g. {"a100": "A100-80GB"}), or when the catalog's
name matcher gives one answer whatever the memory (`v100` has two sizes: refused, never
guessed). Nothing here imports torch.
"""
from __future__ import annotations

import os
import re
import subprocess
from dataclasses import dataclass, field
from typing import Mapping

from contracts.catalog import CATALOG, GIB, match_gpu_type
from contracts.cluster import ClusterSpec, DeviceSpec, NodeSpec

DEFAULT_GRES_NAME = "gpu"
ENV_GRES_NAME = "GPUMIX_SLURM_GRES"  # the site's GRES name for accelerators
SLURM_DATACENTER = "slurm"
CLIENT_TIMEOUT_S = 30.0
_FIELD = re.compile(r"(?:^|(?<=\s))([A-Za-z][A-Za-z0-9_:.]*)=")
_GRES = re.compile(r"^([A-Za-z0-9_.-]+)(?::([A-Za-z0-9_.-]+))?:(\d+)")
_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
DOWN_STATES = ("DOWN", "DRAIN", "FAIL", "NOT_RESPONDING", "POWERED_DOWN", "POWER_DOWN", "FUTURE", "UNKNOWN")


def default_gres_name() -> str:
    return check_name(os.environ.get(ENV_GRES_NAME) or DEFAULT_GRES_NAME, "GRES name")


def check_name(value: str, what: str) -> str:
    """A SLURM name (node, GRES, partition, type) that is safe in an argument and a script."""
    if not isinstance(value, str) or not _NAME.match(value):
        raise ValueError(f"{what} {value!r}: use letters, digits, '_', '-' or '.' (at most 64)")
    return value


def parse_fields(line: str) -> dict[str, str]:
    """One `scontrol ... -o` line as {key: value}."""
    marks = list(_FIELD.finditer(line))
    return {m.group(1): line[m.end(): marks[i + 1].start() if i + 1 < len(marks) else len(line)].strip()
            for i, m in enumerate(marks)}


def parse_gres(text: str, name: str) -> dict[str, int]:
    """`gpu:a100:4(S:0-1),gpu:v100:2` -> {"a100": 4, "v100": 2} for GRES `name` (an untyped
    `gpu:4` is keyed ""). `(null)` or other names: {}."""
    out: dict[str, int] = {}
    if not text or text == "(null)":
        return out
    for part in re.split(r",(?![^(]*\))", text):
        m = _GRES.match(part.strip())
        if m and m.group(1) == name:
            out[m.group(2) or ""] = out.get(m.group(2) or "", 0) + int(m.group(3))
    return out


@dataclass(frozen=True)
class SlurmNode:
    name: str
    addr: str
    state: str  # "IDLE", "MIXED", "DOWN+NOT_RESPONDING", ...
    reason: str
    gres: dict[str, int]  # GRES type -> count (the site's GRES name only)
    gres_used: dict[str, int]
    cpus: int
    memory_mb: int
    partitions: tuple[str, ...] = field(default=())

    @property
    def usable(self) -> bool:
        return not any(s in self.state.upper().split("+") for s in DOWN_STATES)

    def to_dict(self) -> dict:
        return {"name": self.name, "addr": self.addr, "state": self.state, "reason": self.reason,
                "gres": self.gres, "gres_used": self.gres_used, "cpus": self.cpus, "memory_mb": self.memory_mb,
                "partitions": list(self.partitions)}


def _int(text: str | None) -> int:
    m = re.match(r"\d+", text or "")
    return int(m.group(0)) if m else 0


def parse_nodes(text: str, gres_name: str = DEFAULT_GRES_NAME) -> list[SlurmNode]:
    """`scontrol show node -o` output -> nodes, in its order."""
    nodes = []
    for line in text.splitlines():
        if not line.startswith("NodeName="):
            continue
        f = parse_fields(line)
        partitions = tuple(p for p in f.get("Partitions", "").split(",") if p and p != "(null)")
        nodes.append(SlurmNode(f["NodeName"], f.get("NodeAddr") or f["NodeName"], f.get("State", "UNKNOWN"),
                               f.get("Reason", ""), parse_gres(f.get("Gres", ""), gres_name),
                               parse_gres(f.get("GresUsed", ""), gres_name), _int(f.get("CPUTot")),
                               _int(f.get("RealMemory")), partitions))
    return nodes


def parse_sinfo_partitions(text: str) -> dict[str, tuple[str, ...]]:
    """`sinfo -h -N -o "%N|%P|%T"` output -> {node: (partitions...)}, the default one without "*"."""
    out: dict[str, list[str]] = {}
    for line in text.splitlines():
        parts = line.strip().split("|")
        if len(parts) >= 2 and parts[0]:
            out.setdefault(parts[0], [])
            p = parts[1].rstrip("*")
            if p and p not in out[parts[0]]:
                out[parts[0]].append(p)
    return {k: tuple(v) for k, v in out.items()}


def catalog_type(gres_type: str, type_map: Mapping[str, str] | None = None) -> str:
    """The catalog type a GRES type names (module docstring); ValueError when it names none or
    several."""
    if type_map and gres_type in type_map:
        t = type_map[gres_type]
        if t not in CATALOG:
            raise ValueError(f"type map {gres_type}={t}: {t!r} is not a catalog type")
        return t
    by_lower = {k.lower(): k for k in CATALOG}
    if gres_type.lower() in by_lower:
        return by_lower[gres_type.lower()]
    small, large = match_gpu_type(gres_type, 1 * GIB), match_gpu_type(gres_type, 1024 * GIB)
    if small is not None and small == large:
        return small
    if not gres_type:
        raise ValueError("an untyped GRES (gpu:N) names no GPU type: give each a Type= in gres.conf or map it")
    hint = f" (it could be {small} or {large})" if small else ""
    raise ValueError(f"GRES type {gres_type!r} names no single catalog type{hint}: map it, e.g. "
                     f"--type-map {gres_type}={large or 'H200'}")


def build_slurm_cluster(nodes: list[SlurmNode], name: str = "slurm",
                        type_map: Mapping[str, str] | None = None) -> ClusterSpec:
    """The planner's cluster: one device per GRES unit of every usable node that has some."""
    specs = []
    for n in nodes:
        if not n.usable or not n.gres:
            continue
        devices: list[DeviceSpec] = []
        for t, count in n.gres.items():
            devices += [DeviceSpec(catalog_type(t, type_map))] * count
        specs.append(NodeSpec(n.name, SLURM_DATACENTER, tuple(devices)))
    if not specs:
        raise ValueError(f"no usable SLURM node has the GRES {name!r} devices this needs "
                         f"(nodes: {', '.join(f'{n.name} {n.state} {n.gres or {}}' for n in nodes) or 'none'})")
    return ClusterSpec(name, tuple(specs))


def slurm_client(args: list[str], timeout_s: float = CLIENT_TIMEOUT_S) -> str:
    """Run a SLURM client (argument list, no shell); its stdout. ValueError with its message."""
    try:
        r = subprocess.run(args, capture_output=True, text=True, timeout=timeout_s, stdin=subprocess.DEVNULL)
    except FileNotFoundError:
        raise ValueError(f"{args[0]} not found: install the SLURM client (slurm-client) or run on a login "
                         "node") from None
    except subprocess.TimeoutExpired:
        raise ValueError(f"{' '.join(args[:3])} did not answer within {timeout_s:.0f} s") from None
    if r.returncode != 0:
        msg = (r.stderr or r.stdout).strip().splitlines()
        raise ValueError(f"{' '.join(args[:3])} failed: {msg[-1] if msg else f'exit code {r.returncode}'}")
    return r.stdout


def read_nodes(gres_name: str | None = None, names: list[str] | None = None) -> list[SlurmNode]:
    """The nodes as SLURM reports them now (all, or `names`), with their partitions."""
    gres_name = check_name(gres_name, "GRES name") if gres_name else default_gres_name()
    args = ["scontrol", "-d", "show", "node", "-o"]  # -d: GresUsed too
    if names:
        args.append(",".join(check_name(n, "node") for n in names))
    nodes = parse_nodes(slurm_client(args), gres_name)
    parts = parse_sinfo_partitions(slurm_client(["sinfo", "-h", "-N", "-o", "%N|%P|%T"]))
    return [SlurmNode(n.name, n.addr, n.state, n.reason, n.gres, n.gres_used, n.cpus, n.memory_mb,
                      parts.get(n.name, n.partitions)) for n in nodes]


def cluster_name() -> str:
    """The SLURM cluster's ClusterName, or "slurm"."""
    try:
        for line in slurm_client(["scontrol", "show", "config"]).splitlines():
            key, _, value = line.partition("=")
            if key.strip() == "ClusterName" and value.strip():
                return f"slurm-{value.strip()}"
    except ValueError:
        pass
    return "slurm"


def parse_type_map(items: list[str] | None) -> dict[str, str]:
    """["a100=A100-80GB", ...] -> {"a100": "A100-80GB"}."""
    out = {}
    for item in items or []:
        key, sep, value = item.partition("=")
        if not sep or not key or value not in CATALOG:
            raise ValueError(f"--type-map {item!r}: expected GRES_TYPE=CATALOG_TYPE, catalog types: "
                             f"{', '.join(sorted(CATALOG))}")
        out[key] = value
    return out
