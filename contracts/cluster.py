"""The cluster file: which devices exist, on which nodes and datacenters.

Format (DESIGN.md): `{"name", "nodes": [{"name", "datacenter", "gpus"}], "network"}` where `gpus`
is either `{"TYPE": count}` or a list of device objects `{"type": "cpu", "cpu_share": 0.333,
"memory_gb": 2}`. Emulated devices are always labelled as such, in one of two ways:

- `cpu_share` (a `cpu` device): physical emulation under a cgroup CPU quota and memory limit
  (profiler/cgroups.py); such a device is its own profile kind (`profile_key`, e.g. `cpu@share0.333`),
  priced from its own measurement, never from the share;
- `slowdown` (any type) and `memory_gb` without a `cpu_share`: arithmetic emulation (the worker
  sleeps; the labelled fallback of a `cpu_share` device where cgroups are unavailable).

Both in full: docs/executor.md ("Emulated devices"). An optional top-level `emulate_links_gbps`
runs the cluster's ranks over emulated links of that rate (`executor launch --emulate-links`,
docs/emulated_wan.md) and is the default of its `network.intra_node_gbps`, the rate they are priced at.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any

from contracts.catalog import CATALOG, CPU_TYPE, GIB, get_gpu_type
from contracts.constants import MAX_CLUSTER_DEVICES, MAX_CLUSTER_FILE_BYTES
from contracts.jsonio import dumps, read_text_file, save_json_file


def _positive_number(value: Any, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{what} must be a positive number, got {value!r}")
    return float(value)


# the profile kind of a CPU-quota-limited device: "<type>@share<cpu_share>" (cluster module docstring)
PROFILE_KEY_SHARE = "@share"


def profile_key(device_type: str, cpu_share: float | None = None) -> str:
    """The profile store's key of a device kind: its type, plus its CPU quota when it has one."""
    return device_type if cpu_share is None else f"{device_type}{PROFILE_KEY_SHARE}{cpu_share:g}"


def split_profile_key(key: str) -> tuple[str, float | None]:
    """(device type, cpu_share) of a profile key; ValueError for a malformed share."""
    base, sep, share = key.partition(PROFILE_KEY_SHARE)
    if not sep:
        return key, None
    try:
        value = float(share)
    except ValueError:
        raise ValueError(f"profile key {key!r}: the share after {PROFILE_KEY_SHARE!r} is not a number") from None
    return base, _cpu_share(value, f"profile key {key!r}")


def _cpu_share(value: Any, what: str) -> float:
    share = _positive_number(value, f"{what}: cpu_share")
    if share > 1.0:
        raise ValueError(f"{what}: cpu_share is a fraction of one core in (0, 1] (each rank runs one torch "
                         f"thread), got {value!r}")
    return share


@dataclass(frozen=True)
class DeviceSpec:
    """One device. `cpu_share` and `memory_gb` emulate a slower/smaller device under cgroup limits,
    `slowdown` > 1 a slower one by sleeping (module docstring)."""

    type: str
    slowdown: float = 1.0
    memory_gb: float | None = None
    cpu_share: float | None = None  # fraction of one core (cgroup CPU quota); `cpu` devices only

    @property
    def emulated(self) -> bool:
        return self.slowdown != 1.0 or self.memory_gb is not None or self.cpu_share is not None

    @property
    def profile_key(self) -> str:
        """The kind the profile store keys this device's step profiles by (`profile_key`)."""
        return profile_key(self.type, self.cpu_share)

    @property
    def memory_bytes(self) -> int:
        if self.memory_gb is not None:
            return int(self.memory_gb * GIB)
        return get_gpu_type(self.type).memory_bytes

    @property
    def label(self) -> str:
        parts = [self.type]
        if self.cpu_share is not None:
            parts.append(f"{self.cpu_share:g} of a core")
        if self.slowdown != 1.0:
            parts.append(f"slowdown {self.slowdown:g}x")
        if self.memory_gb is not None:
            parts.append(f"{self.memory_gb:g} GiB")
        return self.type if len(parts) == 1 else f"{parts[0]} (emulated: {', '.join(parts[1:])})"

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"type": self.type}
        if self.slowdown != 1.0:
            d["slowdown"] = self.slowdown
        if self.memory_gb is not None:
            d["memory_gb"] = self.memory_gb
        if self.cpu_share is not None:
            d["cpu_share"] = self.cpu_share
        return d

    @classmethod
    def from_dict(cls, d: Any, where: str) -> "DeviceSpec":
        if not isinstance(d, dict) or "type" not in d:
            raise ValueError(f"{where}: a device must be an object with a 'type', got {d!r}")
        unknown = set(d) - {"type", "slowdown", "memory_gb", "cpu_share"}
        if unknown:
            raise ValueError(f"{where}: unknown device keys {sorted(unknown)}")
        if not isinstance(d["type"], str) or d["type"] not in CATALOG:
            raise ValueError(f"{where}: unknown GPU type {d['type']!r}; known: {', '.join(sorted(CATALOG))}")
        slowdown = _positive_number(d.get("slowdown", 1.0), f"{where}: slowdown")
        mem = d.get("memory_gb")
        if mem is not None:
            mem = _positive_number(mem, f"{where}: memory_gb")
        share = d.get("cpu_share")
        if share is not None:
            share = _cpu_share(share, where)
            if d["type"] != CPU_TYPE:
                raise ValueError(f"{where}: cpu_share emulates a slower CPU worker (a CPU quota); "
                                 f"{d['type']!r} is not 'cpu'")
            if slowdown != 1.0:
                raise ValueError(f"{where}: give either cpu_share (a real CPU quota) or slowdown (sleep "
                                 "emulation), not both")
        return cls(d["type"], slowdown, mem, share)


@dataclass(frozen=True)
class NodeSpec:
    name: str
    datacenter: str
    devices: tuple[DeviceSpec, ...]

    def to_dict(self) -> dict[str, Any]:
        if all(not d.emulated for d in self.devices):
            counts: dict[str, int] = {}
            for d in self.devices:
                counts[d.type] = counts.get(d.type, 0) + 1
            gpus: Any = counts
        else:
            gpus = [d.to_dict() for d in self.devices]
        return {"name": self.name, "datacenter": self.datacenter, "gpus": gpus}


@dataclass(frozen=True)
class NetworkSpec:
    # Gbit/s, as every *_gbps in the cluster file (DESIGN.md); converted at the cost model's edge
    intra_node_gbps: float = 300.0
    inter_node_gbps: float = 100.0

    def to_dict(self) -> dict[str, float]:
        return {"intra_node_gbps": self.intra_node_gbps, "inter_node_gbps": self.inter_node_gbps}


@dataclass(frozen=True)
class DeviceGroup:
    """Identical devices on one node: the unit the planner's ILP counts over."""

    node: str
    datacenter: str
    device: DeviceSpec
    count: int
    # global device indices (order of `ClusterSpec.devices()`) of the members
    indices: tuple[int, ...] = field(default=())


@dataclass(frozen=True)
class ClusterSpec:
    name: str
    nodes: tuple[NodeSpec, ...]
    network: NetworkSpec = NetworkSpec()
    emulate_links_gbps: float | None = None  # launches put each rank behind an emulated link of this rate

    @property
    def num_devices(self) -> int:
        return sum(len(n.devices) for n in self.nodes)

    @property
    def emulated(self) -> bool:
        return any(d.emulated for n in self.nodes for d in n.devices)

    def devices(self) -> list[tuple[NodeSpec, DeviceSpec]]:
        """All devices in a fixed order: node by node, as listed."""
        return [(n, d) for n in self.nodes for d in n.devices]

    def groups(self) -> list[DeviceGroup]:
        out: dict[tuple[str, DeviceSpec], list[int]] = {}
        dc: dict[str, str] = {}
        for i, (n, d) in enumerate(self.devices()):
            out.setdefault((n.name, d), []).append(i)
            dc[n.name] = n.datacenter
        return [DeviceGroup(node, dc[node], dev, len(ix), tuple(ix)) for (node, dev), ix in out.items()]

    def device_types(self) -> list[str]:
        return sorted({d.type for _, d in self.devices()})

    def to_dict(self) -> dict[str, Any]:
        d = {"name": self.name, "nodes": [n.to_dict() for n in self.nodes], "network": self.network.to_dict()}
        if self.emulate_links_gbps is not None:
            d["emulate_links_gbps"] = self.emulate_links_gbps
        return d

    # --- editing (the dashboard's cluster editor): each returns a new, validated ClusterSpec ---
    def with_devices(self, node: str, datacenter: str, device: DeviceSpec, count: int) -> "ClusterSpec":
        """`count` more `device`s on node `node` (created in `datacenter` when it is new)."""
        if isinstance(count, bool) or not isinstance(count, int) or count < 1:
            raise ValueError(f"device count must be a positive integer, got {count!r}")
        nodes = [n.to_dict() for n in self.nodes]
        added = [device.to_dict()] * count
        for nd in nodes:
            if nd["name"] == node:
                if nd["datacenter"] != datacenter:
                    raise ValueError(f"node {node!r} is in datacenter {nd['datacenter']!r}, not {datacenter!r}")
                nd["gpus"] = _device_list(nd["gpus"]) + added
                break
        else:
            nodes.append({"name": node, "datacenter": datacenter, "gpus": added})
        return ClusterSpec.from_dict({**self.to_dict(), "nodes": nodes})

    def without_node(self, node: str) -> "ClusterSpec":
        nodes = [n.to_dict() for n in self.nodes if n.name != node]
        if len(nodes) == len(self.nodes):
            raise ValueError(f"no node {node!r} in cluster {self.name!r}")
        return ClusterSpec.from_dict({**self.to_dict(), "nodes": nodes})

    def renamed(self, name: str) -> "ClusterSpec":
        return ClusterSpec.from_dict({**self.to_dict(), "name": name})

    def to_json(self) -> str:
        return dumps(self.to_dict())

    def save(self, path: str) -> None:
        save_json_file(path, self.to_dict())

    @classmethod
    def from_dict(cls, d: Any, source: str = "cluster") -> "ClusterSpec":
        if not isinstance(d, dict):
            raise ValueError(f"{source}: expected a JSON object with 'nodes'")
        unknown = set(d) - {"name", "nodes", "network", "emulate_links_gbps"}
        if unknown:
            raise ValueError(f"{source}: unknown keys {sorted(unknown)}")
        nodes_in = d.get("nodes")
        if not isinstance(nodes_in, list) or not nodes_in:
            raise ValueError(f"{source}: 'nodes' must be a non-empty list")
        if len(nodes_in) > MAX_CLUSTER_DEVICES:  # every node holds a device at least
            raise _too_many_devices(source, f"{len(nodes_in):,} nodes")
        nodes: list[NodeSpec] = []
        total = 0  # devices claimed so far: checked before a node's devices are built
        seen: set[str] = set()
        for i, nd in enumerate(nodes_in):
            where = f"{source}: node {i}"
            if not isinstance(nd, dict):
                raise ValueError(f"{where}: expected an object")
            unknown = set(nd) - {"name", "datacenter", "gpus"}
            if unknown:
                raise ValueError(f"{where}: unknown node keys {sorted(unknown)}")
            name = nd.get("name", f"n{i}")
            if not isinstance(name, str) or not name.strip():
                raise ValueError(f"{where}: 'name' must be a non-empty string, got {name!r}")
            where = f"{source}: node {name!r}"
            datacenter = nd.get("datacenter", "dc0")
            if not isinstance(datacenter, str) or not datacenter.strip():
                raise ValueError(f"{where}: 'datacenter' must be a non-empty string, got {datacenter!r}")
            if name in seen:
                raise ValueError(f"{where}: duplicate node name")
            seen.add(name)
            gpus = nd.get("gpus")
            devices: list[DeviceSpec] = []
            if isinstance(gpus, dict):
                for t, c in gpus.items():
                    if t not in CATALOG:
                        raise ValueError(f"{where}: unknown GPU type {t!r}; known: {', '.join(sorted(CATALOG))}")
                    if isinstance(c, bool) or not isinstance(c, int) or c < 0:
                        raise ValueError(f"{where}: count of {t!r} must be a non-negative integer, got {c!r}")
                    total += c
                    if total > MAX_CLUSTER_DEVICES:
                        raise _too_many_devices(where, f"{total:,} devices")
                    devices += [DeviceSpec(t)] * c
            elif isinstance(gpus, list):
                total += len(gpus)
                if total > MAX_CLUSTER_DEVICES:
                    raise _too_many_devices(where, f"{total:,} devices")
                devices = [DeviceSpec.from_dict(g, f"{where} device {j}") for j, g in enumerate(gpus)]
            else:
                raise ValueError(f"{where}: 'gpus' must be an object {{type: count}} or a list of devices")
            if not devices:
                raise ValueError(f"{where}: has no devices")
            nodes.append(NodeSpec(name, datacenter, tuple(devices)))
        net = d.get("network") or {}
        if not isinstance(net, dict):
            raise ValueError(f"{source}: 'network' must be an object")
        unknown = set(net) - {"intra_node_gbps", "inter_node_gbps"}
        if unknown:
            raise ValueError(f"{source}: unknown network keys {sorted(unknown)}")
        links = d.get("emulate_links_gbps")
        if links is not None:
            links = _positive_number(links, f"{source}: emulate_links_gbps")
            if links > 100:
                raise ValueError(f"{source}: emulate_links_gbps must be at most 100 (Gbit/s), got {links:g}")
        network = NetworkSpec(
            _positive_number(net.get("intra_node_gbps", 300.0 if links is None else links),
                             f"{source}: network.intra_node_gbps"),
            _positive_number(net.get("inter_node_gbps", 100.0), f"{source}: network.inter_node_gbps"),
        )
        name = d.get("name", "cluster")
        if not isinstance(name, str) or not name.strip():
            raise ValueError(f"{source}: 'name' must be a non-empty string, got {name!r}")
        return cls(name, tuple(nodes), network, links)

    @classmethod
    def from_json(cls, text: str, source: str = "cluster") -> "ClusterSpec":
        try:
            d = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"{source}: malformed JSON: {e.msg} at line {e.lineno} column {e.colno}") from None
        return cls.from_dict(d, source)

    @classmethod
    def load(cls, path: str) -> "ClusterSpec":
        # refused by its size before a byte is read (a 10 GB "cluster file" is a mistake), and by
        # its claimed device counts before a device is built (from_dict)
        return cls.from_json(read_text_file(path, "cluster file", MAX_CLUSTER_FILE_BYTES), source=path)


def _too_many_devices(where: str, claimed: str) -> ValueError:
    return ValueError(f"{where}: {claimed}, over the limit of {MAX_CLUSTER_DEVICES:,} devices in a cluster "
                      "(MAX_CLUSTER_DEVICES)")


def _device_list(gpus: Any) -> list[dict[str, Any]]:
    """A node's `gpus` in the list form (`{"T4": 2}` -> `[{"type": "T4"}, {"type": "T4"}]`)."""
    if isinstance(gpus, dict):
        return [{"type": t} for t, c in gpus.items() for _ in range(c)]
    return list(gpus)


def homogeneous_cluster(gpu_type: str, count: int, name: str | None = None) -> ClusterSpec:
    """One node of `count` identical devices (tests, quick what-ifs)."""
    get_gpu_type(gpu_type)
    if count > MAX_CLUSTER_DEVICES:
        raise _too_many_devices(f"cluster of {gpu_type}", f"{count:,} devices")
    return ClusterSpec(name or f"{count}x{gpu_type}", (NodeSpec("n0", "dc0", (DeviceSpec(gpu_type),) * count),))
