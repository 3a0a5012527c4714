"""The plan file: the planner's output and the executor's input.

One `Assignment` per device of the cluster, in the cluster's device order; a device the plan leaves
out has `batch == 0` and `shard_fraction == 0`. The JSON of `python -m planner plan --json` *is* a
plan file.

A pipeline plan (`"pipeline"`, from `planner geo --out`, or `planner plan` when stages beat data
parallelism) cuts the layers into stages; every micro-batch passes every stage, and stage s splits
its rows over its devices (`rows`), so stages may have different numbers of devices. A device of
stage s has `micro_batch = rows[i]`, `accum_steps = num_microbatches`, and a `shard_fraction` of the
STAGE's state: batches and shard fractions sum per stage. Any plan may carry `wan` (the links
`executor launch --emulate-wan` shapes) and `connections` (TCP connections per transfer per link).

Tensor parallelism (DESIGN.md "Plans at scale"; planner/geo/scale/plan_file.py writes it): every
assignment may carry `stage` (its pipeline stage, null for a device left out), `tp` (its TP degree) and
`tp_group` (the first device index of its TP group). The `tp` devices of one group sit on one node and
carry the group's `micro_batch`, `accum_steps` and `shard_fraction` (each holds that share of its 1/tp
slice): they are ONE data-parallel position, so batches and shard fractions sum over the groups, each
counted once. The file's pipeline lists every device of a stage's groups, each with the group's rows;
in memory `Plan.pipeline` lists one entry per TP group (its first device, its rows), the runtime's view,
and `to_dict` writes the file's form back. A top-level `"tensor_parallel"` says whether any tp > 1.
A plan file without these keys reads exactly as before (tp 1 everywhere).

DiLoCo (DESIGN.md "Geo with low-communication training"; models/diloco.py): `"diloco"` names the
groups (each a list of nodes, i.e. datacenters) that train H = `inner_steps` inner steps apart before
an outer step, and its outer optimizer, fragments and wire compression. Each group holds a whole copy
of the training state, so shard fractions sum to 1 PER GROUP; batches still sum to the global batch
over every device. With a pipeline, every group holds a whole pipeline: each stage lists its devices
group by group, shard fractions sum to 1 per group and stage, and a group takes the same rows of every
micro-batch in every stage. `"cuts"` names the kind of every cut between datacenters:
`[{"a", "b", "kind": "pipeline"|"diloco"|"dp", "inner_steps": H}]` (H for "diloco" cuts only).
"""
from __future__ import annotations

import math
import numbers
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from contracts.cluster import ClusterSpec
from contracts.jsonio import dumps, load_json_file, save_json_file
from contracts.constants import DTYPES, RECOMPUTE, check_zero

PLAN_VERSION = 1
REBALANCE_MODES = ("auto", "off")  # Plan.rebalance: re-split the batch live from measured rates, or never
PIPELINE_SCHEDULES = ("1f1b", "gpipe")
# the dtypes the sharded runtime reduce-scatters gradients in (fp32 unless asked: bf16 halves the wire
# bytes and rounds the summed gradient)
REDUCE_DTYPES = ("fp32", "bf16")
# zero-3 units whose gather is in flight ahead of the one computing (1: the next one, FSDP2's default)
DEFAULT_PREFETCH = 1
# reduce-scatters left in flight: 0 waits each as it is issued (the runtime's default and an old plan
# file's), 1 waits it at the start of the next one, so it overlaps the next unit's backward
REDUCE_IN_FLIGHT = (0, 1)
# the tensor-parallel degrees a plan may give a device (a TP group lives inside one node)
TP_DEGREES = (1, 2, 4, 8)
# DiLoCo's outer-exchange wire dtypes (models/diloco.py) and the kinds of a cut between datacenters
DILOCO_COMPRESS = ("fp32", "bf16", "int8")
CUT_KINDS = ("pipeline", "diloco", "dp")
# Assignment keys a plan file written before tensor parallelism lacks, with their defaults
TP_KEYS = {"stage": None, "tp": 1, "tp_group": None}


def check_step_dtypes(zero: int, param_dtype: str, reduce_dtype: str, prefetch: int, what: str = "plan",
                      reduce_in_flight: int = 0) -> None:
    """The runtime's mixed-precision and overlap settings of a plan, checked together: `param_dtype`
    one of DTYPES (not fp32 only at zero 3: zero 1 and 2 keep replicated fp32 parameters),
    `reduce_dtype` one of REDUCE_DTYPES, `prefetch` an integer >= 0, `reduce_in_flight` 0 or 1 (1 only
    at zero 2 and 3, whose reduce-scatters run unit by unit during the backward). ValueError naming
    the problem."""
    if param_dtype not in DTYPES:
        raise ValueError(f"{what}: param_dtype must be one of {', '.join(DTYPES)}, got {param_dtype!r}")
    if param_dtype != "fp32" and zero != 3:
        raise ValueError(f"{what}: param_dtype {param_dtype} needs zero 3 (got zero {zero}): zero 1 and 2 keep "
                         "replicated fp32 parameters and gather them in fp32")
    if reduce_dtype not in REDUCE_DTYPES:
        raise ValueError(f"{what}: reduce_dtype must be one of {', '.join(REDUCE_DTYPES)}, got {reduce_dtype!r}")
    if isinstance(prefetch, bool) or not isinstance(prefetch, int) or prefetch < 0:
        raise ValueError(f"{what}: prefetch must be an integer >= 0 (units gathered ahead), got {prefetch!r}")
    if isinstance(reduce_in_flight, bool) or reduce_in_flight not in REDUCE_IN_FLIGHT:
        raise ValueError(f"{what}: reduce_in_flight must be 0 or 1 (reduce-scatters left in flight), "
                         f"got {reduce_in_flight!r}")
    if reduce_in_flight and zero == 1:
        raise ValueError(f"{what}: reduce_in_flight 1 needs zero 2 or 3 (got zero 1): zero 1 reduces after the "
                         "backward, with no unit's backward left to overlap")


def link_key(a: str, b: str) -> str:
    """The key of the link between two datacenters (or nodes) in `connections`: sorted, "a|b"."""
    return "|".join(sorted((a, b)))


def _optional(value: Any, kind: type) -> Any:
    return None if value is None else kind(value)


def check_count(value: Any, what: str, low: int = 0) -> int:
    """`value` as an int when it is a whole number (never a bool) >= `low`; else ValueError naming `what`."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < low:
        raise ValueError(f"{what} must be an integer >= {low}, got {value!r}")
    return int(value)


def check_real(value: Any, what: str, low: float, high: float = math.inf, low_open: bool = False) -> float:
    """`value` as a float when it is a finite number in [low, high] ((low, high] with `low_open`);
    else ValueError naming `what` (NaN and infinity included)."""
    ok = (not isinstance(value, bool) and isinstance(value, numbers.Real) and math.isfinite(value)
          and (value > low if low_open else value >= low) and value <= high)
    if not ok:
        bound = f"{'(' if low_open else '['}{low:g}, {high:g}]" if high < math.inf else f"{'>' if low_open else '>='} {low:g}"
        raise ValueError(f"{what} must be a finite number {'in ' if high < math.inf else ''}{bound}, got {value!r}")
    return float(value)


@dataclass(frozen=True)
class Assignment:
    device_index: int  # position in ClusterSpec.devices()
    node: str
    type: str
    micro_batch: int
    accum_steps: int
    batch: int  # micro_batch * accum_steps
    shard_fraction: float  # share of the sharded training state this device holds
    predicted_memory_bytes: int
    predicted_step_s: float
    emulated: bool = False
    slowdown: float = 1.0
    memory_gb: float | None = None
    stage: int | None = None  # pipeline stage (None: no pipeline, or a device left out)
    tp: int = 1  # tensor-parallel degree of the device's TP group
    tp_group: int | None = None  # device_index of the group's first device (None: a group of one)

    def __post_init__(self) -> None:
        """Each field's type and range: a negative micro-batch × accumulation pair, a NaN fraction or a
        zero micro-batch of a device with samples would train wrong or die inside the ranks."""
        what = f"plan: device {self.device_index}"
        check_count(self.device_index, "plan: device_index")
        batch = check_count(self.batch, f"{what}: batch")
        low = 1 if batch > 0 else 0  # a device with samples takes them in at least one micro-batch of >= 1
        check_count(self.micro_batch, f"{what}: micro_batch" + (" (the device has samples)" if low else ""), low)
        check_count(self.accum_steps, f"{what}: accum_steps" + (" (the device has samples)" if low else ""), low)
        if batch != self.micro_batch * self.accum_steps:
            raise ValueError(f"plan: device {self.device_index} batch {batch} != micro_batch {self.micro_batch} "
                             f"× accum_steps {self.accum_steps}")
        check_real(self.shard_fraction, f"{what}: shard_fraction", 0.0, 1.0)
        check_count(self.predicted_memory_bytes, f"{what}: predicted_memory_bytes")
        if isinstance(self.predicted_step_s, bool) or not isinstance(self.predicted_step_s, numbers.Real) or not (
                self.predicted_step_s >= 0):  # +inf: a device the cost model cannot time; NaN fails
            raise ValueError(f"{what}: predicted_step_s must be a number >= 0, got {self.predicted_step_s!r}")
        if not isinstance(self.emulated, bool):
            raise ValueError(f"{what}: emulated must be true or false, got {self.emulated!r}")
        check_real(self.slowdown, f"{what}: slowdown", 0.0, low_open=True)
        if self.memory_gb is not None:
            check_real(self.memory_gb, f"{what}: memory_gb", 0.0, low_open=True)
        if not isinstance(self.node, str) or not isinstance(self.type, str):
            raise ValueError(f"{what}: node and type must be strings, got {self.node!r} and {self.type!r}")
        if isinstance(self.tp, bool) or self.tp not in TP_DEGREES:
            raise ValueError(f"{what}: tp must be one of {', '.join(map(str, TP_DEGREES))}, got {self.tp!r}")
        if self.stage is not None:
            check_count(self.stage, f"{what}: stage")
        if self.tp_group is not None:
            check_count(self.tp_group, f"{what}: tp_group")
        if self.tp > 1 and self.used and self.tp_group is None:
            raise ValueError(f"{what}: tp {self.tp} needs tp_group (the first device index of its TP group)")
        if self.tp == 1 and self.tp_group not in (None, self.device_index):
            raise ValueError(f"{what}: tp 1 is a group of one, so tp_group must be the device itself "
                             f"({self.device_index}) or null, got {self.tp_group}")

    @property
    def used(self) -> bool:
        return self.batch > 0 or self.shard_fraction > 0

    @property
    def leader(self) -> int:
        """The device index of this device's TP group's first device (itself at tp 1)."""
        return self.device_index if self.tp_group is None else self.tp_group

    def to_dict(self, tp_keys: bool | None = None) -> dict[str, Any]:
        """The file's object; `stage`, `tp`, `tp_group` only when asked (None: when any is not its
        default), so a plan without tensor parallelism writes what it always did."""
        d = asdict(self)
        if tp_keys is None:
            tp_keys = any(d[k] != v for k, v in TP_KEYS.items())
        if not tp_keys:
            for k in TP_KEYS:
                del d[k]
        return d


@dataclass(frozen=True)
class BaselineResult:
    predicted_iteration_s: float | None  # None when the baseline runs out of memory
    oom: bool
    note: str = ""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)




@dataclass(frozen=True)
class ZeroCandidate:
    """What the planner found at one ZeRO stage it tried (`--zero auto` tries each)."""

    predicted_iteration_s: float | None  # None when no plan fits, or none beats a lower stage's
    feasible: bool | None  # None: not decided (nothing faster than a lower stage's plan exists)
    note: str = ""  # "chosen", why it is infeasible, ...

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class PipelineStage:
    first_layer: int
    num_layers: int
    devices: tuple[int, ...]  # device_index of each of the stage's devices, in data-parallel order
    rows: tuple[int, ...]  # per device: its rows of every micro-batch (sum: the pipeline's micro_batch)
    datacenter: str = ""  # where the stage runs (its devices' node / datacenter)

    def to_dict(self) -> dict[str, Any]:
        return {"first_layer": self.first_layer, "num_layers": self.num_layers, "devices": list(self.devices),
                "rows": list(self.rows), "datacenter": self.datacenter}


@dataclass(frozen=True)
class WanLink:
    """A link to emulate between two datacenters (or nodes): bandwidth and round trip."""
    a: str
    b: str
    gbps: float
    rtt_ms: float = 0.0
    # one TCP connection's measured rate where the scenario gives it (else the window / RTT rule)
    per_connection_gbps: float | None = None

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        if self.per_connection_gbps is None:
            del d["per_connection_gbps"]
        return d


@dataclass(frozen=True)
class PipelineSpec:
    schedule: str  # "1f1b" | "gpipe"
    micro_batch: int  # samples per micro-batch (all stages)
    num_microbatches: int  # per optimizer step; global_batch = micro_batch × num_microbatches
    stages: tuple[PipelineStage, ...]
    # the simulator's timeline of one iteration (planner/geo/pipeline_sim): rows of
    # {"stage", "replica", "op", "mb", "start_s", "end_s"}, for the measured-against-simulated Gantt
    simulated_ops: tuple[dict, ...] = ()

    def __post_init__(self) -> None:
        if self.schedule not in PIPELINE_SCHEDULES:
            raise ValueError(f"plan: pipeline schedule must be one of {', '.join(PIPELINE_SCHEDULES)}, "
                             f"got {self.schedule!r}")
        for what, v in (("micro_batch", self.micro_batch), ("num_microbatches", self.num_microbatches)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"plan: pipeline {what} must be a positive integer, got {v!r}")
        if len(self.stages) < 1:
            raise ValueError("plan: a pipeline needs at least one stage")
        nxt = 0
        for s, st in enumerate(self.stages):
            if st.num_layers < 1:
                raise ValueError(f"plan: pipeline stage {s} has no layers (every stage needs at least one)")
            if st.first_layer != nxt:
                raise ValueError(f"plan: pipeline stage {s} starts at layer {st.first_layer} with {st.num_layers} "
                                 f"layers; stages must cover the layers in order from 0 (stage {s} must start at {nxt})")
            nxt += st.num_layers
            if not st.devices or len(st.devices) != len(st.rows):
                raise ValueError(f"plan: pipeline stage {s} needs one row count per device "
                                 f"({len(st.devices)} devices, {len(st.rows)} row counts)")
            if any(r < 1 for r in st.rows) or sum(st.rows) != self.micro_batch:
                raise ValueError(f"plan: pipeline stage {s}'s rows {list(st.rows)} must be positive and sum to "
                                 f"the micro-batch {self.micro_batch}")
        seen = [d for st in self.stages for d in st.devices]
        if len(seen) != len(set(seen)):
            raise ValueError("plan: a device appears in more than one pipeline stage (or twice in one)")

    @property
    def num_layers(self) -> int:
        return sum(st.num_layers for st in self.stages)

    def stage_of(self, device_index: int) -> tuple[int, int]:
        """(stage, position inside the stage) of a device; ValueError when no stage has it."""
        for s, st in enumerate(self.stages):
            if device_index in st.devices:
                return s, st.devices.index(device_index)
        raise ValueError(f"plan: device {device_index} is in no pipeline stage")

    def to_dict(self) -> dict[str, Any]:
        return {"schedule": self.schedule, "micro_batch": self.micro_batch,
                "num_microbatches": self.num_microbatches, "stages": [st.to_dict() for st in self.stages],
                "simulated_ops": [dict(o) for o in self.simulated_ops]}

    @classmethod
    def from_dict(cls, d: Any) -> "PipelineSpec":
        if not isinstance(d, dict):
            raise ValueError("plan: pipeline must be a JSON object")
        stages = tuple(PipelineStage(first_layer=int(st["first_layer"]), num_layers=int(st["num_layers"]),
                                     devices=tuple(int(x) for x in st["devices"]),
                                     rows=tuple(int(x) for x in st["rows"]), datacenter=str(st.get("datacenter", "")))
                       for st in d["stages"])
        return cls(schedule=str(d["schedule"]), micro_batch=d["micro_batch"], num_microbatches=d["num_microbatches"],
                   stages=stages, simulated_ops=tuple(dict(o) for o in d.get("simulated_ops", ())))


@dataclass(frozen=True)
class DilocoSpec:
    """DiLoCo across the plan's groups (models/diloco.py): each group trains `inner_steps` steps on
    its own, then an outer SGD step (Nesterov momentum) on the groups' averaged parameter deltas."""
    groups: tuple[tuple[str, ...], ...]  # each group's nodes (datacenters), the groups in plan order
    inner_steps: int  # H: inner steps between two outer steps of a fragment
    # DiLoCo's defaults (Douillard et al. 2023, §3): outer Nesterov SGD, lr 0.7, momentum 0.9
    outer_lr: float = 0.7
    outer_momentum: float = 0.9
    nesterov: bool = True
    fragments: int = 1  # streaming: the units in F fragments, synchronised in turn (F <= H)
    compress: str = "fp32"  # the outer exchange's wire dtype: "fp32" | "bf16" | "int8"
    # the exchange overlapped with the next inner step (needs H >= 2), then local and synced
    # parameters merged: θ = merge_alpha · θ_local + (1 - merge_alpha) · θ_synced (0.5: an even mix)
    overlap: bool = False
    merge_alpha: float = 0.5

    def __post_init__(self) -> None:
        what = "plan: diloco"
        if not isinstance(self.groups, tuple) or not self.groups:
            raise ValueError(f"{what}: groups must be a non-empty list of groups (each a list of node names)")
        seen: set[str] = set()
        for g, nodes in enumerate(self.groups):
            if not isinstance(nodes, tuple) or not nodes or not all(isinstance(n, str) and n for n in nodes):
                raise ValueError(f"{what}: groups[{g}] must be a non-empty list of node names, got {nodes!r}")
            twice = seen.intersection(nodes)
            if twice or len(set(nodes)) != len(nodes):
                raise ValueError(f"{what}: node {sorted(twice or nodes)[0]!r} is in more than one group "
                                 "(or twice in one)")
            seen.update(nodes)
        check_count(self.inner_steps, f"{what}: inner_steps", 1)
        check_real(self.outer_lr, f"{what}: outer_lr", 0.0, low_open=True)
        check_real(self.outer_momentum, f"{what}: outer_momentum", 0.0, 1.0)
        if self.outer_momentum >= 1.0:
            raise ValueError(f"{what}: outer_momentum must be below 1, got {self.outer_momentum!r}")
        if not isinstance(self.nesterov, bool):
            raise ValueError(f"{what}: nesterov must be true or false, got {self.nesterov!r}")
        check_count(self.fragments, f"{what}: fragments", 1)
        if self.fragments > self.inner_steps:
            raise ValueError(f"{what}: fragments ({self.fragments}) must not exceed inner_steps "
                             f"({self.inner_steps}): each fragment syncs at its own step of the H")
        if self.compress not in DILOCO_COMPRESS:
            raise ValueError(f"{what}: compress must be one of {', '.join(DILOCO_COMPRESS)}, got {self.compress!r}")
        if not isinstance(self.overlap, bool):
            raise ValueError(f"{what}: overlap must be true or false, got {self.overlap!r}")
        if self.overlap and self.inner_steps < 2:
            raise ValueError(f"{what}: overlap needs inner_steps >= 2 (an exchange completes one inner step after "
                             f"it is issued, before its fragment's next sync), got {self.inner_steps}")
        check_real(self.merge_alpha, f"{what}: merge_alpha", 0.0, 1.0)

    @property
    def num_groups(self) -> int:
        return len(self.groups)

    def groups_nodes(self) -> set[str]:
        """Every node of every group."""
        return {n for g in self.groups for n in g}

    def group_of(self, node: str) -> int:
        """The index of the group holding `node`; ValueError when none does."""
        for g, nodes in enumerate(self.groups):
            if node in nodes:
                return g
        raise ValueError(f"plan: diloco: node {node!r} is in no group")

    def to_dict(self) -> dict[str, Any]:
        return {"groups": [list(g) for g in self.groups], "inner_steps": self.inner_steps,
                "outer_lr": self.outer_lr, "outer_momentum": self.outer_momentum, "nesterov": self.nesterov,
                "fragments": self.fragments, "compress": self.compress, "overlap": self.overlap,
                "merge_alpha": self.merge_alpha}

    @classmethod
    def from_dict(cls, d: Any) -> "DilocoSpec":
        if not isinstance(d, dict):
            raise ValueError("plan: diloco must be a JSON object")
        unknown = set(d) - {f.name for f in fields(cls)}
        if unknown:
            raise ValueError(f"plan: diloco: unknown field(s) {sorted(unknown)}")
        if "groups" not in d or "inner_steps" not in d:
            raise ValueError("plan: diloco needs groups and inner_steps")
        groups = d["groups"]
        if not isinstance(groups, list) or not all(isinstance(g, list) for g in groups):
            raise ValueError(f"plan: diloco: groups must be a list of lists of node names, got {groups!r}")
        return cls(**{**d, "groups": tuple(tuple(g) for g in groups)})


@dataclass(frozen=True)
class Cut:
    """The kind of one cut between two datacenters (nodes) of a geo plan."""
    a: str
    b: str
    kind: str  # "pipeline" | "diloco" | "dp"
    inner_steps: int | None = None  # H of a "diloco" cut; None for the others

    def __post_init__(self) -> None:
        what = f"plan: cut {self.a!r}–{self.b!r}"
        if not isinstance(self.a, str) or not isinstance(self.b, str) or not self.a or not self.b or self.a == self.b:
            raise ValueError(f"{what}: a and b must name two different nodes")
        if self.kind not in CUT_KINDS:
            raise ValueError(f"{what}: kind must be one of {', '.join(CUT_KINDS)}, got {self.kind!r}")
        if self.kind == "diloco":
            check_count(self.inner_steps, f"{what}: inner_steps (a diloco cut)", 1)
        elif self.inner_steps is not None:
            raise ValueError(f"{what}: inner_steps is for diloco cuts only, got {self.inner_steps!r} on a "
                             f"{self.kind} cut")

    def to_dict(self) -> dict[str, Any]:
        return {"a": self.a, "b": self.b, "kind": self.kind, "inner_steps": self.inner_steps}

    @classmethod
    def from_dict(cls, d: Any) -> "Cut":
        if not isinstance(d, dict) or not {"a", "b", "kind"} <= set(d):
            raise ValueError(f"plan: every cut is an object with a, b and kind, got {d!r}")
        unknown = set(d) - {"a", "b", "kind", "inner_steps"}
        if unknown:
            raise ValueError(f"plan: cut: unknown field(s) {sorted(unknown)}")
        return cls(d["a"], d["b"], d["kind"], d.get("inner_steps"))


def _pipeline_by_group(d: Any, assignments: tuple[Assignment, ...]) -> Any:
    """The file's pipeline (every device of a stage's TP groups, each with its group's rows) as the
    contracts hold it: one entry per TP group, its first device with its rows. A plan without TP
    groups comes back unchanged. ValueError naming the device whose entry disagrees with its group."""
    leader = {a.device_index: a.leader for a in assignments}
    if not isinstance(d, dict) or all(leader[i] == i for i in leader):
        return d
    stages = []
    for s, st in enumerate(d["stages"]):
        devices, rows, rows_of = [], [], {}
        for x, r in zip(st["devices"], st["rows"]):
            g = leader.get(int(x), int(x))
            if g in rows_of:
                if rows_of[g] != r:
                    raise ValueError(f"plan: pipeline stage {s} gives device {x} rows {r}, its TP group (device {g}) "
                                     f"rows {rows_of[g]}: a TP group's devices take the same rows")
                continue
            rows_of[g] = r
            devices.append(g)
            rows.append(r)
        stages.append({**st, "devices": devices, "rows": rows})
    return {**d, "stages": stages}


def _cuts(d: Any) -> tuple[Cut, ...]:
    if not isinstance(d, list):
        raise ValueError(f"plan: cuts must be a list, got {type(d).__name__}")
    return tuple(Cut.from_dict(c) for c in d)


@dataclass(frozen=True)
class Plan:
    cluster: ClusterSpec
    model: str  # preset name or config path, as given
    global_batch: int
    seq: int
    dtype: str  # "fp32" | "bf16" | "fp16"
    recompute: str  # "none" | "full"
    assignments: tuple[Assignment, ...]
    predicted_iteration_s: float
    predicted_samples_per_s: float
    baselines: dict[str, BaselineResult] = field(default_factory=dict)
    solve_s: float = 0.0
    notes: tuple[str, ...] = ()
    # the ZeRO stage the sharded runtime runs (contracts/units.py): 1 AdamW state sharded by
    # shard_fraction, 2 + gradients, 3 + parameters; a one-device plan says 1
    zero: int = 1
    # the stages the planner tried and their predicted iteration times (zero -> candidate)
    zero_candidates: dict[int, ZeroCandidate] = field(default_factory=dict)
    pipeline: PipelineSpec | None = None  # None: pure (sharded) data parallelism
    wan: tuple[WanLink, ...] = ()  # links between nodes (datacenters) to emulate (executor launch --emulate-wan)
    connections: dict[str, int] = field(default_factory=dict)  # link_key(a, b) -> TCP connections per transfer
    # mixed precision as the sharded runtime runs it (FSDP2's MixedPrecisionPolicy): fp32 master shards
    # and AdamW state always; zero 3 gathers parameters in param_dtype; gradients are reduce-scattered
    # in reduce_dtype; `prefetch` units are gathered ahead of the one computing; `reduce_in_flight`
    # reduce-scatters are left in flight behind the next unit's backward (0 or 1; 1 only at zero 2/3)
    param_dtype: str = "fp32"  # "fp32" | "bf16" | "fp16", resolved (never "auto")
    reduce_dtype: str = "fp32"  # "fp32" | "bf16"
    prefetch: int = DEFAULT_PREFETCH
    reduce_in_flight: int = 0
    # what the cost model predicts the step puts on the network (bytes all ranks send together) and
    # the communication no compute hides on the slowest rank (s per step); None: not predicted
    predicted_wire_bytes_per_step: int | None = None
    predicted_exposed_comm_s: float | None = None
    # live rebalancing (executor/rebalance.py): "auto" re-splits the batch at a step boundary when
    # measured rates depart from the profiles; "off" keeps this split for the whole run
    rebalance: str = "auto"
    # any assignment with tp > 1 (the file's "tensor_parallel"; a TP group is one data-parallel position)
    tensor_parallel: bool = False
    # DiLoCo across groups of nodes (None: every device in one synchronous step), and the kind of
    # every cut between datacenters (DESIGN.md "Geo with low-communication training")
    diloco: DilocoSpec | None = None
    cuts: tuple[Cut, ...] = ()

    def __post_init__(self) -> None:
        check_count(self.global_batch, "plan: global_batch", 1)
        check_count(self.seq, "plan: seq", 1)
        if self.dtype not in DTYPES:
            raise ValueError(f"plan: dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.recompute not in RECOMPUTE:
            raise ValueError(f"plan: recompute must be one of {', '.join(RECOMPUTE)}, got {self.recompute!r}")
        self._check_devices()
        if self.rebalance not in REBALANCE_MODES:
            raise ValueError(f"plan: rebalance must be one of {', '.join(REBALANCE_MODES)}, got {self.rebalance!r}")
        check_zero(self.zero, what="plan: zero")
        check_step_dtypes(self.zero, self.param_dtype, self.reduce_dtype, self.prefetch,
                          reduce_in_flight=self.reduce_in_flight)
        nodes = {n.name for n in self.cluster.nodes}
        for w in self.wan:
            if w.a not in nodes or w.b not in nodes or w.a == w.b:
                raise ValueError(f"plan: wan link {w.a!r}–{w.b!r} must join two different nodes of the cluster "
                                 f"({', '.join(sorted(nodes))})")
            if not (w.gbps > 0 and w.rtt_ms >= 0 and (w.per_connection_gbps is None or w.per_connection_gbps > 0)):
                raise ValueError(f"plan: wan link {w.a}–{w.b} needs gbps > 0, rtt_ms >= 0 and, when given, "
                                 "per_connection_gbps > 0")
        for k, c in self.connections.items():
            if isinstance(c, bool) or not isinstance(c, int) or c < 1:
                raise ValueError(f"plan: connections[{k!r}] must be a positive integer, got {c!r}")
        self._check_tp_groups()
        self._check_cuts(nodes)
        if self.diloco is not None:
            self._check_diloco(nodes)
            return
        # each TP group counted once: its first device stands for it (a pipeline stage lists only those)
        groups = [[a for a in self.assignments if a.leader == a.device_index]] if self.pipeline is None \
            else self._stage_assignments()
        for g, group in enumerate(groups):
            where = "" if self.pipeline is None else f"pipeline stage {g}: "
            total = sum(a.batch for a in group)
            if total != self.global_batch:
                raise ValueError(f"plan: {where}batches sum to {total}, not the global batch {self.global_batch}")
            frac = sum(a.shard_fraction for a in group)
            if abs(frac - 1.0) > 1e-6:
                raise ValueError(f"plan: {where}shard fractions sum to {frac:.6f}, not 1")

    def _check_cuts(self, nodes: set[str]) -> None:
        """Every cut joins two nodes of the cluster, once; a diloco cut needs the diloco section (with
        its H) and groups on either side, a pipeline cut the pipeline."""
        if not isinstance(self.cuts, tuple) or not all(isinstance(c, Cut) for c in self.cuts):
            raise ValueError("plan: cuts must be a list of Cut entries")
        seen: set[tuple[str, ...]] = set()
        for c in self.cuts:
            what = f"plan: cut {c.a!r}–{c.b!r}"
            if c.a not in nodes or c.b not in nodes:
                raise ValueError(f"{what}: both ends must be nodes of the cluster ({', '.join(sorted(nodes))})")
            key = tuple(sorted((c.a, c.b)))
            if key in seen:
                raise ValueError(f"{what}: named more than once")
            seen.add(key)
            if c.kind == "pipeline" and self.pipeline is None:
                raise ValueError(f"{what}: kind pipeline, but the plan has no pipeline")
            d = self.diloco
            if c.kind == "diloco":
                if d is None:
                    raise ValueError(f"{what}: kind diloco, but the plan has no diloco section")
                if c.inner_steps != d.inner_steps:
                    raise ValueError(f"{what}: inner_steps {c.inner_steps}, but the plan's diloco runs "
                                     f"inner_steps {d.inner_steps} (one H for every diloco cut)")
            if d is not None and c.a in d.groups_nodes() and c.b in d.groups_nodes():
                same = d.group_of(c.a) == d.group_of(c.b)
                if c.kind == "diloco" and same:
                    raise ValueError(f"{what}: kind diloco, but both nodes are in diloco group {d.group_of(c.a)}")
                if c.kind in ("dp", "pipeline") and not same:
                    raise ValueError(f"{what}: kind {c.kind}, but the nodes are in different diloco groups "
                                     f"({d.group_of(c.a)} and {d.group_of(c.b)})")

    def _check_diloco(self, nodes: set[str]) -> None:
        """A DiLoCo plan: no tensor parallelism, every group's nodes in the cluster, every used device's
        node in one group. Without a pipeline: every group with a device with samples and shard
        fractions summing to 1 per group, batches to the global batch over all; with one: every group
        a whole pipeline (_check_diloco_pipeline)."""
        d = self.diloco
        if not isinstance(d, DilocoSpec):
            raise ValueError("plan: diloco must be a DilocoSpec")
        if self.tensor_parallel:
            raise ValueError("plan: diloco does not run tensor-parallel plans (every tp must be 1)")
        for g, group in enumerate(d.groups):
            for n in group:
                if n not in nodes:
                    raise ValueError(f"plan: diloco: groups[{g}] names node {n!r}, which is not in the cluster "
                                     f"({', '.join(sorted(nodes))})")
        used = self.used
        for a in used:
            if a.node not in d.groups_nodes():
                raise ValueError(f"plan: diloco: device {a.device_index} is used but its node {a.node!r} is in no "
                                 "group")
        if self.pipeline is not None:
            self._check_diloco_pipeline()
            return
        total = sum(a.batch for a in used)
        if total != self.global_batch:
            raise ValueError(f"plan: batches sum to {total}, not the global batch {self.global_batch}")
        for g, group in enumerate(d.groups):
            members = [a for a in used if a.node in group]
            if not any(a.batch > 0 for a in members):
                raise ValueError(f"plan: diloco: groups[{g}] ({', '.join(group)}) has no device with samples")
            frac = sum(a.shard_fraction for a in members)
            if abs(frac - 1.0) > 1e-6:
                raise ValueError(f"plan: diloco: groups[{g}]'s shard fractions sum to {frac:.6f}, not 1 (each "
                                 "group holds a whole copy of the training state)")

    def _check_diloco_pipeline(self) -> None:
        """DiLoCo over pipeline replicas: every group holds a whole pipeline of the plan's stages. Each
        stage lists its devices group by group (group 0's first), every group has a device in every
        stage, takes the same rows of every micro-batch in each stage, and its shard fractions sum to 1
        per stage; one fragment (a stage's few units cannot be split per stage and kept in step)."""
        d, p = self.diloco, self.pipeline
        assert d is not None and p is not None
        if d.fragments != 1:
            raise ValueError(f"plan: diloco: fragments {d.fragments} with a pipeline; DiLoCo over pipelines "
                             "synchronises each stage whole (fragments 1)")
        rows_of: dict[int, int] = {}
        for s, group in enumerate(self._stage_assignments()):
            total = sum(a.batch for a in group)
            if total != self.global_batch:
                raise ValueError(f"plan: pipeline stage {s}: batches sum to {total}, not the global batch "
                                 f"{self.global_batch}")
            order = [d.group_of(a.node) for a in group]
            if order != sorted(order):
                raise ValueError(f"plan: diloco: pipeline stage {s} lists its devices in groups {order}: list "
                                 "each group's devices together, in group order (group 0 first)")
            for g, nodes in enumerate(d.groups):
                mine = [a for a, h in zip(group, order) if h == g]
                if not mine:
                    raise ValueError(f"plan: diloco: groups[{g}] ({', '.join(nodes)}) has no device in pipeline "
                                     f"stage {s}: every group holds a whole pipeline")
                rows = sum(a.micro_batch for a in mine)
                if rows_of.setdefault(g, rows) != rows:
                    raise ValueError(f"plan: diloco: groups[{g}] takes {rows_of[g]} rows of every micro-batch in "
                                     f"pipeline stage 0 but {rows} in stage {s}: a group's pipeline passes the "
                                     "same rows through every stage")
                frac = sum(a.shard_fraction for a in mine)
                if abs(frac - 1.0) > 1e-6:
                    raise ValueError(f"plan: diloco: groups[{g}]'s shard fractions in pipeline stage {s} sum to "
                                     f"{frac:.6f}, not 1 (each group holds a whole copy of the stage's state)")

    def diloco_pipeline(self, g: int) -> tuple[PipelineSpec, int]:
        """DiLoCo group g's own pipeline (the plan's stages, each with the group's devices and rows) and
        the offset of its rows in every micro-batch of the plan's pipeline; ValueError for a plan
        without both sections or a group that is not one of them."""
        d, p = self.diloco, self.pipeline
        if d is None or p is None:
            raise ValueError("plan: a DiLoCo group's pipeline needs a plan with a pipeline and a diloco section")
        if not 0 <= g < d.num_groups:
            raise ValueError(f"plan: diloco has {d.num_groups} group(s), no group {g}")
        node = {a.device_index: a.node for a in self.assignments}
        stages, offset = [], 0
        for s, st in enumerate(p.stages):
            mine = [(x, r) for x, r in zip(st.devices, st.rows) if d.group_of(node[x]) == g]
            if s == 0:  # the groups' devices come in group order: the earlier groups' rows come first
                offset = sum(r for x, r in zip(st.devices, st.rows) if d.group_of(node[x]) < g)
            stages.append(PipelineStage(st.first_layer, st.num_layers, tuple(x for x, _ in mine),
                                        tuple(r for _, r in mine), node[mine[0][0]] if mine else st.datacenter))
        rows = sum(stages[0].rows)
        return PipelineSpec(p.schedule, rows, p.num_microbatches, tuple(stages)), offset

    def _check_devices(self) -> None:
        """Every assignment names a device of the plan's cluster, once, with that device's node and type."""
        devices = self.cluster.devices()
        seen: set[int] = set()
        for a in self.assignments:
            if not isinstance(a, Assignment):
                raise ValueError(f"plan: assignments must be Assignment entries, got {type(a).__name__}")
            if a.device_index >= len(devices):
                raise ValueError(f"plan: device_index {a.device_index} is beyond the cluster {self.cluster.name!r}, "
                                 f"which has {len(devices)} device(s) (0-{len(devices) - 1})")
            if a.device_index in seen:
                raise ValueError(f"plan: device {a.device_index} has more than one assignment")
            seen.add(a.device_index)
            node, dev = devices[a.device_index]
            if (a.node, a.type) != (node.name, dev.type):
                raise ValueError(f"plan: device {a.device_index} is a {a.type} on node {a.node!r} in the assignment, "
                                 f"a {dev.type} on node {node.name!r} in the cluster")

    def _check_tp_groups(self) -> None:
        """The TP groups: `tp` devices of one node sharing `tp_group` (their first device's index), with
        one micro_batch, accum_steps and shard_fraction; `tensor_parallel` says whether any tp > 1;
        `stage` names the stage the device's group is in. One-line ValueError naming device and rule."""
        if not isinstance(self.tensor_parallel, bool):
            raise ValueError(f"plan: tensor_parallel must be true or false, got {self.tensor_parallel!r}")
        wide = next((a for a in self.assignments if a.tp > 1), None)
        if self.tensor_parallel != (wide is not None):
            raise ValueError(f"plan: tensor_parallel is false but device {wide.device_index} has tp {wide.tp}"
                             if wide is not None else "plan: tensor_parallel is true but every device has tp 1")
        by_index = {a.device_index: a for a in self.assignments}
        members: dict[int, list[Assignment]] = {}
        for a in self.assignments:
            if a.tp_group is not None:
                members.setdefault(a.tp_group, []).append(a)
        for g, group in sorted(members.items()):
            head = by_index.get(g)
            for a in group:
                what = f"plan: device {a.device_index} (tp_group {g})"
                if head is None or head.tp_group != g:
                    raise ValueError(f"{what}: tp_group must be the index of the group's first device, and device "
                                     f"{g} is {'not in the plan' if head is None else 'not in that group'}")
                if a.device_index < g:
                    raise ValueError(f"{what}: tp_group must be the group's first (lowest) device index")
                if a.tp != head.tp or len(group) != head.tp:
                    raise ValueError(f"{what}: a TP group of tp {head.tp} needs exactly {head.tp} devices with "
                                     f"that tp, got {len(group)} device(s) {[b.device_index for b in group]} "
                                     f"with tp {sorted({b.tp for b in group})}")
                if a.node != head.node:
                    raise ValueError(f"{what}: a TP group lives on one node: it is on {a.node!r}, device {g} on "
                                     f"{head.node!r}")
                if (a.micro_batch, a.accum_steps, a.shard_fraction) != (head.micro_batch, head.accum_steps,
                                                                         head.shard_fraction):
                    raise ValueError(f"{what}: the devices of a TP group carry the same micro_batch, accum_steps "
                                     f"and shard_fraction (one data-parallel position): {a.micro_batch} × "
                                     f"{a.accum_steps}, {a.shard_fraction:g} here, {head.micro_batch} × "
                                     f"{head.accum_steps}, {head.shard_fraction:g} on device {g}")
                if a.stage != head.stage:
                    raise ValueError(f"{what}: the devices of a TP group are in one stage: stage {a.stage} here, "
                                     f"{head.stage} on device {g}")
        for a in self.assignments:
            if a.stage is None or not a.used:
                continue
            if self.pipeline is None:
                if a.stage != 0:
                    raise ValueError(f"plan: device {a.device_index} has stage {a.stage}, but the plan has no "
                                     "pipeline (stage 0 or null)")
            elif a.leader in by_index:
                want = next((s for s, st in enumerate(self.pipeline.stages) if a.leader in st.devices), None)
                if want is not None and a.stage != want:
                    raise ValueError(f"plan: device {a.device_index} has stage {a.stage}, but the pipeline lists its "
                                     f"TP group (device {a.leader}) in stage {want}")

    def tp_groups(self) -> list[list[Assignment]]:
        """The used devices by TP group (a group of one at tp 1), each by device index, the groups by
        their first device: group p is data-parallel position p of a plan without a pipeline."""
        groups: dict[int, list[Assignment]] = {}
        for a in self.used:
            groups.setdefault(a.leader, []).append(a)
        return [sorted(g, key=lambda a: a.device_index) for _, g in sorted(groups.items())]

    @property
    def tp_degree(self) -> int:
        """The largest TP degree of a used device (1: no tensor parallelism)."""
        return max((a.tp for a in self.used), default=1)

    def _stage_assignments(self) -> list[list[Assignment]]:
        p = self.pipeline
        assert p is not None
        if p.micro_batch * p.num_microbatches != self.global_batch:
            raise ValueError(f"plan: pipeline micro_batch {p.micro_batch} × num_microbatches {p.num_microbatches} "
                             f"is not the global batch {self.global_batch}")
        by_index = {a.device_index: a for a in self.assignments}
        staged = {d for st in p.stages for d in st.devices}
        for a in self.assignments:
            if a.used and a.leader not in staged:
                raise ValueError(f"plan: device {a.device_index} is used but in no pipeline stage"
                                 + (f" (its TP group, device {a.leader}, is in none)" if a.leader != a.device_index
                                    else ""))
        groups = []
        for s, st in enumerate(p.stages):
            group = []
            for d, rows in zip(st.devices, st.rows):
                a = by_index.get(d)
                if a is None:
                    raise ValueError(f"plan: pipeline stage {s} names device {d}, which the plan has not")
                if a.micro_batch != rows or a.accum_steps != p.num_microbatches:
                    raise ValueError(f"plan: device {d} of pipeline stage {s} must have micro_batch {rows} "
                                     f"(its rows) × accum_steps {p.num_microbatches}, got "
                                     f"{a.micro_batch} × {a.accum_steps}")
                group.append(a)
            groups.append(group)
        return groups

    @property
    def used(self) -> list[Assignment]:
        return [a for a in self.assignments if a.used]

    def _pipeline_file_dict(self) -> dict[str, Any]:
        """The pipeline as the file writes it: every device of each stage's TP groups, with the group's rows."""
        assert self.pipeline is not None
        d = self.pipeline.to_dict()
        groups = {g[0].device_index: g for g in self.tp_groups()}
        for st in d["stages"]:
            devs = [[b.device_index for b in groups.get(x, ())] or [x] for x in st["devices"]]
            st["rows"] = [r for ds, r in zip(devs, st["rows"]) for _ in ds]
            st["devices"] = [x for ds in devs for x in ds]
        return d

    def to_dict(self) -> dict[str, Any]:
        # a plan that read `stage`, `tp`, `tp_group` writes them on every assignment; an old one: never
        tp_keys = self.tensor_parallel or any(a.to_dict(None).keys() >= TP_KEYS.keys() for a in self.assignments)
        return {
            "version": PLAN_VERSION,
            "cluster": self.cluster.to_dict(),
            "model": self.model,
            "global_batch": self.global_batch,
            "seq": self.seq,
            "dtype": self.dtype,
            "recompute": self.recompute,
            "zero": self.zero,
            "param_dtype": self.param_dtype,
            "reduce_dtype": self.reduce_dtype,
            "prefetch": self.prefetch,
            "reduce_in_flight": self.reduce_in_flight,
            "predicted_wire_bytes_per_step": self.predicted_wire_bytes_per_step,
            "predicted_exposed_comm_s": self.predicted_exposed_comm_s,
            "rebalance": self.rebalance,
            "assignments": [a.to_dict(tp_keys) for a in self.assignments],
            "predicted_iteration_s": self.predicted_iteration_s,
            "predicted_samples_per_s": self.predicted_samples_per_s,
            "baselines": {k: v.to_dict() for k, v in self.baselines.items()},
            "solve_s": self.solve_s,
            "notes": list(self.notes),
            "zero_candidates": {str(z): c.to_dict() for z, c in sorted(self.zero_candidates.items())},
            **({"pipeline": self._pipeline_file_dict()} if self.pipeline is not None else {}),
            **({"tensor_parallel": self.tensor_parallel} if tp_keys else {}),
            **({"wan": [w.to_dict() for w in self.wan]} if self.wan else {}),
            **({"connections": dict(self.connections)} if self.connections else {}),
            **({"diloco": self.diloco.to_dict()} if self.diloco is not None else {}),
            **({"cuts": [c.to_dict() for c in self.cuts]} if self.cuts else {}),
        }

    def to_json(self) -> str:
        return dumps(self.to_dict())

    def save(self, path: str) -> None:
        save_json_file(path, self.to_dict())

    @classmethod
    def from_dict(cls, d: Any, source: str = "plan") -> "Plan":
        if not isinstance(d, dict):
            raise ValueError(f"{source}: expected a JSON object")
        version = d.get("version", PLAN_VERSION)  # a plan written before versions were kept is version 1
        if isinstance(version, bool) or version != PLAN_VERSION:
            raise ValueError(f"{source}: plan version {version!r} is not one this GPUMix reads (version "
                             f"{PLAN_VERSION}); write the plan again with this version's planner")
        try:
            afields = {f.name for f in fields(Assignment)}
            assignments = tuple(Assignment(**{k: v for k, v in a.items() if k in afields}) for a in d["assignments"])
            pipeline = None
            if d.get("pipeline") is not None:
                pipeline = PipelineSpec.from_dict(_pipeline_by_group(d["pipeline"], assignments))
            return cls(
                cluster=ClusterSpec.from_dict(d["cluster"], f"{source}: cluster"),
                model=str(d["model"]),
                global_batch=d["global_batch"],  # checked as integers, never truncated
                seq=d["seq"],
                dtype=str(d.get("dtype", "fp32")),
                recompute=str(d.get("recompute", "none")),
                assignments=assignments,
                predicted_iteration_s=float(d["predicted_iteration_s"]),
                predicted_samples_per_s=float(d["predicted_samples_per_s"]),
                baselines={k: BaselineResult(**v) for k, v in d.get("baselines", {}).items()},
                solve_s=float(d.get("solve_s", 0.0)),
                notes=tuple(d.get("notes", ())),
                zero=d.get("zero", 1),
                zero_candidates={int(z): ZeroCandidate(**c) for z, c in d.get("zero_candidates", {}).items()},
                pipeline=pipeline,
                wan=tuple(WanLink(str(w["a"]), str(w["b"]), float(w["gbps"]), float(w.get("rtt_ms", 0.0)),
                                  None if w.get("per_connection_gbps") is None else float(w["per_connection_gbps"]))
                          for w in d.get("wan", ())),
                connections={str(k): v for k, v in d.get("connections", {}).items()},
                # a plan file written before mixed precision: the runtime gathered and reduced in fp32
                param_dtype=str(d.get("param_dtype", "fp32")),
                reduce_dtype=str(d.get("reduce_dtype", "fp32")),
                prefetch=d.get("prefetch", DEFAULT_PREFETCH),
                # written before reduce-scatters were left in flight: each was waited as issued
                reduce_in_flight=d.get("reduce_in_flight", 0),
                predicted_wire_bytes_per_step=_optional(d.get("predicted_wire_bytes_per_step"), int),
                predicted_exposed_comm_s=_optional(d.get("predicted_exposed_comm_s"), float),
                rebalance=d.get("rebalance", "auto"),  # a plan file written before live rebalancing: auto
                # written before tensor parallelism: none (a file with tp keys but no flag: any tp > 1)
                tensor_parallel=d.get("tensor_parallel", any(a.tp > 1 for a in assignments)),
                diloco=None if d.get("diloco") is None else DilocoSpec.from_dict(d["diloco"]),
                cuts=_cuts(d.get("cuts", [])),
            )
        except KeyError as e:
            raise ValueError(f"{source}: missing key {e.args[0]!r}") from None
        except (TypeError, AttributeError) as e:
            raise ValueError(f"{source}: malformed plan: {e}") from None

    @classmethod
    def load(cls, path: str) -> "Plan":
        return cls.from_dict(load_json_file(path, "plan file"), source=path)


def plan_nodes(plan: Plan) -> list[str]:
    """The nodes with used devices, in plan order."""
    out: list[str] = []
    for a in plan.used:
        if a.node not in out:
            out.append(a.node)
    return out
