"""A DiLoCo plan from a data-parallel plan across datacenters (contracts/plan.py `DilocoSpec`).

`to_diloco_plan` keeps every device's samples (so the global batch and each step's windows stay) and
makes each datacenter (plan node) one DiLoCo group by default: a group holds a whole copy of the
training state, so its devices' shard fractions are rescaled to sum to 1 inside the group, in the
proportions the plan gave them (by samples where the group held none). Every cut between two used
nodes gets its kind: "diloco" between groups (with H), "dp" inside one. `to_diloco_pipeline_plan`
replicates a pipeline on one group's datacenters onto the others' (DiLoCo over pipelines). The runtime:
models/diloco.py; the fields: docs/models/diloco.md.
"""
from __future__ import annotations

import logging
from dataclasses import replace
from itertools import combinations
from typing import Sequence

from contracts.plan import Cut, DilocoSpec, Plan, plan_nodes

log = logging.getLogger(__name__)


def _group_fractions(plan: Plan, groups: Sequence[Sequence[str]]) -> dict[int, float]:
    """device_index -> its shard fraction inside its group (the group's fractions sum to 1)."""
    out: dict[int, float] = {}
    for g, nodes in enumerate(groups):
        members = [a for a in plan.used if a.node in nodes]
        frac = sum(a.shard_fraction for a in members)
        samples = sum(a.batch for a in members)
        if samples == 0:
            raise ValueError(f"to_diloco_plan: group {g} ({', '.join(nodes)}) has no device with samples")
        for a in members:
            out[a.device_index] = a.shard_fraction / frac if frac > 0 else a.batch / samples
    return out


def to_diloco_plan(plan: Plan, inner_steps: int, *, groups: Sequence[Sequence[str]] | None = None,
                   outer_lr: float = 0.7, outer_momentum: float = 0.9, nesterov: bool = True, fragments: int = 1,
                   compress: str = "fp32", overlap: bool = False, merge_alpha: float = 0.5) -> Plan:
    """`plan` (data parallel, no pipeline) as a DiLoCo plan over `groups` (default: one per used
    node); ValueError naming the problem (the DilocoSpec and Plan checks included)."""
    if plan.pipeline is not None:
        raise ValueError("to_diloco_plan: the plan has a pipeline; DiLoCo groups run data parallelism")
    if plan.tensor_parallel:
        raise ValueError("to_diloco_plan: the plan is tensor parallel; DiLoCo groups run tp 1")
    nodes = plan_nodes(plan)
    groups = [[n] for n in nodes] if groups is None else [list(g) for g in groups]
    spec = DilocoSpec(tuple(tuple(g) for g in groups), inner_steps, outer_lr=outer_lr,
                      outer_momentum=outer_momentum, nesterov=nesterov, fragments=fragments, compress=compress,
                      overlap=overlap, merge_alpha=merge_alpha)
    missing = [n for n in nodes if n not in spec.groups_nodes()]
    if missing:
        raise ValueError(f"to_diloco_plan: used node(s) {', '.join(missing)} are in no group")
    fractions = _group_fractions(plan, spec.groups)
    assignments = tuple(replace(a, shard_fraction=fractions.get(a.device_index, a.shard_fraction))
                        for a in plan.assignments)
    cuts = tuple(Cut(a, b, "diloco", inner_steps) if spec.group_of(a) != spec.group_of(b) else Cut(a, b, "dp")
                 for a, b in combinations(nodes, 2))
    note = (f"diloco: {spec.num_groups} group(s) {[list(g) for g in spec.groups]}, H={inner_steps}, "
            f"outer lr {outer_lr:g} momentum {outer_momentum:g}{' nesterov' if nesterov else ''}, "
            f"{fragments} fragment(s), {compress} exchange{' overlapped' if overlap else ''}")
    return replace(plan, assignments=assignments, diloco=spec, cuts=cuts, rebalance="off",
                   notes=(*plan.notes, note))


def _replica_devices(plan: Plan, groups: Sequence[Sequence[str]]) -> dict[int, list[int]]:
    """device_index of a device of group 0's nodes -> the device in the same place in every group
    (groups[g][j] stands for groups[0][j], its k-th device for the k-th): one per group, group 0 first."""
    devices = plan.cluster.devices()
    on_node: dict[str, list[int]] = {}
    for i, (node, _) in enumerate(devices):
        on_node.setdefault(node.name, []).append(i)
    out: dict[int, list[int]] = {}
    for j, home in enumerate(groups[0]):
        for k, x in enumerate(on_node.get(home, [])):
            out[x] = []
            for g, nodes in enumerate(groups):
                there = on_node.get(nodes[j], [])
                if k >= len(there) or devices[there[k]][1].type != devices[x][1].type:
                    raise ValueError(f"to_diloco_pipeline_plan: group {g}'s node {nodes[j]!r} has no "
                                     f"{devices[x][1].type} device {k} to hold the replica of device {x} on "
                                     f"{home!r}")
                out[x].append(there[k])
    return out


def _pipeline_cuts(stages_of: dict[str, set[int]], spec: DilocoSpec) -> tuple[Cut, ...]:
    """Every pair of used nodes: diloco between groups; inside one, dp when they share a stage and
    hold no other, else pipeline."""
    cuts = []
    for a, b in combinations(list(stages_of), 2):
        if spec.group_of(a) != spec.group_of(b):
            cuts.append(Cut(a, b, "diloco", spec.inner_steps))
        else:
            same = stages_of[a] == stages_of[b] and len(stages_of[a]) == 1
            cuts.append(Cut(a, b, "dp" if same else "pipeline"))
    return tuple(cuts)


def to_diloco_pipeline_plan(plan: Plan, groups: Sequence[Sequence[str]], inner_steps: int, *,
                            outer_lr: float = 0.7, outer_momentum: float = 0.9, nesterov: bool = True,
                            compress: str = "fp32", overlap: bool = False, merge_alpha: float = 0.5) -> Plan:
    """`plan`, a pipeline on the nodes of groups[0] only (its cluster holding every group's nodes), as
    DiLoCo over G = len(groups) copies of that pipeline: groups[g][j] runs what groups[0][j] runs, its
    k-th device the k-th device's stage, rows and shard fraction. Every device keeps its work, so the
    global batch is G times the plan's (each micro-batch G times as many rows, group by group) and the
    predicted step is one pipeline's (the outer exchange not included); cuts: diloco between groups,
    pipeline or dp inside one. ValueError naming the problem (the Plan checks included)."""
    if plan.pipeline is None:
        raise ValueError("to_diloco_pipeline_plan: the plan has no pipeline (to_diloco_plan makes DiLoCo of data "
                         "parallelism)")
    if plan.tensor_parallel or plan.diloco is not None:
        raise ValueError("to_diloco_pipeline_plan: the plan must be a pipeline without tensor parallelism or DiLoCo")
    groups = [list(g) for g in groups]
    if len(groups) < 2 or any(len(g) != len(groups[0]) for g in groups):
        raise ValueError(f"to_diloco_pipeline_plan: need at least 2 groups of as many nodes each, got {groups}")
    spec = DilocoSpec(tuple(tuple(g) for g in groups), inner_steps, outer_lr=outer_lr,
                      outer_momentum=outer_momentum, nesterov=nesterov, compress=compress, overlap=overlap,
                      merge_alpha=merge_alpha)
    outside = [a.device_index for a in plan.used if a.node not in groups[0]]
    if outside:
        raise ValueError(f"to_diloco_pipeline_plan: device(s) {outside} are used outside group 0's nodes "
                         f"{groups[0]}: the plan must hold one pipeline, on group 0's nodes")
    replicas = _replica_devices(plan, groups)
    devices = plan.cluster.devices()
    by_index = {a.device_index: a for a in plan.assignments}
    assignments = dict(by_index)
    for x, copies in replicas.items():
        for y in copies[1:]:
            node, dev = devices[y]
            assignments[y] = replace(by_index[x], device_index=y, node=node.name, type=dev.type)
    p = plan.pipeline
    stages = tuple(replace(st, devices=tuple(replicas[x][g] for g in range(len(groups)) for x in st.devices),
                           rows=tuple(st.rows) * len(groups))
                   for st in p.stages)
    pipeline = replace(p, micro_batch=p.micro_batch * len(groups), stages=stages, simulated_ops=())
    stage_of = {x: s for s, st in enumerate(stages) for x in st.devices}
    stages_of: dict[str, set[int]] = {}  # used node -> its stages, the nodes in cluster order
    for x in sorted(stage_of):
        stages_of.setdefault(devices[x][0].name, set()).add(stage_of[x])
    note = (f"diloco over {len(groups)} pipelines {groups}, H={inner_steps}, outer lr {outer_lr:g} momentum "
            f"{outer_momentum:g}{' nesterov' if nesterov else ''}, {compress} exchange per stage; predicted "
            "step: one pipeline's, without the outer exchange")
    return replace(plan, assignments=tuple(assignments[i] for i in sorted(assignments)),
                   global_batch=plan.global_batch * len(groups), pipeline=pipeline, diloco=spec,
                   cuts=_pipeline_cuts(stages_of, spec), rebalance="off",
                   predicted_samples_per_s=plan.predicted_samples_per_s * len(groups), notes=(*plan.notes, note))


__all__ = ["to_diloco_pipeline_plan", "to_diloco_plan"]
